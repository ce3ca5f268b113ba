package seat

import (
	"context"
	"errors"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// SetBeforeSwap has fn called as a rebuild has stopped the old projector, before the verb moves to the
// rebuilt store: where a request's wake used to reach only the stopped projector.
func SetBeforeSwap(s *Seat, fn func(next *projector.Projector)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.beforeSwap = fn
}

// Wake is the wake the seat's plans requests with min_seq call.
func Wake(s *Seat, bucket string) { s.wake(bucket) }

// SetBeforeView has fn called as the verb is about to open a view, before it takes the store that is
// current then; nil removes it.
func SetBeforeView(s *Seat, fn func()) {
	if fn == nil {
		s.reader.beforeAcquire.Store(nil)
		return
	}
	s.reader.beforeAcquire.Store(&fn)
}

// SetAtCaughtUp has fn called, with the rebuild's projector and store, as a rebuild's projection has caught up, before the old projector stops:
// what the old one applies then, the new one may not have read at the swap.
func SetAtCaughtUp(s *Seat, fn func(next *projector.Projector, db *store.DB)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.atCaughtUp = fn
}

// SetSwapWait bounds a rebuild's wait, at its swap, for the new store to reach the replaced one.
func SetSwapWait(s *Seat, d time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.swapWait = d
}

// SetHeldReset has fn called as a rebuild's projector reports, after the rebuild caught up and before
// its swap, that a bucket cannot be resumed.
func SetHeldReset(s *Seat, fn func(bucket string)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.heldReset = fn
}

// RequestRebuild asks the seat for a rebuild, as a bucket that can no longer be resumed does.
func RequestRebuild(s *Seat, bucket string) {
	s.requestRebuild(bucket, errors.New("asked by a test"))
}

// StartWith is Start with hooks called on the seat before anything of it starts: the setters of this
// file, for hooks the seat may reach at once.
func StartWith(ctx context.Context, nc *nats.Conn, js jetstream.JetStream, db *store.DB, cfg Config, hooks func(*Seat)) (*Seat, error) {
	return start(ctx, nc, js, db, cfg, hooks)
}

// SetBeforeRelog has fn called as a first fill without a log has caught up, before the seat checkpoints
// it into a generation with one (relog.go).
func SetBeforeRelog(s *Seat, fn func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.beforeRelog = fn
}
