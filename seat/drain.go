package seat

import (
	"time"

	"github.com/nats-io/nats.go"
)

// drainVerb returns once every request the verb took has been answered. The verb's subscription
// stopped taking requests in Server.Stop, but micro only starts its drain there: requests already
// delivered to this process wait in the subscription's queue, and would be answered after the store
// closed (a 500, or a panic on a closed Pebble snapshot) or never (the connection closed under them)
// — the graceful-stop test under load saw both. Draining the connection answers the queue, from the
// store, which is still open, and then closes it. It runs after the projector and the registry writer
// have stopped, so nothing else needs the connection any more.
func (s *Seat) drainVerb() {
	nc := s.nc
	if nc == nil || nc.IsClosed() {
		return
	}
	closed := make(chan struct{})
	prev := nc.Opts.ClosedCB
	nc.SetClosedHandler(func(c *nats.Conn) {
		if prev != nil {
			prev(c)
		}
		close(closed)
	})
	if err := nc.Drain(); err != nil {
		// Not connected (or closing already): no answer can be sent any more.
		nc.Close()
		return
	}
	t := time.NewTimer(nc.Opts.DrainTimeout + time.Second) // past it, nats.go closes the connection itself
	defer t.Stop()
	select {
	case <-closed:
	case <-t.C:
		s.log.Warn("the verb's connection did not finish draining", "timeout", nc.Opts.DrainTimeout)
	}
}
