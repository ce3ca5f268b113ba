package store_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/store"
)

// foldBuilds folds a composed-<node> bucket's messages into a build record per module and build, as
// Apply does (provisioner.BuildRecord.Fold), and returns the records as of every point from..to: the
// plans as of a point read the bucket through these. A build written differently (m.0042, m.42) is one
// build, so the messages of every spelling fold into one record.
func foldBuilds(tb testing.TB, bucket string, msgs []provisioner.Message, from, to uint64) []map[string]provisioner.BuildRecord {
	tb.Helper()
	shape, ok := provisioner.ShapeOf(bucket)
	require.True(tb, ok, bucket)
	recs := map[string]provisioner.BuildRecord{}
	var out []map[string]provisioner.BuildRecord
	i := 0
	for n := from; n <= to; n++ {
		for ; i < len(msgs) && msgs[i].Seq <= n; i++ {
			m := &msgs[i]
			p, err := provisioner.ParseKey(shape, m.Key)
			if err != nil {
				continue
			}
			b := p.Module + "." + provisioner.FormatBuild(p.Build)
			r := recs[b]
			if r.Fold(m, p.Build) {
				recs[b] = r
			} else {
				delete(recs, b)
			}
		}
		at := make(map[string]provisioner.BuildRecord, len(recs))
		for k, r := range recs {
			at[k] = r
		}
		out = append(out, at)
	}
	return out
}

// logged reads every event a bucket's log keeps, in sequence order.
func logged(tb testing.TB, db *store.DB, bucket string) []provisioner.Message {
	tb.Helper()
	v, err := db.View()
	require.NoError(tb, err)
	defer v.Close()
	var out []provisioner.Message
	require.NoError(tb, v.Events(bucket, 0, func(key []byte, ev *store.Event) bool {
		out = append(out, provisioner.Message{Seq: ev.Seq, Time: ev.Time, Key: string(key), Op: ev.Op, Value: append([]byte(nil), ev.Value...)})
		return true
	}))
	return out
}

// statesOf is the state of a bucket after each of its messages: states[n] is key -> value as of n.
func statesOf(msgs []provisioner.Message) []map[string]string {
	states := []map[string]string{{}}
	for _, m := range msgs {
		next := make(map[string]string, len(states[len(states)-1])+1)
		for k, v := range states[len(states)-1] {
			next[k] = v
		}
		if m.Op == provisioner.OpPut {
			next[m.Key] = string(m.Value)
		} else {
			delete(next, m.Key)
		}
		states = append(states, next)
	}
	return states
}

// trimCounts says what a trimmed composed-<node> log keeps below its floor beyond each key's newest
// put: keys that keep a published composition below a newer event, deletes after a published one,
// and deletes or markers kept because another spelling of the build keeps an event below them.
type trimCounts struct{ pairs, deletes, forSpellings int }

func (c *trimCounts) add(o trimCounts) {
	c.pairs, c.deletes, c.forSpellings = c.pairs+o.pairs, c.deletes+o.deletes, c.forSpellings+o.forSpellings
}

// checkTrimmedComposed checks a composed-<node> bucket's log after a trim to its floor: as of every
// point from the floor on, the state is unchanged, and the build records folded from the log (every
// spelling of a build into one) are those folded from the whole history; below the floor, each key
// keeps at most three events, and a delete that follows no published composition of its key, or a
// purge or TTL marker, only when another spelling of its build had an event below it (a build written
// one way drops them as an empty log folds them: to no record).
func checkTrimmedComposed(t *testing.T, db *store.DB, bucket string, msgs []provisioner.Message, what string) trimCounts {
	t.Helper()
	m := marks(t, db, bucket)
	states := statesOf(msgs)
	log := logged(t, db, bucket)
	last := uint64(len(msgs))
	want, got := foldBuilds(t, bucket, msgs, m.Floor, last), foldBuilds(t, bucket, log, m.Floor, last)
	for n := m.Floor; n <= last; n++ {
		require.Equal(t, want[n-m.Floor], got[n-m.Floor], "%s: %s: build records as of %d, floor %d", what, bucket, n, m.Floor)
		if n == m.Floor || n%10 == 0 || n == last {
			require.Equal(t, states[n], stateAt(t, db, bucket, "", n), "%s: %s: state as of %d, floor %d", what, bucket, n, m.Floor)
		}
	}
	var c trimCounts
	if m.Trimmed < m.Floor {
		return c // the walk has not got there yet
	}
	shape, _ := provisioner.ShapeOf(bucket)
	buildOf := func(p provisioner.Parts) string { return p.Module + "." + provisioner.FormatBuild(p.Build) }
	// spelt: module.build -> spelling -> its first sequence in the whole history.
	spelt := map[string]map[string]uint64{}
	for _, ev := range msgs {
		if p, err := provisioner.ParseKey(shape, ev.Key); err == nil {
			if spelt[buildOf(p)] == nil {
				spelt[buildOf(p)] = map[string]uint64{}
			}
			if _, ok := spelt[buildOf(p)][ev.Key]; !ok {
				spelt[buildOf(p)][ev.Key] = ev.Seq
			}
		}
	}
	below := map[string]int{}
	published := map[string]bool{}
	for _, ev := range log {
		if ev.Seq > m.Floor {
			continue
		}
		below[ev.Key]++
		require.LessOrEqual(t, below[ev.Key], 3, "%s: %s: at most the newest event, a published one and a marker of %s below the floor", what, bucket, ev.Key)
		if below[ev.Key] > 1 {
			c.pairs++
		}
		p, err := provisioner.ParseKey(shape, ev.Key)
		if err != nil {
			require.Equal(t, provisioner.OpPut, ev.Op, "%s: %s: a key out of shape keeps its newest put only", what, bucket)
			continue
		}
		others := 0
		for k, first := range spelt[buildOf(p)] {
			if k != ev.Key && first < ev.Seq {
				others++
			}
		}
		switch {
		case ev.Op == provisioner.OpPut:
			published[ev.Key] = published[ev.Key] || provisioner.PublishesPlan(&ev)
		case ev.Op == provisioner.OpDelete && published[ev.Key]:
			c.deletes++
		default:
			require.Positive(t, others, "%s: %s: %s keeps a delete or marker at %d, its build never written otherwise below it", what, bucket, ev.Key, ev.Seq)
			c.forSpellings++
			if ev.Op != provisioner.OpDelete {
				published[ev.Key] = false
			}
		}
	}
	return c
}

// TestDB_TrimHistoryKeepsTheLastPlanKept: trimming a composed-<node> bucket keeps, of every key, the
// newest published composition beside the newest event, so that the plans as of any point from the
// floor on, rebuilt from the log, find the plan a refusal, a pending composition or a delete left
// kept, and forget what a purge forgot.
func TestDB_TrimHistoryKeepsTheLastPlanKept(t *testing.T) {
	for _, batch := range []int{4096, 3} {
		for seed := uint64(1); seed <= 4; seed++ {
			t.Run(fmt.Sprintf("batch %d seed %d", batch, seed), func(t *testing.T) {
				defer store.SetTrimBatch(batch)()
				db, err := store.OpenState(t.TempDir(), store.Options{})
				require.NoError(t, err)
				defer db.Close()
				hist := randomPlanHistory(t, seed, 900)
				for b, msgs := range hist {
					require.NoError(t, db.Apply(b, msgs, 1, false))
				}
				var c trimCounts
				for b, msgs := range hist {
					if _, ok := provisioner.ComposedNode(b); !ok {
						continue
					}
					last := uint64(len(msgs))
					for _, h := range []uint64{last / 4, last/4 + 1, last / 2, last - 1, last} {
						_, err := db.TrimHistory(context.Background(), b, h, int64(h)*1e9)
						require.NoError(t, err)
						c.add(checkTrimmedComposed(t, db, b, msgs, fmt.Sprintf("trimmed to %d", h)))
					}
				}
				require.Positive(t, c.pairs, "some key keeps a published composition below a newer event")
				require.Positive(t, c.deletes, "some key keeps a delete after its published composition")
				require.Positive(t, c.forSpellings, "some key keeps a delete or marker for another spelling of its build")
			})
		}
	}
}

// TestDB_InterruptedTrimKeepsTheLastPlanKept: a trim of a composed-<node> bucket stopped part way is
// exact, and the trim that resumes it finds the published compositions the first batches kept.
func TestDB_InterruptedTrimKeepsTheLastPlanKept(t *testing.T) {
	defer store.SetTrimBatch(4)()
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	hist := randomPlanHistory(t, 7, 900)
	const b = provisioner.ComposedPrefix + "n2"
	msgs := hist[b]
	require.NoError(t, db.Apply(b, msgs, 1, false))
	last := uint64(len(msgs))

	// A first trim, finished, so that the interrupted one walks on from a compacted log.
	_, err = db.TrimHistory(context.Background(), b, last/3, int64(last/3)*1e9)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // stops after the first batch
	_, err = db.TrimHistory(ctx, b, last-2, int64(last-2)*1e9)
	require.ErrorIs(t, err, context.Canceled)
	m := marks(t, db, b)
	require.Equal(t, last-2, m.Floor, "the floor is committed first")
	require.Less(t, m.Trimmed, m.Floor, "the walk stopped part way")
	checkTrimmedComposed(t, db, b, msgs, "mid-trim")

	// The next trim, even to an older horizon, finishes this one.
	_, err = db.TrimHistory(context.Background(), b, 1, 1e9)
	require.NoError(t, err)
	m = marks(t, db, b)
	require.Equal(t, last-2, m.Trimmed)
	c := checkTrimmedComposed(t, db, b, msgs, "resumed")
	require.Positive(t, c.pairs, "some key keeps a published composition below a newer event")
	require.Positive(t, c.forSpellings, "some key keeps a delete or marker for another spelling of its build")
}

// TestDB_TrimHistoryOfOtherBucketsKeepsOnlyTheNewestPut: the plans' other inputs, and the
// provisioner's buckets, keep at most one event per key below the floor, a put, however their values
// read: only composed-<node> keys keep a published composition.
func TestDB_TrimHistoryOfOtherBucketsKeepsOnlyTheNewestPut(t *testing.T) {
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	published := mpk(t, map[string]any{"status": "published", "plan": 1})
	refused := mpk(t, map[string]any{"status": "refused"})
	for _, b := range []string{provisioner.BucketHostModules, provisioner.BucketNeeds, provisioner.BucketRegistry} {
		key := map[string]string{provisioner.BucketHostModules: "n1.m", provisioner.BucketNeeds: "n1.m.config.a", provisioner.BucketRegistry: "config"}[b]
		require.NoError(t, db.Apply(b, []provisioner.Message{
			put(1, key, published), put(2, key, refused), put(3, key+"x", published), del(4, key+"x"),
		}, 1, false))
		_, err := db.TrimHistory(context.Background(), b, 4, 4e9)
		require.NoError(t, err)
		var seqs []uint64
		for _, ev := range logged(t, db, b) {
			seqs = append(seqs, ev.Seq)
		}
		require.Equal(t, []uint64{2}, seqs, "%s: the newest put of each key, and nothing of a deleted key", b)
	}
	// A composed-<node> key out of shape (its build is no number) has no build record either.
	b := provisioner.ComposedPrefix + "n1"
	require.NoError(t, db.Apply(b, []provisioner.Message{
		put(1, "m.latest", published), put(2, "m.latest", refused), put(3, "m.7", published), put(4, "m.7", refused),
	}, 1, false))
	_, err = db.TrimHistory(context.Background(), b, 4, 4e9)
	require.NoError(t, err)
	var seqs []uint64
	for _, ev := range logged(t, db, b) {
		seqs = append(seqs, ev.Seq)
	}
	require.Equal(t, []uint64{2, 3, 4}, seqs, "m.latest keeps its newest put; m.7 its published composition too")
}

// TestDB_TrimOfALongHistoryStepsEachEventOnce: a trim of one key's long history, in many batches,
// steps Pebble's iterator a few times per event. Each batch used to read back what the batches before
// it kept of the key by stepping over the tombstones of every event they dropped: 4,000 events in
// batches of 100 took about 80,000 steps (quadratic in the history's length).
func TestDB_TrimOfALongHistoryStepsEachEventOnce(t *testing.T) {
	defer store.SetTrimBatch(100)()
	var steps int
	defer store.CountTrimSteps(&steps)()
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	const n = 4000
	var msgs []provisioner.Message
	for i := uint64(1); i <= n; i++ {
		msgs = append(msgs, put(i, "n1.m.config.often", []byte{0x01}))
	}
	require.NoError(t, db.Apply(provisioner.BucketNeeds, msgs, 1, false))
	deleted, err := db.TrimHistory(context.Background(), provisioner.BucketNeeds, n, n*1e9)
	require.NoError(t, err)
	require.Equal(t, n-1, deleted)
	require.Less(t, steps, 4*n, "iterator steps for a trim of %d events", n)
	v, err := db.View()
	require.NoError(t, err)
	defer v.Close()
	ev, ok, err := v.KeyAt(provisioner.BucketNeeds, "n1.m.config.often", n)
	require.NoError(t, err)
	require.True(t, ok)
	require.EqualValues(t, n, ev.Seq)
}
