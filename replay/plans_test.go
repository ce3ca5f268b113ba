package replay_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/replay"
	"github.com/novox/mesh-provisioner/store"
)

// keptPlansScenario is a history of the plans' inputs on one node, one message a second from 1 s:
// the kept plans of every kind a trim could lose, all in place by the horizon, at 20 s, and changes
// after it. What each row answers at the horizon:
//
//	n1.m1  want 7, refused over its published composition: current held refused at the plan the
//	       refusal overwrote (1 s); newest 9, published then refused, with a later build 8 published
//	       in between: newest held refused at 9's plan (14 s), not 8's
//	n1.m2  want 5 pending, have 4 refused over its published composition: held pending at 4's plan
//	n1.m3  want 2, whose key was deleted after it published: held missing at 2's plan
//	n1.m4  want 2 refused; build 1 published, then purged: held refused with no plan
func keptPlansScenario() ([]provisioner.Message, []string) {
	c := provisioner.ComposedPrefix + "n1"
	comp := func(status string, plan any) []byte {
		v := map[string]any{"status": status}
		if plan != nil {
			v["plan"] = plan
		}
		return mp(v)
	}
	type w struct {
		bucket, key string
		op          provisioner.Op
		value       []byte
	}
	writes := []w{
		{c, "m1.7", provisioner.OpPut, comp("published", "m1 7")}, // 1 s
		{c, "m1.7", provisioner.OpPut, comp("refused", "m1 7 refused")},
		{c, "m2.3", provisioner.OpPut, comp("published", "m2 3")},
		{c, "m2.4", provisioner.OpPut, comp("published", "m2 4")},
		{c, "m2.5", provisioner.OpPut, comp("pending", nil)}, // 5 s
		{c, "m2.4", provisioner.OpPut, comp("refused", nil)},
		{c, "m3.1", provisioner.OpPut, comp("published", "m3 1")},
		{c, "m3.2", provisioner.OpPut, comp("published", "m3 2")},
		{c, "m3.2", provisioner.OpDelete, nil},
		{c, "m4.1", provisioner.OpPut, comp("published", "m4 1")}, // 10 s
		{c, "m4.1", provisioner.OpPurge, nil},
		{c, "m4.2", provisioner.OpPut, comp("refused", "m4 2 refused")},
		{c, "m1.8", provisioner.OpPut, comp("published", "m1 8")},
		{c, "m1.9", provisioner.OpPut, comp("published", "m1 9")},
		{c, "m1.9", provisioner.OpPut, comp("refused", nil)}, // 15 s
		{provisioner.BucketHostModules, "n1.m1", provisioner.OpPut, mp(map[string]any{"want": 7})},
		{provisioner.BucketHostModules, "n1.m2", provisioner.OpPut, mp(map[string]any{"want": 5, "have": 4})},
		{provisioner.BucketHostModules, "n1.m3", provisioner.OpPut, mp(map[string]any{"want": 2})},
		{provisioner.BucketHostModules, "n1.m4", provisioner.OpPut, mp(map[string]any{"want": 2})},
		{provisioner.BucketIndexerBuilds, "m1", provisioner.OpPut, mp(map[string]any{"newest": 9})}, // 20 s: the horizon
		{c, "m2.5", provisioner.OpPut, comp("published", "m2 5")},
		{c, "m1.7", provisioner.OpPut, comp("pending", nil)},
		{provisioner.BucketHostModules, "n1.m3", provisioner.OpPut, mp(map[string]any{"want": 3})},
		{c, "m3.2", provisioner.OpPut, comp("published", "m3 2 again")}, // 24 s
	}
	seqs := map[string]uint64{}
	msgs, buckets := make([]provisioner.Message, len(writes)), make([]string, len(writes))
	for i, x := range writes {
		seqs[x.bucket]++
		msgs[i] = provisioner.Message{Seq: seqs[x.bucket], Time: int64(i+1) * 1e9, Key: x.key, Op: x.op, Value: x.value}
		buckets[i] = x.bucket
	}
	return msgs, buckets
}

const keptPlansHorizon, keptPlansEnd = 20, 24

// askPlansAt asks the log for the plans as of a second of the scenario, and returns the rows, or the
// error's code.
func askPlansAt(t *testing.T, db *store.DB, sec int) (string, int) {
	t.Helper()
	at := time.Unix(int64(sec), 0).UTC().Format(time.RFC3339Nano)
	l := &replay.Log{DB: db}
	defer replay.DropPlans(l)
	out, err := l.Ask([]byte(`{"what":"plans","at":"` + at + `"}`))
	if err != nil {
		code := query.Code(err)
		require.NotEqual(t, 500, code, "plans at %s: %v", at, err)
		return "", code
	}
	return plansRows(t, out), 200
}

func plansRows(t *testing.T, answer []byte) string {
	t.Helper()
	var v map[string]any
	dec := json.NewDecoder(bytes.NewReader(answer))
	dec.UseNumber()
	require.NoError(t, dec.Decode(&v))
	rows, err := json.Marshal(v["rows"])
	require.NoError(t, err)
	return string(rows)
}

// livePlans is the live projection's plans answer.
func livePlans(t *testing.T, db *store.DB) string {
	t.Helper()
	v, err := db.View()
	require.NoError(t, err)
	defer v.Close()
	var e query.Encoder
	e.Reset(query.FormatJSON)
	require.NoError(t, query.AnswerPlans(v, &query.Request{What: "plans"}, &e, true))
	return plansRows(t, e.Bytes())
}

// TestPlansAt_AfterTrim: once the retention has trimmed the plans' inputs, plans as of every time from
// the floor on answer what they answered before the trim, and the newest what the live projection
// answers: the kept plans are read from the log, and the trim keeps what they need. (A trim
// interrupted and resumed keeps the same: store's TestDB_InterruptedTrimKeepsTheLastPlanKept.)
func TestPlansAt_AfterTrim(t *testing.T) {
	t.Parallel()
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	msgs, buckets := keptPlansScenario()
	for i := range msgs {
		require.NoError(t, db.Apply(buckets[i], msgs[i:i+1], 1, false))
	}
	live := livePlans(t, db)
	before := map[int]string{}
	for sec := 1; sec <= keptPlansEnd; sec++ {
		before[sec], _ = askPlansAt(t, db, sec)
	}
	require.Equal(t, live, before[keptPlansEnd], "the newest point answers what the live projection does")
	for _, want := range []string{`"m1 7"`, `"m1 9"`, `"m2 4"`, `"m3 2"`} {
		require.Contains(t, before[keptPlansHorizon], want, "a kept plan at the horizon")
	}

	r := store.NewRetention(db, store.RetentionOptions{MaxAge: 100 * time.Second, Now: func() time.Time { return time.Unix(keptPlansHorizon+100, 0) }})
	_, err = r.Apply(context.Background())
	require.NoError(t, err)
	v, err := db.View()
	require.NoError(t, err)
	m, err := v.HistoryMarks(provisioner.ComposedPrefix + "n1")
	v.Close()
	require.NoError(t, err)
	require.EqualValues(t, 15, m.Floor, "composed-n1 is trimmed to its last message at the horizon")
	require.Equal(t, m.Floor, m.Trimmed)

	for sec := keptPlansHorizon; sec <= keptPlansEnd; sec++ {
		got, code := askPlansAt(t, db, sec)
		require.Equal(t, 200, code, "plans at %d s, after the trim", sec)
		require.Equal(t, before[sec], got, "plans at %d s, after the trim", sec)
	}
	require.Equal(t, live, livePlans(t, db), "the live projection does not read the log")
	_, code := askPlansAt(t, db, keptPlansHorizon-1)
	require.Equal(t, 410, code, "below the floor of mesh-indexer_builds")
}

// TestPlansAt_AsOfAtAFloorWhoseEventWasTrimmed: plans as of a time say, in as_of, the sequence of
// each bucket they are as of, also when the trim dropped that very event (a delete of a key that kept
// nothing, which a trim removes with the rest of its key). They said the last event the log still
// held below it, so an answer as of sequence 3 read as one that had not seen 2 and 3.
func TestPlansAt_AsOfAtAFloorWhoseEventWasTrimmed(t *testing.T) {
	t.Parallel()
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	c := provisioner.ComposedPrefix + "n1"
	sec := func(s int) int64 { return int64(s) * 1e9 }
	require.NoError(t, db.Apply(c, []provisioner.Message{
		{Seq: 1, Time: sec(1), Key: "m.1", Op: provisioner.OpPut, Value: mp(map[string]any{"status": "published", "plan": "m 1"})},
		{Seq: 2, Time: sec(2), Key: "y.1", Op: provisioner.OpPut, Value: mp(map[string]any{"status": "pending"})},
		{Seq: 3, Time: sec(3), Key: "y.1", Op: provisioner.OpDelete},
	}, 1, false))
	require.NoError(t, db.Apply(provisioner.BucketHostModules, []provisioner.Message{
		{Seq: 1, Time: sec(4), Key: "n1.m", Op: provisioner.OpPut, Value: mp(map[string]any{"want": 1})},
	}, 1, false))
	asOf := func() (map[string]any, string) {
		t.Helper()
		at := time.Unix(5, 0).UTC().Format(time.RFC3339Nano)
		l := &replay.Log{DB: db}
		defer replay.DropPlans(l)
		out, err := l.Ask([]byte(`{"what":"plans","node":"n1","at":"` + at + `"}`))
		require.NoError(t, err)
		var v map[string]any
		dec := json.NewDecoder(bytes.NewReader(out))
		dec.UseNumber()
		require.NoError(t, dec.Decode(&v))
		return v["as_of"].(map[string]any), plansRows(t, out)
	}
	before, rows := asOf()
	require.Equal(t, json.Number("3"), before[c])

	r := store.NewRetention(db, store.RetentionOptions{MaxAge: time.Second, Now: func() time.Time { return time.Unix(4, 0) }})
	_, err = r.Apply(context.Background())
	require.NoError(t, err)
	v, err := db.View()
	require.NoError(t, err)
	m, err := v.HistoryMarks(c)
	v.Close()
	require.NoError(t, err)
	require.EqualValues(t, 3, m.Floor)

	after, rowsAfter := asOf()
	require.Equal(t, rows, rowsAfter)
	require.Equal(t, before, after, "as_of after the trim")
}

// TestPlansAt_ARollupInAComposedBucket: plans as of a time are folded from the log's events copied to
// a store of their own, one event a sequence, under the message's own key. A composed-<node> message
// whose rollup removed other builds (a wildcard purge, a Nats-Rollup: all) was copied as its own key
// alone, so the builds it removed were still there as of every time after it: plans as of now said
// the plan the live answer had forgotten (held refused at m1 2's plan, not missing), and a module
// whose builds the wildcard purged still published.
func TestPlansAt_ARollupInAComposedBucket(t *testing.T) {
	t.Parallel()
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	c := provisioner.ComposedPrefix + "n1"
	sec := func(s int) int64 { return int64(s) * 1e9 }
	comp := func(status string, plan any) []byte {
		v := map[string]any{"status": status}
		if plan != nil {
			v["plan"] = plan
		}
		return mp(v)
	}
	require.NoError(t, db.Apply(provisioner.BucketHostModules, []provisioner.Message{
		{Seq: 1, Time: sec(1), Key: "n1.m1", Op: provisioner.OpPut, Value: mp(map[string]any{"want": 3})},
		{Seq: 2, Time: sec(1), Key: "n1.m2", Op: provisioner.OpPut, Value: mp(map[string]any{"want": 1})},
	}, 1, false))
	require.NoError(t, db.Apply(provisioner.BucketIndexerBuilds, []provisioner.Message{
		{Seq: 1, Time: sec(1), Key: "m1", Op: provisioner.OpPut, Value: mp(map[string]any{"newest": 4})},
	}, 1, false))
	require.NoError(t, db.Apply(c, []provisioner.Message{
		{Seq: 1, Time: sec(2), Key: "m1.1", Op: provisioner.OpPut, Value: comp("published", "m1 1")},
		{Seq: 2, Time: sec(3), Key: "m1.2", Op: provisioner.OpPut, Value: comp("published", "m1 2")},
		{Seq: 3, Time: sec(4), Key: "m1.3", Op: provisioner.OpPut, Value: comp("refused", nil)},
		{Seq: 4, Time: sec(5), Key: "m2.1", Op: provisioner.OpPut, Value: comp("published", "m2 1")},
	}, 1, false))
	before, code := askPlansAt(t, db, 6)
	require.Equal(t, 200, code)
	require.Equal(t, livePlans(t, db), before)

	require.NoError(t, db.Apply(c, []provisioner.Message{
		{Seq: 5, Time: sec(7), Key: "m2.>", Op: provisioner.OpPurge, Rollup: provisioner.RollupSub},
	}, 1, false))
	afterSub, code := askPlansAt(t, db, 8)
	require.Equal(t, 200, code)
	require.Equal(t, livePlans(t, db), afterSub, "as of a time after the wildcard purge: its live answer")
	require.NotContains(t, afterSub, `"m2 1"`)

	require.NoError(t, db.Apply(c, []provisioner.Message{
		{Seq: 6, Time: sec(9), Key: "m1.4", Op: provisioner.OpPut, Value: comp("published", "m1 4"), Rollup: provisioner.RollupAll},
	}, 1, false))
	afterAll, code := askPlansAt(t, db, 10)
	require.Equal(t, 200, code)
	require.Equal(t, livePlans(t, db), afterAll, "as of a time after the rollup of the whole stream: its live answer")
	require.NotContains(t, afterAll, `"m1 2"`)
	got, _ := askPlansAt(t, db, 8)
	require.Equal(t, afterSub, got, "and as of a time before it, what it answered then")
}

// TestLog_AskPlansPagesFillOnce: `replay state plans` walks the plans a page at a time through
// Log.Ask, and each page applied every plans' input up to the point into a new temporary store: a
// walk of every plan cost pages × the inputs' history (1,000 nodes of 10 modules, 12 s of CPU, against
// 0.6 s for 250). A page after the first now reads the store the first filled, and answers what a
// store filled for it answers.
func TestLog_AskPlansPagesFillOnce(t *testing.T) {
	dir := t.TempDir()
	db, err := store.OpenState(dir, store.Options{})
	require.NoError(t, err)
	const nodes, modules = 60, 10
	var hm []provisioner.Message
	for n := 0; n < nodes; n++ {
		node := fmt.Sprintf("n%03d", n)
		var comp []provisioner.Message
		for m := 0; m < modules; m++ {
			hm = append(hm, provisioner.Message{Seq: uint64(len(hm) + 1), Time: int64(len(hm) + 1), Key: fmt.Sprintf("%s.m%02d", node, m), Op: provisioner.OpPut, Value: mp(map[string]any{"want": 2})})
			for b := 1; b <= 2; b++ {
				comp = append(comp, provisioner.Message{Seq: uint64(len(comp) + 1), Time: int64(len(comp) + 1), Key: fmt.Sprintf("m%02d.%d", m, b), Op: provisioner.OpPut,
					Value: mp(map[string]any{"status": "published", "plan": fmt.Sprintf("%s m%02d %d", node, m, b)})})
			}
		}
		require.NoError(t, db.Apply(provisioner.ComposedPrefix+node, comp, 1, false))
	}
	require.NoError(t, db.Apply(provisioner.BucketHostModules, hm, 1, false))
	require.NoError(t, db.Close())
	l, err := replay.OpenState(dir)
	require.NoError(t, err)
	defer l.Close()

	const at = "2100-01-01T00:00:00Z"
	ask := func(after string) []byte {
		out, err := l.Ask([]byte(fmt.Sprintf(`{"what":"plans","at":%q,"limit":100,"after":%q}`, at, after)))
		require.NoError(t, err)
		return out
	}
	fresh := func(after string) []byte {
		v, err := l.DB.View()
		require.NoError(t, err)
		defer v.Close()
		limit := int64(100)
		var e query.Encoder
		e.Reset(query.FormatJSON)
		require.NoError(t, replay.Answer(v, &query.Request{What: "plans", At: at, Limit: &limit, After: after}, &e, true))
		return append([]byte(nil), e.Bytes()...)
	}
	after, rows := "", 0
	for p := 0; ; p++ {
		got := ask(after)
		require.True(t, bytes.Equal(fresh(after), got), "page %d differs from the answer of a store filled for it", p)
		var a struct {
			Rows []struct{ Current struct{ Build int } }
			Next string
		}
		require.NoError(t, json.Unmarshal(got, &a))
		for _, r := range a.Rows {
			require.Equal(t, 2, r.Current.Build)
		}
		rows += len(a.Rows)
		if a.Next == "" {
			break
		}
		after = a.Next
	}
	require.Equal(t, nodes*modules, rows)
	after = fmt.Sprintf("n%03d.m%02d", nodes/2, 0) // a row's key: the cursor of a page in the middle
	allocs := testing.AllocsPerRun(3, func() { ask(after) })
	filled := testing.AllocsPerRun(1, func() { fresh(after) })
	t.Logf("allocations: %.0f a kept page, %.0f a filled one", allocs, filled)
	require.Less(t, allocs, filled/4, "allocations of a later page with the inputs kept, against a page that applies them")
	require.Greater(t, filled, float64(nodes*modules*3), "allocations of applying the inputs")
}
