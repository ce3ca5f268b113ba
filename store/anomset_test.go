package store

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
)

// checkAnomalySet: every bucket's set of hashes (anomset.go) is exactly the hashes of the raw keys
// that hold anomaly rows as committed, a hash shared by several keys counted once for each beyond the
// first. It returns the classes of every such key, by bucket.
func checkAnomalySet(t *testing.T, db *DB, label string) map[string]map[string]byte {
	t.Helper()
	v, err := db.View()
	require.NoError(t, err)
	defer v.Close()
	keys := map[string]map[string]byte{}
	it, err := v.rows.iter([]byte{prefixAnomaly}, []byte{prefixAnomaly + 1})
	require.NoError(t, err)
	for it.First(); it.Valid(); it.Next() {
		bucket, key, class, ok := splitAnomalyKey(it.Key())
		require.True(t, ok, "anomaly key %q", it.Key())
		if keys[bucket] == nil {
			keys[bucket] = map[string]byte{}
		}
		keys[bucket][key] |= class
	}
	require.NoError(t, it.Error())

	db.applyMu.Lock()
	defer db.applyMu.Unlock()
	db.mu.Lock()
	defer db.mu.Unlock()
	for name, b := range db.buckets {
		want := newAnomSet(0)
		for key, c := range keys[name] {
			want.add(db.anomHash(key), c)
		}
		require.Equal(t, len(keys[name]), b.anom.keys(), "%s: %s keys in the set", label, name)
		require.Equal(t, hashesOf(&want), hashesOf(&b.anom), "%s: %s hashes", label, name)
		require.Equal(t, b.anom.n, len(hashesOf(&b.anom)), "%s: %s hashes found by their probes", label, name)
		require.LessOrEqual(t, b.anom.n*4, len(b.anom.slots)*3, "%s: %s load", label, name)
		require.Equal(t, len(want.shared), len(b.anom.shared), "%s: %s shared hashes", label, name)
		for h, n := range want.shared {
			require.Equal(t, n, b.anom.shared[h], "%s: %s keys beyond the first of hash %x", label, name, h)
		}
		// A hash not marked unknown is one key's, with that key's classes.
		for key, c := range keys[name] {
			h := db.anomHash(key)
			meta, ok := b.anom.lookup(h)
			require.True(t, ok, "%s: %s %q", label, name, key)
			if meta&anomUnknown == 0 {
				require.Zero(t, want.shared[h], "%s: %s %q shares its hash, which is not marked", label, name, key)
				require.Equal(t, uint64(c), meta&anomClasses, "%s: %s %q classes", label, name, key)
			}
		}
	}
	for name := range keys {
		_, ok := db.buckets[name]
		require.True(t, ok, "%s: %s holds anomaly rows and has no state", label, name)
	}
	return keys
}

// hashesOf lists the hashes a set holds, each once, each found where its probe looks.
func hashesOf(s *anomSet) []uint64 {
	out := []uint64{}
	for _, w := range s.slots {
		if h := w &^ anomMeta; w != 0 && s.has(h) {
			out = append(out, h)
		}
	}
	slices.Sort(out)
	return out
}

// TestAnomSet_CountsKeysByHash drives the open-addressing set through random adds and removes of a
// few hashes (many probes share runs, and runs wrap past the table's end) and many others (it grows
// and shrinks), against a map of how many keys hold each hash.
func TestAnomSet_CountsKeysByHash(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 7))
	var s anomSet
	want := map[uint64]int{}
	pick := func() uint64 {
		switch r.IntN(3) {
		case 0:
			return uint64(1+r.IntN(24)) << 4 // home slot 0: one run from the table's start
		case 1:
			return (^uint64(0) - uint64(r.IntN(24))) << 4 // home slot at the table's end: runs wrap
		}
		return anomTag(r.Uint64())
	}
	var held []uint64
	for step := 0; step < 20000; step++ {
		// Grow to about 3,000 keys, then drain, so the table grows and shrinks.
		grow := step < 10000
		if len(held) > 0 && (!grow && r.IntN(10) < 7 || grow && r.IntN(10) < 3) {
			i := r.IntN(len(held))
			h := held[i]
			held[i] = held[len(held)-1]
			held = held[:len(held)-1]
			s.remove(h)
			if want[h]--; want[h] == 0 {
				delete(want, h)
			}
		} else {
			h := pick()
			s.add(h, byte(1+r.IntN(7)))
			want[h]++
			held = append(held, h)
		}
		if step%97 != 0 && step != 19999 {
			continue
		}
		require.Equal(t, len(held), s.keys(), "step %d: keys", step)
		require.Equal(t, len(want), s.n, "step %d: hashes", step)
		require.Equal(t, len(want), len(hashesOf(&s)), "step %d: hashes found by their probes", step)
		for h := range want {
			require.True(t, s.has(h), "step %d: %x", step, h)
		}
		for range 20 {
			h := pick()
			require.Equal(t, want[h] > 0, s.has(h), "step %d: %x", step, h)
		}
		require.LessOrEqual(t, s.n*4, len(s.slots)*3, "step %d: load", step)
	}
	for _, h := range held {
		s.remove(h)
	}
	require.Zero(t, s.keys())
	require.Nil(t, s.slots, "an empty set holds no table")
}

// TestAnomSet_KeepsEachHashsClasses is the set's model with what each word carries beside its hash:
// through adds, removes and updates of clustered hashes (runs that wrap, backward shifts, growing
// and shrinking), a hash one key holds carries that key's classes as last added or updated, and a
// hash two keys held is marked unknown until its last key goes.
func TestAnomSet_KeepsEachHashsClasses(t *testing.T) {
	type held struct {
		keys    int
		classes uint64
		unknown bool
	}
	r := rand.New(rand.NewPCG(11, 3))
	var s anomSet
	want := map[uint64]*held{}
	pick := func() uint64 {
		switch r.IntN(4) {
		case 0:
			return uint64(1+r.IntN(40)) << 4
		case 1:
			return (^uint64(0) - uint64(r.IntN(40))) << 4
		case 2:
			return anomTag(uint64(r.IntN(3000))) // a few thousand keys' worth of fixed hashes
		}
		return anomTag(r.Uint64())
	}
	check := func(step int) {
		t.Helper()
		require.Equal(t, len(want), s.n, "step %d: hashes", step)
		keys := 0
		for h, w := range want {
			keys += w.keys
			meta, ok := s.lookup(h)
			require.True(t, ok, "step %d: %x", step, h)
			require.Equal(t, w.unknown, meta&anomUnknown != 0, "step %d: %x unknown", step, h)
			if !w.unknown {
				require.Equal(t, w.classes, meta&anomClasses, "step %d: %x classes", step, h)
			}
		}
		require.Equal(t, keys, s.keys(), "step %d: keys", step)
		require.LessOrEqual(t, s.n*4, len(s.slots)*3, "step %d: load", step)
	}
	var hs []uint64
	most := 0
	for step := range 30000 {
		grow := step%10000 < 6000
		switch op := r.IntN(10); {
		case len(hs) > 0 && (grow && op < 3 || !grow && op < 7):
			i := r.IntN(len(hs))
			h := hs[i]
			hs[i] = hs[len(hs)-1]
			hs = hs[:len(hs)-1]
			s.remove(h)
			want[h].keys--
			if want[h].keys == 0 {
				delete(want, h)
			}
		case len(hs) > 0 && (grow && op == 3 || !grow && op == 7):
			h := hs[r.IntN(len(hs))]
			c := uint64(1 + r.IntN(7))
			s.update(h, byte(c))
			if w := want[h]; !w.unknown {
				w.classes = c
			}
		default:
			h, c := pick(), uint64(1+r.IntN(7))
			s.add(h, byte(c))
			if w, ok := want[h]; ok {
				w.keys++
				w.unknown = true
			} else {
				want[h] = &held{keys: 1, classes: c}
			}
			hs = append(hs, h)
		}
		most = max(most, s.n)
		if step%101 == 0 {
			check(step)
		}
	}
	check(30000)
	require.Greater(t, most, 500, "the table grew")
}

// withSharedHashes makes the anomaly sets' hashes take a few values only, so that most keys share
// their hash with others, until the test ends.
func withSharedHashes(t *testing.T, mask uint64) {
	old := anomHashMask
	anomHashMask = mask
	t.Cleanup(func() { anomHashMask = old })
}

// TestDB_NodeAnomalyCountsModelWithSharedHashes is the counts' model (nodeanom_model_test.go) with
// hashes of three bits: every key's classes come from its rows through a hash that other keys hold,
// and every count must still equal the rows.
func TestDB_NodeAnomalyCountsModelWithSharedHashes(t *testing.T) {
	withSharedHashes(t, 0x7)
	restore := SetRollupPart(2, nil)
	defer restore()
	for seed := uint64(1); seed <= 2; seed++ {
		t.Run(fmt.Sprint(seed), func(t *testing.T) { nodeAnomalyModel(t, seed) })
	}
}

// TestDB_AnomalySetsHoldTheKeysWithRows: after every step of random histories (puts in and out of
// shape, values that are not MessagePack, deletes, rollups of a node and of the whole bucket in parts,
// registry kinds coming and going, Forget, reopens), each bucket's set holds exactly the hashes of the
// keys that hold anomaly rows, with full hashes and with hashes most keys share.
func TestDB_AnomalySetsHoldTheKeysWithRows(t *testing.T) {
	for _, mask := range []uint64{^uint64(0), 0x3} {
		t.Run(fmt.Sprintf("%x", mask), func(t *testing.T) {
			withSharedHashes(t, mask)
			restore := SetRollupPart(3, nil)
			defer restore()
			anomalySetModel(t, 5)
		})
	}
}

func anomalySetModel(t *testing.T, seed uint64) {
	dir := t.TempDir()
	db, err := Open(dir, Options{})
	require.NoError(t, err)
	defer func() { db.Close() }()
	r := rand.New(rand.NewPCG(seed, 5))
	reg := provisioner.Registry.Entries[0]
	buckets := []string{provisioner.BucketNeeds, provisioner.BucketCollect, provisioner.ComposedPrefix + "n1"}
	seq := map[string]uint64{}
	key := func(bucket string) string {
		node := fmt.Sprintf("n%d", r.IntN(4))
		if provisioner.IsComposedBucket(bucket) {
			return fmt.Sprintf("m%d.%s", r.IntN(3), []string{"1", "x", "2.3"}[r.IntN(3)])
		}
		kind := []string{reg.Kind, "wish"}[r.IntN(2)]
		ks := []string{node, node + ".m." + kind + ".a", node + ".m2." + kind + ".b", node + ".c=3A1.u", node + ".x.y", node + ".m.b=ad", node + ".x\x00y", node + "\x00"}
		return ks[r.IntN(len(ks))]
	}
	msg := func(bucket, k string) provisioner.Message {
		seq[bucket]++
		m := provisioner.Message{Seq: seq[bucket], Time: int64(seq[bucket]), Key: k, Op: provisioner.OpPut, Value: []byte{0x01}}
		if r.IntN(3) == 0 {
			m.Value = []byte{0xc1}
		}
		return m
	}
	for step := 0; step < 150; step++ {
		label := fmt.Sprintf("step %d", step)
		bucket := buckets[r.IntN(len(buckets))]
		switch op := r.IntN(20); {
		case op < 12:
			var msgs []provisioner.Message
			for i := r.IntN(10) + 1; i > 0; i-- {
				m := msg(bucket, key(bucket))
				if r.IntN(4) == 0 {
					m.Op, m.Value = provisioner.OpDelete, nil
				}
				msgs = append(msgs, m)
			}
			require.NoError(t, db.Apply(bucket, msgs, 0, false), label)
		case op < 14:
			m := msg(bucket, fmt.Sprintf("n%d.>", r.IntN(4)))
			if r.IntN(2) == 0 {
				m = msg(bucket, key(bucket))
				m.Rollup = provisioner.RollupAll
			} else {
				m.Op, m.Value, m.Rollup = provisioner.OpPurge, nil, provisioner.RollupSub
			}
			require.NoError(t, db.Apply(bucket, []provisioner.Message{m}, 0, false), label)
		case op < 17:
			m := msg(provisioner.BucketRegistry, reg.Kind)
			m.Value = reg.Value()
			if r.IntN(2) == 0 {
				m.Op, m.Value = provisioner.OpDelete, nil
			}
			require.NoError(t, db.Apply(provisioner.BucketRegistry, []provisioner.Message{m}, 0, false), label)
		case op < 18:
			require.NoError(t, db.Forget(buckets[2], int64(step)), label)
			seq[buckets[2]] = 0
		default:
			require.NoError(t, db.Close())
			db, err = Open(dir, Options{})
			require.NoError(t, err, label)
		}
		checkAnomalySet(t, db, label)
		checkAnomalyMemory(t, db, label)
	}
}

// TestDB_ARollupsPartsReadTheirOwnAnomalyRows: a rollup of the whole bucket removes out-of-shape keys
// too, which have no row, only anomaly rows. It found them by walking the whole anomaly set in
// memory, every part; it reads them from the anomaly rows now, in key order, and each part reads the
// anomaly rows of its own range of keys: here every need holds one (its kind is unanswered), so a
// part reads about its own keys' rows, not the bucket's.
func TestDB_ARollupsPartsReadTheirOwnAnomalyRows(t *testing.T) {
	b := provisioner.BucketNeeds
	db, err := Open(t.TempDir(), Options{})
	require.NoError(t, err)
	defer db.Close()
	var msgs []provisioner.Message
	for i := range 300 {
		key := fmt.Sprintf("n%03d.m.nokind.a", i)
		if i%10 == 3 {
			key = fmt.Sprintf("n%03d.odd", i) // out of shape
		}
		msgs = append(msgs, provisioner.Message{Seq: uint64(i + 1), Time: 1, Key: key, Op: provisioner.OpPut, Value: []byte{0xc0}})
	}
	require.NoError(t, db.Apply(b, msgs, 0, false))
	require.EqualValues(t, 300, db.Checkpoint(b).AnomalyRows)

	const part = 10
	var read []uint64
	restore := SetRollupPart(part, nil)
	defer restore()
	rollupPartOddRead = func(points uint64) { read = append(read, points) }
	defer func() { rollupPartOddRead = nil }()
	all := provisioner.Message{Seq: 301, Time: 2, Key: "n999.m.config.z", Op: provisioner.OpPut, Value: []byte{0xc0}, Rollup: provisioner.RollupAll}
	require.NoError(t, db.Apply(b, []provisioner.Message{all}, 0, false))
	t.Logf("anomaly rows read by each part: %v", read)
	require.GreaterOrEqual(t, len(read), 300/part)
	for i, n := range read {
		// The anomaly rows of its own keys, the one it resumes after, and where it stops.
		require.LessOrEqual(t, n, uint64(2*part+4), "part %d read %d points: %v", i, n, read)
	}
	// Every key removed, the out-of-shape ones too: the rollup's own need is left, of a kind no
	// registry entry answers.
	require.EqualValues(t, 1, db.Checkpoint(b).AnomalyRows)
	keys := checkAnomalySet(t, db, "after the rollup")
	require.Equal(t, map[string]byte{"n999.m.config.z": classKind}, keys[b])
	checkAnomalyMemory(t, db, "after the rollup")
}

// countAnomReads counts the reads that confirm a hash found in a set (anomset.go), Gets and reads
// through the batch's iterator, until the test ends.
func countAnomReads(t *testing.T) (gets, ordered *int) {
	gets, ordered = new(int), new(int)
	anomRead = func(get bool) {
		if get {
			*gets++
		} else {
			*ordered++
		}
	}
	t.Cleanup(func() { anomRead = nil })
	return gets, ordered
}

// TestDB_BulkStepsReadAnomaliesInOrder: the steps that touch every key of a range (a whole-bucket
// rollup, removed in parts; the re-evaluation of every need of a kind the registry gains or loses)
// read the anomaly rows of the keys they meet through one iterator stepping forward, not with a Get
// a key (5 to 7 µs each, which doubled the CPU of a rollup of needs that all held an anomaly); keys
// whose hash is not in the set, new anomalies and messages of keys without any, read nothing. What
// they leave equals the rows.
func TestDB_BulkStepsReadAnomaliesInOrder(t *testing.T) {
	const n = 600
	b := provisioner.BucketNeeds
	kind := provisioner.Registry.Entries[0].Kind
	db, err := Open(t.TempDir(), Options{})
	require.NoError(t, err)
	defer db.Close()
	restore := SetRollupPart(100, nil)
	defer restore()
	gets, ordered := countAnomReads(t)
	reads := func() int { return *gets + *ordered }

	seq := uint64(0)
	var msgs []provisioner.Message
	for i := range n {
		seq++
		key := fmt.Sprintf("n%03d.m.%s.a", i, kind)
		if i%50 == 7 {
			key = fmt.Sprintf("n%03d.odd", i) // out of shape: the set is never empty below
		}
		msgs = append(msgs, provisioner.Message{Seq: seq, Time: 1, Key: key, Op: provisioner.OpPut, Value: []byte{0xc0}})
	}
	require.NoError(t, db.Apply(b, msgs, 0, false))
	require.EqualValues(t, n, db.Checkpoint(b).AnomalyRows, "every need's kind is unanswered")
	require.Zero(t, reads(), "new anomalies read nothing")

	regSeq := uint64(0)
	registry := func(op provisioner.Op) {
		regSeq++
		m := provisioner.Message{Seq: regSeq, Time: 1, Key: kind, Op: op}
		if op == provisioner.OpPut {
			m.Value = provisioner.Registry.Entries[0].Value()
		}
		require.NoError(t, db.Apply(provisioner.BucketRegistry, []provisioner.Message{m}, 0, false))
	}
	registry(provisioner.OpPut)
	require.EqualValues(t, n/50, db.Checkpoint(b).AnomalyRows, "the kind is answered: the out-of-shape keys are left")
	require.Zero(t, *gets, "the kind's needs are read in order, not a Get each")
	require.Equal(t, n-n/50, *ordered)
	checkAnomalySet(t, db, "kind gained")
	checkAnomalyMemory(t, db, "kind gained")

	*gets, *ordered = 0, 0
	msgs = msgs[:0]
	for i := range n {
		seq++
		msgs = append(msgs, provisioner.Message{Seq: seq, Time: 1, Key: fmt.Sprintf("n%03d.m2.%s.b", i, kind), Op: provisioner.OpPut, Value: []byte{0xc0}})
	}
	require.NoError(t, db.Apply(b, msgs, 0, false))
	require.Zero(t, reads(), "messages of keys without anomalies read nothing")

	registry(provisioner.OpDelete)
	require.EqualValues(t, n/50+(n-n/50)+n, db.Checkpoint(b).AnomalyRows, "the kind is unanswered again")
	require.Zero(t, reads(), "needs without anomalies read nothing when their kind goes")
	checkAnomalySet(t, db, "kind lost")

	// A rollup of the whole bucket removes every key, in parts of 100: each key holding an anomaly
	// is read in order.
	seq++
	all := provisioner.Message{Seq: seq, Time: 1, Key: "z.m." + kind + ".z", Op: provisioner.OpPut, Value: []byte{0xc0}, Rollup: provisioner.RollupAll}
	require.NoError(t, db.Apply(b, []provisioner.Message{all}, 0, false))
	require.Zero(t, *gets, "a rollup reads the keys it removes in order, not a Get each")
	require.EqualValues(t, 1, db.Checkpoint(b).AnomalyRows, "the rollup's own need is left")
	keys := checkAnomalySet(t, db, "after the rollup")
	require.Equal(t, map[string]byte{all.Key: classKind}, keys[b])
	checkAnomalyMemory(t, db, "after the rollup")
}

// TestDB_AnomalySetsFollowARollupStoppedBetweenParts: a whole-bucket rollup stopped after its second
// part leaves the parts before committed, and the sets follow exactly them; the store opened again
// finishes the rollup (rollupmark.go) from sets read back from the rows, with full hashes and with
// hashes most keys share.
func TestDB_AnomalySetsFollowARollupStoppedBetweenParts(t *testing.T) {
	for _, mask := range []uint64{^uint64(0), 0x3} {
		t.Run(fmt.Sprintf("%x", mask), func(t *testing.T) {
			withSharedHashes(t, mask)
			b := provisioner.BucketNeeds
			dir := t.TempDir()
			db, err := Open(dir, Options{})
			require.NoError(t, err)
			defer func() { db.Close() }()
			var msgs []provisioner.Message
			for i := range 40 {
				key := fmt.Sprintf("n%02d.m.%s.a", i, []string{"nokind", provisioner.Registry.Entries[0].Kind}[i%2])
				val := []byte{0xc0}
				switch i % 5 {
				case 1:
					val = []byte{0xc1} // not MessagePack
				case 3:
					key = fmt.Sprintf("n%02d.odd", i) // out of shape
				}
				msgs = append(msgs, provisioner.Message{Seq: uint64(i + 1), Time: 1, Key: key, Op: provisioner.OpPut, Value: val})
			}
			require.NoError(t, db.Apply(b, msgs, 0, false))
			checkAnomalySet(t, db, "before the rollup")

			parts := 0
			restore := SetRollupPart(5, func(int) error {
				if parts++; parts == 2 {
					return errors.New("stopped")
				}
				return nil
			})
			defer restore()
			all := provisioner.Message{Seq: 41, Time: 2, Key: "n99.m.nokind.z", Op: provisioner.OpPut, Value: []byte{0xc1}, Rollup: provisioner.RollupAll}
			require.Error(t, db.Apply(b, []provisioner.Message{all}, 0, false))
			keys := checkAnomalySet(t, db, "stopped after two parts")
			require.NotEmpty(t, keys[b])
			checkAnomalyMemory(t, db, "stopped after two parts")

			require.NoError(t, db.Close())
			db, err = Open(dir, Options{})
			require.NoError(t, err)
			keys = checkAnomalySet(t, db, "the rollup finished at open")
			require.Equal(t, map[string]byte{all.Key: classValue | classKind}, keys[b])
			require.EqualValues(t, 2, db.Checkpoint(b).AnomalyRows)
			checkAnomalyMemory(t, db, "the rollup finished at open")
		})
	}
}
