package store_test

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/store"
)

func mpk(tb testing.TB, v any) []byte {
	tb.Helper()
	b, err := msgpack.Marshal(v)
	require.NoError(tb, err)
	return b
}

// planRows reads every plan row narrowed by node and module, with its plans copied.
func planRows(tb testing.TB, db *store.DB, node, module string) []provisioner.PlanRow {
	tb.Helper()
	v, err := db.View()
	require.NoError(tb, err)
	defer v.Close()
	var out []provisioner.PlanRow
	require.NoError(tb, v.Plans(node, module, "", func(r *provisioner.PlanRow) bool {
		c := *r
		c.Current.From.Plan = append([]byte(nil), r.Current.From.Plan...)
		c.Newest.From.Plan = append([]byte(nil), r.Newest.From.Plan...)
		out = append(out, c)
		return true
	}))
	return out
}

// normalize makes rows comparable: an absent plan and an empty one are alike.
func normalize(rows []provisioner.PlanRow) []provisioner.PlanRow {
	out := make([]provisioner.PlanRow, len(rows))
	for i, r := range rows {
		if len(r.Current.From.Plan) == 0 {
			r.Current.From.Plan = nil
		}
		if len(r.Newest.From.Plan) == 0 {
			r.Newest.From.Plan = nil
		}
		out[i] = r
	}
	return out
}

// randomPlanHistory makes a history of the plans' input buckets: host modules set and deleted, newest
// builds moving, compositions published, refused, pending, overwritten, deleted and purged, and
// values out of shape. Each bucket's messages are numbered from 1.
func randomPlanHistory(tb testing.TB, seed uint64, n int) map[string][]provisioner.Message {
	r := rand.New(rand.NewPCG(seed, seed+1))
	nodes := []string{"n1", "n2", "n3"}
	modules := []string{"m1", "m2", "m3"}
	out := map[string][]provisioner.Message{}
	add := func(bucket, key string, op provisioner.Op, v []byte) {
		seq := uint64(len(out[bucket]) + 1)
		out[bucket] = append(out[bucket], provisioner.Message{Seq: seq, Time: int64(seq) * 1e9, Key: key, Op: op, Value: v})
	}
	build := func() any {
		switch r.IntN(10) {
		case 0:
			return nil
		case 1:
			return "bad"
		case 2:
			return fmt.Sprint(1 + r.IntN(6))
		}
		return 1 + r.IntN(6)
	}
	for i := 0; i < n; i++ {
		node, module := nodes[r.IntN(len(nodes))], modules[r.IntN(len(modules))]
		switch k := r.IntN(20); {
		case k < 3:
			v := map[string]any{}
			if w := build(); w != nil {
				v["want"] = w
			}
			if h := build(); h != nil {
				v["have"] = h
			}
			add(provisioner.BucketHostModules, node+"."+module, provisioner.OpPut, mpk(tb, v))
		case k == 3:
			add(provisioner.BucketHostModules, node+"."+module, provisioner.OpDelete, nil)
		case k == 4:
			add(provisioner.BucketIndexerBuilds, module, provisioner.OpPut, mpk(tb, map[string]any{"newest": build()}))
		case k == 5 && r.IntN(4) == 0:
			add(provisioner.BucketIndexerBuilds, module, provisioner.OpPurge, nil)
		default:
			bucket := provisioner.ComposedPrefix + node
			// A build is written 4, 04 or 004 now and then: one build, whose newest message of any
			// spelling is the composition at it.
			key := fmt.Sprintf("%s.%s%d", module, [...]string{"", "", "", "", "0", "00"}[r.IntN(6)], 1+r.IntN(6))
			switch j := r.IntN(20); {
			case j < 8:
				add(bucket, key, provisioner.OpPut, mpk(tb, map[string]any{"status": "published", "plan": map[string]any{"i": i, "key": key}}))
			case j < 12:
				add(bucket, key, provisioner.OpPut, mpk(tb, map[string]any{"status": "refused", "plan": i}))
			case j < 15:
				add(bucket, key, provisioner.OpPut, mpk(tb, map[string]any{"status": "pending"}))
			case j == 15:
				add(bucket, key, provisioner.OpPut, mpk(tb, map[string]any{"status": "done"}))
			case j == 16:
				add(bucket, key, provisioner.OpPut, []byte{0xc1})
			case j == 17:
				add(bucket, key, provisioner.OpDelete, nil)
			case j == 18:
				add(bucket, key, provisioner.OpPurge, nil)
			default:
				add(bucket, module+".latest", provisioner.OpPut, mpk(tb, map[string]any{"status": "published"}))
			}
		}
	}
	return out
}

// TestPlans_IncrementalEqualsFromScratch applies random histories in random batches, bucket by bucket
// in a random interleaving, and compares the incremental projection, after every batch, with the
// plans computed from scratch over the same messages. A row the projection forgot to recompute, or
// recomputed from stale inputs, shows here.
func TestPlans_IncrementalEqualsFromScratch(t *testing.T) {
	for seed := uint64(1); seed <= 8; seed++ {
		t.Run(fmt.Sprint("seed ", seed), func(t *testing.T) {
			hist := randomPlanHistory(t, seed, 600)
			db, err := store.Open(t.TempDir(), store.Options{})
			require.NoError(t, err)
			defer db.Close()
			ref := provisioner.NewPlanInputs()
			r := rand.New(rand.NewPCG(seed, 99))
			pos := map[string]int{}
			var buckets []string
			for b := range hist {
				buckets = append(buckets, b)
			}
			for {
				var open []string
				for _, b := range buckets {
					if pos[b] < len(hist[b]) {
						open = append(open, b)
					}
				}
				if len(open) == 0 {
					break
				}
				b := open[r.IntN(len(open))]
				n := min(1+r.IntN(12), len(hist[b])-pos[b])
				batch := hist[b][pos[b] : pos[b]+n]
				pos[b] += n
				require.NoError(t, db.Apply(b, batch, 1, false))
				for i := range batch {
					ref.Apply(b, &batch[i])
				}
				want, err := ref.Plans()
				require.NoError(t, err)
				require.Equal(t, normalize(want), normalize(planRows(t, db, "", "")), "after %d messages of %s", pos[b], b)
			}
			// Narrowing reads the same rows.
			all := planRows(t, db, "", "")
			require.NotEmpty(t, all)
			for _, node := range []string{"n1", "n2", "n3"} {
				for _, module := range []string{"", "m1", "m2"} {
					var want []provisioner.PlanRow
					for _, row := range all {
						if row.Node == node && (module == "" || row.Module == module) {
							want = append(want, row)
						}
					}
					require.Equal(t, normalize(want), normalize(planRows(t, db, node, module)), "node %s module %s", node, module)
				}
			}
			for _, module := range []string{"m1", "m2", "m3"} {
				var want []provisioner.PlanRow
				for _, row := range all {
					if row.Module == module {
						want = append(want, row)
					}
				}
				require.Equal(t, normalize(want), normalize(planRows(t, db, "", module)), "module %s", module)
			}
		})
	}
}

// TestPlans_ReopenKeepsKeptPlans: the last plan kept is the projection's state, on disk.
func TestPlans_ReopenKeepsKeptPlans(t *testing.T) {
	dir := t.TempDir()
	db, err := store.Open(dir, store.Options{})
	require.NoError(t, err)
	require.NoError(t, db.Apply("composed-n1", []provisioner.Message{
		put(1, "m.5", mpk(t, map[string]any{"status": "published", "plan": "p5"})),
		put(2, "m.5", mpk(t, map[string]any{"status": "refused"})),
	}, 1, false))
	require.NoError(t, db.Apply(provisioner.BucketHostModules, []provisioner.Message{put(1, "n1.m", mpk(t, map[string]any{"want": 5}))}, 1, false))
	before := planRows(t, db, "", "")
	require.Len(t, before, 1)
	require.Equal(t, provisioner.EntryHeld, before[0].Current.Status)
	require.True(t, before[0].Current.HasPlan)
	require.NoError(t, db.Close())

	db, err = store.Open(dir, store.Options{})
	require.NoError(t, err)
	defer db.Close()
	require.Equal(t, before, planRows(t, db, "", ""))
	// A new newest build recomputes from the state on disk: the kept plan is still found.
	require.NoError(t, db.Apply(provisioner.BucketHostModules, []provisioner.Message{put(2, "n1.m", mpk(t, map[string]any{"want": 6}))}, 1, false))
	after := planRows(t, db, "", "")
	require.Equal(t, uint64(1), after[0].Current.From.Revision, "the published revision that the refusal overwrote")
}

// TestPlans_RecomputesOnlyTouchedRows counts rows recomputed: a composition touches its own row, a
// want/have its own row, a newest build its module's rows on every node, and nothing else.
func TestPlans_RecomputesOnlyTouchedRows(t *testing.T) {
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	const nodes, modules = 30, 5
	var host []provisioner.Message
	for n := 0; n < nodes; n++ {
		var comps []provisioner.Message
		for m := 0; m < modules; m++ {
			host = append(host, put(uint64(len(host)+1), fmt.Sprintf("n%d.m%d", n, m), mpk(t, map[string]any{"want": 10, "have": 9})))
			comps = append(comps, put(uint64(len(comps)+1), fmt.Sprintf("m%d.10", m), mpk(t, map[string]any{"status": "published", "plan": n})))
		}
		require.NoError(t, db.Apply(fmt.Sprintf("composed-n%d", n), comps, 1, false))
	}
	require.NoError(t, db.Apply(provisioner.BucketHostModules, host, 1, false))
	var idx []provisioner.Message
	for m := 0; m < modules; m++ {
		idx = append(idx, put(uint64(m+1), fmt.Sprintf("m%d", m), mpk(t, map[string]any{"newest": 10})))
	}
	require.NoError(t, db.Apply(provisioner.BucketIndexerBuilds, idx, 1, false))

	count := func(f func()) int64 {
		before := db.PlanStats().RowsRecomputed
		f()
		return db.PlanStats().RowsRecomputed - before
	}
	require.EqualValues(t, 1, count(func() {
		require.NoError(t, db.Apply("composed-n7", []provisioner.Message{put(modules+1, "m3.11", mpk(t, map[string]any{"status": "published", "plan": "new"}))}, 1, false))
	}), "one composition: its own row")
	require.EqualValues(t, 1, count(func() {
		require.NoError(t, db.Apply("composed-n7", []provisioner.Message{
			put(modules+2, "m3.12", mpk(t, map[string]any{"status": "pending"})),
			put(modules+3, "m3.12", mpk(t, map[string]any{"status": "published", "plan": "x"})),
		}, 1, false))
	}), "a batch of compositions of one module: its row once")
	require.EqualValues(t, 1, count(func() {
		require.NoError(t, db.Apply(provisioner.BucketHostModules, []provisioner.Message{put(uint64(len(host)+1), "n7.m3", mpk(t, map[string]any{"want": 11}))}, 1, false))
	}), "one want: its own row")
	require.EqualValues(t, nodes, count(func() {
		require.NoError(t, db.Apply(provisioner.BucketIndexerBuilds, []provisioner.Message{put(modules+1, "m2", mpk(t, map[string]any{"newest": 12}))}, 1, false))
	}), "one newest build: its module's row on every node")

	rows := planRows(t, db, "n7", "m3")
	require.Len(t, rows, 1)
	require.Equal(t, provisioner.Some(11), rows[0].Want)
	require.Equal(t, uint64(11), rows[0].Current.From.Build)
	require.Len(t, planRows(t, db, "", "m2"), nodes)
}

// TestPlans_Anomalies: keys and values of the plans' inputs out of shape are anomaly rows with the
// contract's reasons, and a later put that fits clears them.
func TestPlans_Anomalies(t *testing.T) {
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	require.NoError(t, db.Apply("composed-n1", []provisioner.Message{
		put(1, "m.latest", mpk(t, map[string]any{"status": "published"})),
		put(2, "m", mpk(t, map[string]any{"status": "published"})),
		put(3, "m.4", mpk(t, map[string]any{"status": "done"})),
		put(4, "m.5", mpk(t, map[string]any{"plan": 1})),
		put(5, "m.6", []byte{0xc1}),
		put(6, "m.7", mpk(t, map[string]any{"status": "published"})),
	}, 1, false))
	require.NoError(t, db.Apply(provisioner.BucketHostModules, []provisioner.Message{
		put(1, "n1.m", mpk(t, map[string]any{"want": "1.5", "have": 7})),
		put(2, "n1", mpk(t, map[string]any{})),
	}, 1, false))
	require.NoError(t, db.Apply(provisioner.BucketIndexerBuilds, []provisioner.Message{
		put(1, "m", mpk(t, map[string]any{"newest": -3})),
		put(2, "m.x", mpk(t, map[string]any{"newest": 3})),
	}, 1, false))
	got, total := anomalies(t, db, "composed-n1", "")
	require.Equal(t, []string{"m token-count", "m.4 bad-value", "m.5 bad-value", "m.6 value-not-msgpack", "m.latest bad-build"}, got)
	require.EqualValues(t, 5, total)
	got, _ = anomalies(t, db, provisioner.BucketHostModules, "n1")
	require.Equal(t, []string{"n1 token-count", "n1.m bad-value"}, got)
	got, _ = anomalies(t, db, provisioner.BucketIndexerBuilds, "")
	require.Equal(t, []string{"m bad-value", "m.x token-count"}, got)

	// The row still answers, with the want out of shape read as absent.
	rows := planRows(t, db, "", "")
	require.Len(t, rows, 1)
	require.False(t, rows[0].Want.Set)
	require.Equal(t, provisioner.Some(7), rows[0].Have)
	require.Equal(t, provisioner.EntryPublished, rows[0].Current.Status)

	require.NoError(t, db.Apply("composed-n1", []provisioner.Message{
		put(7, "m.4", mpk(t, map[string]any{"status": "pending"})),
		del(8, "m.latest"),
	}, 1, false))
	require.NoError(t, db.Apply(provisioner.BucketHostModules, []provisioner.Message{put(3, "n1.m", mpk(t, map[string]any{"want": 7}))}, 1, false))
	got, _ = anomalies(t, db, "composed-n1", "")
	require.Equal(t, []string{"m token-count", "m.5 bad-value", "m.6 value-not-msgpack"}, got)
	got, _ = anomalies(t, db, provisioner.BucketHostModules, "n1")
	require.Equal(t, []string{"n1 token-count"}, got)
}
