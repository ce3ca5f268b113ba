package replay_test

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/replay"
	"github.com/novox/mesh-provisioner/store"
)

// TestExport_CarriesForgottenMarks: an archive of a state dir that forgot a composed-<node> bucket
// carries when, so replay --archive refuses plans as of a time before it (410) for that node and for
// every node, as replay --state does, and answers another node and later times alike. Such an archive
// is version 2; one without a forgotten bucket is still version 1, which older tools read.
func TestExport_CarriesForgottenMarks(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	sec := func(s int) int64 { return int64(s) * 1e9 }
	comp := mp(map[string]any{"status": "published", "plan": "p"})
	require.NoError(t, db.Apply(provisioner.ComposedPrefix+"n3", []provisioner.Message{{Seq: 1, Time: sec(1), Key: "m.1", Op: provisioner.OpPut, Value: comp}}, sec(1), false))
	require.NoError(t, db.Apply(provisioner.ComposedPrefix+"n4", []provisioner.Message{{Seq: 1, Time: sec(1), Key: "m.1", Op: provisioner.OpPut, Value: comp}}, sec(1), false))
	require.NoError(t, db.Apply(provisioner.BucketHostModules, []provisioner.Message{
		{Seq: 1, Time: sec(2), Key: "n3.m", Op: provisioner.OpPut, Value: mp(map[string]any{"want": 1})},
		{Seq: 2, Time: sec(2), Key: "n4.m", Op: provisioner.OpPut, Value: mp(map[string]any{"want": 1})},
	}, sec(1), false))

	// Before any forgetting: version 1.
	plain := filepath.Join(t.TempDir(), "plain.mph")
	h, err := replay.ExportLog(ctx, db, plain, "test", nil)
	require.NoError(t, err)
	require.Equal(t, 1, h.Version)
	require.Empty(t, h.Forgotten)

	require.NoError(t, db.Forget(provisioner.ComposedPrefix+"n3", sec(10)))
	out := filepath.Join(t.TempDir(), "forgot.mph")
	h, err = replay.ExportLog(ctx, db, out, "test", nil)
	require.NoError(t, err)
	require.Equal(t, 2, h.Version)
	require.Equal(t, []replay.ArchiveForgotten{{Bucket: provisioner.ComposedPrefix + "n3", At: sec(10)}}, h.Forgotten)
	read, err := replay.ReadArchiveHeader(out)
	require.NoError(t, err)
	require.Equal(t, h.Forgotten, read.Forgotten)

	a, err := replay.FromArchive(ctx, out, nil)
	require.NoError(t, err)
	defer a.Close()
	old, err := replay.FromArchive(ctx, plain, nil)
	require.NoError(t, err)
	defer old.Close()

	ask := func(l *replay.Log, node string, s int) (string, int) {
		t.Helper()
		body := fmt.Sprintf(`{"what":"plans","at":%q}`, time.Unix(int64(s), 0).UTC().Format(time.RFC3339Nano))
		if node != "" {
			body = fmt.Sprintf(`{"what":"plans","node":%q,"at":%q}`, node, time.Unix(int64(s), 0).UTC().Format(time.RFC3339Nano))
		}
		answer, err := l.Ask([]byte(body))
		if err != nil {
			code := query.Code(err)
			require.NotEqual(t, 500, code, "%s: %v", body, err)
			return "", code
		}
		return plansRows(t, answer), 200
	}
	state := &replay.Log{DB: db}
	defer replay.DropPlans(state)
	for _, q := range []struct {
		node string
		sec  int
		code int
	}{{"n3", 5, 410}, {"", 5, 410}, {"n4", 5, 200}, {"n3", 11, 200}, {"", 11, 200}} {
		wantRows, wantCode := ask(state, q.node, q.sec)
		require.Equal(t, q.code, wantCode, "the state dir, node %q at %d s", q.node, q.sec)
		rows, code := ask(a, q.node, q.sec)
		require.Equal(t, wantCode, code, "the archive, node %q at %d s", q.node, q.sec)
		require.Equal(t, wantRows, rows, "the archive, node %q at %d s", q.node, q.sec)
	}
	// The archive written before the forgetting still answers as the log did then.
	rows, code := ask(old, "n3", 5)
	require.Equal(t, 200, code)
	require.Contains(t, rows, `"plan":"p"`)
}
