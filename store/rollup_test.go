package store_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"testing"

	"github.com/cockroachdb/pebble/v2"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/store"
)

// keysAt lists the keys of a bucket as of n, in byte order.
func keysAt(t *testing.T, db *store.DB, bucket string, n uint64) []string {
	t.Helper()
	keys := slices.Collect(maps.Keys(stateAt(t, db, bucket, "", n)))
	slices.Sort(keys)
	return keys
}

func rollup(m provisioner.Message, r provisioner.Rollup) provisioner.Message {
	m.Rollup = r
	return m
}

// TestDB_ARollupOfAWildcardRemovesTheKeysItMatches: NATS stores a message published on
// $KV.<bucket>.n1.m.k.* as it is, and its Nats-Rollup: sub purges every subject the wildcard matches
// (Nats-Rollup: all, the whole stream). Those keys are gone from the stream, so from the bucket and
// from a rebuild; the projection kept them, answering keys the bucket no longer holds. Now each is
// removed as a purge at the rollup's sequence: its row, its anomalies, and, as of a point, from then
// on; a rollup of a literal key (a KV purge) removes that key alone.
func TestDB_ARollupOfAWildcardRemovesTheKeysItMatches(t *testing.T) {
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	b := provisioner.BucketNeeds
	all := provisioner.Range{Bucket: b, Index: provisioner.IndexPrimary}
	// One batch: the rollup is applied after the puts before it, which it removes.
	require.NoError(t, db.Apply(b, []provisioner.Message{
		put(1, "n2.m.config.a", []byte{0xc0}),
		put(2, "n1.m.config.a", []byte{0xc0}),
		put(3, "n1.m.config.b", []byte{0xc1}), // a value anomaly
		put(4, "n1.x", []byte{0xc0}),          // out of shape
		put(5, "n1.m.secret.c", []byte{0xc0}),
		rollup(purge(6, "n1.m.config.*"), provisioner.RollupSub),
		put(7, "n1.m.config.d", []byte{0xc0}), // after the rollup: kept
	}, 0, false))
	require.Equal(t, []string{"n1.m.config.d", "n1.m.secret.c", "n2.m.config.a"}, rows(t, db, all))
	anoms, total := anomalies(t, db, b, "")
	require.Equal(t, []string{"n1.m.config.d unanswered-kind", "n1.m.secret.c unanswered-kind", "n1.x token-count", "n2.m.config.a unanswered-kind"}, anoms)
	require.EqualValues(t, 4, total)
	require.Equal(t, []string{"n1.m.config.a", "n1.m.config.b", "n1.m.secret.c", "n1.x", "n2.m.config.a"}, keysAt(t, db, b, 5), "before the rollup")
	require.Equal(t, []string{"n1.m.secret.c", "n1.x", "n2.m.config.a"}, keysAt(t, db, b, 6), "as of the rollup")

	// A put on n1.> with a rollup: every key of n1 but itself, out of shape as it is.
	require.NoError(t, db.Apply(b, []provisioner.Message{rollup(put(8, "n1.>", []byte{0xc0}), provisioner.RollupSub)}, 0, false))
	require.Equal(t, []string{"n2.m.config.a"}, rows(t, db, all))
	anoms, _ = anomalies(t, db, b, "n1")
	require.Equal(t, []string{"n1.> token-count"}, anoms)

	// A KV purge of a literal key is that key's alone.
	require.NoError(t, db.Apply(b, []provisioner.Message{put(9, "n3.m.config.a", []byte{0xc0}), rollup(purge(10, "n3.m.config"), provisioner.RollupSub)}, 0, false))
	require.Equal(t, []string{"n2.m.config.a", "n3.m.config.a"}, rows(t, db, all))

	// A rollup of the whole stream leaves its own key alone.
	require.NoError(t, db.Apply(b, []provisioner.Message{rollup(put(11, "n4.m.config.a", []byte{0xc0}), provisioner.RollupAll)}, 0, false))
	require.Equal(t, []string{"n4.m.config.a"}, rows(t, db, all))
	anoms, total = anomalies(t, db, b, "")
	require.Equal(t, []string{"n4.m.config.a unanswered-kind"}, anoms)
	require.EqualValues(t, 1, total, "the anomaly count follows")

	// The log keeps each removal under its key, and the rollup under the message's own.
	v, err := db.View()
	require.NoError(t, err)
	defer v.Close()
	var ops []string
	require.NoError(t, v.KeyHistory(b, "n1.m.config.a", func(ev *store.Event) bool {
		ops = append(ops, ev.Op.String())
		return true
	}))
	require.Equal(t, []string{"PUT", "PURGE"}, ops)
	var rollups []provisioner.Rollup
	require.NoError(t, v.Events(b, 1, func(key []byte, ev *store.Event) bool {
		rollups = append(rollups, ev.Rollup)
		return true
	}))
	require.Equal(t, []provisioner.Rollup{0, 0, 0, 0, 0, provisioner.RollupSub, 0, provisioner.RollupSub, 0, 0, provisioner.RollupAll}, rollups,
		"a rollup is kept where it removed other keys")
}

// TestPlans_ARollupOfAWildcardForgetsTheBuildsItPurged: in a composed-<node> bucket the keys a
// wildcard rollup removed are purged builds, as a rebuild reads the stream after the rollup: the plan
// rows equal those of a store that read only what the stream still holds.
func TestPlans_ARollupOfAWildcardForgetsTheBuildsItPurged(t *testing.T) {
	c := provisioner.ComposedPrefix + "n1"
	comp := func(status, plan string) []byte {
		return mpk(t, map[string]any{"status": status, "plan": plan})
	}
	hosts := []provisioner.Message{put(1, "n1.m1", mpk(t, map[string]any{"want": 2})), put(2, "n1.m2", mpk(t, map[string]any{"want": 1}))}
	live, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer live.Close()
	require.NoError(t, live.Apply(provisioner.BucketHostModules, hosts, 0, false))
	require.NoError(t, live.Apply(c, []provisioner.Message{
		put(1, "m1.1", comp("published", "m1 1")),
		put(2, "m1.2", comp("published", "m1 2")),
		put(3, "m2.1", comp("published", "m2 1")),
		rollup(purge(4, "m1.*"), provisioner.RollupSub),
	}, 0, false))
	rebuilt, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer rebuilt.Close()
	require.NoError(t, rebuilt.Apply(provisioner.BucketHostModules, hosts, 0, false))
	require.NoError(t, rebuilt.Apply(c, []provisioner.Message{
		put(3, "m2.1", comp("published", "m2 1")),
		rollup(purge(4, "m1.*"), provisioner.RollupSub),
	}, 0, false))
	want := normalize(planRows(t, rebuilt, "", ""))
	require.Len(t, want, 2)
	require.Equal(t, want, normalize(planRows(t, live, "", "")))
	require.Equal(t, provisioner.EntryHeld, want[0].Current.Status)
	require.False(t, want[0].Current.HasPlan, "m1 has no plan left")
}

// TestDB_TrimKeepsWhatARollupRemoved: a trim past a rollup leaves every point from the floor as it
// was: the removed keys stay removed.
func TestDB_TrimKeepsWhatARollupRemoved(t *testing.T) {
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	b := provisioner.BucketApplied
	require.NoError(t, db.Apply(b, []provisioner.Message{
		put(1, "n1.a", []byte{0xc0}),
		put(2, "n1.b", []byte{0xc0}),
		put(3, "n2.a", []byte{0xc0}),
		rollup(del(4, "n1.*"), provisioner.RollupSub),
		put(5, "n1.c", []byte{0xc0}),
		put(6, "n2.b", []byte{0xc0}),
	}, 0, false))
	want := map[uint64][]string{}
	for n := uint64(4); n <= 6; n++ {
		want[n] = keysAt(t, db, b, n)
	}
	require.Equal(t, []string{"n1.c", "n2.a", "n2.b"}, want[6])
	for _, horizon := range []uint64{4, 5} {
		_, err = db.TrimHistory(context.Background(), b, horizon, int64(horizon)*1e9)
		require.NoError(t, err)
		for n := horizon; n <= 6; n++ {
			require.Equal(t, want[n], keysAt(t, db, b, n), "as of %d after a trim to %d", n, horizon)
		}
	}
}

// schemaOf reads the schema version a closed state dir holds, as an older binary would.
func schemaOf(t *testing.T, dir string) string {
	t.Helper()
	db, err := store.OpenState(dir, store.Options{})
	require.NoError(t, err)
	gen := db.Dir()
	require.NoError(t, db.Close())
	pdb, err := pebble.Open(gen, &pebble.Options{})
	require.NoError(t, err)
	defer pdb.Close()
	v, closer, err := pdb.Get([]byte("\x01schema"))
	require.NoError(t, err)
	defer closer.Close()
	return string(v)
}

// TestOpenState_ARollupInTheLogMarksTheSchema: the event log keeps a rollup that removed other keys
// in the top bits of its op byte, which a binary of schema 1 reads as an op it does not know (a rollup's
// put as no value as of every point, its export as an empty put), while it opened the state dir as its
// own. A state dir stays schema 1 until the batch that logs its first such rollup, which writes 2, so
// an older binary refuses it from then on (and starts over) instead of misreading it; this binary
// opens both.
func TestOpenState_ARollupInTheLogMarksTheSchema(t *testing.T) {
	dir := t.TempDir()
	b := provisioner.BucketNeeds
	apply := func(msgs ...provisioner.Message) {
		t.Helper()
		db, err := store.OpenState(dir, store.Options{})
		require.NoError(t, err)
		require.NoError(t, db.Apply(b, msgs, 0, true))
		require.NoError(t, db.Close())
	}
	apply(put(1, "n1.m.config.a", []byte{0xc0}), put(2, "n2.m.config.a", []byte{0xc0}), del(3, "n2.m.config.a"),
		rollup(purge(4, "n1.m.config.a"), provisioner.RollupSub)) // a KV purge: a rollup of its own key
	require.Equal(t, "1", schemaOf(t, dir), "no rollup of other keys: older binaries read this log")

	apply(put(5, "n1.m.config.b", []byte{0xc0}), put(6, "n2.m.config.b", []byte{0xc0}),
		rollup(put(7, "n2.m.config.c", []byte{0xc0}), provisioner.RollupAll))
	require.Equal(t, "2", schemaOf(t, dir), "the log holds a rollup an older binary misreads")

	db, err := store.OpenState(dir, store.Options{})
	require.NoError(t, err, "this binary reads what it wrote")
	defer db.Close()
	require.Equal(t, []string{"n2.m.config.c"}, rows(t, db, provisioner.Range{Bucket: b, Index: provisioner.IndexPrimary}))
	require.Equal(t, []string{"n1.m.config.b", "n2.m.config.b"}, keysAt(t, db, b, 6))
}

// TestDB_AWholeBucketRollupIsRemovedInParts: a Nats-Rollup: all removes every other key of the bucket
// (any node's user can send one), and removing a million keys in the rollup's own batch took about
// 1 GiB. The keys are removed in batches of a bounded number of keys, committed before the message's
// own batch, which alone moves the checkpoint: an Apply stopped between two parts and applied again
// removes the rest, to the same state, anomaly count and log as in one go.
func TestDB_AWholeBucketRollupIsRemovedInParts(t *testing.T) {
	b := provisioner.BucketNeeds
	all := provisioner.Range{Bucket: b, Index: provisioner.IndexPrimary}
	var msgs []provisioner.Message
	for i := range 25 {
		msgs = append(msgs, put(uint64(i+1), fmt.Sprintf("n%02d.m.config.a", i), []byte{0xc0}))
	}
	msgs = append(msgs, put(26, "n1.x", []byte{0xc0}), put(27, "n2.x", []byte{0xc1})) // out of shape
	whole := rollup(put(28, "n99.m.config.z", []byte{0xc0}), provisioner.RollupAll)

	run := func(t *testing.T, part int, stopAfter int) *store.DB {
		db, err := store.Open(t.TempDir(), store.Options{})
		require.NoError(t, err)
		t.Cleanup(func() { db.Close() })
		require.NoError(t, db.Apply(b, msgs, 0, false))
		parts := 0
		restore := store.SetRollupPart(part, func(n int) error {
			require.LessOrEqual(t, n, part, "a part holds at most its size")
			if parts++; parts == stopAfter {
				return errors.New("stopped")
			}
			return nil
		})
		defer restore()
		if stopAfter > 0 {
			require.Error(t, db.Apply(b, []provisioner.Message{whole}, 0, false))
			applied, _ := db.Applied(b)
			require.EqualValues(t, 27, applied, "the checkpoint moves with the message alone")
			left := rows(t, db, all)
			require.Less(t, len(left), 25, "the first part was committed")
			require.NotEmpty(t, left)
		}
		require.NoError(t, db.Apply(b, []provisioner.Message{whole}, 0, false))
		if stopAfter == 0 && part < len(msgs) {
			require.Greater(t, parts, 2, "removed in parts")
		}
		return db
	}
	inOne := run(t, 1000, 0)
	for _, tc := range []struct {
		name            string
		part, stopAfter int
	}{{"in parts of 4", 4, 0}, {"stopped after a part and read again", 4, 1}} {
		t.Run(tc.name, func(t *testing.T) {
			db := run(t, tc.part, tc.stopAfter)
			require.Equal(t, []string{"n99.m.config.z"}, rows(t, db, all))
			want, wantTotal := anomalies(t, inOne, b, "")
			got, total := anomalies(t, db, b, "")
			require.Equal(t, want, got)
			require.Equal(t, wantTotal, total)
			for n := uint64(26); n <= 28; n++ {
				require.Equal(t, keysAt(t, inOne, b, n), keysAt(t, db, b, n), "as of %d", n)
			}
			for _, m := range msgs {
				require.Equal(t, history(t, inOne, b, m.Key), history(t, db, b, m.Key), m.Key)
			}
		})
	}
}

// history lists a key's events in the log as "seq op".
func history(t *testing.T, db *store.DB, bucket, key string) []string {
	t.Helper()
	v, err := db.View()
	require.NoError(t, err)
	defer v.Close()
	var out []string
	require.NoError(t, v.KeyHistory(bucket, key, func(ev *store.Event) bool {
		out = append(out, fmt.Sprintf("%d %s", ev.Seq, ev.Op))
		return true
	}))
	return out
}

// TestDB_ARollupInPartsIsNeverSeenHalfDone: while a rollup's removals are committed in parts, every
// answer (View and RowsView) reads the state before the rollup, whole, with that state's as_of; the
// first answer after the rollup's own batch reads the state after it. Read from what was committed,
// an answer in between held some of the removed keys and not others under the as_of before the
// rollup: a state the stream never had. A view opened in between and still open after the rollup
// keeps reading the state it opened on.
func TestDB_ARollupInPartsIsNeverSeenHalfDone(t *testing.T) {
	b := provisioner.BucketNeeds
	all := provisioner.Range{Bucket: b, Index: provisioner.IndexPrimary}
	byModule := provisioner.Range{Bucket: b, Index: provisioner.IndexModule, Value: "m"}
	var msgs []provisioner.Message
	for i := range 25 {
		msgs = append(msgs, put(uint64(i+1), fmt.Sprintf("n%02d.m.config.a", i), []byte{0xc0}))
	}
	msgs = append(msgs, put(26, "n1.x", []byte{0xc0}), put(27, "n2.x", []byte{0xc1})) // out of shape
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	require.NoError(t, db.Apply(b, msgs, 0, false))
	before := rows(t, db, all)
	beforeByModule := rows(t, db, byModule)
	beforeAnomalies, beforeTotal := anomalies(t, db, b, "")
	require.Len(t, before, 25)
	require.Len(t, beforeAnomalies, 27) // two out of shape; no registry, so every kind unanswered

	asOf := func(v interface {
		Checkpoint(string) (store.Checkpoint, error)
	}) uint64 {
		cp, err := v.Checkpoint(b)
		require.NoError(t, err)
		return cp.Applied
	}
	rowsOf := func(v interface {
		Rows(provisioner.Range, func(*provisioner.Row) bool) error
	}, r provisioner.Range) []string {
		var keys []string
		require.NoError(t, v.Rows(r, func(row *provisioner.Row) bool {
			keys = append(keys, string(row.Key))
			return true
		}))
		return keys
	}
	var held *store.View
	parts := 0
	restore := store.SetRollupPart(4, func(int) error {
		parts++
		require.Equal(t, before, rows(t, db, all), "part %d: a View reads the state before the rollup", parts)
		require.Equal(t, beforeByModule, rows(t, db, byModule), "part %d: and its index", parts)
		got, total := anomalies(t, db, b, "")
		require.Equal(t, beforeAnomalies, got, "part %d", parts)
		require.Equal(t, beforeTotal, total, "part %d", parts)
		rv, err := db.RowsView()
		require.NoError(t, err)
		require.Equal(t, before, rowsOf(rv, all), "part %d: a RowsView (the verb's) too", parts)
		require.EqualValues(t, 27, asOf(rv), "part %d: as of the message before the rollup", parts)
		require.NoError(t, rv.Close())
		if held == nil {
			held, err = db.View()
			require.NoError(t, err)
		}
		return nil
	})
	defer restore()
	require.NoError(t, db.Apply(b, []provisioner.Message{rollup(put(28, "n99.m.config.z", []byte{0xc0}), provisioner.RollupAll)}, 0, false))
	require.Greater(t, parts, 2, "removed in parts")

	require.Equal(t, []string{"n99.m.config.z"}, rows(t, db, all), "after the rollup's batch: the state after it")
	rv, err := db.RowsView()
	require.NoError(t, err)
	require.Equal(t, []string{"n99.m.config.z"}, rowsOf(rv, all))
	require.EqualValues(t, 28, asOf(rv))
	require.NoError(t, rv.Close())
	got, total := anomalies(t, db, b, "")
	require.Equal(t, []string{"n99.m.config.z unanswered-kind"}, got)
	require.EqualValues(t, 1, total)

	require.NotNil(t, held)
	require.Equal(t, before, rowsOf(held, all), "a view opened during the parts keeps its state")
	require.EqualValues(t, 27, asOf(held))
	require.NoError(t, held.Close())
}

// TestDB_ARollupsPartsEachReadTheirOwnKeys: each part of a rollup's removals scans from where the part
// before it ended. It started at the first row and stepped over every key the parts before had
// removed (their tombstones stay until a compaction), so a part read more than the last, and a rollup
// of a million keys in a hundred parts read about fifty million points.
func TestDB_ARollupsPartsEachReadTheirOwnKeys(t *testing.T) {
	b := provisioner.BucketNeeds
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	var msgs []provisioner.Message
	for i := range 200 {
		msgs = append(msgs, put(uint64(i+1), fmt.Sprintf("n%03d.m.config.a", i), []byte{0xc0}))
	}
	require.NoError(t, db.Apply(b, msgs, 0, false))
	const part = 10
	var read []uint64
	restore := store.SetRollupPartRead(part, nil, func(points uint64) { read = append(read, points) })
	defer restore()
	require.NoError(t, db.Apply(b, []provisioner.Message{rollup(put(201, "n999.m.config.z", []byte{0xc0}), provisioner.RollupAll)}, 0, false))
	require.Equal(t, []string{"n999.m.config.z"}, rows(t, db, provisioner.Range{Bucket: b, Index: provisioner.IndexPrimary}))
	require.GreaterOrEqual(t, len(read), 200/part)
	for i, n := range read {
		// Its own keys, and the one it resumes after (a key and its tombstone).
		require.LessOrEqual(t, n, uint64(part+4), "part %d read %d points: %v", i, n, read)
	}
}

// TestOpen_FinishesARollupStoppedBetweenParts: a rollup that removes other keys commits them in parts
// before its own batch, which alone moves the checkpoint. A process stopped between two parts left a
// state dir holding part of the removal under the checkpoint before the rollup, and answered that
// from the open until the projector read the message again: a state the stream never had. The first
// part marks the rollup, and Open finishes it before anything reads the store: without an Apply, the
// reopened store holds, key for key, what a store that applied the rollup in one go holds (rows,
// indexes, anomalies and their counts, log, plans, checkpoint), and the message read again changes
// nothing.
func TestOpen_FinishesARollupStoppedBetweenParts(t *testing.T) {
	needs := provisioner.BucketNeeds
	var needMsgs []provisioner.Message
	for i := range 25 {
		needMsgs = append(needMsgs, put(uint64(i+1), fmt.Sprintf("n%d.m.config.k%d", i%3, i), []byte{0xc0}))
	}
	needMsgs = append(needMsgs, put(26, "n1.x", []byte{0xc0}), put(27, "n2.x", []byte{0xc1}), put(28, "n1.m.k0.b", []byte{0xc1}))
	var regs []provisioner.Message
	for i := range 25 {
		regs = append(regs, put(uint64(i+1), fmt.Sprintf("k%d", i), []byte{0xc0}))
	}
	c := provisioner.ComposedPrefix + "n1"
	comp := func(status, plan string) []byte {
		return mpk(t, map[string]any{"status": status, "plan": plan})
	}
	hosts := []provisioner.Message{put(1, "n1.m1", mpk(t, map[string]any{"want": 2})), put(2, "n1.m2", mpk(t, map[string]any{"want": 1})),
		put(3, "n1.m3", mpk(t, map[string]any{"want": 1}))}
	var comps []provisioner.Message
	for i := range 9 {
		comps = append(comps, put(uint64(i+1), fmt.Sprintf("m%d.%d", i%3+1, i/3+1), comp("published", fmt.Sprint("plan ", i))))
	}
	for _, tc := range []struct {
		name   string
		before []rollupInput // applied first, in one go
		rollup rollupInput   // its one message is the rollup, stopped after its first part
	}{
		{"whole bucket", []rollupInput{{needs, needMsgs}},
			rollupInput{needs, []provisioner.Message{rollup(put(29, "n9.m.config.z", []byte{0xc0}), provisioner.RollupAll)}}},
		{"wildcard", []rollupInput{{needs, needMsgs}},
			rollupInput{needs, []provisioner.Message{rollup(put(29, "n1.>", []byte{0xc1}), provisioner.RollupSub)}}},
		{"registry", []rollupInput{{provisioner.BucketRegistry, regs}, {needs, needMsgs}},
			rollupInput{provisioner.BucketRegistry, []provisioner.Message{rollup(put(26, "k3", []byte{0xc0}), provisioner.RollupAll)}}},
		{"composed", []rollupInput{{provisioner.BucketHostModules, hosts}, {c, comps}},
			rollupInput{c, []provisioner.Message{rollup(purge(10, "m1.*"), provisioner.RollupSub)}}},
		{"composed whole bucket", []rollupInput{{provisioner.BucketHostModules, hosts}, {c, comps}},
			rollupInput{c, []provisioner.Message{rollup(del(10, "m2.9"), provisioner.RollupAll)}}},
		// On a subject added to the stream by hand (foreign_test.go).
		{"whole bucket on an added subject", []rollupInput{{needs, needMsgs}},
			rollupInput{needs, []provisioner.Message{foreign(29, "extra.x", provisioner.RollupAll, []byte("data"))}}},
		{"composed whole bucket on an added subject", []rollupInput{{provisioner.BucketHostModules, hosts}, {c, comps}},
			rollupInput{c, []provisioner.Message{foreign(10, "extra.x", provisioner.RollupAll, nil)}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := tc.rollup.bucket
			open := func(dir string) *store.DB {
				t.Helper()
				db, err := store.Open(dir, store.Options{})
				require.NoError(t, err)
				return db
			}
			// stop applies the store and the rollup, stopped after its first part of 2 keys, and
			// closes the store.
			stop := func(dir string) {
				t.Helper()
				db := open(dir)
				for _, in := range tc.before {
					require.NoError(t, db.Apply(in.bucket, in.msgs, 7, false))
				}
				before := db.Checkpoint(b)
				all := provisioner.Range{Bucket: b, Index: provisioner.IndexPrimary}
				rowsBefore := rows(t, db, all)
				restore := store.SetRollupPart(2, func(int) error { return errors.New("stopped") })
				require.Error(t, db.Apply(b, tc.rollup.msgs, 7, false))
				restore()
				require.Equal(t, before.Applied, db.Checkpoint(b).Applied, "stopped before the message's own batch")
				require.Len(t, rows(t, db, all), len(rowsBefore)-2, "the first part is committed")
				require.NoError(t, db.Close())
			}

			oneGo := open(t.TempDir())
			for _, in := range append(tc.before, tc.rollup) {
				require.NoError(t, oneGo.Apply(in.bucket, in.msgs, 7, false))
			}
			require.NoError(t, oneGo.Close())
			oneGo = open(oneGo.Dir())
			defer oneGo.Close()

			dir := t.TempDir()
			stop(dir)
			db := open(dir)
			defer db.Close()
			checkSame(t, oneGo, db, tc.before, tc.rollup)

			// The projector reads the message again after the open: it is applied already.
			require.NoError(t, db.Apply(b, tc.rollup.msgs, 7, false))
			checkSame(t, oneGo, db, tc.before, tc.rollup)
		})
	}
}

// rollupInput is messages of one bucket.
type rollupInput struct {
	bucket string
	msgs   []provisioner.Message
}

// checkSame requires two stores that applied the same inputs and rollup to hold the same: every key
// and value, and what answers read of them.
func checkSame(t *testing.T, want, got *store.DB, before []rollupInput, rollup rollupInput) {
	t.Helper()
	buckets := []string{provisioner.BucketNeeds, provisioner.BucketRegistry}
	for _, in := range append(before, rollup) {
		buckets = append(buckets, in.bucket)
	}
	for _, b := range buckets {
		require.Equal(t, want.Checkpoint(b), got.Checkpoint(b), "checkpoint of %s", b)
		all := provisioner.Range{Bucket: b, Index: provisioner.IndexPrimary}
		require.Equal(t, rows(t, want, all), rows(t, got, all), "rows of %s", b)
		for _, node := range []string{"", "n0", "n1", "n2", "n9"} {
			wa, wn := anomalies(t, want, b, node)
			ga, gn := anomalies(t, got, b, node)
			require.Equal(t, wa, ga, "anomalies of %s node %q", b, node)
			require.Equal(t, wn, gn, "anomaly count of %s node %q", b, node)
		}
	}
	seq := rollup.msgs[0].Seq
	for n := uint64(1); n <= seq; n++ {
		require.Equal(t, keysAt(t, want, rollup.bucket, n), keysAt(t, got, rollup.bucket, n), "keys as of %d", n)
	}
	for _, in := range before {
		for _, m := range in.msgs {
			require.Equal(t, history(t, want, in.bucket, m.Key), history(t, got, in.bucket, m.Key), "history of %s %s", in.bucket, m.Key)
		}
	}
	require.Equal(t, normalize(planRows(t, want, "", "")), normalize(planRows(t, got, "", "")), "plans")
	require.Equal(t, dump(t, want), dump(t, got), "every key and value")
}

// TestOpen_ARollupMarkerAnOlderBinaryLeftIsDropped: a binary from before rollup markers ignores one
// (an unknown meta key), reads the rollup again from the stream and removes the rest, and leaves the
// marker behind. The next open finds the checkpoint at the marker's sequence: the rollup is done, so
// the marker is deleted and nothing is applied again.
func TestOpen_ARollupMarkerAnOlderBinaryLeftIsDropped(t *testing.T) {
	b := provisioner.BucketNeeds
	var msgs []provisioner.Message
	for i := range 9 {
		msgs = append(msgs, put(uint64(i+1), fmt.Sprintf("n%d.m.config.a", i), []byte{0xc0}))
	}
	whole := []provisioner.Message{rollup(put(10, "n9.m.config.z", []byte{0xc0}), provisioner.RollupAll)}
	oneGo, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer oneGo.Close()
	require.NoError(t, oneGo.Apply(b, append(slices.Clone(msgs), whole...), 0, false))

	dir := t.TempDir()
	db, err := store.Open(dir, store.Options{})
	require.NoError(t, err)
	require.NoError(t, db.Apply(b, msgs, 0, false))
	restore := store.SetRollupPart(2, func(int) error { return errors.New("stopped") })
	require.Error(t, db.Apply(b, whole, 0, false))
	restore()
	require.NoError(t, db.Close())

	// The older binary: the marker is a key it never reads (taken out here so this binary's open
	// leaves the parts as the older one found them, and put back as the older one leaves it).
	marker := []byte("\x01rollup " + b)
	pdb, err := pebble.Open(dir, &pebble.Options{})
	require.NoError(t, err)
	v, closer, err := pdb.Get(marker)
	require.NoError(t, err, "the first part marked the rollup")
	saved := slices.Clone(v)
	require.NoError(t, closer.Close())
	require.NoError(t, pdb.Delete(marker, pebble.Sync))
	require.NoError(t, pdb.Close())
	db, err = store.Open(dir, store.Options{})
	require.NoError(t, err)
	require.Less(t, len(rows(t, db, provisioner.Range{Bucket: b, Index: provisioner.IndexPrimary})), 9, "part of the removal")
	require.NoError(t, db.Apply(b, whole, 0, false), "read again from the stream")
	require.NoError(t, db.Close())
	pdb, err = pebble.Open(dir, &pebble.Options{})
	require.NoError(t, err)
	require.NoError(t, pdb.Set(marker, saved, pebble.Sync))
	require.NoError(t, pdb.Close())

	db, err = store.Open(dir, store.Options{})
	require.NoError(t, err)
	defer db.Close()
	require.NotContains(t, dump(t, db), string(marker), "a finished rollup's marker is dropped")
	checkSame(t, oneGo, db, []rollupInput{{b, msgs}}, rollupInput{b, whole})
}
