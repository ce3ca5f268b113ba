package query

import (
	"fmt"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/faultfs"
	"github.com/novox/mesh-provisioner/store"
)

// A read that cannot open a table of the state dir for want of a file descriptor (EMFILE in Pebble's
// table cache) is answered 500 with a text that says so and to ask again (the contract has no other
// code for it), counted apart; asked again once descriptors are back, it is answered. The store holds
// more tables than its table cache (Pebble's least, 64), so that a scan of them all opens some.
func TestServer_OutOfFileDescriptorsSaysAskAgain(t *testing.T) {
	dir := t.TempDir()
	var out atomic.Bool
	// Compactions wait (BulkLoad): the tables stay as the flushes wrote them.
	opts := store.Options{CacheSize: 1 << 20, MinFreeBytes: -1, TableSize: 1 << 10, MaxOpenFiles: 74, BulkLoad: true,
		FS: faultfs.NoDescriptorsToRead(".sst", &out)}
	db, err := store.Open(dir, opts)
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	var seq uint64
	for db.Pebble().Metrics().Total().TablesCount < 80 {
		var msgs []provisioner.Message
		for range 20 {
			seq++
			msgs = append(msgs, provisioner.Message{Seq: seq, Time: int64(seq), Key: fmt.Sprintf("n%04d.m1.config.a", seq), Op: provisioner.OpPut, Value: []byte{0x80}})
		}
		require.NoError(t, db.Apply(provisioner.BucketNeeds, msgs, 1, false))
		require.NoError(t, db.Pebble().Flush())
	}
	db.SetSynced(provisioner.BucketNeeds, true)

	s, nc := serveStore(t, db)

	out.Store(true)
	ask := []byte(`{"what":"needs","limit":10000}`)
	a := askRaw(t, nc, ask, FormatJSON)
	require.Equal(t, 500, a.code, a.desc)
	require.True(t, strings.HasPrefix(a.desc, OutOfFDsText+": "), a.desc)
	require.Contains(t, a.desc, "ask again")
	require.Contains(t, a.desc, "LimitNOFILE=")
	require.EqualValues(t, 1, s.OutOfFDs())
	require.Positive(t, db.OutOfFDs(), "the store counts the open that failed")

	out.Store(false)
	a = askRaw(t, nc, ask, FormatJSON)
	require.Equal(t, 200, a.code, a.desc)
	require.Len(t, a.body["rows"], int(seq))
	require.EqualValues(t, 1, s.OutOfFDs())
}
