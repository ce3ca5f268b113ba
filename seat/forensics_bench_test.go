package seat_test

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/seat"
)

// BenchmarkLookupBesideWalks times node lookups (250 rows, MessagePack) of a seat while 0, 1, 2 and 4
// other clients walk the whole needs bucket, page after page at limit 10000: as of a point (at, the
// forensics of an incident) or live (a module across the mesh is as wide). It reports the lookups'
// median, p99 and slowest, the most requests seen queued for the workers as a lookup was sent, and
// the walkers' pages: how long a page took, the first of a walk apart (it derives the state's
// anomalies, kept for the pages after it).
// Run using: BENCH_NODES=1000 go test ./seat -run x -bench LookupBesideWalks -benchtime 200x
// (BENCH_MODES=at or live for one of the two, BENCH_WALKERS=n for one count of walkers,
// BENCH_AT_MOVES=1 for each at walk at a point of its own).
func BenchmarkLookupBesideWalks(b *testing.B) {
	nodes := 1000
	if n, err := strconv.Atoi(os.Getenv("BENCH_NODES")); err == nil && n > 0 {
		nodes = n
	}
	ns := natstest.RunServer(b)
	_, js := natstest.Connect(b, ns.ClientURL())
	mesh := fixtures.Mesh{Seed: 1, Nodes: nodes, Modules: 25, NeedsPerModule: 10, Collections: 2, BadKeys: 1, BadValues: 1}
	if err := fixtures.Load(context.Background(), js, mesh.OpsOf(provisioner.BucketNeeds), 0, nil); err != nil {
		b.Fatal(err)
	}
	// The seat's compaction after its catch-up would run during the first rounds: it is done here,
	// before any is timed.
	compactAfter := seat.CompactAfter
	seat.CompactAfter = 1 << 62
	defer func() { seat.CompactAfter = compactAfter }()
	st, stop := startBenchSeat(b, ns.ClientURL())
	defer stop()
	natstest.CheckFor(b, 10*time.Minute, 50*time.Millisecond, func() error {
		if !st.Synced() {
			return fmt.Errorf("not synced")
		}
		return nil
	})
	if err := st.Store().CompactAll(context.Background()); err != nil {
		b.Fatal(err)
	}
	walkerCounts := []int{0, 1, 2, 4}
	if w, err := strconv.Atoi(os.Getenv("BENCH_WALKERS")); err == nil {
		walkerCounts = []int{w}
	}
	modes := []string{"at", "live"}
	if m := os.Getenv("BENCH_MODES"); m != "" {
		modes = strings.Split(m, ",")
	}
	applied, _ := st.Store().Applied(provisioner.BucketNeeds)
	for _, mode := range modes {
		for _, walkers := range walkerCounts {
			b.Run(fmt.Sprintf("%s/walkers=%d", mode, walkers), func(b *testing.B) {
				walk := map[string]any{"what": "needs", "limit": 10000}
				if mode == "at" {
					walk["at"] = fmt.Sprintf("seq:%d", applied)
				}
				benchBesideWalks(b, ns.ClientURL(), st.Server, nodes, walkers, walk)
			})
		}
	}
}

// walkStats are the pages a walker was answered.
type walkStats struct {
	mu           sync.Mutex
	first, later []time.Duration
	// early and late are the pages after the first of the walks walked to their end, in their first
	// half and in their second: a page that read the state before its cursor would take longer late.
	early, late []time.Duration
	errs        int
}

// lastNext reads an answer's next, its last field when present, without decoding the page: the
// walkers run on the seat's two cores, and decoding a page of 5,000 rows would measure the decoder.
func lastNext(answer []byte) (string, error) {
	i := bytes.LastIndex(answer, []byte("\xa4next"))
	if i < 0 {
		return "", nil
	}
	rd := bytes.NewReader(answer[i+5:])
	var next string
	if err := msgpack.NewDecoder(rd).Decode(&next); err != nil || rd.Len() != 0 {
		return "", nil // "next" inside a row: the answer has none
	}
	return next, nil
}

func benchBesideWalks(b *testing.B, url string, srv *query.Server, nodes, walkers int, walk map[string]any) {
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var ws walkStats
	for i := 0; i < walkers; i++ {
		wnc, _ := natstest.Connect(b, url)
		wg.Add(1)
		go func() {
			defer wg.Done()
			req := map[string]any{}
			for k, v := range walk {
				req[k] = v
			}
			var walk []time.Duration // this walk's pages
			for ctx.Err() == nil {
				start := time.Now()
				body, _ := msgpack.Marshal(req)
				msg, err := wnc.Request(query.Subject, body, 2*time.Minute)
				d := time.Since(start)
				var next string
				if err == nil && msg.Header.Get("Nats-Service-Error-Code") == "" {
					next, err = lastNext(msg.Data)
				} else if err == nil {
					err = fmt.Errorf("%s", msg.Header.Get("Nats-Service-Error"))
				}
				ws.mu.Lock()
				switch {
				case err != nil:
					ws.errs++
				case req["after"] == nil:
					ws.first = append(ws.first, d)
				default:
					ws.later = append(ws.later, d)
				}
				if err == nil {
					walk = append(walk, d)
				}
				if err == nil && next == "" && len(walk) > 2 {
					half := (len(walk) + 1) / 2
					ws.early = append(ws.early, walk[1:half]...)
					ws.late = append(ws.late, walk[half:]...)
				}
				ws.mu.Unlock()
				if err != nil || next == "" {
					walk = walk[:0]
					delete(req, "after")
					if at, ok := req["at"].(string); ok && os.Getenv("BENCH_AT_MOVES") != "" {
						// Each walk at a point of its own: its first page derives the state's anomalies.
						var seq uint64
						fmt.Sscanf(at, "seq:%d", &seq)
						req["at"] = fmt.Sprintf("seq:%d", seq-1)
					}
					continue
				}
				req["after"] = next
			}
		}()
	}
	defer func() { cancel(); wg.Wait() }()

	nc, _ := natstest.Connect(b, url)
	r := rand.New(rand.NewPCG(1, 2))
	if walkers > 0 {
		// Let the walks get going.
		natstest.CheckFor(b, time.Minute, 10*time.Millisecond, func() error {
			ws.mu.Lock()
			defer ws.mu.Unlock()
			if len(ws.first)+len(ws.later) < walkers {
				return fmt.Errorf("walks not under way")
			}
			return nil
		})
	}
	lat := make([]time.Duration, 0, b.N)
	maxQueued := 0
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		body, _ := msgpack.Marshal(map[string]any{"what": "needs", "node": fixtures.NodeName(r.IntN(nodes)), "limit": 10000})
		maxQueued = max(maxQueued, srv.Queued())
		start := time.Now()
		msg, err := nc.Request(query.Subject, body, time.Minute)
		if err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(start))
		if len(msg.Data) < 1000 {
			b.Fatalf("short answer: %q", msg.Data)
		}
		time.Sleep(5 * time.Millisecond) // a node asks now and then, not back to back
	}
	b.StopTimer()
	slices.Sort(lat)
	ms := func(d time.Duration) float64 { return float64(d) / 1e6 }
	b.ReportMetric(ms(lat[len(lat)/2]), "p50-ms")
	b.ReportMetric(ms(lat[len(lat)*99/100]), "p99-ms")
	b.ReportMetric(ms(lat[len(lat)-1]), "max-ms")
	b.ReportMetric(float64(maxQueued), "queued-max")
	ws.mu.Lock()
	defer ws.mu.Unlock()
	mean := func(ds []time.Duration) float64 {
		if len(ds) == 0 {
			return 0
		}
		var sum time.Duration
		for _, d := range ds {
			sum += d
		}
		return ms(sum / time.Duration(len(ds)))
	}
	if walkers > 0 {
		b.ReportMetric(mean(ws.first), "first-page-ms")
		b.ReportMetric(mean(ws.later), "page-ms")
		b.ReportMetric(mean(ws.early), "early-page-ms")
		b.ReportMetric(mean(ws.late), "late-page-ms")
		b.ReportMetric(float64(len(ws.first)+len(ws.later)), "pages")
		b.ReportMetric(float64(ws.errs), "walk-errs")
	}
}
