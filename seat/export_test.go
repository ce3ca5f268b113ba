package seat

import "github.com/novox/mesh-provisioner/projector"

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
