package seat_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/benchprof"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/query"
)

// BenchmarkNodeLookup asks one node's needs (250 rows, MessagePack) of a seat holding 100,000 needs.
// Run using: go test ./seat -run x -bench NodeLookup -cpuprofile cpu.prof
// (or BENCH_PROFILE=cpu.prof to profile the timed loop alone, without loading and ingesting the mesh).
func BenchmarkNodeLookup(b *testing.B) {
	benchLookup(b, func(r *rand.Rand) map[string]any {
		return map[string]any{"what": "needs", "node": fixtures.NodeName(r.IntN(400)), "limit": 10000}
	})
}

// BenchmarkModuleLookup asks one module's needs across all nodes (about 2,000 rows).
func BenchmarkModuleLookup(b *testing.B) {
	benchLookup(b, func(r *rand.Rand) map[string]any {
		return map[string]any{"what": "needs", "module": fixtures.ModuleName(r.IntN(50)), "limit": 10000}
	})
}

func benchLookup(b *testing.B, req func(*rand.Rand) map[string]any) {
	ns := natstest.RunServer(b)
	nc, js := natstest.Connect(b, ns.ClientURL())
	if err := fixtures.Load(context.Background(), js, fixtures.Mesh{Seed: 1, Nodes: 400, Modules: 25, NeedsPerModule: 10, Collections: 4}.Ops(), 0, nil); err != nil {
		b.Fatal(err)
	}
	st, stop := startBenchSeat(b, ns.ClientURL())
	defer stop()
	natstest.CheckFor(b, time.Minute, 10*time.Millisecond, func() error {
		if !st.Synced() {
			return fmt.Errorf("not synced")
		}
		return nil
	})
	if os.Getenv("BENCH_COMPACT") != "" {
		if err := st.DB.Pebble().Compact(context.Background(), []byte{0}, []byte{0xff}, true); err != nil {
			b.Fatal(err)
		}
	}
	r := rand.New(rand.NewPCG(1, 1))
	bodies := make([][]byte, 256)
	for i := range bodies {
		bodies[i], _ = msgpack.Marshal(req(r))
	}
	defer benchprof.Start(b)()
	var ru0 syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru0)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		msg, err := nc.Request(query.Subject, bodies[i%len(bodies)], 5*time.Second)
		if err != nil {
			b.Fatal(err)
		}
		if len(msg.Data) < 1000 {
			b.Fatalf("short answer: %q", msg.Data)
		}
	}
	b.StopTimer()
	// CPU time per request of this process (seat, client and server together) is steadier than wall
	// time on a shared machine.
	var ru1 syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru1)
	cpu := (ru1.Utime.Nano() + ru1.Stime.Nano()) - (ru0.Utime.Nano() + ru0.Stime.Nano())
	b.ReportMetric(float64(cpu)/1e3/float64(b.N), "cpu-µs/op")
}
