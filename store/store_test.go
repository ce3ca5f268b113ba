package store_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/cockroachdb/pebble/v2"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/store"
)

func put(seq uint64, key string, value []byte) provisioner.Message {
	return provisioner.Message{Seq: seq, Time: int64(seq) * 1e9, Key: key, Op: provisioner.OpPut, Value: value}
}

func del(seq uint64, key string) provisioner.Message {
	return provisioner.Message{Seq: seq, Time: int64(seq) * 1e9, Key: key, Op: provisioner.OpDelete}
}

func rows(t *testing.T, db *store.DB, r provisioner.Range) []string {
	t.Helper()
	v, err := db.View()
	require.NoError(t, err)
	defer v.Close()
	var keys []string
	require.NoError(t, v.Rows(r, func(row *provisioner.Row) bool {
		keys = append(keys, string(row.Key))
		return true
	}))
	return keys
}

func anomalies(t *testing.T, db *store.DB, bucket, node string) ([]string, int64) {
	t.Helper()
	v, err := db.View()
	require.NoError(t, err)
	defer v.Close()
	var out []string
	total, err := v.Anomalies(bucket, node, 1000, func(a provisioner.Anomaly) {
		out = append(out, a.Key+" "+string(a.Reason))
	})
	require.NoError(t, err)
	return out, total
}

func TestOpenState_Locked(t *testing.T) {
	dir := t.TempDir()
	db, err := store.OpenState(dir, store.Options{})
	require.NoError(t, err)
	defer db.Close()
	_, err = store.OpenState(dir, store.Options{})
	require.ErrorIs(t, err, store.ErrLocked)
	require.Contains(t, err.Error(), "in use by another process")
}

func TestOpenState_SchemaMismatchSaysRebuild(t *testing.T) {
	dir := t.TempDir()
	db, err := store.OpenState(dir, store.Options{})
	require.NoError(t, err)
	gen := db.Dir()
	require.NoError(t, db.Close())

	pdb, err := pebble.Open(gen, &pebble.Options{})
	require.NoError(t, err)
	require.NoError(t, pdb.Set([]byte("\x01schema"), []byte("0"), pebble.Sync))
	require.NoError(t, pdb.Close())

	_, err = store.OpenState(dir, store.Options{})
	require.ErrorIs(t, err, store.ErrSchema)
	require.True(t, store.NeedsRebuild(err))
	require.Contains(t, err.Error(), "rebuild")
}

func TestOpenState_GarbledSaysRebuild(t *testing.T) {
	dir := t.TempDir()
	db, err := store.OpenState(dir, store.Options{})
	require.NoError(t, err)
	gen := db.Dir()
	require.NoError(t, db.Apply(provisioner.BucketNeeds, []provisioner.Message{put(1, "n1.m.config.a", []byte{0x01})}, 0, true))
	require.NoError(t, db.Close())
	// Garble the manifest Pebble starts from.
	m, err := findFile(gen, "MANIFEST-")
	require.NoError(t, err)
	require.NoError(t, writeFile(m, []byte("garbage garbage garbage garbage")))
	_, err = store.OpenState(dir, store.Options{})
	require.Error(t, err)
	require.True(t, store.NeedsRebuild(err), "%v", err)
	require.Contains(t, err.Error(), "rebuild")
}

func TestDB_ApplyIsIdempotent(t *testing.T) {
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	msgs := []provisioner.Message{
		put(1, "n1.m1.config.a", []byte{0x01}),
		put(2, "n1.m1.config", []byte{0x01}),   // out of shape
		put(3, "n1.m2.secret.b", []byte{0xc1}), // not MessagePack
		put(4, "n2.m1.config.c", []byte{0x02}),
		del(5, "n2.m1.config.c"),
	}
	require.NoError(t, db.Apply(provisioner.BucketNeeds, msgs, 0, false))
	before := rows(t, db, provisioner.Range{Bucket: provisioner.BucketNeeds, Index: provisioner.IndexPrimary})
	anomBefore, totalBefore := anomalies(t, db, provisioner.BucketNeeds, "")
	// Delivered again, in part and in whole: nothing changes.
	require.NoError(t, db.Apply(provisioner.BucketNeeds, msgs[2:], 0, false))
	require.NoError(t, db.Apply(provisioner.BucketNeeds, msgs, 0, false))
	require.Equal(t, before, rows(t, db, provisioner.Range{Bucket: provisioner.BucketNeeds, Index: provisioner.IndexPrimary}))
	a, total := anomalies(t, db, provisioner.BucketNeeds, "")
	require.Equal(t, anomBefore, a)
	require.Equal(t, totalBefore, total)
	seq, _ := db.Applied(provisioner.BucketNeeds)
	require.EqualValues(t, 5, seq)
	require.Equal(t, []string{"n1.m1.config.a", "n1.m2.secret.b"}, before)
}

func TestDB_AnomalyLifecycle(t *testing.T) {
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	b := provisioner.BucketCollect
	require.NoError(t, db.Apply(b, []provisioner.Message{
		put(1, "n1.bad=Z.c", []byte{0x01}),
		put(2, "n1.shell.c", []byte{0xc1}),
		put(3, "n2.x", []byte{0x01}),
		put(4, "n1", []byte{0x01}),
	}, 0, false))
	a, total := anomalies(t, db, b, "")
	require.Equal(t, []string{"n1 token-count", "n1.bad=Z.c bad-escape", "n1.shell.c value-not-msgpack", "n2.x token-count"}, a)
	require.EqualValues(t, 4, total)
	a, total = anomalies(t, db, b, "n1")
	require.Equal(t, []string{"n1 token-count", "n1.bad=Z.c bad-escape", "n1.shell.c value-not-msgpack"}, a)
	require.EqualValues(t, 3, total)

	// A fitting put clears a value anomaly; a delete clears a key anomaly.
	require.NoError(t, db.Apply(b, []provisioner.Message{put(5, "n1.shell.c", []byte{0x01}), del(6, "n1.bad=Z.c")}, 0, false))
	a, total = anomalies(t, db, b, "")
	require.Equal(t, []string{"n1 token-count", "n2.x token-count"}, a)
	require.EqualValues(t, 2, total)
}

func TestDB_UnansweredKindFollowsRegistry(t *testing.T) {
	dir := t.TempDir()
	db, err := store.OpenState(dir, store.Options{})
	require.NoError(t, err)
	reg := provisioner.Registry.Entries[0]
	require.NoError(t, db.Apply(provisioner.BucketNeeds, []provisioner.Message{
		put(1, "n1.m.wish.a", []byte{0x01}),
		put(2, "n1.m."+reg.Kind+".b", []byte{0x01}),
	}, 0, false))
	a, _ := anomalies(t, db, provisioner.BucketNeeds, "")
	require.Equal(t, []string{"n1.m." + reg.Kind + ".b unanswered-kind", "n1.m.wish.a unanswered-kind"}, a, "no registry yet")

	require.NoError(t, db.Apply(provisioner.BucketRegistry, []provisioner.Message{put(1, reg.Kind, reg.Value())}, 0, false))
	a, total := anomalies(t, db, provisioner.BucketNeeds, "")
	require.Equal(t, []string{"n1.m.wish.a unanswered-kind"}, a, "a kind added clears its needs")
	require.EqualValues(t, 1, total)

	// Kinds survive a restart.
	require.NoError(t, db.Close())
	db, err = store.OpenState(dir, store.Options{})
	require.NoError(t, err)
	defer db.Close()
	require.NoError(t, db.Apply(provisioner.BucketNeeds, []provisioner.Message{put(3, "n2.m."+reg.Kind+".c", []byte{0x01})}, 0, false))
	a, _ = anomalies(t, db, provisioner.BucketNeeds, "n2")
	require.Empty(t, a)

	require.NoError(t, db.Apply(provisioner.BucketRegistry, []provisioner.Message{del(2, reg.Kind)}, 0, false))
	a, total = anomalies(t, db, provisioner.BucketNeeds, "")
	require.Len(t, a, 3, "a kind removed raises its needs")
	require.EqualValues(t, 3, total)
	for _, x := range a {
		require.True(t, strings.HasSuffix(x, "unanswered-kind"), x)
	}
}

func TestDB_RangesAreBounded(t *testing.T) {
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	b := provisioner.BucketCollect
	require.NoError(t, db.Apply(b, []provisioner.Message{
		put(1, "n1.shell=3Azsh.c1", []byte{0x01}),
		put(2, "n1.shell=3azsh.c2", []byte{0x01}), // the same collection, other case of hex
		put(3, "n10.shell=3Azsh.c1", []byte{0x01}),
		put(4, "n1.shell.c1", []byte{0x01}),
		put(5, "n1.=00x.c1", []byte{0x01}), // a decoded name with a zero byte
	}, 0, false))
	require.Equal(t, []string{"n1.shell=3Azsh.c1", "n1.shell=3azsh.c2", "n10.shell=3Azsh.c1"},
		rows(t, db, provisioner.Range{Bucket: b, Index: provisioner.IndexCollection, Value: "shell:zsh"}))
	require.Equal(t, []string{"n1.shell=3Azsh.c1", "n1.shell=3azsh.c2"},
		rows(t, db, provisioner.Range{Bucket: b, Index: provisioner.IndexCollection, Value: "shell:zsh", Prefix: "n1."}))
	require.Equal(t, []string{"n1.=00x.c1"}, rows(t, db, provisioner.Range{Bucket: b, Index: provisioner.IndexCollection, Value: "\x00x"}))
	require.Equal(t, []string{"n1.=00x.c1", "n1.shell.c1", "n1.shell=3Azsh.c1", "n10.shell=3Azsh.c1"},
		rows(t, db, provisioner.Range{Bucket: b, Index: provisioner.IndexContributor, Value: "c1"}))
	require.Equal(t, []string{"n1.shell=3azsh.c2"},
		rows(t, db, provisioner.Range{Bucket: b, Index: provisioner.IndexPrimary, Prefix: "n1.", After: "n1.shell=3Azsh.c1"}))
}

// TestRowsView_OnePointInTime reads through a RowsView while later batches commit, and a flush and a
// compaction rewrite the files: every read, whatever range it moves the view's iterator to, sees the
// state of the view's opening, checkpoint and anomalies included.
func TestRowsView_OnePointInTime(t *testing.T) {
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	b := provisioner.BucketNeeds
	require.NoError(t, db.Apply(b, []provisioner.Message{put(1, "n1.m.config.a", []byte{0x01}), put(2, "n2.m.config.a", []byte{0x01})}, 0, false))
	v, err := db.RowsView()
	require.NoError(t, err)
	defer v.Close()
	require.NoError(t, db.Apply(b, []provisioner.Message{put(3, "n1.m.config.b", []byte{0x01}), del(4, "n2.m.config.a"), put(5, "n3.bad", []byte{0x01})}, 0, false))
	require.NoError(t, db.Pebble().Flush())
	require.NoError(t, db.CompactAll(context.Background()))
	for i := 0; i < 2; i++ {
		cp, err := v.Checkpoint(b)
		require.NoError(t, err)
		require.EqualValues(t, 2, cp.Applied)
		var keys []string
		require.NoError(t, v.Rows(provisioner.Range{Bucket: b, Index: provisioner.IndexPrimary}, func(row *provisioner.Row) bool {
			keys = append(keys, string(row.Key))
			return true
		}))
		require.Equal(t, []string{"n1.m.config.a", "n2.m.config.a"}, keys)
		ok, err := v.HasRow(provisioner.Range{Bucket: b, Index: provisioner.IndexModule, Value: "m"}, "n2.m.config.a")
		require.NoError(t, err)
		require.True(t, ok)
		var anoms []string
		_, err = v.Anomalies(b, "n3", 10, func(a provisioner.Anomaly) { anoms = append(anoms, a.Key) })
		require.NoError(t, err)
		require.Empty(t, anoms)
	}
	require.Equal(t, []string{"n1.m.config.a", "n1.m.config.b"}, rows(t, db, provisioner.Range{Bucket: b, Index: provisioner.IndexPrimary}))
}

// Changed wakes when a bucket becomes synced without a commit (a stream not created yet), and marking
// buckets synced after Close does not close a channel twice.
func TestDB_SetSyncedWakesChanged(t *testing.T) {
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	ch := db.Changed("b")
	db.SetSynced("b", true)
	select {
	case <-ch:
	default:
		t.Fatal("Changed did not wake when the bucket became synced")
	}
	ch = db.Changed("b")
	db.SetSynced("b", true) // no change: no wake
	select {
	case <-ch:
		t.Fatal("Changed woke though nothing changed")
	default:
	}
	require.NoError(t, db.Close())
	db.SetSynced("b", false)
	db.SetSynced("b", true)
}

// Reading a bucket the store holds nothing of keeps no state for it: a client may name any node in a
// plans min_seq, and each name used to cost the seat a bucket state for good. A waiter on such a
// bucket still wakes when it comes to exist, and at Close.
func TestDB_ReadsOfUnknownBucketsKeepNoState(t *testing.T) {
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	before := db.States()
	for i := 0; i < 1000; i++ {
		b := fmt.Sprintf("composed-made-up-%d", i)
		seq, synced := db.Applied(b)
		require.Zero(t, seq)
		require.False(t, synced)
		require.Zero(t, db.Checkpoint(b))
		_ = db.Changed(b)
	}
	require.Equal(t, before, db.States(), "no state for a name only read")

	ch := db.Changed("composed-n1")
	select {
	case <-ch:
		t.Fatal("woke before anything happened")
	default:
	}
	require.NoError(t, db.Apply("composed-n1", []provisioner.Message{{Seq: 1, Key: "m.1", Op: provisioner.OpPut, Value: []byte{0x80}}}, 1, false))
	select {
	case <-ch:
	default:
		t.Fatal("a waiter on a bucket the store held nothing of did not wake when it came to exist")
	}
	seq, _ := db.Applied("composed-n1")
	require.Equal(t, uint64(1), seq)

	ch = db.Changed("composed-n2")
	require.NoError(t, db.Close())
	select {
	case <-ch:
	default:
		t.Fatal("a waiter on an unknown bucket did not wake at Close")
	}
	select {
	case <-db.Changed("composed-n3"):
	default:
		t.Fatal("Changed after Close of an unknown bucket must not block")
	}
}
