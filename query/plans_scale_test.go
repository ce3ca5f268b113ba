package query

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
)

// TestAnswerPlans_EveryNodeCostsWhatThePageHolds: a page of plans across every node reads the anomaly
// rows it lists and their count, not the checkpoint of every node's composed-<node> bucket: its
// allocations do not grow with the nodes (they were one or more per node). Its anomalies are every
// composed-<node> bucket's, in order of bucket then key, and their count follows a bucket forgotten.
func TestAnswerPlans_EveryNodeCostsWhatThePageHolds(t *testing.T) {
	db := smallStore(t)
	mp := func(v any) []byte {
		b, err := msgpack.Marshal(v)
		require.NoError(t, err)
		return b
	}
	const nodes = 3000
	var hosts []provisioner.Message
	var want []string
	for i := 0; i < nodes; i++ {
		node := fmt.Sprintf("n%04d", i)
		comps := []provisioner.Message{{Seq: 1, Time: 1, Key: "api.7", Op: provisioner.OpPut, Value: mp(map[string]any{"status": "published", "plan": "p"})}}
		if i%150 == 0 { // 20 nodes with an anomaly row each
			comps = append(comps, provisioner.Message{Seq: 2, Time: 1, Key: "bad", Op: provisioner.OpPut, Value: mp(1)})
			want = append(want, provisioner.ComposedPrefix+node+" bad")
		}
		require.NoError(t, db.Apply(provisioner.ComposedPrefix+node, comps, 1, false))
		hosts = append(hosts, provisioner.Message{Seq: uint64(len(hosts) + 1), Time: 1, Key: node + ".api", Op: provisioner.OpPut, Value: mp(map[string]any{"want": 7})})
	}
	require.NoError(t, db.Apply(provisioner.BucketHostModules, hosts, 1, false))

	limit := int64(10)
	req := Request{What: "plans", Limit: &limit, After: "n0100.api"}
	var e Encoder
	page := func() {
		e.Reset(FormatMsgpack)
		v, err := db.View()
		require.NoError(t, err)
		defer v.Close()
		require.NoError(t, AnswerPlans(v, &req, &e, true))
	}
	anomalies := func() ([]string, int64) {
		page()
		var a struct {
			Rows      []map[string]any `msgpack:"rows"`
			Anomalies []struct {
				Bucket string `msgpack:"bucket"`
				Key    string `msgpack:"key"`
			} `msgpack:"anomalies"`
			Total int64 `msgpack:"anomalies_total"`
		}
		require.NoError(t, msgpack.Unmarshal(e.Bytes(), &a))
		require.Len(t, a.Rows, 10)
		var got []string
		for _, an := range a.Anomalies {
			got = append(got, an.Bucket+" "+an.Key)
		}
		return got, a.Total
	}
	got, total := anomalies()
	require.Equal(t, want, got)
	require.EqualValues(t, len(want), total)

	allocs := testing.AllocsPerRun(5, page)
	require.Less(t, allocs, float64(nodes/3), "allocations of a page of 10 plans across %d nodes", nodes)

	require.NoError(t, db.Forget(provisioner.ComposedPrefix+"n0150", 1))
	got, total = anomalies()
	require.Equal(t, append(want[:1:1], want[2:]...), got)
	require.EqualValues(t, len(want)-1, total)
}
