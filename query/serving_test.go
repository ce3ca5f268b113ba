package query

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/store"
)

// gatedReader is a store's Reader that counts the views open at once, and holds each one from
// opening until its gate opens.
type gatedReader struct {
	Reader
	gate       chan struct{}
	open, most atomic.Int64
}

func (g *gatedReader) View(bucket string) (View, bool, error) {
	n := g.open.Add(1)
	for m := g.most.Load(); n > m && !g.most.CompareAndSwap(m, n); m = g.most.Load() {
	}
	<-g.gate
	g.open.Add(-1)
	return g.Reader.View(bucket)
}

// codes collects answers on an inbox: how many of each code (200 when none).
type codes struct {
	mu sync.Mutex
	n  map[string]int
}

func collect(t *testing.T, nc *nats.Conn) (*codes, string) {
	t.Helper()
	c := &codes{n: map[string]int{}}
	inbox := nats.NewInbox()
	sub, err := nc.Subscribe(inbox+".*", func(m *nats.Msg) {
		code := m.Header.Get(micro.ErrorCodeHeader)
		if code == "" {
			code = "200"
		}
		c.mu.Lock()
		c.n[code]++
		c.mu.Unlock()
	})
	require.NoError(t, err)
	require.NoError(t, sub.SetPendingLimits(-1, -1))
	return c, inbox
}

func (c *codes) get(code string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[code]
}

// putNeed applies a need of its own key at seq, synced.
func putNeed(t *testing.T, db *store.DB, seq uint64) {
	t.Helper()
	msg := provisioner.Message{Seq: seq, Time: int64(seq), Key: fmt.Sprintf("n%d.m.config.a", seq), Op: provisioner.OpPut, Value: []byte{0x80}}
	require.NoError(t, db.Apply(provisioner.BucketNeeds, []provisioner.Message{msg}, 0, true))
}

// TestServer_WaitersAnsweredByTheWorkers: docs/decisions.md (Serving), answers are written by a few
// workers. Requests that wait for the same sequence wake together when it comes; they are answered by
// the workers, never more at once than there are workers, not each in its own goroutine at the same
// moment (a page of up to a NATS message each).
func TestServer_WaitersAnsweredByTheWorkers(t *testing.T) {
	db := smallStore(t)
	put := func(seq uint64) { putNeed(t, db, seq) }
	put(1)
	db.SetSynced(provisioner.BucketNeeds, true)
	g := &gatedReader{Reader: StoreReader(db), gate: make(chan struct{})}
	var once sync.Once
	openGate := func() { once.Do(func() { close(g.gate) }) }
	ns := natstest.RunServer(t)
	snc, _ := natstest.Connect(t, ns.ClientURL())
	const workers = 2
	const queued = 8
	s := NewServer(g, Options{Workers: workers, MaxQueued: queued, NoReadAhead: true})
	require.NoError(t, s.Start(snc, nil))
	t.Cleanup(s.Stop)
	t.Cleanup(openGate)

	nc, _ := natstest.Connect(t, ns.ClientURL())
	got, inbox := collect(t, nc)
	const n = 40
	for i := 0; i < n; i++ {
		// A node's lookup: no wide request (the wide requests' lane leaves a worker to the others).
		require.NoError(t, nc.PublishRequest(Subject, fmt.Sprintf("%s.%d", inbox, i), []byte(`{"what":"needs","node":"n1","min_seq":2,"wait_ms":10000}`)))
	}
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if w := s.Waiting(); w < n {
			return fmt.Errorf("%d of %d waiting", w, n)
		}
		return nil
	})
	require.Zero(t, g.most.Load(), "no view opened while they wait")

	put(2)
	// Every worker is in an answer, their queue is full, and the rest are still waiting to be queued
	// (they have waited already: they are not answered busy).
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if w, o := s.Waiting(), g.open.Load(); w != n-workers-queued || o != workers {
			return fmt.Errorf("%d waiting, %d views open", w, o)
		}
		return nil
	})
	require.EqualValues(t, workers, g.most.Load(), "views open at once")
	openGate()
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if c := got.get("200"); c < n {
			return fmt.Errorf("%d of %d answered", c, n)
		}
		return nil
	})
	require.EqualValues(t, workers, g.most.Load(), "views open at once")
	require.Zero(t, s.Waiting())
}

// TestServer_RequestWithoutReplyIsNotAnswered: a request published without a reply subject has no
// one to answer: it is not answered, and takes no place among the requests waiting for min_seq, so
// such a flood leaves the waiters' places to those who ask.
func TestServer_RequestWithoutReplyIsNotAnswered(t *testing.T) {
	db := smallStore(t)
	require.NoError(t, db.Apply(provisioner.BucketNeeds, []provisioner.Message{{Seq: 1, Time: 1, Key: "n1.m.config.a", Op: provisioner.OpPut, Value: []byte{0x80}}}, 0, true))
	db.SetSynced(provisioner.BucketNeeds, true)
	ns := natstest.RunServer(t)
	snc, _ := natstest.Connect(t, ns.ClientURL())
	s := NewServer(StoreReader(db), Options{MaxWaiting: 10})
	require.NoError(t, s.Start(snc, nil))
	t.Cleanup(s.Stop)
	nc, _ := natstest.Connect(t, ns.ClientURL())
	for i := 0; i < 100; i++ {
		require.NoError(t, nc.Publish(Subject, []byte(`{"what":"needs","min_seq":5,"wait_ms":10000}`)))
		require.NoError(t, nc.Publish(Subject, []byte(`{"what":"needs"}`)))
		require.NoError(t, nc.Publish(Subject, []byte(`{"what":"needs","limit":0}`)))
	}
	// Requests are handled in order: once this one is answered, the published ones were handled.
	a, _, err := natstest.Ask(nc, Subject, []byte(`{"what":"needs"}`), false)
	require.NoError(t, err)
	require.Len(t, a.Rows, 1)
	require.Zero(t, s.Waiting())
	require.Equal(t, map[string]int64{"200": 1}, s.Answered())
	// The waiters' places are free for those who ask (node lookups of ten nodes, which may take them
	// all; one node may take an eighth).
	got, inbox := collect(t, nc)
	for i := 0; i < 10; i++ {
		require.NoError(t, nc.PublishRequest(Subject, fmt.Sprintf("%s.%d", inbox, i), []byte(fmt.Sprintf(`{"what":"needs","node":"n%d","min_seq":5,"wait_ms":10000}`, i))))
	}
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if w := s.Waiting(); w < 10 {
			return fmt.Errorf("%d of 10 waiting", w)
		}
		return nil
	})
	require.Zero(t, got.get("504"))
}

// TestServer_FullQueueAnswersBusy: docs/decisions.md (Serving), requests past what the workers' queue
// holds are answered 500 at once, saying the seat is busy, rather than queued behind answers their
// askers will have stopped waiting for; those queued are answered, and the seat serves on.
func TestServer_FullQueueAnswersBusy(t *testing.T) {
	db := smallStore(t)
	require.NoError(t, db.Apply(provisioner.BucketNeeds, []provisioner.Message{{Seq: 1, Time: 1, Key: "n1.m.config.a", Op: provisioner.OpPut, Value: []byte{0x80}}}, 0, true))
	db.SetSynced(provisioner.BucketNeeds, true)
	g := &gatedReader{Reader: StoreReader(db), gate: make(chan struct{})}
	var once sync.Once
	openGate := func() { once.Do(func() { close(g.gate) }) }
	ns := natstest.RunServer(t)
	snc, _ := natstest.Connect(t, ns.ClientURL())
	const workers, queued, n = 1, 10, 200
	s := NewServer(g, Options{Workers: workers, MaxQueued: queued, NoReadAhead: true})
	require.NoError(t, s.Start(snc, nil))
	t.Cleanup(s.Stop)
	t.Cleanup(openGate)

	nc, _ := natstest.Connect(t, ns.ClientURL())
	got, inbox := collect(t, nc)
	// The worker is held in its first answer (sent alone: in a burst the rest could fill the queue
	// before the worker took the first from it), then the queue fills, and every other request is
	// answered busy at once.
	require.NoError(t, nc.PublishRequest(Subject, inbox+".0", []byte(`{"what":"needs"}`)))
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if g.open.Load() != 1 {
			return fmt.Errorf("the worker is not in its first answer yet")
		}
		return nil
	})
	for i := 1; i < n; i++ {
		require.NoError(t, nc.PublishRequest(Subject, fmt.Sprintf("%s.%d", inbox, i), []byte(`{"what":"needs"}`)))
	}
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if b := got.get("500"); b < n-workers-queued {
			return fmt.Errorf("%d answered busy", b)
		}
		return nil
	})
	require.Equal(t, n-workers-queued, got.get("500"))
	require.Zero(t, got.get("200"))
	require.Equal(t, queued, s.Queued())
	_, _, err := natstest.Ask(nc, Subject, []byte(`{"what":"needs"}`), false)
	var ve *natstest.VerbError
	require.ErrorAs(t, err, &ve)
	require.Equal(t, 500, ve.Code)
	require.Contains(t, ve.Description, "busy")

	openGate()
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if c := got.get("200"); c < workers+queued {
			return fmt.Errorf("%d answered", c)
		}
		return nil
	})
	a, _, err := natstest.Ask(nc, Subject, []byte(`{"what":"needs"}`), false)
	require.NoError(t, err)
	require.Len(t, a.Rows, 1)
	require.Equal(t, map[string]int64{"200": workers + queued + 1, "500": n - workers - queued + 1}, s.Answered())
	require.Zero(t, s.queuedBytes.Load())
}

// TestServer_StopWithAWaiterBlockedOnAFullQueue: Stop returns, and every request is answered, when a
// request whose min_seq has come is waiting for a place in the workers' full queue while the workers
// answer paged requests (whose next pages they ask to be written ahead). The waiter held the queue's
// lock to read while it waited for a place; Stop's wait for it to write stopped any worker from asking
// for a page ahead under the same lock, so no worker freed a place: Stop, and the seat's shutdown,
// never returned.
func TestServer_StopWithAWaiterBlockedOnAFullQueue(t *testing.T) {
	db := smallStore(t)
	put := func(seq uint64) { putNeed(t, db, seq) }
	put(1)
	put(2)
	db.SetSynced(provisioner.BucketNeeds, true)
	g := &gatedReader{Reader: StoreReader(db), gate: make(chan struct{})}
	var once sync.Once
	openGate := func() { once.Do(func() { close(g.gate) }) }
	t.Cleanup(openGate)
	ns := natstest.RunServer(t)
	snc, _ := natstest.Connect(t, ns.ClientURL())
	s := NewServer(g, Options{Workers: 1, MaxQueued: 1})
	require.NoError(t, s.Start(snc, nil))

	nc, _ := natstest.Connect(t, ns.ClientURL())
	got, inbox := collect(t, nc)
	ask := func(i int, body string) {
		require.NoError(t, nc.PublishRequest(Subject, fmt.Sprintf("%s.%d", inbox, i), []byte(body)))
	}
	ask(0, `{"what":"needs","limit":1}`) // the worker is held in its view
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if o := g.open.Load(); o != 1 {
			return fmt.Errorf("%d views open", o)
		}
		return nil
	})
	ask(1, `{"what":"needs","limit":1}`) // fills the queue
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if q := s.Queued(); q != 1 {
			return fmt.Errorf("%d queued", q)
		}
		return nil
	})
	ask(2, `{"what":"needs","limit":1,"min_seq":3,"wait_ms":10000}`)
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if w := s.Waiting(); w != 1 {
			return fmt.Errorf("%d waiting, answered %v", w, s.Answered())
		}
		return nil
	})
	put(3) // the waiter wakes, and waits for a place in the queue
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if s.jobsMu.TryLock() {
			s.jobsMu.Unlock()
			return fmt.Errorf("the waiter is not yet waiting for a place")
		}
		return nil
	})
	stopped := make(chan struct{})
	go func() {
		s.Stop()
		close(stopped)
	}()
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if s.jobsMu.TryRLock() {
			s.jobsMu.RUnlock()
			return fmt.Errorf("Stop is not yet waiting for the queue")
		}
		return nil
	})
	openGate()
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		select {
		case <-stopped:
			return nil
		default:
			return fmt.Errorf("Stop has not returned: %d queued, %d waiting", s.Queued(), s.Waiting())
		}
	})
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if c := got.get("200"); c != 3 {
			return fmt.Errorf("%d of 3 answered", c)
		}
		return nil
	})
	require.Equal(t, map[string]int64{"200": 3}, s.Answered())
}

// TestServer_StopDuringAFlood: Stop returns while paged requests flood a small queue and requests
// waiting for their min_seq wake as it comes (a seat stopped under load). Before, it could hang for
// good (TestServer_StopWithAWaiterBlockedOnAFullQueue says how); this is the same, unstaged.
func TestServer_StopDuringAFlood(t *testing.T) {
	ns := natstest.RunServer(t)
	for round := 0; round < 5; round++ {
		db := smallStore(t)
		put := func(seq uint64) error {
			return db.Apply(provisioner.BucketNeeds, []provisioner.Message{{Seq: seq, Time: 1, Key: fmt.Sprintf("n%d.m.config.a", seq), Op: provisioner.OpPut, Value: []byte{0x80}}}, 0, true)
		}
		for i := uint64(1); i <= 5; i++ {
			require.NoError(t, put(i))
		}
		db.SetSynced(provisioner.BucketNeeds, true)
		snc, _ := natstest.Connect(t, ns.ClientURL())
		s := NewServer(StoreReader(db), Options{Workers: 1, MaxQueued: 3})
		require.NoError(t, s.Start(snc, nil))
		nc, _ := natstest.Connect(t, ns.ClientURL())
		_, inbox := collect(t, nc)
		for i := 0; i < 300; i++ {
			body := `{"what":"needs","limit":1,"after":"n1.m.config.a"}`
			if i%5 == 0 {
				body = fmt.Sprintf(`{"what":"needs","limit":1,"min_seq":%d,"wait_ms":10000}`, 6+i%3)
			}
			require.NoError(t, nc.PublishRequest(Subject, fmt.Sprintf("%s.%d", inbox, i), []byte(body)))
		}
		applied := make(chan error, 1)
		go func() {
			var err error
			for i := uint64(6); i <= 8 && err == nil; i++ {
				err = put(i)
			}
			applied <- err
		}()
		stopped := make(chan struct{})
		go func() {
			s.Stop()
			close(stopped)
		}()
		natstest.CheckFor(t, 20*time.Second, 5*time.Millisecond, func() error {
			select {
			case <-stopped:
				return nil
			default:
				return fmt.Errorf("round %d: Stop has not returned: %d queued, %d waiting", round, s.Queued(), s.Waiting())
			}
		})
		require.NoError(t, <-applied)
		require.Zero(t, s.Waiting())
	}
}
