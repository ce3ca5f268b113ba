package store

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestCompact_CloseWhileCompactAllStarts: a store closed while a compaction of it is being asked for
// (a rebuild's SwapIn closing the old store while the seat's compaction after a catch-up starts on
// it) neither panics (Pebble panics on a Flush or Compact of a closed DB) nor leaves a compaction
// goroutine behind Close: CompactAll returns ErrClosed, or what the compaction returned.
func TestCompact_CloseWhileCompactAllStarts(t *testing.T) {
	for i := 0; i < 25; i++ {
		db, err := Open(t.TempDir(), Options{MemTableSize: 4 << 20})
		require.NoError(t, err)
		var seq uint64
		fill(t, db, &seq, 20)
		var wg sync.WaitGroup
		start := make(chan struct{})
		errs := make([]error, 3)
		wg.Add(2)
		go func() {
			defer wg.Done()
			<-start
			errs[0] = db.CompactAll(context.Background())
		}()
		if i%5 == 4 { // CompactAll twice at once
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				errs[1] = db.CompactAll(context.Background())
			}()
		}
		go func() {
			defer wg.Done()
			<-start
			errs[2] = db.compact(context.Background(), []byte{prefixHistory}, []byte{prefixEvent + 1}, false)
		}()
		close(start)
		require.NoError(t, db.Close())
		wg.Wait()
		for _, err := range errs {
			if err != nil && !errors.Is(err, ErrClosed) && !errors.Is(err, context.Canceled) {
				t.Fatalf("round %d: compaction: %v", i, err)
			}
		}
		require.Error(t, db.CompactAll(context.Background()), "a closed store compacts nothing")
	}
}

// TestCompact_SwapInWhileTheOldStoreCompacts: a rebuilt store swapped in while the old store's
// compaction after a catch-up runs or is starting closes the old one without a panic or a hang, and
// the rebuilt store is the state dir's.
func TestCompact_SwapInWhileTheOldStoreCompacts(t *testing.T) {
	dir := t.TempDir()
	for i := 0; i < 5; i++ {
		old, err := OpenState(dir, Options{MemTableSize: 4 << 20})
		require.NoError(t, err)
		var seq uint64
		fill(t, old, &seq, 200)
		gen, err := old.State().NewGeneration()
		require.NoError(t, err)
		rebuilt, err := Open(gen, Options{})
		require.NoError(t, err)
		rebuilt.BulkLoad()
		var seq2 uint64
		fill(t, rebuilt, &seq2, 50)
		done := make(chan error, 1)
		go func() { done <- old.CompactAll(context.Background()) }()
		require.NoError(t, SwapIn(old, rebuilt))
		if err := <-done; err != nil {
			require.ErrorIs(t, err, ErrClosed)
		}
		require.NoError(t, rebuilt.Close())
	}
	db, err := OpenState(dir, Options{})
	require.NoError(t, err)
	defer db.Close()
	require.EqualValues(t, 50, db.Checkpoint("mesh-provisioner_needs").Applied)
}
