package query

import (
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

// TestServer_WideWaitersLeaveRoomToNodeLookups: docs/decisions.md (Serving), the requests waiting for
// min_seq that no node narrows (a module polled across the mesh, a whole bucket) take at most half of
// the waiters' places and of their bytes. A flood of them waiting for a sequence far ahead, past
// either half, is answered 504 at once saying so, and a node's lookup with min_seq (a node client
// reading its own write) still waits, and is answered once its sequence comes. Before, the flood took
// every place (or every byte), and each node lookup with min_seq was answered 504 at once.
func TestServer_WideWaitersLeaveRoomToNodeLookups(t *testing.T) {
	const far = `"min_seq":1000000,"wait_ms":10000`
	wideOf := func(module string) []byte {
		return []byte(`{"what":"needs","module":"` + module + `",` + far + `}`)
	}
	nodeOf := func(i int) []byte {
		return []byte(fmt.Sprintf(`{"what":"needs","node":"n%d","min_seq":2,"wait_ms":10000}`, i))
	}
	node := nodeOf(1)

	t.Run("places", func(t *testing.T) {
		const places = 4
		s, nc, db := waitingServer(t, places)
		got, inbox := collect(t, nc)
		for i := 0; i < places; i++ {
			require.NoError(t, nc.PublishRequest(Subject, fmt.Sprintf("%s.w%d", inbox, i), wideOf("m")))
		}
		natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
			if w, c := s.Waiting(), got.get("504"); w+c != places {
				return fmt.Errorf("%d waiting, %d answered 504", w, c)
			}
			return nil
		})
		require.Equal(t, places/2, s.Waiting(), "wide requests waiting")
		// One more is told why it is not waiting.
		_, _, err := natstest.Ask(nc, Subject, wideOf("m"), false)
		var ve *natstest.VerbError
		require.ErrorAs(t, err, &ve)
		require.Equal(t, 504, ve.Code)
		require.Equal(t, "timeout: min_seq 1000000 not reached (applied 1), and 2 requests not narrowed by node wait for theirs already, as many as this seat holds of them: ask again", ve.Description)

		// The node lookups (of nodes of their own) wait in the other half, and are answered when their
		// sequence comes.
		for i := 0; i < places/2; i++ {
			require.NoError(t, nc.PublishRequest(Subject, fmt.Sprintf("%s.n%d", inbox, i), nodeOf(i)))
		}
		natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
			if w, c := s.Waiting(), got.get("504"); w+c != places+places/2 {
				return fmt.Errorf("%d waiting, %d answered 504", w, c)
			}
			return nil
		})
		require.Equal(t, places/2, got.get("504"), "node lookups answered 504 at once")
		putNeed(t, db, 2)
		natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
			if n := got.get("200"); n != places/2 {
				return fmt.Errorf("%d node lookups answered", n)
			}
			return nil
		})
		require.Equal(t, places/2, s.Waiting(), "the wide requests still wait")
	})

	t.Run("bytes", func(t *testing.T) {
		s, nc, _ := waitingServer(t, 0)
		got, inbox := collect(t, nc)
		waitingBytes := func() int {
			s.waitMu.Lock()
			defer s.waitMu.Unlock()
			return s.waitingBytes
		}
		i := 0
		send := func(body []byte) {
			t.Helper()
			i++
			waiting, timedOut := s.Waiting(), got.get("504")
			require.NoError(t, nc.PublishRequest(Subject, fmt.Sprintf("%s.%d", inbox, i), body))
			natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
				if s.Waiting() > waiting || got.get("504") > timedOut {
					return nil
				}
				return fmt.Errorf("request %d neither waits nor was answered 504", i)
			})
		}
		// Wide requests of 900 KiB of fields each until one is refused, then smaller ones to fill
		// what is left to the byte, until one of those is refused.
		const most = 900 << 10
		for got.get("504") == 0 {
			require.Less(t, i, 100, "the wide requests took every byte")
			send(wideOf(strings.Repeat("m", most)))
		}
		overhead := (&Request{What: "needs", MinSeq: 1, WaitMS: 1}).size()
		for refused := got.get("504"); got.get("504") == refused; {
			rest := maxWaitingBytes - waitingBytes() - overhead
			if rest <= 0 {
				break
			}
			send(wideOf(strings.Repeat("m", min(rest, most))))
		}

		// A node's lookup still waits.
		waiting, refused, wide := s.Waiting(), got.get("504"), waitingBytes()
		require.NoError(t, nc.PublishRequest(Subject, inbox+".node", node))
		natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
			if s.Waiting() == waiting && got.get("504") == refused {
				return fmt.Errorf("the node lookup neither waits nor was answered")
			}
			return nil
		})
		require.Equal(t, refused, got.get("504"), "node lookup answered 504 with %d bytes of fields waiting", waitingBytes())
		require.Equal(t, waiting+1, s.Waiting())
		require.LessOrEqual(t, wide, maxWideWaitingBytes, "bytes of the wide requests waiting")
	})
}

// TestServer_OneNodesWaitersLeaveRoomToOtherNodes: docs/decisions.md (Serving), the requests of one
// node waiting for min_seq take at most an eighth of the waiters' places (and of their bytes), the
// registry's as one node. A client flooding its node's lookups with a min_seq far ahead is answered
// 504 at once past its share, saying so, and another node's lookup with min_seq still waits, and is
// answered once its sequence comes. Before, the flood took every place, and every other node's
// client reading its own write was answered 504 at once.
func TestServer_OneNodesWaitersLeaveRoomToOtherNodes(t *testing.T) {
	for _, flood := range []string{`"what":"needs","node":"n1"`, `"what":"registry"`} {
		t.Run(flood, func(t *testing.T) {
			const places = 16
			s, nc, db := waitingServer(t, places)
			got, inbox := collect(t, nc)
			far := []byte(`{` + flood + `,"min_seq":1000000,"wait_ms":10000}`)
			for i := 0; i < places; i++ {
				require.NoError(t, nc.PublishRequest(Subject, fmt.Sprintf("%s.f%d", inbox, i), far))
			}
			natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
				if w, c := s.Waiting(), got.get("504"); w+c != places {
					return fmt.Errorf("%d waiting, %d answered 504", w, c)
				}
				return nil
			})
			require.Equal(t, places/8, s.Waiting(), "the flood's requests waiting")
			_, _, err := natstest.Ask(nc, Subject, far, false)
			var ve *natstest.VerbError
			require.ErrorAs(t, err, &ve)
			require.Equal(t, 504, ve.Code)
			require.Contains(t, ve.Description, "as many as this seat holds for one node: ask again")

			// The other nodes' lookups wait, up to their share each, and are answered when their
			// sequence comes.
			refused := got.get("504")
			for i := 2; i < 2+places/2; i++ {
				body := fmt.Sprintf(`{"what":"needs","node":"n%d","min_seq":2,"wait_ms":10000}`, i)
				require.NoError(t, nc.PublishRequest(Subject, fmt.Sprintf("%s.n%d", inbox, i), []byte(body)))
			}
			natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
				if w := s.Waiting(); w != places/8+places/2 {
					return fmt.Errorf("%d waiting, %d answered 504", w, got.get("504"))
				}
				return nil
			})
			require.Equal(t, refused, got.get("504"), "other nodes' lookups answered 504 at once")
			putNeed(t, db, 2)
			natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
				if n := got.get("200"); n != places/2 {
					return fmt.Errorf("%d node lookups answered", n)
				}
				return nil
			})
			require.Equal(t, places/8, s.Waiting(), "the flood's requests still wait")
			s.waitMu.Lock()
			require.Len(t, s.byNode, 1, "nodes counted")
			s.waitMu.Unlock()
		})
	}
}

// waitingServer serves a store holding need 1, synced, with two workers, no read-ahead and the given
// MaxWaiting (0: the default), on a nats-server of its own; it returns a client's connection.
func waitingServer(t *testing.T, maxWaiting int) (*Server, *nats.Conn, *store.DB) {
	t.Helper()
	db := smallStore(t)
	putNeed(t, db, 1)
	db.SetSynced(provisioner.BucketNeeds, true)
	ns := natstest.RunServer(t)
	snc, _ := natstest.Connect(t, ns.ClientURL())
	s := NewServer(StoreReader(db), Options{Workers: 2, NoReadAhead: true, MaxWaiting: maxWaiting})
	require.NoError(t, s.Start(snc, nil))
	t.Cleanup(s.Stop)
	nc, _ := natstest.Connect(t, ns.ClientURL())
	return s, nc, db
}

// TestServer_ReachedWideWaitersKeepToTheirShareOfTheQueue: the wide requests whose min_seq came wait
// for room in their share of the queued bytes (half), as they wait for a place. The wide requests'
// queue holds its half of the bytes behind a wide answer under way, and wide requests with long fields
// wait for a sequence that then comes: a node's lookup is still answered. Before, a request that had
// waited for its min_seq was queued past the bytes' bounds, and the wide ones took the whole 32 MiB:
// every node lookup was answered busy while the worker kept for them was free. Stop, while they wait
// for room, answers them all.
func TestServer_ReachedWideWaitersKeepToTheirShareOfTheQueue(t *testing.T) {
	g := startGated(t, Options{NoReadAhead: true}, func(r *Request) bool { return r.Node == "" }, nil)
	s, nc, held, open := g.s, g.nc, &g.held, g.open
	got, inbox := collect(t, nc)
	const most = 900 << 10
	i := 0
	// send sends a request and waits until it is counted: in the wide bytes queued, held, waiting, or
	// answered.
	send := func(body string) {
		t.Helper()
		i++
		state := func() string {
			return fmt.Sprint(got.get("500"), got.get("504"), s.wideBytes.Load(), held.Load(), s.Waiting())
		}
		before := state()
		require.NoError(t, nc.PublishRequest(Subject, fmt.Sprintf("%s.%d", inbox, i), []byte(body)))
		natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
			if state() != before {
				return nil
			}
			return fmt.Errorf("request %d neither queued, waiting nor answered", i)
		})
	}
	// fill sends requests of module fields as long as room (the bytes its bound has left) allows, up
	// to 900 KiB, until one is refused (code) or the bound is full to the byte.
	overhead := (&Request{What: "needs"}).size()
	fill := func(code string, body func(module string) string, room func() int) {
		t.Helper()
		for refused := got.get(code); got.get(code) == refused; {
			rest := room() - overhead
			if rest <= 0 {
				return
			}
			require.Less(t, i, 200, "the bound took every request")
			send(body(strings.Repeat("m", min(rest, most))))
		}
	}
	// A wide answer is held; wide requests fill their share of the queue behind it.
	send(`{"what":"needs","module":"m"}`)
	natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
		if held.Load() != 1 {
			return fmt.Errorf("the wide answer is not held yet")
		}
		return nil
	})
	fill("500", func(m string) string { return `{"what":"needs","module":"` + m + `"}` },
		func() int { return maxWideBytes - int(s.wideBytes.Load()) })
	queued := s.Queued()
	// Wide requests of as long fields wait for sequence 4, as many as their share of the waiters.
	fill("504", func(m string) string { return `{"what":"needs","module":"` + m + `","min_seq":4,"wait_ms":10000}` },
		func() int {
			s.waitMu.Lock()
			defer s.waitMu.Unlock()
			return maxWideWaitingBytes - s.waitingBytes
		})
	waiting := s.Waiting()
	require.Positive(t, waiting)
	putNeed(t, g.db, 4)
	// Their sequence has come: each is handed to the wide requests' queue, or waits for room there.
	natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
		s.waitMu.Lock()
		watched := len(s.waiters)
		s.waitMu.Unlock()
		w, q := s.Waiting(), s.Queued()
		switch {
		case watched != 0:
		case w == waiting && q == queued+1: // each waits for room, the first of them with a place
			return nil
		case w == 0 && q == queued+waiting: // (before) each was queued
			return nil
		}
		return fmt.Errorf("%d waiting, %d queued, %d buckets watched", w, q, watched)
	})

	// A node's lookup is answered.
	a, _, err := natstest.Ask(nc, Subject, []byte(`{"what":"needs","node":"n1"}`), false)
	require.NoError(t, err, "%d queued, %d bytes of fields", s.Queued(), s.queuedBytes.Load())
	require.Len(t, a.Rows, 1)
	require.LessOrEqual(t, s.wideBytes.Load(), int64(maxWideBytes))

	// Stop, called while they wait for room, returns once the wide answers go on, and the waiters are
	// answered too.
	stopped := make(chan struct{})
	go func() {
		s.Stop()
		close(stopped)
	}()
	natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
		if s.jobsMu.TryRLock() {
			s.jobsMu.RUnlock()
			return fmt.Errorf("Stop is not yet waiting for the queue")
		}
		return nil
	})
	open()
	natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
		select {
		case <-stopped:
		default:
			return fmt.Errorf("Stop has not returned: %d queued, %d waiting", s.Queued(), s.Waiting())
		}
		if n := got.get("200"); n != 1+queued+waiting {
			return fmt.Errorf("%d of %d answered", n, 1+queued+waiting)
		}
		return nil
	})
	require.Zero(t, s.Waiting())
	require.Zero(t, s.queuedBytes.Load())
	require.Zero(t, s.wideBytes.Load())
}

// TestServer_ReachedWideWaiterIsNotOvertakenForRoom: a wide request whose min_seq came and that waits
// for room in the wide requests' bytes is given that room before the wide requests that come after
// it, as a reached request waiting for a place is given the place before a new request. The wide
// requests' queue is full to its bytes behind a held wide answer, with requests of 400 KiB of fields,
// and a reached request of 900 KiB waits for room; each time an answer goes on, another wide request
// of 400 KiB comes: a new one, or one whose min_seq a commit then reaches. Each of those is answered
// after the one that waited before it. Before, each took the 400 KiB just freed, and the reached
// request, 900 KiB, never found room for as long as they came: its asker, who had waited for its
// sequence already, got no answer at all while the seat answered the wide requests that came after.
func TestServer_ReachedWideWaiterIsNotOvertakenForRoom(t *testing.T) {
	for _, after := range []string{"new", "reached"} {
		t.Run(after, func(t *testing.T) {
			db := syncedStoreOfThreeNeeds(t)
			ns := natstest.RunServer(t)
			snc, _ := natstest.Connect(t, ns.ClientURL())
			s := NewServer(StoreReader(db), Options{Workers: 2, NoReadAhead: true})
			const fill, big, later = 400 << 10, 900 << 10, 400<<10 + 1 // module lengths
			// The wide answers are held at a gate that lets one through for each token; the order
			// they start in is kept, by the length of their module.
			tokens, done := make(chan struct{}), make(chan struct{})
			var held atomic.Int64
			var mu sync.Mutex
			var started []int
			s.answering = func(r *Request) {
				if r.Node == "" {
					mu.Lock()
					started = append(started, len(r.Module))
					mu.Unlock()
					held.Add(1)
					select {
					case <-tokens:
					case <-done:
					}
					held.Add(-1)
				}
			}
			require.NoError(t, s.Start(snc, nil))
			var once sync.Once
			open := func() { once.Do(func() { close(done) }) }
			t.Cleanup(func() { open(); s.Stop() })
			nc, _ := natstest.Connect(t, ns.ClientURL())
			got, inbox := collect(t, nc)

			i := 0
			state := func() string {
				return fmt.Sprint(got.get("200"), got.get("500"), got.get("504"), s.wideBytes.Load(), held.Load(), s.Waiting())
			}
			// send sends a request and waits until it is counted: queued, held, waiting or answered.
			send := func(body string) {
				t.Helper()
				i++
				before := state()
				require.NoError(t, nc.PublishRequest(Subject, fmt.Sprintf("%s.%d", inbox, i), []byte(body)))
				natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
					if state() != before {
						return nil
					}
					return fmt.Errorf("request %d neither queued, waiting nor answered", i)
				})
			}
			wideOf := func(n int, more string) string {
				return `{"what":"needs","module":"` + strings.Repeat("m", n) + `"` + more + `}`
			}
			seq := uint64(3)
			// reach commits the next sequence, and waits until the watcher has handed over the
			// requests it reaches.
			reach := func() {
				t.Helper()
				seq++
				putNeed(t, db, seq)
				natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
					s.waitMu.Lock()
					defer s.waitMu.Unlock()
					if len(s.waiters) != 0 {
						return fmt.Errorf("sequence %d not yet handed over", seq)
					}
					return nil
				})
			}

			// A wide answer is held, and the wide requests' bytes are full behind it.
			send(`{"what":"needs","module":"m"}`)
			natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
				if held.Load() != 1 {
					return fmt.Errorf("the wide answer is not held yet")
				}
				return nil
			})
			for got.get("500") == 0 {
				require.Less(t, i, 100, "the wide requests' bytes took every request")
				send(wideOf(fill, ""))
			}
			queued := s.Queued()

			// A wide request of 900 KiB waits for the next sequence, which comes: it waits for room.
			send(wideOf(big, fmt.Sprintf(`,"min_seq":%d,"wait_ms":10000`, seq+1)))
			require.Equal(t, 1, s.Waiting())
			reach()
			// Handed over, it takes its place on a goroutine of its own (queueWhenRoom): polled for.
			natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
				if q := s.Queued(); q != queued+1 {
					return fmt.Errorf("%d queued, want %d: the reached request has no place yet", q, queued+1)
				}
				return nil
			})
			require.Equal(t, 1, s.Waiting(), "the reached request waits for room")

			// Answers go on one by one, and after each another wide request of 400 KiB comes.
			for round := 1; round <= 4; round++ {
				tokens <- struct{}{}
				natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
					if n := got.get("200"); n != round || held.Load() != 1 {
						return fmt.Errorf("%d answered, %d held", n, held.Load())
					}
					return nil
				})
				if after == "new" {
					send(wideOf(later, ""))
				} else {
					send(wideOf(later, fmt.Sprintf(`,"min_seq":%d,"wait_ms":10000`, seq+1)))
					reach()
				}
			}
			require.LessOrEqual(t, s.wideBytes.Load(), int64(maxWideBytes))

			// Every request is answered once the gate opens, the reached one before those that came
			// after it, and nothing is left counted.
			open()
			natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
				if n := got.get("200") + got.get("500") + got.get("504"); n != i {
					return fmt.Errorf("%d of %d answered", n, i)
				}
				return nil
			})
			mu.Lock()
			order := slices.Index(started, big)
			first := slices.Index(started, later)
			mu.Unlock()
			require.GreaterOrEqual(t, order, 0, "the reached request is answered")
			if first >= 0 {
				require.Less(t, order, first, "the reached request is answered after a wide request that came after it")
			}
			require.Zero(t, s.Waiting())
			require.Zero(t, s.Queued())
			require.Zero(t, s.queuedBytes.Load())
			require.Zero(t, s.wideBytes.Load())
			require.Zero(t, s.wideWanted.Load())
		})
	}
}
