package query

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
)

// TestServer_LanesStorm: node lookups and wide requests, with and without min_seq (near, far, short
// and long wait_ms), some wide ones with fields of hundreds of KiB, and a walk's next page asked again
// and again, all at once into small queues and waiters' bounds while the answers are held and commits
// land; then the answers go on (or not) and the server stops. Each request is answered exactly once,
// Stop returns, and every count of the queues and waiters (places, bytes, the wide requests' share of
// each, the room kept for reached ones, the wide slots) is back to zero, the watchers and the
// goroutines that wait for room gone.
func TestServer_LanesStorm(t *testing.T) {
	for _, seed := range []uint64{1, 2} { // held until Stop, and answered as they come
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, 62))
			db := syncedStoreOfThreeNeeds(t)
			ns := natstest.RunServer(t)
			snc, _ := natstest.Connect(t, ns.ClientURL())
			nc, _ := natstest.Connect(t, ns.ClientURL())
			base := runtime.NumGoroutine()
			s := NewServer(StoreReader(db), Options{Workers: 2, MaxQueued: 40, MaxWaiting: 40})
			// The answers are held at a gate, but for the walk's first page asked below.
			gate := make(chan struct{})
			var once sync.Once
			open := func() { once.Do(func() { close(gate) }) }
			var free atomic.Bool
			s.answering = func(*Request) {
				if !free.Load() {
					<-gate
				}
			}
			require.NoError(t, s.Start(snc, nil))
			stopped := false
			t.Cleanup(func() {
				open()
				if !stopped {
					s.Stop()
				}
			})
			// A walk's second page, whose request is sent again and again: written ahead, taken,
			// made stale by the commits.
			free.Store(true)
			first, _, err := natstest.Ask(nc, Subject, []byte(`{"what":"needs","module":"m","limit":1}`), false)
			free.Store(false)
			require.NoError(t, err)
			require.NotEmpty(t, first.Next)
			natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
				if n := s.Ahead(); n < 1 {
					return fmt.Errorf("%d pages written ahead", n)
				}
				return nil
			})
			got, inbox := collectBy(t, nc)

			const n = 200
			seq := uint64(3)
			sent := 0
			long := func(req map[string]any) string {
				b, err := natstest.Body(req, true)
				require.NoError(t, err)
				return string(b)
			}
			publish := func() {
				var body string
				near := seq + 1 + uint64(rng.IntN(3))
				switch rng.IntN(10) {
				case 0:
					body = `{"what":"needs","node":"n1"}`
				case 1:
					body = fmt.Sprintf(`{"what":"needs","node":"n1","min_seq":%d,"wait_ms":10000}`, near)
				case 2:
					body = fmt.Sprintf(`{"what":"needs","module":"m","min_seq":%d,"wait_ms":10000}`, near)
				case 3, 4: // long fields, in MessagePack: a long JSON string is slow to decode under -race
					body = long(map[string]any{"what": "needs", "module": strings.Repeat("m", 600<<10+rng.IntN(350<<10)), "min_seq": near, "wait_ms": 10000})
				case 5, 6:
					body = long(map[string]any{"what": "needs", "module": strings.Repeat("m", 600<<10+rng.IntN(350<<10))})
				case 7:
					body = fmt.Sprintf(`{"what":"needs","min_seq":%d,"wait_ms":%d}`, seq+1000, 1+rng.IntN(30))
				case 8:
					body = fmt.Sprintf(`{"what":"needs","node":"n2","min_seq":%d,"wait_ms":%d}`, seq+1000, 1+rng.IntN(2)*10000)
				default:
					body = fmt.Sprintf(`{"what":"needs","module":"m","limit":1,"after":%q}`, first.Next)
				}
				sent++
				require.NoError(t, nc.PublishRequest(Subject, fmt.Sprintf("%s.r%d", inbox, sent), []byte(body)))
			}
			received := func() int { return s.Service().Stats().Endpoints[0].NumRequests }
			for sent < n/2 {
				publish()
				if sent == 1 {
					// The page written ahead is fresh: this one is queued as a copy, stale once taken.
					sent++
					require.NoError(t, nc.PublishRequest(Subject, fmt.Sprintf("%s.r%d", inbox, sent),
						[]byte(fmt.Sprintf(`{"what":"needs","module":"m","limit":1,"after":%q}`, first.Next))))
				}
				if rng.IntN(6) == 0 {
					seq++
					putNeed(t, db, seq)
				}
			}
			natstest.CheckFor(t, 20*time.Second, 5*time.Millisecond, func() error {
				if r := received(); r < sent {
					return fmt.Errorf("%d of %d requests taken", r, sent)
				}
				return nil
			})
			// The sequences the waiters wait for come while their queues are full: they wait for a
			// place, or for room in the wide requests' bytes.
			for range 3 {
				seq++
				putNeed(t, db, seq)
			}
			natstest.CheckFor(t, 20*time.Second, 5*time.Millisecond, func() error {
				s.waitMu.Lock()
				defer s.waitMu.Unlock()
				if bw := s.waiters[provisioner.BucketNeeds]; bw != nil && len(bw.bySeq) > 0 && bw.bySeq[0].seq <= seq {
					return fmt.Errorf("min_seq %d reached, not yet taken", bw.bySeq[0].seq)
				}
				return nil
			})
			live := seed%2 == 0
			if live {
				// The answers go on while the rest come and the commits land.
				open()
				for sent < n {
					publish()
					if rng.IntN(6) == 0 {
						seq++
						putNeed(t, db, seq)
					}
				}
				natstest.CheckFor(t, 20*time.Second, 5*time.Millisecond, func() error {
					if r := received(); r < sent {
						return fmt.Errorf("%d of %d requests taken", r, sent)
					}
					return nil
				})
			}
			// Stop, with the answers still held or not.
			done := make(chan struct{})
			go func() {
				s.Stop()
				close(done)
			}()
			open()
			natstest.CheckFor(t, 30*time.Second, 5*time.Millisecond, func() error {
				select {
				case <-done:
				default:
					return fmt.Errorf("Stop has not returned: %d queued, %d waiting", s.Queued(), s.Waiting())
				}
				if c := got.count(); c < sent {
					return fmt.Errorf("%d of %d answered", c, sent)
				}
				return nil
			})
			stopped = true
			require.NoError(t, nc.Flush())
			got.mu.Lock()
			for i := 1; i <= sent; i++ {
				tok := fmt.Sprintf("r%d", i)
				require.Len(t, got.by[tok], 1, "%s answered %v", tok, got.by[tok])
			}
			require.Len(t, got.by, sent)
			got.mu.Unlock()

			s.waitMu.Lock()
			require.Empty(t, s.waiters, "buckets still watched")
			require.Empty(t, s.byNode, "nodes still counted")
			counts := []int{s.waiting, s.waitingBytes, s.wideWaiting, s.wideWaitingBytes}
			s.waitMu.Unlock()
			require.Equal(t, []int{0, 0, 0, 0}, counts, "waiting, their bytes, the wide ones, their bytes")
			require.Equal(t, []int64{0, 0, 0}, []int64{s.queuedBytes.Load(), s.wideBytes.Load(), s.wideWanted.Load()},
				"queued bytes, the wide ones, the room kept for reached ones")
			require.Equal(t, []int{0, 0, 0}, []int{s.Queued(), len(s.wideRoom), len(s.wideSlots)}, "queued, wide places, wide slots")
			natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
				if g := runtime.NumGoroutine(); g > base+10 {
					return fmt.Errorf("%d goroutines, %d before the server started", g, base)
				}
				return nil
			})
		})
	}
}
