package store

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestHeapGiver_TrimsOnceAFlushBegins: a flush beginning (its memtable replaced by a new one, whose
// reservation evicted blocks) has the C heap's free pages given back, on the store's goroutine; Close
// ends that goroutine, and a flush said after it asks nothing of it.
func TestHeapGiver_TrimsOnceAFlushBegins(t *testing.T) {
	db, err := Open(t.TempDir(), Options{MemTableSize: 4 << 20})
	require.NoError(t, err)
	before := db.giver.trims.Load()
	var seq uint64
	fill(t, db, &seq, 100) // applies and flushes
	require.Eventually(t, func() bool { return db.giver.trims.Load() > before }, 30*time.Second, 5*time.Millisecond,
		"a flush began and no trim followed")

	require.NoError(t, db.Close())
	select {
	case <-db.giver.done:
	default:
		t.Fatal("Close left the giver's goroutine running")
	}
	db.giver.due()
	db.giver.due() // neither waits for the stopped goroutine
}
