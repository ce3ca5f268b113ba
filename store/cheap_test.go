package store

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestHeapGiver_LooksAtEveryFlush: each flush that begins is looked at, on the store's goroutine (so a
// memtable's reservation that evicted blocks has their pages given back); Close ends that goroutine,
// and a flush said after it asks nothing of it.
func TestHeapGiver_LooksAtEveryFlush(t *testing.T) {
	db, err := Open(t.TempDir(), Options{CacheSize: 1 << 20, MemTableSize: 1 << 20})
	require.NoError(t, err)
	var seq uint64
	for i := 0; i < 3; i++ {
		fill(t, db, &seq, 200) // and a flush
	}
	require.Eventually(t, func() bool { return db.giver.checks.Load() >= 3 }, 30*time.Second, 5*time.Millisecond,
		"flushes began and were not looked at")
	require.NoError(t, db.Close())
	select {
	case <-db.giver.done:
	default:
		t.Fatal("Close left the giver's goroutine running")
	}
	db.giver.due()
	db.giver.due() // neither waits for the stopped goroutine
}

// TestHeapGiver_TrimsWhenFreedBlocksAddUp: a trim once the C heap holds an eighth of the cache more
// free than at its lowest since the last trim, and not before: pages given back are faulted in again.
func TestHeapGiver_TrimsWhenFreedBlocksAddUp(t *testing.T) {
	g := newHeapGiver(800) // room: 100 bytes
	for _, step := range []struct {
		free  int64
		trims int64
	}{
		{1000, 0}, // the first look
		{1099, 0}, // freed less than the room
		{900, 0},  // reused: the lowest now
		{999, 0},
		{1000, 1}, // 100 more than the lowest
		{1001, 1}, // the lowest is what the heap held free after the trim
	} {
		g.look(step.free)
		require.Equal(t, step.trims, g.trims.Load(), "after a look at %d bytes free", step.free)
	}
}
