package replay

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/internal/natstest"
)

// A fill runs under the context of the answer that started it. When that context ends, an answer
// waiting on the fill whose own context is still live fills the store itself: it is not refused with
// another answer's cancellation.
func TestKeptPlans_WaiterOutlivesTheFillersContext(t *testing.T) {
	tmp, v, inputs := onePlanInputs(t)

	k := &keptPlans{max: seatPlansKept}
	fillerCtx, cancel := context.WithCancel(context.Background())
	started := make(chan struct{})
	fillerErr := make(chan error, 1)
	go func() {
		_, err := k.get(fillerCtx, "a", func() (*plansAt, error) {
			close(started)
			<-fillerCtx.Done()
			return fillPlans(fillerCtx, v, inputs)
		})
		fillerErr <- err
	}()
	<-started
	waiterDone := make(chan struct{})
	var got *keptEntry
	var waiterErr error
	go func() {
		defer close(waiterDone)
		got, waiterErr = k.get(context.Background(), "a", func() (*plansAt, error) {
			return fillPlans(context.Background(), v, inputs)
		})
	}()
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		k.mu.Lock()
		defer k.mu.Unlock()
		if len(k.entries) != 1 || k.entries[0].refs != 2 {
			return fmt.Errorf("the waiter is not in yet: %d entries", len(k.entries))
		}
		return nil
	})
	cancel()
	require.ErrorIs(t, <-fillerErr, context.Canceled)
	<-waiterDone
	require.NoError(t, waiterErr, "the waiter's own context is live")
	require.NotNil(t, got.pa)
	require.Len(t, plansDirs(t, tmp), 1)
	k.release(got)
	k.close()
	require.Empty(t, plansDirs(t, tmp), "no store is left behind")
}

// Many answers of a few keys, some cancelled, with the kept stores evicted under them and close
// called in the middle: no store is closed under an answer reading it (pebble would panic, or the
// read fail), and once every answer has ended no temporary store is left.
func TestKeptPlans_ConcurrentAnswersEvictionAndClose(t *testing.T) {
	tmp, v, inputs := onePlanInputs(t)

	k := &keptPlans{max: 2}
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for i := range 48 {
		if i == 32 {
			k.close()
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			if i%5 == 0 {
				cancel()
			}
			key := plansKey(fmt.Sprint(i % 4))
			e, err := k.get(ctx, key, func() (*plansAt, error) { return fillPlans(ctx, v, inputs) })
			if err != nil {
				if ctx.Err() == nil {
					errs <- fmt.Errorf("ask %d: %w", i, err)
				}
				return
			}
			defer k.release(e)
			tv, err := e.pa.db.View()
			if err != nil {
				errs <- fmt.Errorf("ask %d: %w", i, err)
				return
			}
			defer tv.Close()
			if _, err := tv.Checkpoint(inputs[0].bucket); err != nil {
				errs <- fmt.Errorf("ask %d: %w", i, err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	k.close()
	require.Empty(t, plansDirs(t, tmp), "every store is removed once its answers ended")
}
