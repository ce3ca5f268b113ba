package store_test

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/store"
)

// TestDB_CorruptionFoundWhileReading garbles the sstables under an open store: the read that meets a
// bad block fails with an error NeedsRebuild says yes to, and Broken reports it with what to do,
// instead of Pebble's default of a fatal log line (a panic).
func TestDB_CorruptionFoundWhileReading(t *testing.T) {
	dir := t.TempDir()
	db, err := store.Open(dir, store.Options{CacheSize: 1 << 10, MemTableSize: 1 << 20})
	require.NoError(t, err)
	defer db.Close()
	var msgs []provisioner.Message
	for i := 1; i <= 5000; i++ {
		msgs = append(msgs, put(uint64(i), fmt.Sprintf("n%04d.m.config.k", i), []byte{0xa8, 'p', 'a', 'd', 'd', 'i', 'n', 'g', 's'}))
	}
	require.NoError(t, db.Apply(provisioner.BucketNeeds, msgs, 0, false))
	require.NoError(t, db.Pebble().Flush())
	select {
	case <-db.Broken():
		t.Fatal("broken before any damage")
	default:
	}

	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	n := 0
	for _, e := range entries {
		if strings.HasSuffix(e.Name(), ".sst") {
			garbleSpread(t, filepath.Join(dir, e.Name()), 16)
			n++
		}
	}
	require.Positive(t, n)

	v, err := db.View()
	require.NoError(t, err)
	err = v.Rows(provisioner.Range{Bucket: provisioner.BucketNeeds, Index: provisioner.IndexPrimary}, func(*provisioner.Row) bool { return true })
	require.NoError(t, v.Close())
	require.Error(t, err, "a read over garbled blocks fails")
	require.True(t, store.NeedsRebuild(err), "%v", err)
	select {
	case <-db.Broken():
	default:
		t.Fatal("Broken was not closed")
	}
	require.ErrorIs(t, db.BrokenErr(), store.ErrCorrupt)
	require.Contains(t, db.BrokenErr().Error(), "mesh-provisioner rebuild")
}

// TestOpen_KeepsRoom refuses to open a state dir, with ErrNoSpace and what to do, on a file system
// with less free than the store keeps (Apply's refusal is proven against a filled tmpfs in
// reliability/brokenstate_test.go).
func TestOpen_KeepsRoom(t *testing.T) {
	dir := t.TempDir()
	var st syscall.Statfs_t
	require.NoError(t, syscall.Statfs(dir, &st))
	free := int64(st.Bavail) * st.Bsize
	_, err := store.Open(dir, store.Options{MinFreeBytes: free * 2})
	require.ErrorIs(t, err, store.ErrNoSpace)
	require.Contains(t, err.Error(), "free space")
	require.False(t, store.NeedsRebuild(err), "a full disk is no broken state")

	db, err := store.Open(dir, store.Options{MinFreeBytes: 1 << 20})
	require.NoError(t, err)
	defer db.Close()
	require.NoError(t, db.Apply(provisioner.BucketNeeds, []provisioner.Message{put(1, "n1.m.config.a", []byte{0x01})}, 0, false))
}

// garbleSpread overwrites n places spread over the first 90% of a file (its data blocks).
func garbleSpread(t *testing.T, path string, n int) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	require.NoError(t, err)
	defer f.Close()
	info, err := f.Stat()
	require.NoError(t, err)
	for i := 0; i < n; i++ {
		_, err := f.WriteAt(bytes.Repeat([]byte{0x5a}, 32), info.Size()*9/10*int64(i)/int64(n))
		require.NoError(t, err)
	}
}

// TestOpen_CorruptionSaysItOnOneLine: a state dir whose tables are garbled is refused at open with
// ErrCorrupt, what to do, and Pebble's words for the damage on the same line, without the internal
// "<corruption detail carrier>" line Pebble joins to its error (replay --state and serve's log quoted
// it to the operator).
func TestOpen_CorruptionSaysItOnOneLine(t *testing.T) {
	dir := t.TempDir()
	db, err := store.Open(dir, store.Options{})
	require.NoError(t, err)
	var msgs []provisioner.Message
	for i := 1; i <= 2000; i++ {
		msgs = append(msgs, put(uint64(i), fmt.Sprintf("n%04d.m.config.k", i), []byte{0x01}))
	}
	require.NoError(t, db.Apply(provisioner.BucketNeeds, msgs, 0, false))
	require.NoError(t, db.Pebble().Flush())
	require.NoError(t, db.Close())
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	for _, e := range entries {
		if strings.HasSuffix(e.Name(), ".sst") {
			garbleSpread(t, filepath.Join(dir, e.Name()), 64)
		}
	}
	_, err = store.Open(dir, store.Options{})
	require.ErrorIs(t, err, store.ErrCorrupt)
	require.Contains(t, err.Error(), "checksum")
	require.Contains(t, err.Error(), "mesh-provisioner rebuild")
	require.NotContains(t, err.Error(), "\n", "one line")
	require.NotContains(t, err.Error(), "carrier")
}
