package projector_test

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	provisioner "github.com/novox/mesh-provisioner"

	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/benchprof"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// BenchmarkIngest projects a needs stream of 100,000 messages into an empty store, as serve does.
// Run using: go test ./projector -run x -bench Ingest -benchtime 3x -cpuprofile cpu.prof
func BenchmarkIngest(b *testing.B) {
	js, needs := loadNeeds(b)
	ctx := context.Background()
	last := uint64(len(needs))
	var cpu time.Duration
	// BENCH_PULL_MESSAGES=8192 pulls by a count of messages, as before pulls were bounded by bytes
	// (docs/performance.md, session 16).
	pull, _ := strconv.Atoi(os.Getenv("BENCH_PULL_MESSAGES"))
	// BENCH_PROFILE=cpu.prof profiles the ingest alone: from an empty store to the last message applied.
	stopProfile := benchprof.Start(b)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		cpu0 := cpuTime()
		db, err := store.Open(filepath.Join(b.TempDir(), "s"), store.Options{})
		if err != nil {
			b.Fatal(err)
		}
		// The registry answers every kind, as in a real mesh.
		var reg []provisioner.Message
		for i, e := range provisioner.Registry.Entries {
			reg = append(reg, provisioner.Message{Seq: uint64(i + 1), Key: e.Kind, Op: provisioner.OpPut, Value: e.Value()})
		}
		if err := db.Apply(provisioner.BucketRegistry, reg, 0, false); err != nil {
			b.Fatal(err)
		}
		p := projector.New(js, db, projector.Options{Buckets: []string{provisioner.BucketNeeds}, PullMessages: pull})
		p.Start(ctx)
		for {
			if seq, _ := db.Applied(provisioner.BucketNeeds); seq >= last {
				break
			}
			time.Sleep(time.Millisecond)
		}
		// Up to the last message applied: what the store does after (its compaction once the
		// catch-up ends, as Close waits for it) is not ingest.
		cpu += cpuTime() - cpu0
		stopProfile()
		p.Stop()
		b.StopTimer()
		db.Close()
		b.StartTimer()
	}
	b.ReportMetric(float64(last)*float64(b.N)/b.Elapsed().Seconds(), "msgs/s")
	// CPU time per message (this process: the projector, Pebble and the embedded server's delivery)
	// is steadier than wall time on a shared machine.
	b.ReportMetric(float64(cpu)/1e3/float64(last)/float64(b.N), "cpu-µs/msg")
}

func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkStreamLimit reads the same stream with a bare ordered consumer that does nothing: the
// floor BenchmarkIngest is measured against.
func BenchmarkStreamLimit(b *testing.B) {
	js, needs := loadNeeds(b)
	ctx := context.Background()
	stream, err := js.Stream(ctx, provisioner.StreamName(provisioner.BucketNeeds))
	if err != nil {
		b.Fatal(err)
	}
	cpu0 := cpuTime()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		cons, err := stream.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
		if err != nil {
			b.Fatal(err)
		}
		it, err := cons.Messages(jetstream.PullMaxMessages(8192))
		if err != nil {
			b.Fatal(err)
		}
		for n := 0; n < len(needs); n++ {
			if _, err := it.Next(); err != nil {
				b.Fatal(err)
			}
		}
		it.Stop()
	}
	b.ReportMetric(float64(len(needs))*float64(b.N)/b.Elapsed().Seconds(), "msgs/s")
	b.ReportMetric(float64(cpuTime()-cpu0)/1e3/float64(len(needs))/float64(b.N), "cpu-µs/msg")
}

// loadNeeds starts a server and loads the needs of a 400-node mesh: 100,000 messages (BENCH_NODES=4000:
// 1,000,000, as make bench).
func loadNeeds(b *testing.B) (jetstream.JetStream, []fixtures.Op) {
	ns := natstest.RunServer(b)
	_, js := natstest.Connect(b, ns.ClientURL())
	nodes := 400
	if n, err := strconv.Atoi(os.Getenv("BENCH_NODES")); err == nil && n > 0 {
		nodes = n
	}
	needs := (fixtures.Mesh{Seed: 1, Nodes: nodes, Modules: 25, NeedsPerModule: 10}).OpsOf(provisioner.BucketNeeds)
	if err := fixtures.Load(context.Background(), js, needs, 16384, nil); err != nil {
		b.Fatal(err)
	}
	return js, needs
}
