package store

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
)

// TestRowsView_WarmRowsInChunks: read in chunks, each from where the last stopped, WarmRows reads every
// checkpoint, row and per-node anomaly count exactly once, and nothing else (not the index entries,
// anomaly rows or event log).
func TestRowsView_WarmRowsInChunks(t *testing.T) {
	db, err := Open(t.TempDir(), Options{})
	require.NoError(t, err)
	defer db.Close()
	var needs, applied []provisioner.Message
	for i := range 30 {
		needs = append(needs, provisioner.Message{Seq: uint64(i + 1), Key: fmt.Sprintf("n%d.m.wish.k", i%7), Op: provisioner.OpPut, Value: []byte{0x01}}) // unanswered-kind
		applied = append(applied, provisioner.Message{Seq: uint64(i + 1), Key: fmt.Sprintf("n%d.m%d", i%5, i), Op: provisioner.OpPut, Value: []byte{0x01}})
	}
	require.NoError(t, db.Apply(provisioner.BucketNeeds, needs, 0, false))
	require.NoError(t, db.Apply(provisioner.BucketApplied, applied, 0, false))
	// 7 needs rows (keys written again) and 30 applied rows, 2 checkpoints, 7 nodes with a count.
	const want = 7 + 30 + 2 + 7

	v, err := db.RowsView()
	require.NoError(t, err)
	defer v.Close()
	all, next, err := v.WarmRows(nil, 1<<20)
	require.NoError(t, err)
	require.Nil(t, next)
	require.Equal(t, want, all)

	for _, chunk := range []int{1, 6, 7, 45, 46} {
		var from []byte
		read, calls := 0, 0
		for {
			n, next, err := v.WarmRows(from, chunk)
			require.NoError(t, err)
			require.LessOrEqual(t, n, chunk)
			read += n
			calls++
			require.Less(t, calls, 100, "no progress")
			if next == nil {
				break
			}
			from = next
		}
		require.Equal(t, want, read, "chunks of %d", chunk)
	}
}
