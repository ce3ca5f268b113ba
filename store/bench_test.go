package store_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"testing"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/store"
)

// BenchmarkView_NodeRows scans one node's 250 needs rows out of 100,000, the store's share of a node
// lookup. Run using: go test ./store -run x -bench NodeRows -cpuprofile cpu.prof
func BenchmarkView_NodeRows(b *testing.B) {
	db, err := store.OpenState(b.TempDir(), store.Options{CacheSize: cacheSize()})
	if err != nil {
		b.Fatal(err)
	}
	defer db.Close()
	var msgs []provisioner.Message
	for _, op := range (fixtures.Mesh{Seed: 1, Nodes: 400, Modules: 25, NeedsPerModule: 10}).OpsOf(provisioner.BucketNeeds) {
		msgs = append(msgs, provisioner.Message{Seq: uint64(len(msgs) + 1), Key: op.Key, Op: provisioner.OpPut, Value: op.Value})
	}
	for i := 0; i < len(msgs); i += 4096 {
		if err := db.Apply(provisioner.BucketNeeds, msgs[i:min(i+4096, len(msgs))], 0, false); err != nil {
			b.Fatal(err)
		}
	}
	if os.Getenv("BENCH_COMPACT") != "" {
		if err := db.Pebble().Compact(context.Background(), []byte{0}, []byte{0xff}, true); err != nil {
			b.Fatal(err)
		}
	}
	b.Logf("%s", db.Pebble().Metrics().String())
	r := rand.New(rand.NewPCG(1, 1))
	b.ResetTimer()
	rows := 0
	for i := 0; i < b.N; i++ {
		v, err := db.View()
		if err != nil {
			b.Fatal(err)
		}
		node := fixtures.NodeName(r.IntN(400))
		if err := v.Rows(provisioner.Range{Bucket: provisioner.BucketNeeds, Index: provisioner.IndexPrimary, Prefix: node + "."}, func(*provisioner.Row) bool {
			rows++
			return true
		}); err != nil {
			b.Fatal(err)
		}
		v.Close()
	}
	if rows != 250*b.N {
		b.Fatal(fmt.Sprintf("%d rows, want %d", rows, 250*b.N))
	}
}

func cacheSize() int64 {
	if s := os.Getenv("BENCH_CACHE_MB"); s != "" {
		n, _ := strconv.Atoi(s)
		return int64(n) << 20
	}
	return 0
}
