package store_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/store"
)

// TestDB_ForeignRollupsFirstAndInARow: a whole-stream rollup on an added subject as the stream's very
// first message, and two in a row (one batch, then one a batch), on subjects of odd forms ($KV.<other
// bucket>.x, a subject with the bucket's name but not its prefix): each empties the bucket at its
// sequence, every sequence is logged once and read back as the message it was, no answer holds the
// logged form, and a trim past them all keeps the state after them.
func TestDB_ForeignRollupsFirstAndInARow(t *testing.T) {
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	b := provisioner.BucketNeeds
	all := provisioner.Range{Bucket: b, Index: provisioner.IndexPrimary}
	odd := "$KV." + provisioner.BucketApplied + ".x"
	near := "$KV." + b // the bucket's name, not its prefix
	msgs := []provisioner.Message{
		foreign(1, odd, provisioner.RollupAll, []byte("first")),
		put(2, "n1.m.config.a", []byte{0xc0}),
		put(3, "n1.x", []byte{0xc0}),
		foreign(4, odd, provisioner.RollupAll, nil),
		foreign(5, near, provisioner.RollupAll, []byte("second")),
		put(6, "n2.m.config.b", []byte{0xc1}),
	}
	require.NoError(t, db.Apply(b, msgs[:1], 0, false))
	applied, _ := db.Applied(b)
	require.EqualValues(t, 1, applied)
	require.Empty(t, rows(t, db, all))
	require.NoError(t, db.Apply(b, msgs[1:], 0, false))
	require.NoError(t, db.Apply(b, []provisioner.Message{foreign(7, near, provisioner.RollupAll, nil)}, 0, false))
	applied, _ = db.Applied(b)
	require.EqualValues(t, 7, applied)
	require.Empty(t, rows(t, db, all))
	anoms, total := anomalies(t, db, b, "")
	require.Empty(t, anoms)
	require.Zero(t, total)
	for _, node := range []string{"n1", "n2", " $KV", "$KV"} {
		_, total := anomalies(t, db, b, node)
		require.Zero(t, total, node)
	}
	require.Equal(t, []string{"n1.m.config.a", "n1.x"}, keysAt(t, db, b, 3))
	for _, n := range []uint64{1, 4, 5, 7} {
		require.Empty(t, keysAt(t, db, b, n), "as of %d", n)
	}
	require.Equal(t, []string{"n2.m.config.b"}, keysAt(t, db, b, 6))
	require.Equal(t, []string{"2 PUT", "4 PURGE"}, history(t, db, b, "n1.m.config.a"))

	v, err := db.View()
	require.NoError(t, err)
	var got []provisioner.Message
	require.NoError(t, v.Events(b, 0, func(key []byte, ev *store.Event) bool {
		m := ev.Message(key)
		m.Value = append([]byte(nil), m.Value...)
		got = append(got, m)
		return true
	}))
	v.Close()
	want := append(append([]provisioner.Message(nil), msgs...), foreign(7, near, provisioner.RollupAll, nil))
	require.Len(t, got, len(want), "one event a sequence")
	for i, m := range want {
		if m.Value == nil {
			m.Value = []byte{}
		}
		if got[i].Value == nil {
			got[i].Value = []byte{}
		}
		require.Equal(t, m, got[i], "sequence %d read back", m.Seq)
	}

	// Applied again from the start (a rebuild of the same stream): nothing changes.
	before := dump(t, db)
	require.NoError(t, db.Apply(b, want, 0, false))
	require.Equal(t, before, dump(t, db))

	_, err = db.TrimHistory(context.Background(), b, 7, 7e9)
	require.NoError(t, err)
	require.Empty(t, keysAt(t, db, b, 7))
	require.NoError(t, db.Apply(b, []provisioner.Message{put(8, "n3.m.config.c", []byte{0xc0})}, 0, false))
	require.Equal(t, []string{"n3.m.config.c"}, keysAt(t, db, b, 8))
	require.Equal(t, []string{"n3.m.config.c"}, rows(t, db, all))
}
