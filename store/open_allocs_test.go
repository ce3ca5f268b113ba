// Not under the race detector: it builds Pebble with its invariants on (internal/invariants), whose
// checks allocate and hold memory of their own at random, so the counts measure Pebble, not the store.

//go:build !race

package store_test

import (
	"fmt"
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/store"
)

// openMallocs is how many allocations an Open of a store holding rows needs of an unanswered kind (one
// anomaly row each) makes, once Pebble has nothing left to replay from its log.
func openMallocs(t *testing.T, rows int) uint64 {
	dir := t.TempDir()
	db, err := store.Open(dir, store.Options{})
	require.NoError(t, err)
	var seq uint64
	rewrite(t, db, provisioner.BucketNeeds, func(i int) string { return fmt.Sprintf("n%02d.m.nokind.k%05d", i%30, i) }, []byte{0x80}, rows, 1, &seq)
	require.NoError(t, db.Pebble().Flush())
	require.NoError(t, db.Close())
	var m0, m1 runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&m0)
	db, err = store.Open(dir, store.Options{})
	runtime.ReadMemStats(&m1)
	require.NoError(t, err)
	require.NoError(t, db.Close())
	return m1.Mallocs - m0.Mallocs
}

// TestDB_OpenAllocatesOncePerAnomalyRow: every open reads every anomaly row into the buckets' anomaly
// sets; it made four allocations a row (the bucket's name and the raw key, each unescaped and copied),
// and looked the bucket's state up under a lock for each. It now makes one, the raw key the set keeps.
func TestDB_OpenAllocatesOncePerAnomalyRow(t *testing.T) {
	small, large := openMallocs(t, 3000), openMallocs(t, 6000)
	perRow := float64(int64(large)-int64(small)) / 3000
	t.Logf("open: %d allocations with 3,000 anomaly rows, %d with 6,000: %.2f a row", small, large, perRow)
	require.Less(t, perRow, 2.0, "allocations an anomaly row at open")
}
