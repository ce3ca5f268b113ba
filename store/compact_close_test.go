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
		errs := make([]error, 2)
		wg.Add(2)
		go func() {
			defer wg.Done()
			<-start
			errs[0] = db.CompactAll(context.Background())
		}()
		go func() {
			defer wg.Done()
			<-start
			errs[1] = db.compact(context.Background(), []byte{prefixHistory}, []byte{prefixEvent + 1}, false)
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
