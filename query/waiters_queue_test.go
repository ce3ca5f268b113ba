package query

import (
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
)

// TestServer_WaiterTimesOutWhileTheQueueIsFull: a request waiting for min_seq is answered 504 once its
// wait_ms has passed, even while the workers' queue is full and another request of its bucket, whose
// min_seq has come, waits for a place in it. The bucket's watcher handed that request to the queue and
// waited there for a place, so every other request of the bucket waited past its wait_ms (its asker
// timing out with no answer at all) until a worker was free, and Stop could not reach them either.
func TestServer_WaiterTimesOutWhileTheQueueIsFull(t *testing.T) {
	db := smallStore(t)
	putNeed(t, db, 1)
	db.SetSynced(provisioner.BucketNeeds, true)
	gate := make(chan struct{})
	gr := &gatedReader{Reader: StoreReader(db), gate: gate}
	ns := natstest.RunServer(t)
	snc, _ := natstest.Connect(t, ns.ClientURL())
	s := NewServer(gr, Options{Workers: 1, MaxQueued: 1, NoReadAhead: true})
	require.NoError(t, s.Start(snc, nil))
	opened := false
	open := func() {
		if !opened {
			opened = true
			close(gate)
		}
	}
	t.Cleanup(func() { open(); s.Stop() })
	nc, _ := natstest.Connect(t, ns.ClientURL())
	got, inbox := collect(t, nc)

	// The one worker is held by an answer, and the queue's one place is taken.
	holdOneQueueOne(t, s, nc, inbox, gr.open.Load)

	// Two requests wait on the bucket: one whose sequence comes next, and one far ahead with a short wait.
	require.NoError(t, nc.PublishRequest(Subject, inbox+".near", []byte(`{"what":"needs","min_seq":2,"wait_ms":10000}`)))
	require.NoError(t, nc.PublishRequest(Subject, inbox+".far", []byte(`{"what":"needs","min_seq":1000000,"wait_ms":200}`)))
	natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
		if w := s.Waiting(); w != 2 {
			return fmt.Errorf("%d waiting", w)
		}
		return nil
	})
	putNeed(t, db, 2) // near's sequence: it waits for a place in the full queue

	// far's wait_ms passes while the worker is still held: it is answered 504 all the same.
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if n := got.get("504"); n != 1 {
			return fmt.Errorf("%d answered 504 (waiting %d)", n, s.Waiting())
		}
		return nil
	})
	require.Zero(t, got.get("200"), "nothing answered while the worker is held")
	require.Equal(t, 1, s.Waiting(), "near waits for a place, and counts as waiting")

	// Once the worker is free, the held, queued and near requests are answered, each once.
	open()
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if n := got.get("200"); n != 3 {
			return fmt.Errorf("%d answered 200", n)
		}
		return nil
	})
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if w := s.Waiting(); w != 0 {
			return fmt.Errorf("%d waiting", w)
		}
		return nil
	})
	require.Equal(t, 1, got.get("504"))
}

// TestServer_ReachedNodeLookupNotHeldBehindAFullWideQueue: docs/decisions.md (Serving), a request
// whose min_seq came is handed to its own queue. A wide request (no node) and a node's lookup wait on
// the bucket, and one commit reaches both while the wide requests' queue is full behind a wide answer
// under way: the node lookup is answered at once by the worker kept for it. Before, the bucket's
// watcher handed them over in min_seq order and, once the wide one found its queue full, made the node
// lookup wait behind it for a place in the wide requests' queue, which only the wide answers free (a
// node client reading its own write waited for every answer across the mesh queued before it).
func TestServer_ReachedNodeLookupNotHeldBehindAFullWideQueue(t *testing.T) {
	g := startGated(t, Options{MaxQueued: 1, NoReadAhead: true}, func(r *Request) bool { return r.Node == "" }, nil)
	s, nc, held, open := g.s, g.nc, &g.held, g.open
	got, inbox := collect(t, nc)

	// A wide answer is under way, held, and one more waits in the wide requests' queue: it is full.
	holdOneQueueOne(t, s, nc, inbox, held.Load)

	// A wide request and a node lookup wait, the wide one for the lower sequence.
	require.NoError(t, nc.PublishRequest(Subject, inbox+".wide", []byte(`{"what":"needs","min_seq":4,"wait_ms":10000}`)))
	require.NoError(t, nc.PublishRequest(Subject, inbox+".node", []byte(`{"what":"needs","node":"n1","min_seq":5,"wait_ms":10000}`)))
	natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
		if w := s.Waiting(); w != 2 {
			return fmt.Errorf("%d waiting", w)
		}
		return nil
	})
	// One commit reaches both.
	db := g.db
	require.NoError(t, db.Apply(provisioner.BucketNeeds, []provisioner.Message{
		{Seq: 4, Time: 4, Key: "n4.m.config.a", Op: provisioner.OpPut, Value: []byte{0x80}},
		{Seq: 5, Time: 5, Key: "n5.m.config.a", Op: provisioner.OpPut, Value: []byte{0x80}},
	}, 0, true))
	natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
		if n := got.get("200"); n != 1 {
			return fmt.Errorf("%d answered (%d waiting, %d queued)", n, s.Waiting(), s.Queued())
		}
		return nil
	})
	require.Equal(t, 1, s.Waiting(), "the wide request waits for a place in its queue")

	// Once the wide answers go on, the rest are answered.
	open()
	natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
		if n := got.get("200"); n != 4 {
			return fmt.Errorf("%d answered", n)
		}
		return nil
	})
	require.Zero(t, s.Waiting())
	require.Zero(t, got.get("504"))
	require.Zero(t, got.get("500"))
}

// holdOneQueueOne sends a wide request that the server's one slot holds (answered on inbox.held; held
// says how many are held), then one that waits in the queue (inbox.queued): its one place is taken.
func holdOneQueueOne(t *testing.T, s *Server, nc *nats.Conn, inbox string, held func() int64) {
	t.Helper()
	require.NoError(t, nc.PublishRequest(Subject, inbox+".held", []byte(`{"what":"needs"}`)))
	natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
		if held() != 1 {
			return fmt.Errorf("the answer is not held yet")
		}
		return nil
	})
	require.NoError(t, nc.PublishRequest(Subject, inbox+".queued", []byte(`{"what":"needs"}`)))
	natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
		if q := s.Queued(); q != 1 {
			return fmt.Errorf("%d queued", q)
		}
		return nil
	})
}
