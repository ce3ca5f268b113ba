package store

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
)

// dump returns every key and value of the store, in key order.
func dump(t *testing.T, db *DB) []string {
	t.Helper()
	it, err := db.pdb.NewIter(nil)
	require.NoError(t, err)
	defer it.Close()
	var out []string
	for it.First(); it.Valid(); it.Next() {
		out = append(out, fmt.Sprintf("%q=%q", it.Key(), it.Value()))
	}
	require.NoError(t, it.Error())
	return out
}

// TestApply_SortedBatchIsMessageByMessage checks that handing a batch's writes to Pebble in key order
// changes nothing: a random stream of puts, deletes and out-of-shape keys, many on the same few keys,
// applied as one batch leaves exactly the store that applying it one message per batch leaves.
func TestApply_SortedBatchIsMessageByMessage(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 7))
	var msgs []provisioner.Message
	for seq := uint64(1); seq <= 2000; seq++ {
		key := fmt.Sprintf("n%d.m%d.config.x%d", r.IntN(4), r.IntN(3), r.IntN(3))
		switch r.IntN(10) {
		case 0:
			key = fmt.Sprintf("n%d.m%d", r.IntN(4), r.IntN(3)) // out of shape
		case 1:
			key = fmt.Sprintf("n%d.m%d.nokind.x", r.IntN(4), r.IntN(3)) // unanswered kind
		}
		m := provisioner.Message{Seq: seq, Time: int64(seq) * 1e6, Key: key, Op: provisioner.OpPut, Value: []byte{byte(r.IntN(100))}}
		switch r.IntN(6) {
		case 0:
			m.Op, m.Value = provisioner.OpDelete, nil
		case 1:
			m.Value = []byte{0xc1} // not MessagePack
		}
		msgs = append(msgs, m)
	}
	reg := []provisioner.Message{{Seq: 1, Key: "config", Op: provisioner.OpPut, Value: provisioner.Registry.Entries[0].Value()}}

	open := func() *DB {
		db, err := Open(t.TempDir(), Options{})
		require.NoError(t, err)
		t.Cleanup(func() { db.Close() })
		require.NoError(t, db.Apply(provisioner.BucketRegistry, reg, 0, false))
		return db
	}
	whole, one := open(), open()
	require.NoError(t, whole.Apply(provisioner.BucketNeeds, msgs, 0, false))
	for i := range msgs {
		require.NoError(t, one.Apply(provisioner.BucketNeeds, msgs[i:i+1], 0, false))
	}
	got, want := dump(t, whole), dump(t, one)
	require.Greater(t, len(want), 2000, "the stream leaves rows, index entries, anomalies and events")
	require.Equal(t, want, got)
}
