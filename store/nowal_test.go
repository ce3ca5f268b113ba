package store_test

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/store"
)

// TestOpen_NoWALKilledKeepsBatchesWithTheirCheckpoints: a store without a log (a rebuild's generation)
// keeps its commits in memtables until a memtable is flushed. What a SIGKILL leaves of it (the files as
// written, the memtables gone) opens as the store was after one of its batches: the checkpoint names
// exactly the rows kept, never one that went with the memtable, so the rebuild resumed from it reads
// the rest again. Its Close writes every memtable out.
func TestOpen_NoWALKilledKeepsBatchesWithTheirCheckpoints(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "gen")
	db, err := store.Open(dir, store.Options{NoWAL: true, MemTableSize: 64 << 10, BulkLoad: true, MinFreeBytes: -1})
	require.NoError(t, err)
	b := provisioner.BucketNeeds
	value := append([]byte{0xc5, 0x01, 0x00}, make([]byte, 256)...) // MessagePack bin 8 of 256 bytes
	const batches, perBatch = 60, 8
	for i := range batches {
		var msgs []provisioner.Message
		for j := range perBatch {
			seq := uint64(i*perBatch + j + 1)
			msgs = append(msgs, put(seq, fmt.Sprintf("n%04d.m.config.a", seq), value))
		}
		require.NoError(t, db.Apply(b, msgs, 1, true), "a commit asked to sync has no log to sync")
	}
	require.NoError(t, db.Flush(), "Flush does nothing without a log")

	// What a kill leaves: the files as the flushes wrote them, not the memtable being filled. Copied
	// once no flush runs or waits (one memtable left, the mutable one), so that no file changes
	// under the copy.
	natstest.CheckFor(t, 10*time.Second, time.Millisecond, func() error {
		m := db.Pebble().Metrics()
		if m.Flush.NumInProgress > 0 || m.MemTable.Count > 1 {
			return fmt.Errorf("%d flushes in progress, %d memtables", m.Flush.NumInProgress, m.MemTable.Count)
		}
		return nil
	})
	killed := filepath.Join(t.TempDir(), "killed")
	copyFiles(t, dir, killed)

	kept, err := store.Open(killed, store.Options{})
	require.NoError(t, err)
	applied := kept.Checkpoint(b).Applied
	require.Positive(t, applied, "the flushed memtables hold batches")
	require.Less(t, applied, uint64(batches*perBatch), "the memtable being filled held the last batches, and is gone")
	require.Zero(t, applied%perBatch, "a checkpoint is a batch's, with all of its rows")
	var want []string
	for seq := uint64(1); seq <= applied; seq++ {
		want = append(want, fmt.Sprintf("n%04d.m.config.a", seq))
	}
	require.Equal(t, want, rows(t, kept, provisioner.Range{Bucket: b, Index: provisioner.IndexPrimary}),
		"exactly the rows of the batches up to the checkpoint")
	require.NoError(t, kept.Close())

	// Closed, it keeps every batch.
	require.NoError(t, db.Close())
	db, err = store.Open(dir, store.Options{})
	require.NoError(t, err)
	defer db.Close()
	require.Equal(t, uint64(batches*perBatch), db.Checkpoint(b).Applied)
	require.Len(t, rows(t, db, provisioner.Range{Bucket: b, Index: provisioner.IndexPrimary}), batches*perBatch)
}

// copyFiles copies the files of dir into a new directory to: a file Pebble removed meanwhile (an
// obsolete one) is left out, as a kill after its removal would leave it.
func copyFiles(t *testing.T, dir, to string) {
	t.Helper()
	require.NoError(t, os.MkdirAll(to, 0o755))
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	for _, e := range entries {
		if e.IsDir() {
			continue
		}
		src, err := os.Open(filepath.Join(dir, e.Name()))
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		require.NoError(t, err)
		dst, err := os.Create(filepath.Join(to, e.Name()))
		require.NoError(t, err)
		_, err = io.Copy(dst, src)
		require.NoError(t, err)
		require.NoError(t, src.Close())
		require.NoError(t, dst.Close())
	}
}

// TestOpenState_FirstFillNoWALOnlyForAGenerationItCreates: FirstFillNoWAL opens without a log only the
// generation the open makes (an empty state dir, or one started over); one that exists opens with its
// log. A checkpoint of a store without a log, taken while it is written, opens with one and holds what
// was committed before it.
func TestOpenState_FirstFillNoWALOnlyForAGenerationItCreates(t *testing.T) {
	dir := t.TempDir()
	opts := store.Options{FirstFillNoWAL: true, MinFreeBytes: -1}
	db, err := store.OpenState(dir, opts)
	require.NoError(t, err)
	require.True(t, db.NoWAL(), "the generation made for the first fill")
	b := provisioner.BucketNeeds
	require.NoError(t, db.Apply(b, []provisioner.Message{put(1, "n1.m.config.a", []byte{0x80})}, 1, true))
	gen, err := db.CheckpointGeneration()
	require.NoError(t, err)
	require.NoError(t, db.Apply(b, []provisioner.Message{put(2, "n1.m.config.b", []byte{0x80})}, 1, true))
	logs, err := filepath.Glob(filepath.Join(db.Dir(), "*.log"))
	require.NoError(t, err)
	for _, l := range logs {
		info, err := os.Stat(l)
		require.NoError(t, err)
		require.Zero(t, info.Size(), "no byte in a log: %s", l)
	}
	cp, err := store.Open(gen, store.Options{MinFreeBytes: -1})
	require.NoError(t, err)
	require.False(t, cp.NoWAL())
	require.Equal(t, uint64(1), cp.Checkpoint(b).Applied, "the checkpoint holds the commit before it")
	require.NoError(t, cp.Close())
	require.NoError(t, db.Close())

	db, err = store.OpenState(dir, opts)
	require.NoError(t, err)
	require.False(t, db.NoWAL(), "a generation that exists opens with its log")
	require.Equal(t, uint64(2), db.Checkpoint(b).Applied, "Close flushed the memtable")
	require.NoError(t, db.Close())

	db, err = store.ResetState(dir, opts)
	require.NoError(t, err)
	require.True(t, db.NoWAL(), "a state dir started over is a first fill")
	require.NoError(t, db.Close())
}

// TestOpenState_FirstFillNoWALSyncedIsKeptByAKill: a first fill's store without a log answers, and a
// bucket caught up at its stream's end answers synced: true; so what a commit asked to sync, or a
// Flush, must survive a SIGKILL (store.CopyCurrent: the files as written, not the memtables), as it
// does with a log. A commit not asked to sync (a catch-up's batch) need not: the kill takes it back.
func TestOpenState_FirstFillNoWALSyncedIsKeptByAKill(t *testing.T) {
	dir := t.TempDir()
	db, err := store.OpenState(dir, store.Options{FirstFillNoWAL: true, MinFreeBytes: -1})
	require.NoError(t, err)
	defer db.Close()
	require.True(t, db.NoWAL())
	b := provisioner.BucketNeeds

	require.NoError(t, db.Apply(b, []provisioner.Message{put(1, "n1.m.config.a", []byte{0x80})}, 1, false))
	require.Zero(t, killedApplied(t, dir, b), "a batch not asked to sync is in the memtable only")
	require.NoError(t, db.Apply(b, []provisioner.Message{put(2, "n1.m.config.b", []byte{0x80})}, 1, true))
	require.Equal(t, uint64(2), killedApplied(t, dir, b), "a batch asked to sync (the stream's end) survives a kill")
	require.NoError(t, db.Apply(b, []provisioner.Message{put(3, "n1.m.config.c", []byte{0x80})}, 1, false))
	require.NoError(t, db.Flush())
	require.Equal(t, uint64(3), killedApplied(t, dir, b), "Flush (the stream's end read after its batch) makes it durable")
}

// killedApplied is the bucket's applied sequence in what a SIGKILL of the store in dir would leave now
// (store.CopyCurrent: its files as written, not its memtables).
func killedApplied(t *testing.T, dir, bucket string) uint64 {
	t.Helper()
	cp, err := store.CopyCurrent(dir)
	require.NoError(t, err)
	defer func() { require.NoError(t, store.RemoveCopy(cp)) }()
	kdb, err := store.Open(cp, store.Options{MinFreeBytes: -1})
	require.NoError(t, err)
	defer kdb.Close()
	return kdb.Checkpoint(bucket).Applied
}
