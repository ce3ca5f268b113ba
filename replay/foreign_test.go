package replay_test

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/replay"
	"github.com/novox/mesh-provisioner/store"
)

// TestExportLog_AWholeStreamRollupOnAnAddedSubject: a message on a subject added to a bucket's stream
// by hand with Nats-Rollup: all removed every key of the bucket (store.DB.Apply). Export of the local
// log writes it back as it was stored (its subject, its rollup, its data), and the archive answers as
// the log does, before and after it. Plans as of a time after such a rollup of a composed-<node>
// bucket forget the builds it removed, as the live answer does.
func TestExportLog_AWholeStreamRollupOnAnAddedSubject(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	sec := func(s int) int64 { return int64(s) * 1e9 }
	n, c := provisioner.BucketNeeds, provisioner.ComposedPrefix+"n1"
	require.NoError(t, db.Apply(n, []provisioner.Message{
		{Seq: 1, Time: sec(1), Key: "n1.m.config.a", Op: provisioner.OpPut, Value: mp("a")},
		{Seq: 2, Time: sec(2), Key: "extra.x", Op: provisioner.OpPut, Value: mp("out of shape")},
		{Seq: 3, Time: sec(3), Key: "extra.x", Foreign: true, Rollup: provisioner.RollupAll, Value: []byte("the rollup")},
		{Seq: 4, Time: sec(4), Key: "n2.m.config.b", Op: provisioner.OpPut, Value: mp("b")},
	}, 1, false))
	require.NoError(t, db.Apply(provisioner.BucketHostModules, []provisioner.Message{
		{Seq: 1, Time: sec(1), Key: "n1.m1", Op: provisioner.OpPut, Value: mp(map[string]any{"want": 1})},
	}, 1, false))
	require.NoError(t, db.Apply(c, []provisioner.Message{
		{Seq: 1, Time: sec(2), Key: "m1.1", Op: provisioner.OpPut, Value: mp(map[string]any{"status": "published", "plan": "m1 1"})},
	}, 1, false))
	before, code := askPlansAt(t, db, 3)
	require.Equal(t, 200, code)
	require.Contains(t, before, `"m1 1"`)
	require.NoError(t, db.Apply(c, []provisioner.Message{
		{Seq: 2, Time: sec(5), Key: "extra.x", Foreign: true, Rollup: provisioner.RollupAll},
	}, 1, false))
	after, code := askPlansAt(t, db, 6)
	require.Equal(t, 200, code)
	require.Equal(t, livePlans(t, db), after, "as of a time after the rollup: its live answer")
	require.NotContains(t, after, `"m1 1"`, "the build it removed is forgotten")
	got, _ := askPlansAt(t, db, 3)
	require.Equal(t, before, got, "and as of a time before it, what it answered then")

	out := filepath.Join(t.TempDir(), "state.mph")
	_, err = replay.ExportLog(ctx, db, out, "test", nil)
	require.NoError(t, err)
	var rollups []archived
	for _, r := range archiveRecords(t, out) {
		if r.Subject == "extra.x" {
			rollups = append(rollups, r)
		}
	}
	require.Len(t, rollups, 2, "each rollup once, on its own subject")
	require.Equal(t, map[string][]string{provisioner.HeaderRollup: {"all"}}, rollups[0].Headers)
	require.Equal(t, []byte("the rollup"), rollups[0].Data)
	require.EqualValues(t, 3, rollups[0].Seq)

	a, err := replay.FromArchive(ctx, out, nil)
	require.NoError(t, err)
	defer a.Close()
	db.SetSynced(n, true) // as an archive's store is
	l := &replay.Log{DB: db}
	for _, at := range []string{"seq:2", "seq:3", "seq:4"} {
		want, err := l.Ask([]byte(`{"what":"needs","at":"` + at + `"}`))
		require.NoError(t, err, at)
		got, err := a.Ask([]byte(`{"what":"needs","at":"` + at + `"}`))
		require.NoError(t, err, at)
		require.JSONEq(t, string(want), string(got), at)
	}
	got, code = askPlansAt(t, a.DB, 6)
	require.Equal(t, 200, code)
	require.Equal(t, after, got, "the archive's plans")
}
