package replay_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/replay"
	"github.com/novox/mesh-provisioner/store"
)

// TestDiff_AcrossAWholeStreamRollupOnAnAddedSubject: replay diff across a whole-stream rollup on a
// subject added to the stream says each key it removed, rows and anomaly rows, narrowed by node too,
// and nothing of the subject's logged form (" " + subject); a time point at the rollup answers the
// empty bucket, and the history of a removed key ends with its purge at the rollup.
func TestDiff_AcrossAWholeStreamRollupOnAnAddedSubject(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	sec := func(s int) int64 { return int64(s) * 1e9 }
	n := provisioner.BucketNeeds
	require.NoError(t, db.Apply(provisioner.BucketRegistry, []provisioner.Message{
		{Seq: 1, Time: sec(1), Key: "config", Op: provisioner.OpPut, Value: mp(map[string]any{"kind": "config"})},
	}, 1, false))
	require.NoError(t, db.Apply(n, []provisioner.Message{
		{Seq: 1, Time: sec(1), Key: "n1.m.config.a", Op: provisioner.OpPut, Value: mp("a")},
		{Seq: 2, Time: sec(2), Key: "n1.x", Op: provisioner.OpPut, Value: mp("out of shape")},
		{Seq: 3, Time: sec(3), Key: "n2.m.config.b", Op: provisioner.OpPut, Value: []byte{0xc1}},
		{Seq: 4, Time: sec(4), Key: "$KV.other.x", Foreign: true, Rollup: provisioner.RollupAll, Value: []byte("r")},
		{Seq: 5, Time: sec(5), Key: "n1.m.config.c", Op: provisioner.OpPut, Value: mp("c")},
	}, 1, false))
	db.SetSynced(n, true)
	l := &replay.Log{DB: db}

	diff := func(node string, from, to replay.Point) []string {
		var out []string
		err := l.DiffEach(ctx, query.Request{What: "needs", Node: node}, from, to, nil, func(it *replay.DiffItem) error {
			switch it.Kind {
			case replay.DiffAppeared, replay.DiffCleared:
				out = append(out, [...]string{"+", "~", "-", "appeared", "cleared"}[it.Kind]+" "+it.Anomaly.Key+" "+string(it.Anomaly.Reason))
			default:
				out = append(out, [...]string{"+", "~", "-"}[it.Kind]+" "+it.Row.Key)
			}
			return nil
		})
		require.NoError(t, err)
		for _, line := range out {
			require.NotContains(t, line, " $KV", "the logged form of the rollup")
			require.False(t, strings.Contains(line, "other"), line)
		}
		return out
	}
	require.Equal(t, []string{"- n1.m.config.a", "- n2.m.config.b", "cleared n1.x token-count", "cleared n2.m.config.b value-not-msgpack"},
		diff("", replay.Point{Seq: 3}, replay.Point{Seq: 4}))
	require.Equal(t, []string{"- n1.m.config.a", "+ n1.m.config.c", "cleared n1.x token-count"},
		diff("n1", replay.Point{Seq: 3}, replay.Point{Time: time.Unix(0, sec(5))}))
	require.Equal(t, []string{"+ n1.m.config.a", "+ n2.m.config.b", "appeared n1.x token-count", "appeared n2.m.config.b value-not-msgpack"},
		diff("", replay.Point{Time: time.Unix(0, sec(4))}, replay.Point{Seq: 3}), "backwards")
	require.Empty(t, diff("", replay.Point{Seq: 4}, replay.Point{Time: time.Unix(0, sec(4)+5e8)}))

	var ops []string
	_, err = l.EachRevision(ctx, n, "n2.m.config.b", func(r *replay.Revision) error {
		ops = append(ops, r.Op.String())
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, []string{"PUT", "PURGE"}, ops)
}
