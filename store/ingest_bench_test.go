package store_test

import (
	"os"
	"strconv"
	"testing"
	"time"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/benchprof"
	"github.com/novox/mesh-provisioner/store"
)

// BenchmarkApply_Needs applies the needs of a 400-node mesh (100,000 messages; BENCH_NODES=4000:
// 1,000,000) to an empty store in batches of 4,096, as the projector does during a catch-up
// (compactions held while 50,000 or more are behind, every kind answered), and reports the CPU time
// of the Applies per message: the store's part of ingest, without NATS.
// Run using: go test ./store -run x -bench Apply_Needs -benchtime 5x
// (BENCH_PROFILE=cpu.prof profiles the Applies of the first run alone.)
func BenchmarkApply_Needs(b *testing.B) {
	nodes := 400
	if n, err := strconv.Atoi(os.Getenv("BENCH_NODES")); err == nil && n > 0 {
		nodes = n
	}
	var msgs []provisioner.Message
	for _, op := range (fixtures.Mesh{Seed: 1, Nodes: nodes, Modules: 25, NeedsPerModule: 10}).OpsOf(provisioner.BucketNeeds) {
		msgs = append(msgs, provisioner.Message{Seq: uint64(len(msgs) + 1), Time: int64(len(msgs)+1) * 1e6, Key: op.Key, Op: provisioner.OpPut, Value: op.Value})
	}
	var reg []provisioner.Message
	for i, e := range provisioner.Registry.Entries {
		reg = append(reg, provisioner.Message{Seq: uint64(i + 1), Key: e.Kind, Op: provisioner.OpPut, Value: e.Value()})
	}
	stopProfile := benchprof.Start(b)
	var cpu time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		db, err := store.Open(b.TempDir(), store.Options{})
		if err != nil {
			b.Fatal(err)
		}
		if err := db.Apply(provisioner.BucketRegistry, reg, 0, false); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		c0 := cpuTime()
		for j := 0; j < len(msgs); j += 4096 {
			end := min(j+4096, len(msgs))
			db.CatchingUp(provisioner.BucketNeeds, uint64(len(msgs)-end))
			if err := db.Apply(provisioner.BucketNeeds, msgs[j:end], 1, end == len(msgs)); err != nil {
				b.Fatal(err)
			}
		}
		cpu += cpuTime() - c0
		stopProfile()
		b.StopTimer()
		db.CatchingUp(provisioner.BucketNeeds, 0)
		if err := db.Close(); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
	b.ReportMetric(float64(len(msgs))*float64(b.N)/b.Elapsed().Seconds(), "msgs/s")
	b.ReportMetric(float64(cpu)/1e3/float64(len(msgs))/float64(b.N), "cpu-µs/msg")
}
