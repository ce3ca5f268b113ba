package store_test

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"syscall"
	"testing"
	"time"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/store"
)

// fillUnanswered applies n needs of a kind no registry entry answers to a store, one anomaly row each,
// spread over 4,000 nodes as a module rolling out a new kind across a mesh would write them.
func fillUnanswered(tb testing.TB, db *store.DB, n int) {
	tb.Helper()
	const batch = 4096
	msgs := make([]provisioner.Message, 0, batch)
	for i := 0; i < n; i++ {
		key := fmt.Sprintf("%s.%s.rolling-out.name-%07d", fixtures.NodeName(i%4000), fixtures.ModuleName(i%25), i)
		msgs = append(msgs, provisioner.Message{Seq: uint64(i + 1), Time: int64(i + 1), Key: key, Op: provisioner.OpPut, Value: []byte{0x80}})
		if len(msgs) == batch || i == n-1 {
			if err := db.Apply(provisioner.BucketNeeds, msgs, 1, i == n-1); err != nil {
				tb.Fatal(err)
			}
			msgs = msgs[:0]
		}
	}
}

// BenchmarkOpen_Anomalies measures what an open store keeps in memory for its anomaly rows, and what
// opening it costs, with ANOM_ROWS (default 100,000) unanswered-kind anomaly rows in the needs bucket.
// Run using: ANOM_ROWS=1000000 go test ./store -run x -bench Open_Anomalies -benchtime 1x
func BenchmarkOpen_Anomalies(b *testing.B) {
	n := 100000
	if v, err := strconv.Atoi(os.Getenv("ANOM_ROWS")); err == nil && v > 0 {
		n = v
	}
	dir := b.TempDir()
	db, err := store.Open(dir, store.Options{})
	if err != nil {
		b.Fatal(err)
	}
	fillUnanswered(b, db, n)
	// Compacted, so that the open measured has no compaction of the fill running beside it.
	if err := db.Pebble().Compact(context.Background(), []byte{0}, []byte{0xff}, true); err != nil {
		b.Fatal(err)
	}
	if err := db.Close(); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		var m0, m1, m2 runtime.MemStats
		for range 3 { // sync.Pools are emptied over two collections
			runtime.GC()
		}
		runtime.ReadMemStats(&m0)
		start, cpu0 := time.Now(), cpuTime()
		db, err := store.Open(dir, store.Options{})
		took, cpu := time.Since(start), cpuTime()-cpu0
		if err != nil {
			b.Fatal(err)
		}
		runtime.ReadMemStats(&m1)
		for range 3 {
			runtime.GC()
		}
		runtime.ReadMemStats(&m2)
		held := int64(m2.HeapAlloc) - int64(m0.HeapAlloc)
		b.ReportMetric(float64(held)/float64(n), "heap-B/anomaly")
		b.ReportMetric(float64(held)/(1<<20), "heap-MiB")
		b.ReportMetric(float64(m1.Mallocs-m0.Mallocs)/float64(n), "open-allocs/anomaly")
		b.ReportMetric(float64(m1.TotalAlloc-m0.TotalAlloc)/(1<<20), "open-alloc-MiB")
		b.ReportMetric(float64(took.Milliseconds()), "open-ms")
		b.ReportMetric(float64(cpu.Milliseconds()), "open-cpu-ms")
		if err := db.Close(); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkApply_Anomalies applies 100,000 needs of a kind no registry entry answers to an empty store
// (new: each raises an anomaly on a key that has none), then the same keys again (rewrite: each put
// meets the anomaly its key holds), and reports the CPU time of each per message.
// Run using: go test ./store -run x -bench Apply_Anomalies -benchtime 3x
func BenchmarkApply_Anomalies(b *testing.B) {
	const n = 100000
	var fill, again time.Duration
	for i := 0; i < b.N; i++ {
		db, err := store.Open(b.TempDir(), store.Options{})
		if err != nil {
			b.Fatal(err)
		}
		c0 := cpuTime()
		fillUnanswered(b, db, n)
		c1 := cpuTime()
		fill += c1 - c0
		const batch = 4096
		msgs := make([]provisioner.Message, 0, batch)
		for j := 0; j < n; j++ {
			key := fmt.Sprintf("%s.%s.rolling-out.name-%07d", fixtures.NodeName(j%4000), fixtures.ModuleName(j%25), j)
			msgs = append(msgs, provisioner.Message{Seq: uint64(n + j + 1), Time: int64(n + j + 1), Key: key, Op: provisioner.OpPut, Value: []byte{0x81, 0xa1, 'v', 0x01}})
			if len(msgs) == batch || j == n-1 {
				if err := db.Apply(provisioner.BucketNeeds, msgs, 1, j == n-1); err != nil {
					b.Fatal(err)
				}
				msgs = msgs[:0]
			}
		}
		again += cpuTime() - c1
		b.StopTimer()
		if err := db.Close(); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
	b.ReportMetric(float64(fill)/1e3/float64(n*b.N), "new-cpu-µs/msg")
	b.ReportMetric(float64(again)/1e3/float64(n*b.N), "rewrite-cpu-µs/msg")
}

func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkApply_AnomaliesInBulk fills a store with ANOM_ROWS (default 200,000) unanswered-kind needs,
// then times the one Apply that touches them all: the registry gaining their kind (every anomaly
// cleared by the re-evaluation), or a rollup of the whole needs bucket (every key removed, in parts),
// and reports the process's CPU time for it (background compactions included).
// Run using: ANOM_ROWS=1000000 go test ./store -run x -bench Apply_AnomaliesInBulk -benchtime 1x
func BenchmarkApply_AnomaliesInBulk(b *testing.B) {
	n := 200000
	if v, err := strconv.Atoi(os.Getenv("ANOM_ROWS")); err == nil && v > 0 {
		n = v
	}
	entry := provisioner.Registry.Entries[0]
	for _, tc := range []struct {
		name   string
		bucket string
		msg    provisioner.Message
		left   int64
	}{
		{"kind-gained", provisioner.BucketRegistry, provisioner.Message{Seq: 1, Time: 1, Key: "rolling-out", Op: provisioner.OpPut, Value: entry.Value()}, 0},
		{"rollup-all", provisioner.BucketNeeds, provisioner.Message{Seq: uint64(n + 1), Time: 1, Key: "x.m.rolling-out.a", Op: provisioner.OpPut, Value: []byte{0x80}, Rollup: provisioner.RollupAll}, 1},
	} {
		b.Run(tc.name, func(b *testing.B) {
			var cpu time.Duration
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				db, err := store.Open(b.TempDir(), store.Options{})
				if err != nil {
					b.Fatal(err)
				}
				fillUnanswered(b, db, n)
				b.StartTimer()
				c0 := cpuTime()
				if err := db.Apply(tc.bucket, []provisioner.Message{tc.msg}, 1, true); err != nil {
					b.Fatal(err)
				}
				cpu += cpuTime() - c0
				b.StopTimer()
				if got := db.Checkpoint(provisioner.BucketNeeds).AnomalyRows; got != tc.left {
					b.Fatalf("%d anomaly rows left, want %d", got, tc.left)
				}
				if err := db.Close(); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
			b.ReportMetric(float64(cpu.Milliseconds())/float64(b.N), "cpu-ms")
		})
	}
}
