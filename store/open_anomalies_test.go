package store

import (
	"fmt"
	"maps"
	"testing"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
)

// TestDB_OpenReadsAnomalyRowsAsApplyKept: Open reads every anomaly row back into the buckets' anomaly
// sets and per-node counts, cutting the keys without copying them (cutAnomalyKey) and looking a
// bucket up once per run of its rows. What it reads must equal what Apply kept in memory before the
// close: a key with two classes (an unanswered kind and a value that is not MessagePack) is one entry
// of the set and two rows of its node's count; raw keys holding 0x00 bytes (escaped
// in the store key) and keys whose bucket name is a prefix of another's come back as they were.
func TestDB_OpenReadsAnomalyRowsAsApplyKept(t *testing.T) {
	dir := t.TempDir()
	db, err := Open(dir, Options{})
	require.NoError(t, err)
	buckets := []string{provisioner.BucketNeeds, provisioner.ComposedPrefix + "n1", provisioner.ComposedPrefix + "n1-x",
		provisioner.ComposedPrefix + "n10", provisioner.BucketApplied}
	seq := map[string]uint64{}
	for round := 0; round < 40; round++ {
		for _, b := range buckets { // interleaved: each Apply touches another bucket than the one before
			seq[b]++
			val := []byte{0x01}
			if round%3 == 0 {
				val = []byte{0xc1} // not MessagePack
			}
			var key string
			switch round % 4 {
			case 0:
				key = fmt.Sprintf("n%d.m.nokind.k%d", round%5, round) // unanswered kind (and a bad value every third)
			case 1:
				key = fmt.Sprintf("n%d\x00.x\x00y", round%5) // out of shape, 0x00 in the raw key
			case 2:
				key = fmt.Sprintf("\x00n%d", round)
			default:
				key = fmt.Sprintf("n%d.m.config.k%d", round%5, round)
			}
			require.NoError(t, db.Apply(b, []provisioner.Message{{Seq: seq[b], Time: int64(seq[b]), Key: key, Op: provisioner.OpPut, Value: val}}, 1, false))
		}
	}
	// The sets hold hashes seeded per open: what is kept across the close is which keys they hold
	// (checkAnomalySet) and the per-node counts.
	snapshot := func(db *DB) map[string]map[string]int64 {
		out := map[string]map[string]int64{}
		db.mu.Lock()
		defer db.mu.Unlock()
		for name, b := range db.buckets {
			out[name] = maps.Clone(b.nodeAnom)
		}
		return out
	}
	before := snapshot(db)
	keys := checkAnomalySet(t, db, "before close")
	twoClasses := 0
	for _, byKey := range keys {
		for _, c := range byKey {
			if c&(c-1) != 0 {
				twoClasses++
			}
		}
	}
	require.Positive(t, twoClasses, "some key holds two classes")
	require.NoError(t, db.Close())

	db, err = Open(dir, Options{})
	require.NoError(t, err)
	defer db.Close()
	require.Equal(t, before, snapshot(db))
	require.Equal(t, keys, checkAnomalySet(t, db, "after open"))
	checkAnomalyMemory(t, db, "after open")
	v, err := db.View()
	require.NoError(t, err)
	defer v.Close()
	checkAnomalyCounts(t, &v.rows, "after open", []string{"n1", "n10", "\x00n1"})
}
