package store

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/cockroachdb/pebble/v2"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
)

// TestView_NodeAnomaliesReadOnlyWhatTheyList: an answer narrowed by node reads the anomaly rows it
// lists and the node's count, not every anomaly row of the node: a node with thousands of them (its
// needs ask a kind no registry entry answers) costs each page of its answer the same as a node with
// a few.
func TestView_NodeAnomaliesReadOnlyWhatTheyList(t *testing.T) {
	db, err := Open(t.TempDir(), Options{})
	require.NoError(t, err)
	defer db.Close()
	var msgs []provisioner.Message
	for i := 0; i < 3000; i++ {
		msgs = append(msgs, provisioner.Message{Seq: uint64(i + 1), Key: fmt.Sprintf("n1.m.wish.k%05d", i), Op: provisioner.OpPut, Value: []byte{0x01}})
	}
	msgs = append(msgs, provisioner.Message{Seq: 3001, Key: "n2.m.wish.k", Op: provisioner.OpPut, Value: []byte{0x01}})
	require.NoError(t, db.Apply(provisioner.BucketNeeds, msgs, 0, false))

	v, err := db.View()
	require.NoError(t, err)
	defer v.Close()
	var listed int
	total, err := v.Anomalies(provisioner.BucketNeeds, "n1", 10, func(provisioner.Anomaly) { listed++ })
	require.NoError(t, err)
	require.EqualValues(t, 3000, total)
	require.Equal(t, 10, listed)
	st := v.it.Stats()
	read := st.ForwardSeekCount[pebble.InterfaceCall] + st.ForwardStepCount[pebble.InterfaceCall]
	require.LessOrEqual(t, read, 20, "iterator calls for 10 anomaly rows of 3,000: %+v", st)
}

// TestView_NodeWithoutAnomaliesSeeksNoAnomalyRow: a node whose count is zero (most nodes) lists nothing
// without seeking into the anomaly rows: one read, the count's (three before: the count and the rows of
// the node's key and of its keys below it, blocks no other lookup kept in the block cache).
func TestView_NodeWithoutAnomaliesSeeksNoAnomalyRow(t *testing.T) {
	db, err := Open(t.TempDir(), Options{})
	require.NoError(t, err)
	defer db.Close()
	require.NoError(t, db.Apply(provisioner.BucketNeeds, []provisioner.Message{
		{Seq: 1, Key: "n1.m.wish.k", Op: provisioner.OpPut, Value: []byte{0x01}}, // unanswered-kind
		{Seq: 2, Key: "n2", Op: provisioner.OpPut, Value: []byte{0x01}},          // token-count
	}, 0, false))

	v, err := db.View()
	require.NoError(t, err)
	defer v.Close()
	total, err := v.Anomalies(provisioner.BucketNeeds, "n10", 1000, func(a provisioner.Anomaly) { t.Errorf("listed %+v", a) })
	require.NoError(t, err)
	require.Zero(t, total)
	st := v.it.Stats()
	require.Equal(t, 1, st.ForwardSeekCount[pebble.InterfaceCall], "seeks for a node without anomaly rows: %+v", st)
	total, err = v.Anomalies(provisioner.BucketNeeds, "n1", 1000, func(provisioner.Anomaly) {})
	require.NoError(t, err)
	require.EqualValues(t, 1, total)
}

// TestDB_NodeAnomalyCountsFollowTheRows: the count of each node's anomaly rows equals the rows, through
// puts out of shape and back, deletes, keys of two classes, a registry that raises and clears
// unanswered kinds, a reopen, a store that lost its counts (written before they existed), and a
// forgotten bucket; and so does the sum of every composed-<node> bucket's anomaly rows.
func TestDB_NodeAnomalyCountsFollowTheRows(t *testing.T) {
	dir := t.TempDir()
	db, err := Open(dir, Options{})
	require.NoError(t, err)
	defer func() { db.Close() }()
	reg := provisioner.Registry.Entries[0]
	nodes := []string{"n1", "n2", "n10", "n1-x"}
	check := func(label string) {
		t.Helper()
		v, err := db.View()
		require.NoError(t, err)
		defer v.Close()
		var sum int64
		defer func() { require.Positive(t, sum, "%s: no anomaly rows to count", label) }()
		listed := 0
		total, err := v.ComposedAnomalies(math.MaxInt, func(a provisioner.Anomaly) {
			require.True(t, provisioner.IsComposedBucket(a.Bucket), a.Bucket)
			listed++
		})
		require.NoError(t, err)
		require.EqualValues(t, listed, total, "%s: every composed-<node> bucket's", label)
		for _, bucket := range []string{provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.ComposedPrefix + "n1"} {
			for _, node := range nodes {
				listed := 0
				total, err := v.Anomalies(bucket, node, math.MaxInt, func(provisioner.Anomaly) { listed++ })
				require.NoError(t, err)
				require.EqualValues(t, listed, total, "%s: %s node %s", label, bucket, node)
				sum += total
			}
		}
	}
	r := rand.New(rand.NewPCG(7, 7))
	seq := map[string]uint64{}
	regSeq := uint64(0)
	for round := 0; round < 30; round++ {
		for _, bucket := range []string{provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.ComposedPrefix + "n1", provisioner.ComposedPrefix + "n2"} {
			var msgs []provisioner.Message
			for i := 0; i < 40; i++ {
				node := nodes[r.IntN(len(nodes))]
				keys := []string{node, node + ".m", node + ".m.wish.a", node + ".m." + reg.Kind + ".b", node + ".m.x.y.z", node + ".7"}
				key := keys[r.IntN(len(keys))]
				seq[bucket]++
				m := provisioner.Message{Seq: seq[bucket], Key: key, Op: provisioner.OpPut, Value: []byte{0x01}}
				switch r.IntN(4) {
				case 0:
					m.Op, m.Value = provisioner.OpDelete, nil
				case 1:
					m.Value = []byte{0xc1} // not MessagePack
				}
				msgs = append(msgs, m)
			}
			require.NoError(t, db.Apply(bucket, msgs, 0, false))
		}
		regSeq++
		op := provisioner.OpPut
		if round%2 == 1 {
			op = provisioner.OpDelete
		}
		require.NoError(t, db.Apply(provisioner.BucketRegistry, []provisioner.Message{{Seq: regSeq, Key: reg.Kind, Op: op, Value: reg.Value()}}, 0, false))
		check(fmt.Sprintf("round %d", round))
	}

	require.NoError(t, db.Close())
	db, err = Open(dir, Options{})
	require.NoError(t, err)
	check("reopened")

	// A store written before the counts existed has none: its first open counts them.
	require.NoError(t, db.pdb.DeleteRange([]byte{prefixNodeAnom}, []byte{prefixNodeAnom + 1}, pebble.Sync))
	require.NoError(t, db.pdb.Set(nodeAnomKey(nil, provisioner.BucketNeeds, "gone"), []byte{5}, pebble.Sync))
	require.NoError(t, db.pdb.Delete(composedAnomKey(), pebble.Sync))
	require.NoError(t, db.Close())
	db, err = Open(dir, Options{})
	require.NoError(t, err)
	check("counts lost")
	_, closer, err := db.pdb.Get(nodeAnomKey(nil, provisioner.BucketNeeds, "gone"))
	require.ErrorIs(t, err, pebble.ErrNotFound, "a count of no rows is removed")
	if closer != nil {
		closer.Close()
	}

	require.NoError(t, db.Forget(provisioner.ComposedPrefix+"n1", 1))
	check("forgotten")
	it, err := db.pdb.NewIter(&pebble.IterOptions{LowerBound: bucketPrefix(nil, prefixNodeAnom, provisioner.ComposedPrefix+"n1"), UpperBound: prefixEnd(bucketPrefix(nil, prefixNodeAnom, provisioner.ComposedPrefix+"n1"))})
	require.NoError(t, err)
	require.False(t, it.First(), "a forgotten bucket keeps no counts")
	require.NoError(t, it.Close())
}
