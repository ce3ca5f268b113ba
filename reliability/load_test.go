package reliability_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/query"
)

// TestLoad_ClientsWhileUpdatesStream runs 8 clients asking as fast as they can, every what with every
// narrowing in both formats, while updates stream in (20,000 in make test, 100,000 in make chaos):
// no request fails, and the as_of each client sees for a bucket never goes backwards. Once the
// writer is done the verb equals the buckets.
func TestLoad_ClientsWhileUpdatesStream(t *testing.T) {
	updates := 20_000
	if full {
		updates = 100_000
	}
	url := runServer(t, "")
	nc, js := natstest.Connect(t, url)
	require.NoError(t, fixtures.Load(context.Background(), js, fixtures.Mesh{Seed: 9, Nodes: 100, Modules: 4, NeedsPerModule: 3, Collections: 3, BadKeys: 2, BadValues: 2}.Ops(), 0, nil))
	startSeat(t, url, t.TempDir())
	waitRegistry(t, js, 10*time.Second)

	requests := []map[string]any{
		{}, {"what": "registry", "kind": "config"}, {"what": "needs", "node": "n00007"}, {"what": "needs", "module": "mod-003", "limit": 50},
		{"what": "needs", "kind": "secret", "limit": 50}, {"what": "needs", "node": "n00012", "module": "mod-001"},
		{"what": "applied", "node": "n00003"}, {"what": "applied", "module": "mod-002", "limit": 20},
		{"what": "collect", "collection": "shell:zsh:normal", "limit": 50}, {"what": "collect", "node": "n00020"},
		{"what": "collect", "contributor": "mod-004", "limit": 30}, {"what": "needs", "limit": 100},
	}
	const clients = 8
	var served, failed atomic.Int64
	var mu sync.Mutex
	var failures []string
	done := make(chan struct{})
	var wg sync.WaitGroup
	for c := 0; c < clients; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cnc, _ := natstest.Connect(t, url)
			r := rand.New(rand.NewPCG(uint64(c), 1))
			asOf := map[string]uint64{}
			fail := func(format string, args ...any) {
				failed.Add(1)
				mu.Lock()
				if len(failures) < 20 {
					failures = append(failures, fmt.Sprintf("client %d: ", c)+fmt.Sprintf(format, args...))
				}
				mu.Unlock()
			}
			for {
				select {
				case <-done:
					return
				default:
				}
				req := requests[r.IntN(len(requests))]
				asMsgpack := r.IntN(2) == 0
				var body []byte
				if asMsgpack {
					body, _ = msgpack.Marshal(req)
				} else {
					body, _ = json.Marshal(req)
				}
				a, _, err := natstest.Ask(cnc, query.Subject, body, asMsgpack)
				if err != nil {
					fail("%v: %v", req, err)
					continue
				}
				served.Add(1)
				what, _ := req["what"].(string)
				if what == "" {
					what = "registry"
				}
				if a.AsOf < asOf[what] {
					fail("%s: as_of went back from %d to %d", what, asOf[what], a.AsOf)
				}
				asOf[what] = a.AsOf
			}
		}()
	}
	m := newMix(42, 200)
	start := time.Now()
	w := startWriter(t, js, m, 1000, updates)
	w.wait(t, 4*time.Minute)
	wrote := time.Since(start)
	// The clients go on until the seat has caught up with the last update, then stop.
	last := map[string]uint64{}
	natstest.CheckFor(t, 60*time.Second, 20*time.Millisecond, func() error {
		for _, b := range mixBuckets {
			st, err := js.Stream(context.Background(), provisioner.StreamName(b))
			if err != nil {
				return err
			}
			last[b] = st.CachedInfo().State.LastSeq
		}
		for _, what := range []string{"needs", "applied", "collect"} {
			a, _, err := natstest.Ask(nc, query.Subject, []byte(`{"what":"`+what+`","limit":1}`), false)
			if err != nil {
				return err
			}
			shape, _ := provisioner.ShapeOfWhat(provisioner.What(what))
			if a.AsOf < last[shape.Bucket] {
				return fmt.Errorf("%s: as_of %d of %d", what, a.AsOf, last[shape.Bucket])
			}
		}
		return nil
	})
	close(done)
	wg.Wait()
	elapsed := time.Since(start)
	t.Logf("%d updates written in %v; %d requests served by 8 clients in %v, %d failed",
		updates, wrote.Round(time.Millisecond), served.Load(), elapsed.Round(time.Millisecond), failed.Load())
	require.Zero(t, failed.Load(), "%v", failures)
	require.Positive(t, served.Load())
	checkEqual(t, nc, js, 30*time.Second)
}
