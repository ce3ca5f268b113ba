package store

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"slices"
	"syscall"
	"testing"

	"github.com/cockroachdb/pebble/v2"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
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

// TestSortedWrites_KeyOrder checks writeTo against a stable sort of the whole keys: keys that share
// long prefixes, agree on the 16 bytes it sorts by or end within them, hold 0x00 and 0xff bytes, are
// prefixes of one another, or repeat (their writes keep their order, so the last one wins).
func TestSortedWrites_KeyOrder(t *testing.T) {
	db, err := Open(t.TempDir(), Options{})
	require.NoError(t, err)
	defer db.Close()
	r := rand.New(rand.NewPCG(3, 3))
	alphabet := []byte{0x00, 0x01, 'a', 'b', 0xff}
	for round := 0; round < 50; round++ {
		var w sortedWrites
		type op struct {
			key, val []byte
			del      bool
		}
		var ops []op
		var keys [][]byte
		for n := r.IntN(600); len(ops) < n; {
			var k []byte
			switch {
			case len(keys) > 0 && r.IntN(4) == 0: // the same key again
				k = keys[r.IntN(len(keys))]
			case len(keys) > 0 && r.IntN(2) == 0: // a prefix of another, or one more byte or more
				k = append([]byte(nil), keys[r.IntN(len(keys))]...)
				if r.IntN(2) == 0 {
					k = k[:1+r.IntN(len(k))]
				}
				for range r.IntN(20) {
					k = append(k, alphabet[r.IntN(len(alphabet))])
				}
			default:
				k = []byte{[]byte{3, 4, 6, 7}[r.IntN(4)]}
				for range r.IntN(40) {
					k = append(k, alphabet[r.IntN(len(alphabet))])
				}
			}
			keys = append(keys, k)
			o := op{key: k, del: r.IntN(5) == 0}
			if o.del {
				w.delete(o.key)
			} else {
				o.val = fmt.Appendf(nil, "%d", len(ops))
				w.set(o.key, o.val)
			}
			ops = append(ops, o)
		}
		want := slices.Clone(ops)
		slices.SortStableFunc(want, func(x, y op) int { return bytes.Compare(x.key, y.key) })

		b := db.pdb.NewBatch()
		require.NoError(t, w.writeTo(b))
		var got []op
		for rd := b.Reader(); ; {
			kind, k, v, ok, err := rd.Next()
			require.NoError(t, err)
			if !ok {
				break
			}
			o := op{key: slices.Clone(k), del: kind == pebble.InternalKeyKindDelete}
			if !o.del {
				o.val = slices.Clone(v)
			}
			got = append(got, o)
		}
		require.NoError(t, b.Close())
		str := func(ops []op) []string {
			var s []string
			for _, o := range ops {
				s = append(s, fmt.Sprintf("%x del=%t %s", o.key, o.del, o.val))
			}
			return s
		}
		require.Equal(t, str(want), str(got), "round %d", round)
	}
}

// BenchmarkSortedWrites_Needs hands one catch-up batch's writes (4,096 needs of a 400-node mesh, the
// projector's batch) to a Pebble batch in key order: the sort and the copy, without the commit.
// Run using: go test ./store -run x -bench SortedWrites -benchtime 200x
func BenchmarkSortedWrites_Needs(b *testing.B) {
	db, err := Open(b.TempDir(), Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer db.Close()
	a := db.newApplier()
	defer a.close()
	shape, _ := provisioner.ShapeOf(provisioner.BucketNeeds)
	ops := (fixtures.Mesh{Seed: 1, Nodes: 400, Modules: 25, NeedsPerModule: 10}).OpsOf(provisioner.BucketNeeds)
	for i, op := range ops[50000 : 50000+4096] {
		m := provisioner.Message{Seq: uint64(50001 + i), Time: int64(i) * 1e6, Key: op.Key, Op: provisioner.OpPut, Value: op.Value}
		if err := a.apply(shape, &m); err != nil {
			b.Fatal(err)
		}
	}
	batch := db.pdb.NewBatch(pebble.WithMaxRetainedSizeBytes(16 << 20)) // as newApplier's
	defer batch.Close()
	b.ResetTimer()
	var ru0, ru1 syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru0)
	for i := 0; i < b.N; i++ {
		batch.Reset()
		if err := a.w.writeTo(batch); err != nil {
			b.Fatal(err)
		}
	}
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru1)
	cpu := ru1.Utime.Nano() + ru1.Stime.Nano() - ru0.Utime.Nano() - ru0.Stime.Nano()
	// CPU time is steadier than wall time on a shared machine.
	b.ReportMetric(float64(cpu)/1e3/4096/float64(b.N), "cpu-µs/msg")
}
