package store_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/store"
)

// diffState is everything a point of a bucket's log answers: the state by key (StateAt: key, revision,
// value), and what a fill of the log by sequence up to the point applies to (replay's plans as of a
// point, an export read back): its rows and, for a composed bucket, its plan rows.
type diffState struct {
	state []string
	fill  []string
	plans []string
}

// diffAll is what every point from..to of a bucket's log answers, the fill's rows and plans read
// after each point's events are applied to one store.
func diffAll(t *testing.T, db *store.DB, bucket string, from, to uint64, modules []string) []diffState {
	t.Helper()
	out := make([]diffState, to+1)
	v, err := db.View()
	require.NoError(t, err)
	defer v.Close()
	for n := from; n <= to; n++ {
		require.NoError(t, v.StateAt(bucket, "", "", n, func(k []byte, ev *store.Event) bool {
			out[n].state = append(out[n].state, fmt.Sprintf("%q@%d=%x", k, ev.Seq, ev.Value))
			return true
		}))
	}
	tmp, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer tmp.Close()
	node, composed := provisioner.ComposedNode(bucket)
	if composed {
		var msgs []provisioner.Message
		for i, mod := range modules {
			msgs = append(msgs, put(uint64(i+1), node+"."+mod, mpk(t, map[string]any{"want": "3"})))
		}
		require.NoError(t, tmp.Apply(provisioner.BucketHostModules, msgs, 0, false))
	}
	var msgs []provisioner.Message
	require.NoError(t, v.Events(bucket, 1, func(key []byte, ev *store.Event) bool {
		if ev.Seq > to {
			return false
		}
		m := ev.Message(key)
		m.Value = append([]byte(nil), m.Value...)
		msgs = append(msgs, m)
		return true
	}))
	for n := uint64(1); n <= to; n++ {
		for len(msgs) > 0 && msgs[0].Seq <= n {
			require.NoError(t, tmp.Apply(bucket, msgs[:1], 0, false))
			msgs = msgs[1:]
		}
		if n < from {
			continue
		}
		if composed {
			for _, r := range planRows(t, tmp, "", "") {
				out[n].plans = append(out[n].plans, fmt.Sprintf("%+v", r))
			}
		}
		tv, err := tmp.View()
		require.NoError(t, err)
		require.NoError(t, tv.Rows(provisioner.Range{Bucket: bucket, Index: provisioner.IndexPrimary}, func(r *provisioner.Row) bool {
			out[n].fill = append(out[n].fill, fmt.Sprintf("%q@%d=%x", r.Key, r.Revision, r.Value))
			return true
		}))
		tv.Close()
	}
	return out
}

// randomHistory applies a random history of n messages to bucket: puts, deletes, KV purges, TTL
// markers, puts that roll their own key up, and rollups that remove other keys (a wildcard with a
// literal prefix, one with the wildcard first and a literal after it, Nats-Rollup: all).
func randomHistory(t *testing.T, r *rand.Rand, db *store.DB, bucket string, keys, patterns []string, n int) uint64 {
	t.Helper()
	var batch []provisioner.Message
	flush := func() {
		if len(batch) > 0 {
			require.NoError(t, db.Apply(bucket, batch, 0, false))
			batch = batch[:0]
		}
	}
	val := func(seq uint64) []byte {
		if provisioner.IsComposedBucket(bucket) {
			status := []string{"published", "published", "refused", "pending"}[r.IntN(4)]
			return mpk(t, map[string]any{"status": status, "plan": fmt.Sprint("p", seq)})
		}
		return mpk(t, seq)
	}
	for seq := uint64(1); seq <= uint64(n); seq++ {
		k := keys[r.IntN(len(keys))]
		var m provisioner.Message
		switch x := r.IntN(20); {
		case x < 10:
			m = put(seq, k, val(seq))
		case x < 12:
			m = del(seq, k)
		case x < 13:
			m = rollup(purge(seq, k), provisioner.RollupSub)
		case x < 14:
			m = provisioner.Message{Seq: seq, Time: int64(seq) * 1e9, Key: k, Op: provisioner.OpExpire}
		case x < 15:
			m = rollup(put(seq, k, val(seq)), provisioner.RollupSub)
		case x < 19:
			m = rollup(purge(seq, patterns[r.IntN(len(patterns))]), provisioner.RollupSub)
		default:
			m = rollup(put(seq, k, val(seq)), provisioner.RollupAll)
		}
		if m.RemovesOthers() || r.IntN(3) == 0 {
			flush()
		}
		batch = append(batch, m)
	}
	flush()
	return uint64(n)
}

// TestDB_TrimDifferential: random histories with rollups of every kind, trimmed at random horizons in
// random batch sizes, some trims stopped between batches and resumed, some by a reopen of the store:
// every point at or after the floor answers exactly as it did before any trim (its state by key, and
// a fill of the log by sequence: rows and plans). TRIM_SEEDS sets how many histories each bucket runs
// (40; 8 with -short). A stop between batches stands for a crash too: each batch commits atomically.
func TestDB_TrimDifferential(t *testing.T) {
	cases := []struct {
		bucket   string
		keys     []string
		patterns []string
		modules  []string
	}{
		{provisioner.BucketApplied, []string{"n1.a", "n1.b", "n2.a", "n2.m", "n1", "n1.a.x", "n1\x00.a", "n1.\x00"},
			[]string{"n1.*", "*.a", "n1.>", "*.m", "*.>"}, nil},
		{provisioner.BucketNeeds, []string{"n1.m.k.a", "n1.m.k.b", "n2.m.k.a", "n1.x.k.a", "n1.m", "n1.m.k"},
			[]string{"*.m.>", "n1.m.>", "n1.*.k.a", "n1.m.*.*", ">"}, nil},
		{provisioner.ComposedPrefix + "n1", []string{"a.3", "a.03", "a.003", "a.1", "b.3", "b.1", "a"},
			[]string{"*.3", "a.*", "*.03", "*.*", "a.>"}, []string{"a", "b"}},
	}
	seeds := 40
	if s := os.Getenv("TRIM_SEEDS"); s != "" {
		seeds, _ = strconv.Atoi(s)
	}
	if testing.Short() {
		seeds = 8
	}
	for _, tc := range cases {
		for seed := range seeds {
			t.Run(fmt.Sprintf("%s/%d", tc.bucket, seed), func(t *testing.T) {
				r := rand.New(rand.NewPCG(uint64(seed), 81))
				dir := t.TempDir()
				db, err := store.Open(dir, store.Options{})
				require.NoError(t, err)
				defer func() { db.Close() }()
				last := randomHistory(t, r, db, tc.bucket, tc.keys, tc.patterns, 30+r.IntN(30))
				want := diffAll(t, db, tc.bucket, 1, last, tc.modules)
				answered := false
				for _, w := range want {
					answered = answered || len(w.fill) > 0 || len(w.plans) > 0
				}
				require.True(t, answered, "the fill answers rows or plans")
				floor := uint64(0)
				for trims := 0; trims < 3 && floor < last; trims++ {
					h := floor + 1 + uint64(r.IntN(int(last-floor)))
					restore := store.SetTrimBatch([]int{1, 2, 3, 5, 4096}[r.IntN(5)])
					switch r.IntN(3) {
					case 0:
						_, err = db.TrimHistory(context.Background(), tc.bucket, h, int64(h)*1e9)
						require.NoError(t, err)
					default: // stopped after some batches, resumed (after a reopen, the second time)
						ctx, cancel := context.WithCancel(context.Background())
						stopAt, batches := 1+r.IntN(4), 0
						undo := store.OnTrimBatch(func() {
							if batches++; batches == stopAt {
								cancel()
							}
						})
						_, err = db.TrimHistory(ctx, tc.bucket, h, int64(h)*1e9)
						undo()
						cancel()
						if err != nil {
							require.ErrorIs(t, err, context.Canceled)
						}
						if r.IntN(2) == 0 {
							require.NoError(t, db.Close())
							db, err = store.Open(dir, store.Options{})
							require.NoError(t, err)
						}
						_, err = db.TrimHistory(context.Background(), tc.bucket, h, int64(h)*1e9)
						require.NoError(t, err)
					}
					restore()
					floor = h
					got := diffAll(t, db, tc.bucket, floor, last, tc.modules)
					for n := floor; n <= last; n++ {
						require.Equal(t, want[n], got[n], "as of %d after trims to %d", n, floor)
					}
				}
			})
		}
	}
}

// TestDB_TrimKeepsWhatARollupRemovedBeforeItsKeptPurge: a rollup of *.3 removed a.3 while a.03 kept
// the build's published composition: the purge under a.3 forgets build 3 (one record for every
// spelling), so module a is held at its last plan kept, build 1. The trim kept that purge and pinned
// the rollup, but dropped a.3's put before it: a fill of the log by sequence (plans as of a point)
// meets the purge only through the rollup, which removes a.3 only when the fill holds it, so the
// plans as of every later point answered build 3 published again.
func TestDB_TrimKeepsWhatARollupRemovedBeforeItsKeptPurge(t *testing.T) {
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	c := provisioner.ComposedPrefix + "n1"
	pub := mpk(t, map[string]any{"status": "published", "plan": "p"})
	refused := mpk(t, map[string]any{"status": "refused", "plan": "r"})
	require.NoError(t, db.Apply(c, []provisioner.Message{put(1, "a.03", pub), put(2, "a.3", refused), put(3, "a.1", pub)}, 0, false))
	require.NoError(t, db.Apply(c, []provisioner.Message{rollup(purge(4, "*.3"), provisioner.RollupSub)}, 0, false))
	require.NoError(t, db.Apply(c, []provisioner.Message{put(5, "b.1", pub)}, 0, false))
	want := diffAll(t, db, c, 4, 5, []string{"a"})
	require.Contains(t, want[4].plans[0], "Build:1", "held at build 1 before the trim")
	for _, horizon := range []uint64{4, 5} {
		_, err = db.TrimHistory(context.Background(), c, horizon, int64(horizon)*1e9)
		require.NoError(t, err)
		got := diffAll(t, db, c, horizon, 5, []string{"a"})
		for n := horizon; n <= 5; n++ {
			require.Equal(t, want[n], got[n], "as of %d after a trim to %d", n, horizon)
		}
	}
}
