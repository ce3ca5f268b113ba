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

// openHeap is the heap an open store holds, after collection, with keys needs of an unanswered kind
// (one anomaly row each) across 100 nodes.
func openHeap(t *testing.T, keys int) int64 {
	dir := t.TempDir()
	db, err := store.Open(dir, store.Options{})
	require.NoError(t, err)
	var seq uint64
	rewrite(t, db, provisioner.BucketNeeds, func(i int) string { return fmt.Sprintf("n%03d.mod-01.nokind.name-%06d", i%100, i) }, []byte{0x80}, keys, 1, &seq)
	require.NoError(t, db.Pebble().Flush())
	require.NoError(t, db.Close())
	heap := func() int64 {
		for range 3 { // sync.Pools empty over two collections
			runtime.GC()
		}
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return int64(m.HeapAlloc)
	}
	before := heap()
	db, err = store.Open(dir, store.Options{})
	require.NoError(t, err)
	held := heap() - before
	require.NoError(t, db.Close())
	return held
}

// TestDB_AnomalySetsHeapPerKey: an open store keeps, for every key holding anomaly rows, what Apply
// needs to know that it does. It kept the raw key and its classes in a map: about 100 bytes of heap a
// key, 100 MiB at a million unanswered needs (a module rolling a new kind out across a mesh) of the
// seat's 400 MB. It keeps a 64-bit hash in an open-addressing table: 8 bytes a slot, 16 at most a key.
func TestDB_AnomalySetsHeapPerKey(t *testing.T) {
	small, large := openHeap(t, 10000), openHeap(t, 30000)
	perKey := float64(large-small) / 20000
	t.Logf("open store heap: %d bytes with 10,000 anomaly keys, %d with 30,000: %.1f bytes a key", small, large, perKey)
	require.Less(t, perKey, 32.0, "heap bytes an anomaly key")
}
