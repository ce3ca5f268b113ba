package query

import (
	"container/heap"
	"fmt"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
)

// answersBy records every answer on an inbox by the reply token it came to: each code it got.
type answersBy struct {
	mu sync.Mutex
	by map[string][]string
}

func collectBy(t *testing.T, nc *nats.Conn) (*answersBy, string) {
	t.Helper()
	a := &answersBy{by: map[string][]string{}}
	inbox := nats.NewInbox()
	sub, err := nc.Subscribe(inbox+".*", func(m *nats.Msg) {
		code := m.Header.Get(micro.ErrorCodeHeader)
		if code == "" {
			code = "200"
		}
		a.mu.Lock()
		tok := m.Subject[strings.LastIndexByte(m.Subject, '.')+1:]
		a.by[tok] = append(a.by[tok], code)
		a.mu.Unlock()
	})
	require.NoError(t, err)
	require.NoError(t, sub.SetPendingLimits(-1, -1))
	return a, inbox
}

func (a *answersBy) count() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	n := 0
	for _, c := range a.by {
		n += len(c)
	}
	return n
}

// TestServer_WaitersModel: requests wait for min_seq on the needs bucket and on hundreds of
// composed-<node> buckets (plans, one bucket each, as a mesh of thousands of nodes asks), with equal
// and different min_seq and deadlines, while commits land; then the server stops. Compared with
// what must happen to each: answered exactly once; 200 when its sequence was committed and its
// wait_ms is long; 504 when its sequence never came; either when its sequence came near a short
// wait_ms. Stop returns, nothing waits after it, and the watchers are gone.
func TestServer_WaitersModel(t *testing.T) {
	for _, seed := range []uint64{1, 2, 3} {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, seed))
			db := smallStore(t)
			putNeed(t, db, 1)
			db.SetSynced(provisioner.BucketNeeds, true)
			ns := natstest.RunServer(t)
			snc, _ := natstest.Connect(t, ns.ClientURL())
			base := runtime.NumGoroutine()
			s := NewServer(StoreReader(db), Options{Workers: 2, NoReadAhead: true,
				Plans: Plans(StorePlans(db), func(string) bool { return true }, nil)})
			require.NoError(t, s.Start(snc, nil))
			stopped := false
			t.Cleanup(func() {
				if !stopped {
					s.Stop()
				}
			})
			nc, _ := natstest.Connect(t, ns.ClientURL())
			got, inbox := collectBy(t, nc)

			const last = 40 // the needs sequence committed at the end
			type want struct{ codes []string }
			wants := map[string]want{}
			any := []string{"200", "504"}
			seq := uint64(1)
			for i := 0; i < 600; i++ {
				if rng.IntN(20) == 0 && seq < last {
					seq++
					putNeed(t, db, seq)
				}
				tok := fmt.Sprintf("r%d", i)
				long := rng.IntN(2) == 0
				waitMS := 10000
				if !long {
					waitMS = 1 + rng.IntN(3)*10 // equal deadlines among many
				}
				var body string
				var w want
				if rng.IntN(3) == 0 {
					node := fmt.Sprintf("n%d", rng.IntN(300))
					body = fmt.Sprintf(`{"what":"plans","node":%q,"min_seq":%d,"wait_ms":%d}`, node, 1+rng.IntN(3), waitMS)
					w.codes = []string{"504"} // no composed bucket is ever read
				} else {
					ms := 2 + rng.IntN(50) // equal min_seq among many; some never come
					body = fmt.Sprintf(`{"what":"needs","min_seq":%d,"wait_ms":%d}`, ms, waitMS)
					switch {
					case ms > last:
						w.codes = []string{"504"}
					case long:
						w.codes = []string{"200"}
					default:
						w.codes = any
					}
				}
				wants[tok] = w
				require.NoError(t, nc.PublishRequest(Subject, inbox+"."+tok, []byte(body)))
			}
			for seq < last {
				seq++
				putNeed(t, db, seq)
			}
			// Every short wait ends, and every request whose sequence came is answered, before Stop.
			natstest.CheckFor(t, 20*time.Second, 10*time.Millisecond, func() error {
				got.mu.Lock()
				defer got.mu.Unlock()
				for tok, w := range wants {
					if len(w.codes) == 1 && w.codes[0] == "200" && len(got.by[tok]) == 0 {
						return fmt.Errorf("%s not answered yet", tok)
					}
				}
				return nil
			})
			require.Positive(t, s.Waiting(), "the long waits on buckets never read still wait before Stop")
			s.Stop()
			stopped = true
			natstest.CheckFor(t, 20*time.Second, 10*time.Millisecond, func() error {
				if n := got.count(); n < len(wants) {
					return fmt.Errorf("%d of %d answered", n, len(wants))
				}
				return nil
			})
			require.NoError(t, nc.Flush())
			got.mu.Lock()
			for tok, w := range wants {
				codes := got.by[tok]
				require.Len(t, codes, 1, "%s answered %v", tok, codes)
				require.Contains(t, w.codes, codes[0], "%s", tok)
			}
			require.Len(t, got.by, len(wants))
			got.mu.Unlock()
			require.Zero(t, s.Waiting())
			s.waitMu.Lock()
			require.Empty(t, s.waiters, "buckets still watched after Stop")
			require.Zero(t, s.waitingBytes)
			s.waitMu.Unlock()
			// The watchers ended with Stop (micro's and the connections' goroutines are counted in base).
			natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
				if n := runtime.NumGoroutine(); n > base+20 {
					return fmt.Errorf("%d goroutines, %d before the server started", n, base)
				}
				return nil
			})
		})
	}
}

// TestServer_TakeModel: the two heaps of a bucket's waiters, against a plain list. Waiters with equal
// and different min_seq and deadlines are added while the applied sequence and the clock move on in
// random steps; each take returns exactly the waiters the list says (reached first, then expired),
// each once, and every waiter's index in each heap is where it sits.
func TestServer_TakeModel(t *testing.T) {
	for seed := uint64(0); seed < 20; seed++ {
		rng := rand.New(rand.NewPCG(seed, 7))
		s := &Server{waiters: map[string]*bucketWaiters{}}
		bw := &bucketWaiters{kick: make(chan struct{}, 1)}
		s.waiters["b"] = bw
		t0 := time.Unix(1000, 0)
		var model []*waiter
		have, now := uint64(0), t0
		taken := map[*waiter]bool{}
		for step := 0; step < 300; step++ {
			for range rng.IntN(4) {
				w := &waiter{seq: have + 1 + uint64(rng.IntN(5))}
				w.j.deadline = now.Add(time.Duration(1+rng.IntN(4)) * time.Second)
				heap.Push(&bw.bySeq, w)
				heap.Push(&bw.byTime, w)
				model = append(model, w)
			}
			have += uint64(rng.IntN(2))
			now = now.Add(time.Duration(rng.IntN(2)) * time.Second)
			var wantReady, wantExpired []*waiter
			var rest []*waiter
			for _, w := range model {
				switch {
				case w.seq <= have:
					wantReady = append(wantReady, w)
				case !w.j.deadline.After(now):
					wantExpired = append(wantExpired, w)
				default:
					rest = append(rest, w)
				}
			}
			model = rest
			s.waiters["b"] = bw
			ready, expired, next, empty := s.take("b", bw, have, now, nil, nil)
			require.ElementsMatch(t, wantReady, ready, "seed %d step %d: reached", seed, step)
			require.ElementsMatch(t, wantExpired, expired, "seed %d step %d: expired", seed, step)
			for _, w := range append(ready, expired...) {
				require.False(t, taken[w], "taken twice")
				taken[w] = true
			}
			require.Equal(t, len(model) == 0, empty)
			require.Len(t, bw.bySeq, len(model))
			require.Len(t, bw.byTime, len(model))
			for i, w := range bw.bySeq {
				require.Equal(t, i, w.bySeq, "seed %d step %d: index in the min_seq heap", seed, step)
			}
			for i, w := range bw.byTime {
				require.Equal(t, i, w.byTime, "seed %d step %d: index in the deadline heap", seed, step)
			}
			if !empty {
				first := model[0].j.deadline
				for _, w := range model {
					if w.j.deadline.Before(first) {
						first = w.j.deadline
					}
				}
				require.Equal(t, first, next)
			}
		}
	}
}
