package store

import (
	"context"
	"testing"

	"github.com/cockroachdb/pebble/v2"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
)

// TestDB_TablesHoldLargeBlocks: the tables a compaction writes hold data blocks of about blockSize
// (32 KiB), not Pebble's 4 KiB, so a walk that misses the block cache reads an eighth as many blocks.
func TestDB_TablesHoldLargeBlocks(t *testing.T) {
	db, err := Open(t.TempDir(), Options{})
	require.NoError(t, err)
	defer db.Close()
	var ms []provisioner.Message
	for _, op := range (fixtures.Mesh{Seed: 1, Nodes: 40, Modules: 10, NeedsPerModule: 10}).OpsOf(provisioner.BucketNeeds) {
		ms = append(ms, provisioner.Message{Seq: uint64(len(ms) + 1), Key: op.Key, Op: op.Op, Value: op.Value, Time: 1.7e18})
	}
	require.NoError(t, db.Apply(provisioner.BucketNeeds, ms, 1, false))
	require.NoError(t, db.CompactAll(context.Background()))

	levels, err := db.pdb.SSTables(pebble.WithProperties())
	require.NoError(t, err)
	var raw, blocks uint64
	for _, tables := range levels {
		for _, tb := range tables {
			raw += tb.Properties.RawKeySize + tb.Properties.RawValueSize
			blocks += tb.Properties.NumDataBlocks
		}
	}
	require.NotZero(t, blocks)
	// Keys are stored with their shared prefixes left out, so a block holds more than its size of raw
	// keys and values; with 4 KiB blocks this is about 6 KiB.
	require.Greater(t, raw/blocks, uint64(blockSize*3/4), "raw bytes a data block: %d over %d blocks", raw, blocks)
}
