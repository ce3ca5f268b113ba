//go:build scalemeasure

package replay_test

import (
	"encoding/json"
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/replay"
	"github.com/novox/mesh-provisioner/store"
)

func cpuNow() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func TestPlansMeasure(t *testing.T) {
	for _, nodes := range []int{250, 500, 1000} {
		dir := t.TempDir()
		db, err := store.OpenState(dir, store.Options{})
		require.NoError(t, err)
		var hm []provisioner.Message
		for n := 0; n < nodes; n++ {
			node := fmt.Sprintf("n%05d", n)
			var comp []provisioner.Message
			for m := 0; m < 10; m++ {
				hm = append(hm, provisioner.Message{Seq: uint64(len(hm) + 1), Time: int64(len(hm) + 1), Key: fmt.Sprintf("%s.m%02d", node, m), Op: provisioner.OpPut, Value: mp(map[string]any{"want": 2})})
				for b := 1; b <= 2; b++ {
					comp = append(comp, provisioner.Message{Seq: uint64(len(comp) + 1), Time: int64(len(comp) + 1), Key: fmt.Sprintf("m%02d.%d", m, b), Op: provisioner.OpPut, Value: mp(map[string]any{"status": "published", "plan": "p"})})
				}
			}
			require.NoError(t, db.Apply(provisioner.ComposedPrefix+node, comp, 1, false))
		}
		require.NoError(t, db.Apply(provisioner.BucketHostModules, hm, 1, false))
		require.NoError(t, db.Close())
		l, err := replay.OpenState(dir)
		require.NoError(t, err)
		c0 := cpuNow()
		after := ""
		pages, rows := 0, 0
		for {
			body := fmt.Sprintf(`{"what":"plans","at":"2100-01-01T00:00:00Z","after":%q}`, after)
			out, err := l.Ask([]byte(body))
			require.NoError(t, err)
			var a struct {
				Rows []any
				Next string
			}
			require.NoError(t, json.Unmarshal(out, &a))
			pages++
			rows += len(a.Rows)
			if a.Next == "" {
				break
			}
			after = a.Next
		}
		t.Logf("nodes %d: %d rows in %d pages, cpu %.2fs", nodes, rows, pages, (cpuNow() - c0).Seconds())
		l.Close()
	}
}
