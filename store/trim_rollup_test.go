package store_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/store"
)

// logEvents counts a bucket's logged events: by sequence, and under each key (which holds the purges a
// rollup wrote under the keys it removed).
func logEvents(t *testing.T, db *store.DB, bucket string, keys ...string) (bySeq, byKey int) {
	t.Helper()
	v, err := db.View()
	require.NoError(t, err)
	defer v.Close()
	require.NoError(t, v.Events(bucket, 0, func([]byte, *store.Event) bool { bySeq++; return true }))
	for _, k := range keys {
		require.NoError(t, v.KeyHistory(bucket, k, func(*store.Event) bool { byKey++; return true }))
	}
	return bySeq, byKey
}

// TestDB_TrimBoundsTheLogUnderRepeatedRollups: the trim keeps a rollup that removed other keys while a
// key it removed still holds an event from before it (dropped, a fill of the log by sequence brings
// that key back), and was built to bound the log by the keys' count. A client that rolls its bucket
// up again and again (a put with Nats-Rollup: all, a purge of n1.*) kept every one of those rollups,
// and a purge under every key each removed, for ever: 2 events more per round, trimmed or not. Now
// the trim walks the keys a rollup removed when it meets it, drops what of them came before it (as a
// purge of theirs would), and the rollup is then an event like any other; the log stays the size of
// the keys, and the state as of every point from the floor on is unchanged.
func TestDB_TrimBoundsTheLogUnderRepeatedRollups(t *testing.T) {
	for _, tc := range []struct {
		name   string
		bucket string
		roll   func(seq uint64) provisioner.Message
	}{
		{"all", provisioner.BucketApplied, func(seq uint64) provisioner.Message {
			return rollup(put(seq, "n1.x", []byte{0xc0}), provisioner.RollupAll)
		}},
		{"wildcard", provisioner.BucketApplied, func(seq uint64) provisioner.Message {
			return rollup(provisioner.Message{Seq: seq, Time: int64(seq) * 1e9, Key: "n1.*", Op: provisioner.OpPurge}, provisioner.RollupSub)
		}},
		{"needs", provisioner.BucketNeeds, func(seq uint64) provisioner.Message {
			return rollup(provisioner.Message{Seq: seq, Time: int64(seq) * 1e9, Key: "n1.m.>", Op: provisioner.OpPurge}, provisioner.RollupSub)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			db, err := store.Open(t.TempDir(), store.Options{})
			require.NoError(t, err)
			defer db.Close()
			b := tc.bucket
			keys := []string{"n1.a", "n1.b", "n2.a"}
			if b == provisioner.BucketNeeds {
				keys = []string{"n1.m.k.a", "n1.m.k.b", "n2.m.k.a"}
			}
			seq := uint64(0)
			const rounds = 50
			var sizes []int
			for r := 0; r < rounds; r++ {
				var msgs []provisioner.Message
				for _, k := range keys {
					seq++
					msgs = append(msgs, put(seq, k, []byte{0xc0}))
				}
				require.NoError(t, db.Apply(b, msgs, 0, false))
				seq++
				require.NoError(t, db.Apply(b, []provisioner.Message{tc.roll(seq)}, 0, false))
				seq++
				require.NoError(t, db.Apply(b, []provisioner.Message{put(seq, keys[0], []byte{0xc0})}, 0, false))
				want := map[uint64][]string{}
				for n := seq - 2; n <= seq; n++ {
					want[n] = keysAt(t, db, b, n)
				}
				_, err = db.TrimHistory(ctx, b, seq-2, int64(seq-2)*1e9)
				require.NoError(t, err)
				for n := seq - 2; n <= seq; n++ {
					require.Equal(t, want[n], keysAt(t, db, b, n), "round %d: as of %d after a trim to %d", r, n, seq-2)
				}
				bySeq, byKey := logEvents(t, db, b, append(keys, "n1.x", "n1.*", "n1.m.>")...)
				sizes = append(sizes, bySeq+byKey)
			}
			t.Logf("%s: logged events (by sequence + by key) after rounds 1, 10, %d: %d, %d, %d", tc.name, rounds, sizes[0], sizes[9], sizes[rounds-1])
			require.LessOrEqual(t, sizes[rounds-1], sizes[1], fmt.Sprintf("the log grew with the rollups: %v", sizes))
		})
	}
}

// TestDB_TrimHandlesARollupsKeysInLots: the keys a rollup of a whole bucket removed (any node's user can
// send one, docs/accounts.md) are handled by the trim that meets it trimBatch at a time, each lot in a
// batch of its own, not all in the rollup's batch (a million keys' events in one Pebble batch). A trim
// stopped between two lots resumes, and leaves the log and every point from the floor on as an
// uninterrupted one does.
func TestDB_TrimHandlesARollupsKeysInLots(t *testing.T) {
	defer store.SetTrimBatch(4)()
	b := provisioner.BucketApplied
	build := func() (*store.DB, uint64) {
		db, err := store.Open(t.TempDir(), store.Options{})
		require.NoError(t, err)
		seq := uint64(0)
		var msgs []provisioner.Message
		for i := 0; i < 30; i++ {
			seq++
			msgs = append(msgs, put(seq, fmt.Sprintf("n%d.m", i%3+1)+fmt.Sprint(i), []byte{0xc0}))
		}
		require.NoError(t, db.Apply(b, msgs, 0, false))
		_, err = db.TrimHistory(context.Background(), b, seq, int64(seq)*1e9) // the keys are kept from an earlier trim
		require.NoError(t, err)
		seq++
		require.NoError(t, db.Apply(b, []provisioner.Message{rollup(put(seq, "n9.x", []byte{0xc0}), provisioner.RollupAll)}, 0, false))
		seq++
		require.NoError(t, db.Apply(b, []provisioner.Message{put(seq, "n1.m0", []byte{0xc0})}, 0, false))
		return db, seq
	}
	whole, seq := build()
	defer whole.Close()
	want := map[uint64][]string{}
	for n := seq - 1; n <= seq; n++ {
		want[n] = keysAt(t, whole, b, n)
	}
	batches := 0
	restore := store.OnTrimBatch(func() { batches++ })
	_, err := whole.TrimHistory(context.Background(), b, seq, int64(seq)*1e9)
	restore()
	require.NoError(t, err)
	require.GreaterOrEqual(t, batches, 30/4+1, "a walk of 2 events, the rollup's 30 keys in lots of 4")
	wantSeq, wantKey := logEvents(t, whole, b, "n9.x", "n1.m0")
	require.Equal(t, want[seq], keysAt(t, whole, b, seq))

	stopped, _ := build()
	defer stopped.Close()
	ctx, cancel := context.WithCancel(context.Background())
	at := batches/2 + 1 // in the middle of the rollup's lots
	batches = 0
	restore = store.OnTrimBatch(func() {
		if batches++; batches == at {
			cancel()
		}
	})
	_, err = stopped.TrimHistory(ctx, b, seq, int64(seq)*1e9)
	restore()
	require.ErrorIs(t, err, context.Canceled)
	_, err = stopped.TrimHistory(context.Background(), b, seq, int64(seq)*1e9)
	require.NoError(t, err)
	for n := seq - 1; n <= seq; n++ {
		require.Equal(t, want[n], keysAt(t, stopped, b, n), "as of %d", n)
	}
	gotSeq, gotKey := logEvents(t, stopped, b, "n9.x", "n1.m0")
	require.Equal(t, []int{wantSeq, wantKey}, []int{gotSeq, gotKey})
	v, err := stopped.View()
	require.NoError(t, err)
	defer v.Close()
	events := 0
	require.NoError(t, v.StateAt(b, "", "", seq, func([]byte, *store.Event) bool { events++; return true }))
	require.Equal(t, 2, events)
}

// TestDB_TrimStillPinsARollupAKeyKeepsThePurgeOf: the one rollup the trim keeps whatever follows it is one
// that removed a composed build's key while another spelling of the build keeps an event below it
// (a.3 removed by *.3, a.03 not): a.3 keeps its purge, which a fill of the log by sequence meets
// only through the rollup.
func TestDB_TrimStillPinsARollupAKeyKeepsThePurgeOf(t *testing.T) {
	ctx := context.Background()
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	c := provisioner.ComposedPrefix + "n1"
	pub := mpk(t, map[string]any{"status": "published", "plan": "p"})
	require.NoError(t, db.Apply(c, []provisioner.Message{put(1, "a.03", pub), put(2, "a.3", pub), put(3, "b.1", pub)}, 0, false))
	require.NoError(t, db.Apply(c, []provisioner.Message{rollup(purge(4, "*.3"), provisioner.RollupSub)}, 0, false))
	require.NoError(t, db.Apply(c, []provisioner.Message{put(5, "b.1", pub)}, 0, false))
	require.NoError(t, db.Apply(c, []provisioner.Message{rollup(purge(6, "*.3"), provisioner.RollupSub)}, 0, false))
	require.NoError(t, db.Apply(c, []provisioner.Message{put(7, "b.1", pub)}, 0, false))
	want := keysAt(t, db, c, 7)
	for _, horizon := range []uint64{5, 7} {
		_, err = db.TrimHistory(ctx, c, horizon, int64(horizon)*1e9)
		require.NoError(t, err)
		require.Equal(t, want, keysAt(t, db, c, 7))
		v, err := db.View()
		require.NoError(t, err)
		var seqs []uint64
		require.NoError(t, v.Events(c, 0, func(_ []byte, ev *store.Event) bool { seqs = append(seqs, ev.Seq); return true }))
		v.Close()
		require.Contains(t, seqs, uint64(4), "after a trim to %d: %v", horizon, seqs)
		var hist []uint64
		require.NoError(t, func() error {
			v, err := db.View()
			require.NoError(t, err)
			defer v.Close()
			return v.KeyHistory(c, "a.3", func(ev *store.Event) bool { hist = append(hist, ev.Seq); return true })
		}())
		// and its put before it, which a fill by sequence holds for the rollup to remove again.
		require.Equal(t, []uint64{2, 4}, hist, "a.3 keeps the purge the rollup wrote, after a trim to %d", horizon)
	}
}

// TestDB_TrimStepsOverARollupsKeysOnce: a key the trim has not met yet reads back what earlier trims
// kept of it, stepping back from its event; for a rollup's keys, handled in lots each committed,
// stepping back from the first key of a lot went on over the tombstones of every key the lots
// before had removed (until compacted): quadratic in the rollup's keys. A trim past a rollup of
// 250,000 keys took 24.7 million internal steps in its last quarter of lots, 100 times its first.
// Limited to the key's own events, the steps are a few per key.
func TestDB_TrimStepsOverARollupsKeysOnce(t *testing.T) {
	defer store.SetTrimBatch(64)()
	// Small memtables: the removed keys' tombstones reach the tables, as in a long trim.
	db, err := store.Open(t.TempDir(), store.Options{MemTableSize: 256 << 10})
	require.NoError(t, err)
	defer db.Close()
	b := provisioner.BucketApplied
	const keys = 4000
	var msgs []provisioner.Message
	for i := 0; i < keys; i++ {
		msgs = append(msgs, put(uint64(i+1), fmt.Sprintf("n1.m%05d", i), []byte{0xc0}))
	}
	require.NoError(t, db.Apply(b, msgs, 0, false))
	_, err = db.TrimHistory(context.Background(), b, keys, keys*1e9) // the keys are kept from an earlier trim
	require.NoError(t, err)
	require.NoError(t, db.Apply(b, []provisioner.Message{rollup(put(keys+1, "n2.x", []byte{0xc0}), provisioner.RollupAll)}, 0, false))
	var steps int
	defer store.CountTrimSteps(&steps)()
	_, err = db.TrimHistory(context.Background(), b, keys+1, (keys+1)*1e9)
	require.NoError(t, err)
	require.Equal(t, []string{"n2.x"}, keysAt(t, db, b, keys+1))
	t.Logf("%d internal steps for %d keys", steps, keys)
	require.Less(t, steps, 20*keys, "steps of the trim's history iterators")
}
