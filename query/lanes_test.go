package query

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/store"
)

// TestServer_WideAnswersLeaveAWorkerToNodeLookups: docs/decisions.md (Serving), the wide requests
// (forensics with at, plans as of a point, walks across the mesh) never take every worker. With two
// workers and two such answers held in progress, a node's lookup is answered at once; one more wide
// request finds their queue full and is answered busy; Stop answers the one queued. Before, the two
// held answers took both workers, and the node lookup waited until one of them was done: an operator
// walking the event log during an incident held up every node of the mesh.
func TestServer_WideAnswersLeaveAWorkerToNodeLookups(t *testing.T) {
	cases := []struct {
		name string
		body string // of a wide request
	}{
		{"at of the whole bucket", `{"what":"needs","at":"seq:3","limit":10000}`},
		{"at of one node", `{"what":"needs","node":"n1","at":"seq:3"}`},
		{"plans at a time", `{"what":"plans","at":"2026-01-01T00:00:00Z"}`},
		{"a module across the mesh", `{"what":"needs","module":"m","limit":10000}`},
		{"plans of every node", `{"what":"plans"}`},
	}
	ns := natstest.RunServer(t)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			db := syncedStoreOfThreeNeeds(t)
			// at and plans answer from the live projection here: what matters is that they are held.
			answerLive := func(_ context.Context, r *Request, e *Encoder) error {
				v, _, err := StoreReader(db).View(provisioner.BucketNeeds)
				if err != nil {
					return err
				}
				defer v.Close()
				live := *r
				live.What, live.At = string(provisioner.WhatNeeds), ""
				return AnswerView(v, &live, e, 3, true)
			}
			snc, _ := natstest.Connect(t, ns.ClientURL())
			s := NewServer(StoreReader(db), Options{Workers: 2, MaxQueued: 1, NoReadAhead: true, At: answerLive, Plans: answerLive})
			gate := make(chan struct{})
			var held, most atomic.Int64
			s.answering = func(r *Request) {
				if r.Node == "n1" && r.At == "" {
					return // the node lookup
				}
				n := held.Add(1)
				for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
				}
				<-gate
				held.Add(-1)
			}
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

			for i := 1; i <= 2; i++ {
				require.NoError(t, nc.PublishRequest(Subject, fmt.Sprintf("%s.wide%d", inbox, i), []byte(tc.body)))
				natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
					if h, q := held.Load(), s.Queued(); h+int64(q) != int64(i) || h == 0 {
						return fmt.Errorf("%d answers held, %d queued", h, q)
					}
					return nil
				})
			}

			// Both wide requests are in progress: a node's lookup is answered all the same.
			require.NoError(t, nc.PublishRequest(Subject, inbox+".node", []byte(`{"what":"needs","node":"n1"}`)))
			natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
				if n := got.get("200"); n != 1 {
					return fmt.Errorf("%d answered (%d answers held, %d queued)", n, held.Load(), s.Queued())
				}
				return nil
			})
			require.EqualValues(t, 1, most.Load(), "wide answers under way at once")
			require.Equal(t, 1, s.Queued())

			// Their queue holds one (MaxQueued): one more is answered busy, as the workers' queue does.
			a, _, err := natstest.Ask(nc, Subject, []byte(tc.body), false)
			var ve *natstest.VerbError
			require.ErrorAs(t, err, &ve, "answered %+v", a)
			require.Equal(t, 500, ve.Code)
			require.Equal(t, "busy: the seat is busy, 1 requests are queued before this one: ask again shortly, or ask another seat", ve.Description)

			// Stop answers what is queued: the held answer and the one behind it.
			stopped := make(chan struct{})
			go func() {
				s.Stop()
				close(stopped)
			}()
			open()
			natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
				select {
				case <-stopped:
				default:
					return fmt.Errorf("Stop has not returned: %d queued", s.Queued())
				}
				if n := got.get("200"); n != 3 {
					return fmt.Errorf("%d of 3 answered", n)
				}
				return nil
			})
			require.EqualValues(t, 1, most.Load(), "wide answers under way at once")
			require.Equal(t, map[string]int64{"200": 3, "500": 1}, s.Answered())
			require.Zero(t, s.Queued())
			require.Zero(t, s.queuedBytes.Load())
		})
	}
}

// TestServer_PageAheadOfAWideWalkWaitsForASlot: the page the read-ahead worker writes ahead of a walk
// across the mesh is a wide answer: with two workers, it is not written while a wide answer is under
// way, and is once that answer ends. Before, the read-ahead worker wrote it beside the wide answers of
// the workers, and four clients walking a module across the mesh kept both cores of a 2-core seat
// busy, node lookups waiting for one.
func TestServer_PageAheadOfAWideWalkWaitsForASlot(t *testing.T) {
	var aheadWhileHeld, ahead atomic.Int64
	g := startGated(t, Options{}, func(r *Request) bool { return r.Node == "" }, func(g *gated) {
		g.s.writingAhead = func(r *Request) {
			ahead.Add(1)
			if g.held.Load() > 0 {
				aheadWhileHeld.Add(1)
			}
		}
	})
	s, nc, held, open := g.s, g.nc, &g.held, g.open
	got, inbox := collect(t, nc)

	// A wide answer is under way, and a walk of the module asks for its second page ahead.
	require.NoError(t, nc.PublishRequest(Subject, inbox+".wide", []byte(`{"what":"needs","module":"m","limit":1}`)))
	natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
		if held.Load() != 1 {
			return fmt.Errorf("the wide answer is not held yet")
		}
		return nil
	})
	walk := Request{What: "needs", Module: "m", Limit: ptr(int64(1))}
	s.queueAhead(aheadJob{r: walk, format: FormatJSON, depth: aheadDepth}, "n1.m.config.a")
	natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
		if n := len(s.ahead.jobs); n != 0 {
			return fmt.Errorf("the read-ahead worker has not taken the page yet")
		}
		return nil
	})
	// A node lookup is answered meanwhile (the other worker), the page ahead still waits.
	a, _, err := natstest.Ask(nc, Subject, []byte(`{"what":"needs","node":"n1"}`), false)
	require.NoError(t, err)
	require.Len(t, a.Rows, 1)
	require.Zero(t, aheadWhileHeld.Load(), "a page written ahead while a wide answer was under way")
	require.Zero(t, s.Ahead())

	open()
	natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
		if got.get("200") != 1 || s.Ahead() == 0 {
			return fmt.Errorf("%d answered, %d pages ahead", got.get("200"), s.Ahead())
		}
		return nil
	})
	require.Zero(t, aheadWhileHeld.Load())
	require.NotZero(t, ahead.Load())
}

// TestServer_WideRequestsLeaveQueueRoomToNodeLookups: the wide requests' queue shares the 32 MiB of
// queued fields with the others, and may hold only half of it: a flood of wide requests with long
// fields (a cursor, a module or a collection may be long), queued behind the wide answers under way,
// leaves room for a node's lookup. Before, it could take all 32 MiB, and every node lookup was
// answered busy until the wide requests had drained: the worker kept for lookups sat idle.
func TestServer_WideRequestsLeaveQueueRoomToNodeLookups(t *testing.T) {
	g := startGated(t, Options{NoReadAhead: true}, func(r *Request) bool { return r.Node == "" }, nil)
	s, nc, held, open := g.s, g.nc, &g.held, g.open
	got, inbox := collect(t, nc)
	wideOf := func(module string) []byte { return []byte(`{"what":"needs","module":"` + module + `"}`) }
	send := func(i int, body []byte) {
		t.Helper()
		busy := got.get("500")
		require.NoError(t, nc.PublishRequest(Subject, fmt.Sprintf("%s.w%d", inbox, i), body))
		natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
			if got.get("500") > busy || int(held.Load())+s.Queued() == i-got.get("500") {
				return nil
			}
			return fmt.Errorf("request %d neither queued nor answered busy", i)
		})
	}

	// Wide requests of 900 KiB of fields each, until their queue refuses one; then smaller ones, to
	// fill what is left to the byte, while they are taken.
	const most = 900 << 10
	i := 0
	for got.get("500") == 0 {
		i++
		require.Less(t, i, 100, "the wide requests' queue took every request")
		send(i, wideOf(strings.Repeat("m", most)))
	}
	overhead := int64((&Request{What: "needs"}).size())
	for busy := got.get("500"); got.get("500") == busy; {
		rest := maxQueuedBytes - s.queuedBytes.Load() - overhead
		if rest <= 0 {
			break
		}
		i++
		send(i, wideOf(strings.Repeat("m", int(min(rest, most)))))
	}
	require.EqualValues(t, 1, held.Load())

	// A node's lookup still finds room in its queue, and the free worker answers it.
	a, _, err := natstest.Ask(nc, Subject, []byte(`{"what":"needs","node":"n1"}`), false)
	require.NoError(t, err, "%d wide requests queued, %d bytes of fields", s.Queued(), s.queuedBytes.Load())
	require.Len(t, a.Rows, 1)

	open()
	s.Stop()
	require.Zero(t, s.queuedBytes.Load())
	require.Zero(t, s.Queued())
}

// TestServer_APageWrittenAheadIsNoWideAnswer: a walk's page already written ahead is answered from it
// at once, while the wide slot is taken (with two workers, one slot: the read-ahead worker writing the
// page after it, or another wide answer). Before, the request for it queued as a wide answer behind
// that slot: a module walk's every page waited for the writing of the page after it, and the module
// lookups of make bench went from about 23 to 26 ms.
func TestServer_APageWrittenAheadIsNoWideAnswer(t *testing.T) {
	g := startGated(t, Options{}, func(r *Request) bool { return r.At != "" }, nil)
	nc := g.nc

	// The first page of a module walk, one row a page: the next ones are written ahead.
	first := g.firstPageOfAWalk(t, 2)
	// A wide answer takes the one slot and is held there.
	_, inbox := collect(t, nc)
	g.holdAWideAnswer(t, inbox)
	// The walk's second page is answered from the page written ahead all the same.
	body := fmt.Sprintf(`{"what":"needs","module":"m","limit":1,"after":%q}`, first.Next)
	second, _, err := natstest.Ask(nc, Subject, []byte(body), false)
	require.NoError(t, err, "the page written ahead waited for the wide slot")
	require.Len(t, second.Rows, 1)
	require.Equal(t, "n2.m.config.a", second.Rows[0]["key"])
}

// gated is a Server of two workers over three needs (n1 to n3 of module m, synced), whose answers that
// hold picks wait at a gate: a test holds wide answers in progress with it.
type gated struct {
	s    *Server
	db   *store.DB    // the store it serves
	nc   *nats.Conn   // a client's connection
	held atomic.Int64 // answers waiting at the gate now
	open func()       // opens the gate, once; the test's cleanup opens it too, then stops the server
}

// firstPageOfAWalk asks the first page of a walk of module m, one row a page, and waits until at
// least n pages after it are written ahead; it returns that first answer.
func (g *gated) firstPageOfAWalk(t *testing.T, n int) natstest.Answer {
	t.Helper()
	first, _, err := natstest.Ask(g.nc, Subject, []byte(`{"what":"needs","module":"m","limit":1}`), false)
	require.NoError(t, err)
	require.NotEmpty(t, first.Next)
	natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
		if ahead := g.s.Ahead(); ahead < n {
			return fmt.Errorf("%d pages written ahead", ahead)
		}
		return nil
	})
	return first
}

// holdAWideAnswer sends an at request (a wide answer, answered on inbox.at) and waits until the gate
// holds it, the one held.
func (g *gated) holdAWideAnswer(t *testing.T, inbox string) {
	t.Helper()
	require.NoError(t, g.nc.PublishRequest(Subject, inbox+".at", []byte(`{"what":"needs","at":"seq:3","limit":10000}`)))
	natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
		if g.held.Load() != 1 {
			return fmt.Errorf("the wide answer is not held yet")
		}
		return nil
	})
}

// syncedStoreOfThreeNeeds is a small store holding needs of sequences 1 to 3, synced.
func syncedStoreOfThreeNeeds(t *testing.T) *store.DB {
	t.Helper()
	db := smallStore(t)
	for seq := uint64(1); seq <= 3; seq++ {
		putNeed(t, db, seq)
	}
	db.SetSynced(provisioner.BucketNeeds, true)
	return db
}

// startGated starts a gated Server with opts (two workers); hooks, when set, sets the server's other
// test hooks before it starts.
func startGated(t *testing.T, opts Options, hold func(r *Request) bool, hooks func(g *gated)) *gated {
	db := syncedStoreOfThreeNeeds(t)
	ns := natstest.RunServer(t)
	snc, _ := natstest.Connect(t, ns.ClientURL())
	opts.Workers = 2
	g := &gated{s: NewServer(StoreReader(db), opts), db: db}
	gate := make(chan struct{})
	g.s.answering = func(r *Request) {
		if hold(r) {
			g.held.Add(1)
			<-gate
			g.held.Add(-1)
		}
	}
	if hooks != nil {
		hooks(g)
	}
	require.NoError(t, g.s.Start(snc, nil))
	var once sync.Once
	g.open = func() { once.Do(func() { close(gate) }) }
	t.Cleanup(func() { g.open(); g.s.Stop() })
	g.nc, _ = natstest.Connect(t, ns.ClientURL())
	return g
}

// TestServer_AStalePageWrittenAheadIsAWideAnswer: a walk's page written ahead is answered as a copy
// outside the wide requests' lane only while it is the answer the request would be given; once a
// commit has made it stale, the page is a wide answer to write, and waits for the wide slot, held here
// by an at answer: two wide answers are never written at once with two workers. Before, the request
// went to the workers' queue because a page was kept for it, and the worker kept for node lookups
// wrote the whole page when it found it stale: on a mesh whose needs bucket commits all the time,
// every page of a walk across the mesh was written beside the wide answers.
func TestServer_AStalePageWrittenAheadIsAWideAnswer(t *testing.T) {
	for _, when := range []string{"before it is queued", "once a worker takes it"} {
		t.Run(when, func(t *testing.T) {
			var commit atomic.Pointer[func()]
			g := startGated(t, Options{}, func(r *Request) bool {
				if r.After != "" {
					if fn := commit.Swap(nil); fn != nil {
						(*fn)()
					}
				}
				return r.At != ""
			}, nil)
			s, nc, open := g.s, g.nc, g.open

			first := g.firstPageOfAWalk(t, 2)
			got, inbox := collect(t, nc)
			g.holdAWideAnswer(t, inbox)
			// A need of module m is committed: the page kept for the walk's second page is stale.
			put := func() { putNeed(t, g.db, 4) }
			if when == "before it is queued" {
				put()
			} else {
				commit.Store(&put)
			}
			body := fmt.Sprintf(`{"what":"needs","module":"m","limit":1,"after":%q}`, first.Next)
			require.NoError(t, nc.PublishRequest(Subject, inbox+".second", []byte(body)))

			// A node lookup is answered by the other worker; the second page waits for the wide slot.
			a, _, err := natstest.Ask(nc, Subject, []byte(`{"what":"needs","node":"n1"}`), false)
			require.NoError(t, err)
			require.Len(t, a.Rows, 1)
			require.Nil(t, commit.Load(), "the commit was made")
			require.Equal(t, 1, s.Queued(), "the stale page's request is not in the wide requests' queue")

			open()
			natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
				if n := got.get("200"); n != 1 {
					return fmt.Errorf("%d answered", n)
				}
				return nil
			})
		})
	}
}

// heldChanges is a Reader whose needs bucket's commits wake no waiter until release is closed: a test
// commits what a waiter waits for and sets the server up around it before the waiter is handed over.
type heldChanges struct {
	Reader
	held    atomic.Bool
	release chan struct{}
}

func (h *heldChanges) Changed(bucket string) <-chan struct{} {
	if bucket == provisioner.BucketNeeds && h.held.Load() {
		return h.release
	}
	return h.Reader.Changed(bucket)
}

// TestServer_AReachedRequestWhosePageGoesStaleIsNotBusy: a request that waited for its min_seq is
// handed to the workers' queue for a page written ahead for it (a copy); a commit makes the page stale
// before a worker takes it, and the wide requests' queue it is handed on to is full. It waits for a
// place there and is answered, as a reached request is (docs/decisions.md, Serving). Before, the worker
// answered it busy: its asker, having waited for its sequence, got "ask again".
func TestServer_AReachedRequestWhosePageGoesStaleIsNotBusy(t *testing.T) {
	var commit atomic.Pointer[func()]
	hc := &heldChanges{release: make(chan struct{})}
	hc.held.Store(true)
	g := startGated(t, Options{MaxQueued: 1}, func(r *Request) bool {
		if r.MinSeq > 0 {
			if fn := commit.Swap(nil); fn != nil {
				(*fn)()
			}
		}
		return r.At != ""
	}, func(g *gated) {
		hc.Reader = g.s.r
		g.s.r = hc
	})
	s, nc, db := g.s, g.nc, g.db
	got, inbox := collectBy(t, nc)
	codesOf := func(tok string) []string {
		got.mu.Lock()
		defer got.mu.Unlock()
		return slices.Clone(got.by[tok])
	}
	other := func(seq uint64) {
		t.Helper()
		require.NoError(t, db.Apply(provisioner.BucketNeeds, []provisioner.Message{
			{Seq: seq, Time: int64(seq), Key: fmt.Sprintf("n%d.x.config.a", seq), Op: provisioner.OpPut, Value: []byte{0x80}},
		}, 0, true))
	}

	// The third page of a walk of module m, one row a page, waits for sequence 4, which comes; the
	// waiter is not told yet.
	third := `{"what":"needs","module":"m","limit":1,"after":"n2.m.config.a","min_seq":4,"wait_ms":10000}`
	require.NoError(t, nc.PublishRequest(Subject, inbox+".reached", []byte(third)))
	natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
		if w := s.Waiting(); w != 1 {
			return fmt.Errorf("%d waiting", w)
		}
		return nil
	})
	other(4)
	// The walk's second page is asked: the third is written ahead, at sequence 4.
	second, _, err := natstest.Ask(nc, Subject, []byte(`{"what":"needs","module":"m","limit":1,"after":"n1.m.config.a"}`), false)
	require.NoError(t, err)
	require.Equal(t, "n2.m.config.a", second.Next)
	natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
		one := int64(1)
		if !s.aheadReady(&Request{What: "needs", Module: "m", Limit: &one, After: "n2.m.config.a"}, FormatJSON) {
			return fmt.Errorf("the third page is not written ahead")
		}
		return nil
	})
	// A wide answer holds the one slot, and the wide requests' queue is full behind it.
	g.holdAWideAnswer(t, inbox)
	require.NoError(t, nc.PublishRequest(Subject, inbox+".queued", []byte(`{"what":"needs"}`)))
	natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
		if q := s.Queued(); q != 1 {
			return fmt.Errorf("%d queued", q)
		}
		return nil
	})

	// The waiter is handed over with its page fresh; a commit as a worker takes it makes it stale.
	put := func() { other(5) }
	commit.Store(&put)
	hc.held.Store(false)
	close(hc.release)
	natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
		if commit.Load() != nil {
			return fmt.Errorf("no worker has taken the reached request yet")
		}
		if s.Waiting() != 0 {
			return fmt.Errorf("%d waiting", s.Waiting())
		}
		return nil
	})
	a, _, err := natstest.Ask(nc, Subject, []byte(`{"what":"needs","node":"n1"}`), false)
	require.NoError(t, err, "a node lookup is answered meanwhile")
	require.Len(t, a.Rows, 1)
	require.Empty(t, codesOf("reached"), "the reached request was answered before a place freed")

	g.open()
	natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
		if c := codesOf("reached"); len(c) == 0 {
			return fmt.Errorf("the reached request is not answered")
		}
		return nil
	})
	require.Equal(t, []string{"200"}, codesOf("reached"))
	natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
		if c := codesOf("queued"); len(c) == 0 {
			return fmt.Errorf("the queued request is not answered")
		}
		return nil
	})
	require.Equal(t, []string{"200"}, codesOf("queued"))
}
