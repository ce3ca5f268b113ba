package store

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/cockroachdb/pebble/v2"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
)

// anomalyScan is what the anomaly rows of a state hold, counted from the rows themselves: rows per
// bucket and node (the raw key's first token), and the rows of every composed-<node> bucket together.
type anomalyScan struct {
	byNode   map[string]map[string]int64
	composed int64
}

func scanAnomalyRows(t *testing.T, v *rows) anomalyScan {
	t.Helper()
	s := anomalyScan{byNode: map[string]map[string]int64{}}
	it, err := v.iter([]byte{prefixAnomaly}, []byte{prefixAnomaly + 1})
	require.NoError(t, err)
	for it.First(); it.Valid(); it.Next() {
		bucket, key, _, ok := splitAnomalyKey(it.Key())
		require.True(t, ok, "anomaly key %q", it.Key())
		if s.byNode[bucket] == nil {
			s.byNode[bucket] = map[string]int64{}
		}
		s.byNode[bucket][anomalyNode(key)]++
		if provisioner.IsComposedBucket(bucket) {
			s.composed++
		}
	}
	require.NoError(t, it.Error())
	return s
}

// storedNodeCounts reads every per-node count key through the view.
func storedNodeCounts(t *testing.T, v *rows) map[string]int64 {
	t.Helper()
	out := map[string]int64{}
	it, err := v.iter([]byte{prefixNodeAnom}, []byte{prefixNodeAnom + 1})
	require.NoError(t, err)
	for it.First(); it.Valid(); it.Next() {
		n, w := binary.Uvarint(it.Value())
		require.Positive(t, w, "count %q", it.Key())
		out[string(it.Key())] = int64(n)
	}
	require.NoError(t, it.Error())
	return out
}

// checkAnomalyCounts: in the state v reads, every node's count (as an answer reads it, and as stored,
// with no count left for a node without rows), every bucket's checkpoint count and the composed
// buckets' sum equal the anomaly rows.
func checkAnomalyCounts(t *testing.T, v *rows, label string, probe []string) {
	t.Helper()
	s := scanAnomalyRows(t, v)
	want := map[string]int64{}
	for bucket, nodes := range s.byNode {
		var all int64
		for node, n := range nodes {
			want[string(nodeAnomKey(nil, bucket, node))] = n
			all += n
			got, err := v.Anomalies(bucket, node, 0, func(provisioner.Anomaly) {})
			require.NoError(t, err)
			require.Equal(t, n, got, "%s: anomalies_total of %s node %q", label, bucket, node)
		}
		cp, err := v.Checkpoint(bucket)
		require.NoError(t, err)
		require.Equal(t, all, cp.AnomalyRows, "%s: checkpoint's anomaly rows of %s", label, bucket)
		for _, node := range probe {
			if nodes[node] == 0 {
				got, err := v.Anomalies(bucket, node, 0, func(provisioner.Anomaly) {})
				require.NoError(t, err)
				require.Zero(t, got, "%s: anomalies_total of %s node %q, which has none", label, bucket, node)
			}
		}
	}
	require.Equal(t, want, storedNodeCounts(t, v), "%s: stored per-node counts", label)
	listed := int64(0)
	total, err := v.ComposedAnomalies(1<<30, func(a provisioner.Anomaly) { listed++ })
	require.NoError(t, err)
	require.Equal(t, s.composed, total, "%s: composed buckets' anomalies_total", label)
	require.Equal(t, s.composed, listed, "%s: composed buckets' anomaly rows listed", label)
}

// checkAnomalyMemory: what the store keeps in memory (and writes the next counts from) equals the rows.
func checkAnomalyMemory(t *testing.T, db *DB, label string) {
	t.Helper()
	v, err := db.View()
	require.NoError(t, err)
	defer v.Close()
	s := scanAnomalyRows(t, &v.rows)
	db.applyMu.Lock()
	defer db.applyMu.Unlock()
	require.Equal(t, s.composed, db.composedAnom, "%s: composed sum in memory", label)
	db.mu.Lock()
	defer db.mu.Unlock()
	for name, b := range db.buckets {
		want := s.byNode[name]
		if want == nil {
			want = map[string]int64{}
		}
		require.Equal(t, want, b.nodeAnom, "%s: %s per-node counts in memory", label, name)
	}
}

// TestDB_NodeAnomalyCountsModel drives a store through random histories (puts in and out of shape,
// deletes, purges, wildcard and whole-bucket rollups removed in parts of two keys, registry kinds
// coming and going, Forget and ForgetFrom of composed buckets, trims, reopens, lost and corrupted
// counts) and checks after each step, and in the pinned state views read between a rollup's parts,
// that every count equals the anomaly rows it counts.
func TestDB_NodeAnomalyCountsModel(t *testing.T) {
	restore := SetRollupPart(2, nil)
	defer restore()
	for seed := uint64(1); seed <= 3; seed++ {
		t.Run(fmt.Sprint(seed), func(t *testing.T) { nodeAnomalyModel(t, seed) })
	}
}

func nodeAnomalyModel(t *testing.T, seed uint64) {
	dir := t.TempDir()
	db, err := Open(dir, Options{})
	require.NoError(t, err)
	defer func() { db.Close() }()
	r := rand.New(rand.NewPCG(seed, 99))
	nodes := []string{"n1", "n10", "n1-x", "n2", "n1=2E"}
	probe := append([]string{"n", "n100", "x"}, nodes...)
	buckets := []string{provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect,
		provisioner.ComposedPrefix + "n1", provisioner.ComposedPrefix + "n10", provisioner.ComposedPrefix + "n1-x"}
	kinds := []string{"wish", "config", "other"}
	reg := provisioner.Registry.Entries[0]
	seq := map[string]uint64{}
	var now int64 = 1_000
	parts := 0
	pinnedChecks := 0
	SetRollupPart(2, func(int) error {
		parts++
		v, err := db.View()
		require.NoError(t, err)
		defer v.Close()
		require.NotNil(t, v.pinned, "a view between a rollup's parts reads the pinned state")
		checkAnomalyCounts(t, &v.rows, fmt.Sprintf("seed %d: between a rollup's parts", seed), probe)
		rv, err := db.RowsView()
		require.NoError(t, err)
		defer rv.Close()
		checkAnomalyCounts(t, &rv.rows, fmt.Sprintf("seed %d: between a rollup's parts (rows view)", seed), probe)
		pinnedChecks++
		return nil
	})
	key := func(bucket string) string {
		node := nodes[r.IntN(len(nodes))]
		kind := kinds[r.IntN(len(kinds))]
		if provisioner.IsComposedBucket(bucket) {
			node = "m" + fmt.Sprint(r.IntN(3)) // the first token of a composed key is its module
		}
		ks := []string{node, node + ".m", node + ".m." + kind + ".a", node + ".m2." + kind + ".b", node + ".m.x.y.z",
			node + ".7", node + ".c=3A1.u", node + ".m." + kind, node + ".m.b=ad", node + "..x"}
		return ks[r.IntN(len(ks))]
	}
	msg := func(bucket string, k string) provisioner.Message {
		seq[bucket]++
		now++
		m := provisioner.Message{Seq: seq[bucket], Time: now, Key: k, Op: provisioner.OpPut, Value: []byte{0x01}}
		if r.IntN(4) == 0 {
			m.Value = []byte{0xc1} // not MessagePack
		}
		return m
	}
	for step := 0; step < 120; step++ {
		label := fmt.Sprintf("seed %d step %d", seed, step)
		bucket := buckets[r.IntN(len(buckets))]
		switch op := r.IntN(20); {
		case op < 9: // a batch of puts, deletes and purges
			var msgs []provisioner.Message
			for i := r.IntN(12) + 1; i > 0; i-- {
				m := msg(bucket, key(bucket))
				switch r.IntN(5) {
				case 0:
					m.Op, m.Value = provisioner.OpDelete, nil
				case 1:
					m.Op, m.Value, m.Rollup = provisioner.OpPurge, nil, provisioner.RollupSub
				}
				msgs = append(msgs, m)
			}
			require.NoError(t, db.Apply(bucket, msgs, 0, r.IntN(2) == 0), label)
		case op < 12: // a wildcard rollup: a purge of a node's keys, or of a node's module
			pat := nodes[r.IntN(len(nodes))] + ".>"
			if provisioner.IsComposedBucket(bucket) {
				pat = "m" + fmt.Sprint(r.IntN(3)) + ".*"
			} else if r.IntN(2) == 0 {
				pat = nodes[r.IntN(len(nodes))] + ".m.>"
			}
			m := msg(bucket, pat)
			m.Op, m.Value, m.Rollup = provisioner.OpPurge, nil, provisioner.RollupSub
			msgs := []provisioner.Message{m, msg(bucket, key(bucket))}
			require.NoError(t, db.Apply(bucket, msgs, 0, false), label)
		case op < 13: // a rollup of the whole bucket
			m := msg(bucket, key(bucket))
			m.Rollup = provisioner.RollupAll
			require.NoError(t, db.Apply(bucket, []provisioner.Message{m}, 0, false), label)
		case op < 16: // a registry kind comes or goes: needs of it raise or clear unanswered-kind
			k := kinds[r.IntN(len(kinds))]
			if k == "wish" {
				k = reg.Kind
			}
			m := msg(provisioner.BucketRegistry, k)
			m.Value = reg.Value()
			if r.IntN(2) == 0 {
				m.Op, m.Value = provisioner.OpDelete, nil
			}
			require.NoError(t, db.Apply(provisioner.BucketRegistry, []provisioner.Message{m}, 0, false), label)
		case op < 17: // a composed bucket forgotten, or forgotten and resumed
			b := buckets[3+r.IntN(3)]
			if r.IntN(2) == 0 {
				require.NoError(t, db.Forget(b, now), label)
			} else {
				require.NoError(t, db.ForgetFrom(b, now, Checkpoint{Applied: seq[b]}), label)
			}
		case op < 18: // a trim
			_, err := db.TrimHistory(t.Context(), bucket, db.Checkpoint(bucket).Applied/2, 0)
			require.NoError(t, err, label)
		case op < 19: // a reopen, with the counts as they are, lost, or wrong
			require.NoError(t, db.Close())
			pdb, err := pebble.Open(dir, &pebble.Options{Logger: pebbleLogger{}})
			require.NoError(t, err)
			switch r.IntN(4) {
			case 0: // written by the layout before the counts
				require.NoError(t, pdb.DeleteRange([]byte{prefixNodeAnom}, []byte{prefixNodeAnom + 1}, pebble.Sync))
				require.NoError(t, pdb.Delete(composedAnomKey(), pebble.Sync))
			case 1: // wrong, and a count of a node with no rows
				require.NoError(t, pdb.Set(nodeAnomKey(nil, provisioner.BucketNeeds, "n1"), []byte{0x7f}, pebble.Sync))
				require.NoError(t, pdb.Set(nodeAnomKey(nil, provisioner.BucketNeeds, "ghost"), []byte{3}, pebble.Sync))
				require.NoError(t, pdb.Set(composedAnomKey(), []byte{0x7f}, pebble.Sync))
			case 2: // not a uvarint
				require.NoError(t, pdb.Set(nodeAnomKey(nil, provisioner.BucketApplied, "n2"), []byte{0xff}, pebble.Sync))
				require.NoError(t, pdb.Set(composedAnomKey(), []byte{0xff}, pebble.Sync))
			}
			require.NoError(t, pdb.Close())
			db, err = Open(dir, Options{})
			require.NoError(t, err, label)
		default:
			continue
		}
		v, err := db.View()
		require.NoError(t, err)
		checkAnomalyCounts(t, &v.rows, label, probe)
		require.NoError(t, v.Close())
		rv, err := db.RowsView()
		require.NoError(t, err)
		checkAnomalyCounts(t, &rv.rows, label+" (rows view)", probe)
		require.NoError(t, rv.Close())
		checkAnomalyMemory(t, db, label)
	}
	require.Positive(t, pinnedChecks, "some rollup was removed in parts")
	s := func() anomalyScan {
		v, err := db.View()
		require.NoError(t, err)
		defer v.Close()
		return scanAnomalyRows(t, &v.rows)
	}()
	require.NotEmpty(t, s.byNode, "the history leaves anomaly rows to count")
}
