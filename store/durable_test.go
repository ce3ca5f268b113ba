package store_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/store"
)

// TestOpenState_FirstFillAnswersSyncedOnlyWhatAKillKeeps: on a first fill's store without a log, a
// commit is seen by views at once and made durable by a flush some ms later. A synced bucket's answers
// (Answered, Reach, AnswerRowsView, AnswerView) must hold nothing a SIGKILL in between takes back
// (store.CopyCurrent: the files as written, not the memtables): they read the state as of the last
// flush that ended, and move on when the next ends. A bucket not synced yet answers what is committed,
// which a kill may take back (its answers say synced: false).
func TestOpenState_FirstFillAnswersSyncedOnlyWhatAKillKeeps(t *testing.T) {
	dir := t.TempDir()
	db, err := store.OpenState(dir, store.Options{FirstFillNoWAL: true, MinFreeBytes: -1})
	require.NoError(t, err)
	defer db.Close()
	require.True(t, db.NoWAL())
	b := provisioner.BucketNeeds
	all := provisioner.Range{Bucket: b, Index: provisioner.IndexPrimary}
	// answered is what each of the synced answers' reads says of b: its sequence, and the rows' keys.
	answered := func() (uint64, []string) {
		t.Helper()
		seq, synced := db.Answered(b)
		require.True(t, synced)
		require.Equal(t, seq, db.Reach(b), "min_seq is reached for what the answers show")
		rv, synced, err := db.AnswerRowsView(b)
		require.NoError(t, err)
		defer rv.Close()
		require.True(t, synced)
		cp, err := rv.Checkpoint(b)
		require.NoError(t, err)
		require.Equal(t, seq, cp.Applied, "the answer's as_of is the view's")
		var keys []string
		require.NoError(t, rv.Rows(all, func(r *provisioner.Row) bool { keys = append(keys, string(r.Key)); return true }))
		v, err := db.AnswerView(true)
		require.NoError(t, err)
		defer v.Close()
		vcp, err := v.Checkpoint(b)
		require.NoError(t, err)
		require.Equal(t, seq, vcp.Applied, "plans and at answers read the same state")
		return seq, keys
	}

	require.NoError(t, db.Apply(b, []provisioner.Message{put(1, "n1.m.config.a", []byte{0x80})}, 1, true))
	db.SetSynced(b, true)
	seq, keys := answered()
	require.Equal(t, uint64(1), seq)
	require.Equal(t, []string{"n1.m.config.a"}, keys)

	// A message to the synced bucket: its batch (the stream's end, asked to sync) is committed, and
	// its flush held.
	entered, release := make(chan struct{}, 16), make(chan struct{})
	restore := store.HoldFlushes(func() {
		entered <- struct{}{}
		<-release
	})
	defer restore()
	changed := db.Changed(b)
	applied := make(chan error, 1)
	go func() {
		applied <- db.Apply(b, []provisioner.Message{put(2, "n1.m.config.b", []byte{0x80})}, 1, true)
	}()
	<-entered
	have, _ := db.Applied(b)
	require.Equal(t, uint64(2), have, "committed, not flushed: the window")
	<-changed // the commit moved the applied sequence
	seq, keys = answered()
	require.Equal(t, uint64(1), seq, "a synced answer does not show what is not flushed")
	require.Equal(t, []string{"n1.m.config.a"}, keys)
	require.GreaterOrEqual(t, killedApplied(t, dir, b), seq, "a kill now keeps what was answered synced")
	// A bucket still catching up answers what is committed (synced: false), flushed or not.
	require.NoError(t, db.Apply(provisioner.BucketApplied, []provisioner.Message{put(1, "n1.m", []byte{0x80})}, 1, false))
	aseq, asynced := db.Answered(provisioner.BucketApplied)
	require.Equal(t, uint64(1), aseq)
	require.False(t, asynced)
	rv, asynced, err := db.AnswerRowsView(provisioner.BucketApplied)
	require.NoError(t, err)
	require.False(t, asynced)
	acp, err := rv.Checkpoint(provisioner.BucketApplied)
	require.NoError(t, err)
	require.Equal(t, uint64(1), acp.Applied)
	require.NoError(t, rv.Close())

	changed = db.Changed(b)
	rewrites := db.AnswerRewrites()
	restore()
	close(release)
	require.NoError(t, <-applied)
	select {
	case <-changed: // the flush moved what the answers show: a waiter for min_seq 2 looks again
	case <-time.After(10 * time.Second):
		t.Fatal("the flush did not wake the bucket's waiters")
	}
	seq, keys = answered()
	require.Equal(t, uint64(2), seq, "flushed: answered")
	require.Equal(t, []string{"n1.m.config.a", "n1.m.config.b"}, keys)
	require.GreaterOrEqual(t, killedApplied(t, dir, b), seq)
	require.Greater(t, db.AnswerRewrites(), rewrites, "a page read ahead of the state before is dropped")

	// A batch of the synced bucket not asked to sync (more of its stream to read, an expiry) is
	// answered once a flush it started has ended.
	require.NoError(t, db.Apply(b, []provisioner.Message{put(3, "n1.m.config.c", []byte{0x80})}, 1, false))
	require.Eventually(t, func() bool { s, _ := db.Answered(b); return s == 3 }, 10*time.Second, 5*time.Millisecond)
	seq, _ = answered()
	require.GreaterOrEqual(t, killedApplied(t, dir, b), seq)

	// Once synced, a bucket's answers do not go back from what it answered before (synced: false).
	require.NoError(t, db.Apply(provisioner.BucketApplied, []provisioner.Message{put(2, "n2.m", []byte{0x80})}, 1, false))
	db.SetSynced(provisioner.BucketApplied, true)
	aseq, asynced = db.Answered(provisioner.BucketApplied)
	require.True(t, asynced)
	require.Equal(t, uint64(2), aseq)
	require.GreaterOrEqual(t, killedApplied(t, dir, provisioner.BucketApplied), aseq)
}

// TestOpen_DurableStateOnlyOnAFirstFill: a store with a log, or without one that is no first fill,
// answers what is committed.
func TestOpen_DurableStateOnlyOnAFirstFill(t *testing.T) {
	for _, opts := range []store.Options{{MinFreeBytes: -1}, {NoWAL: true, MinFreeBytes: -1}} {
		db, err := store.Open(t.TempDir(), opts)
		require.NoError(t, err)
		b := provisioner.BucketNeeds
		require.NoError(t, db.Apply(b, []provisioner.Message{put(1, "n1.m.config.a", []byte{0x80})}, 1, false))
		db.SetSynced(b, true)
		seq, synced := db.Answered(b)
		require.True(t, synced)
		require.Equal(t, uint64(1), seq)
		rv, synced, err := db.AnswerRowsView(b)
		require.NoError(t, err)
		require.True(t, synced)
		cp, err := rv.Checkpoint(b)
		require.NoError(t, err)
		require.Equal(t, uint64(1), cp.Applied)
		require.NoError(t, rv.Close())
		require.NoError(t, db.Close())
	}
}
