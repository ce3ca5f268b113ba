package replay_test

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/replay"
	"github.com/novox/mesh-provisioner/seat"
	"github.com/novox/mesh-provisioner/store"
)

func mp(v any) []byte {
	b, err := msgpack.Marshal(v)
	if err != nil {
		panic(err)
	}
	return b
}

var notMsgpack = []byte{0xc1, 'x'}

// script is a recorded sequence of puts, deletes and purges of the needs bucket, with out-of-shape
// keys, a value that is not MessagePack, a kind no registry entry answers, and one key written ten
// times into a bucket that keeps two revisions.
func script() []fixtures.Op {
	n := provisioner.BucketNeeds
	ops := []fixtures.Op{
		{Bucket: n, Key: "n1.m1.config.a", Op: provisioner.OpPut, Value: mp("a1")},   // 1
		{Bucket: n, Key: "n1.m1.secret.b", Op: provisioner.OpPut, Value: mp("b1")},   // 2
		{Bucket: n, Key: "n2.m1.config.a", Op: provisioner.OpPut, Value: mp("n2a1")}, // 3
		{Bucket: n, Key: "n1.m1.wish.c", Op: provisioner.OpPut, Value: mp("c1")},     // 4: unanswered-kind
		{Bucket: n, Key: "n1.m1.config", Op: provisioner.OpPut, Value: mp("short")},  // 5: token-count
		{Bucket: n, Key: "n2.m2.port.x", Op: provisioner.OpPut, Value: notMsgpack},   // 6: value-not-msgpack
		{Bucket: n, Key: "n1.m1.config.a", Op: provisioner.OpPut, Value: mp("a2")},   // 7
		{Bucket: n, Key: "n1.m1.secret.b", Op: provisioner.OpDelete},                 // 8
		{Bucket: n, Key: "n2.m1.config.a", Op: provisioner.OpPurge},                  // 9
		{Bucket: n, Key: "n10.m1.config.z", Op: provisioner.OpPut, Value: mp("z1")},  // 10
	}
	for i := 1; i <= 10; i++ { // 11..20
		ops = append(ops, fixtures.Op{Bucket: n, Key: "n3.m1.config.hot", Op: provisioner.OpPut, Value: mp(map[string]int{"rev": i})})
	}
	ops = append(ops,
		fixtures.Op{Bucket: n, Key: "n1.m1.config", Op: provisioner.OpDelete},                  // 21: clears token-count
		fixtures.Op{Bucket: n, Key: "n2.m2.port.x", Op: provisioner.OpPut, Value: mp("fixed")}, // 22: clears value-not-msgpack
		fixtures.Op{Bucket: n, Key: "n1.m2.dir.d", Op: provisioner.OpPut, Value: mp("d1")},     // 23
		fixtures.Op{Bucket: n, Key: "n1.m1.wish.c", Op: provisioner.OpPurge},                   // 24: clears unanswered-kind
		fixtures.Op{Bucket: n, Key: "n1.m1.secret.b", Op: provisioner.OpPut, Value: mp("b2")},  // 25
	)
	return ops
}

type written struct {
	op  fixtures.Op
	seq uint64
	at  time.Time
}

type tval struct {
	value []byte
	rev   uint64
}

// truth is the needs bucket as of step i of the script (0: before it), computed from the script alone.
func truth(steps []written, i int) map[string]tval {
	st := map[string]tval{}
	for _, w := range steps[:i] {
		if w.op.Op == provisioner.OpPut {
			st[w.op.Key] = tval{value: w.op.Value, rev: w.seq}
		} else {
			delete(st, w.op.Key)
		}
	}
	return st
}

// expectState is what replay must answer for a state: rows of keys that fit, and anomalies.
func expectState(st map[string]tval, node string) (rows []string, anomalies []string) {
	for k, v := range st {
		toks := strings.Split(k, ".")
		if node != "" && toks[0] != node {
			continue
		}
		if len(toks) != 4 {
			anomalies = append(anomalies, fmt.Sprintf("%s token-count %d", k, v.rev))
			continue
		}
		rows = append(rows, fmt.Sprintf("%s %d %x", k, v.rev, v.value))
		if v.value[0] == 0xc1 {
			anomalies = append(anomalies, fmt.Sprintf("%s value-not-msgpack %d", k, v.rev))
		}
		if _, ok := provisioner.Registry.Lookup(toks[2]); !ok {
			anomalies = append(anomalies, fmt.Sprintf("%s unanswered-kind %d", k, v.rev))
		}
	}
	sort.Strings(rows)
	sort.Strings(anomalies)
	return rows, anomalies
}

func gotState(s replay.State) (rows, anomalies []string) {
	for _, r := range s.Rows {
		rows = append(rows, fmt.Sprintf("%s %d %x", r.Key, r.Revision, r.Value))
	}
	for _, a := range s.Anomalies {
		anomalies = append(anomalies, fmt.Sprintf("%s %s %d", a.Key, a.Reason, a.Revision))
	}
	sort.Strings(anomalies)
	return rows, anomalies
}

type recording struct {
	t     *testing.T
	url   string
	nc    *nats.Conn
	js    jetstream.JetStream
	dir   string
	seat  *seat.Seat
	stop  func()
	steps []written
}

// record starts a nats-server and a seat on a fresh state dir, waits for the registry, and plays the
// script one message at a time, each applied by the seat before the next is written: a seat that keeps
// up. (One that falls behind a bucket keeping two revisions loses the older ones: a gap, which the
// tests of the streams' own history look at.)
func record(t *testing.T) *recording {
	t.Helper()
	ctx := context.Background()
	ns := natstest.RunServer(t)
	r := &recording{t: t, url: ns.ClientURL(), dir: t.TempDir()}
	r.nc, r.js = natstest.Connect(t, r.url)
	_, err := r.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.BucketNeeds, History: 2})
	require.NoError(t, err)
	require.NoError(t, fixtures.CreateBuckets(ctx, r.js, provisioner.BucketApplied, provisioner.BucketCollect))
	r.startSeat()
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		if seq, _ := r.seat.Store().Applied(provisioner.BucketRegistry); seq < uint64(len(provisioner.Registry.Entries)) {
			return fmt.Errorf("registry applied %d", seq)
		}
		return nil
	})
	stream, err := r.js.Stream(ctx, provisioner.StreamName(provisioner.BucketNeeds))
	require.NoError(t, err)
	for _, op := range script() {
		ack, err := r.js.PublishMsg(ctx, fixtures.OpMsg(op))
		require.NoError(t, err)
		m, err := stream.GetMsg(ctx, ack.Sequence)
		require.NoError(t, err)
		r.steps = append(r.steps, written{op: op, seq: ack.Sequence, at: m.Time})
		r.waitApplied()
	}
	return r
}

func (r *recording) startSeat() {
	r.t.Helper()
	nc, js := natstest.Connect(r.t, r.url)
	db, err := store.OpenState(r.dir, store.Options{})
	require.NoError(r.t, err)
	st, err := seat.Start(context.Background(), nc, js, db, seat.Config{WriteRegistry: true, Projector: projector.Options{Poll: 50 * time.Millisecond}})
	require.NoError(r.t, err)
	done := false
	r.seat = st
	r.stop = func() {
		if done {
			return
		}
		done = true
		require.NoError(r.t, st.Stop())
		require.NoError(r.t, db.Close())
		nc.Close()
	}
	r.t.Cleanup(r.stop)
}

func (r *recording) waitApplied() {
	r.t.Helper()
	last := r.steps[len(r.steps)-1].seq
	natstest.CheckFor(r.t, 10*time.Second, 10*time.Millisecond, func() error {
		if seq, _ := r.seat.Store().Applied(provisioner.BucketNeeds); seq < last {
			return fmt.Errorf("needs applied %d of %d", seq, last)
		}
		return nil
	})
}

// points are the five points the tests ask at, by step of the script: some as sequences, some as
// times (the message's own time stamp, and a nanosecond before the next one).
type point struct {
	name string
	at   string
	step int // the state as of this many steps
}

func (r *recording) points() []point {
	s := r.steps
	return []point{
		{"seq after the unanswered kind", fmt.Sprintf("seq:%d", s[3].seq), 4},
		{"time of the purge", s[8].at.UTC().Format(time.RFC3339Nano), 9},
		{"seq inside the hot key's revisions", fmt.Sprintf("seq:%d", s[14].seq), 15},
		{"just before the 22nd message", s[21].at.Add(-time.Nanosecond).UTC().Format(time.RFC3339Nano), 21},
		{"the end", fmt.Sprintf("seq:%d", s[len(s)-1].seq), len(s)},
	}
}

func needsReq(node string) query.Request {
	return query.Request{What: string(provisioner.WhatNeeds), Node: node}
}

func (r *recording) checkStates(l *replay.Log, name string) {
	r.t.Helper()
	for _, p := range r.points() {
		pt, err := replay.ParsePoint(p.at)
		require.NoError(r.t, err)
		for _, node := range []string{"", "n1"} {
			st, err := l.State(needsReq(node), pt)
			require.NoError(r.t, err, "%s: %s", name, p.name)
			wantRows, wantAnoms := expectState(truth(r.steps, p.step), node)
			gotRows, gotAnoms := gotState(st)
			require.Equal(r.t, wantRows, gotRows, "%s: %s node %q: rows", name, p.name, node)
			require.Equal(r.t, wantAnoms, gotAnoms, "%s: %s node %q: anomalies", name, p.name, node)
			require.Equal(r.t, r.steps[p.step-1].seq, st.AsOf, "%s: %s: as_of", name, p.name)
		}
	}
	// A time before the bucket's first message, with nothing trimmed, is the empty state.
	st, err := l.State(needsReq(""), replay.Point{Time: r.steps[0].at.Add(-time.Second)})
	require.NoError(r.t, err, name)
	require.Empty(r.t, st.Rows, name)
	require.Empty(r.t, st.Anomalies, name)
	require.Zero(r.t, st.AsOf, name)
}

func TestReplay_StateAtFivePointsFromTheLocalLog(t *testing.T) {
	t.Parallel()
	r := record(t)
	// While the seat runs: replay reads a private copy of the state dir.
	l, err := replay.OpenState(r.dir)
	require.NoError(t, err)
	r.checkStates(l, "running")
	require.NoError(t, l.Close())

	// With the seat stopped.
	r.stop()
	l, err = replay.OpenState(r.dir)
	require.NoError(t, err)
	defer l.Close()
	r.checkStates(l, "stopped")
	entries, err := filepath.Glob(filepath.Join(r.dir, ".replay-*"))
	require.NoError(t, err)
	require.Len(t, entries, 1, "only the open copy; the closed one was removed")
}

func TestReplay_DiffListsExactlyTheChanges(t *testing.T) {
	t.Parallel()
	r := record(t)
	l, err := replay.OpenState(r.dir)
	require.NoError(t, err)
	defer l.Close()
	pts := r.points()
	from, to := pts[1], pts[3]
	pf, _ := replay.ParsePoint(from.at)
	pt, _ := replay.ParsePoint(to.at)
	var d struct {
		Added, Removed                      []replay.Row
		Changed                             []replay.DiffItem
		AnomaliesAppeared, AnomaliesCleared []provisioner.Anomaly
	}
	require.NoError(t, l.DiffEach(context.Background(), needsReq(""), pf, pt, nil, func(it *replay.DiffItem) error {
		switch it.Kind { // keys, revisions and reasons only: no slice of an item outlives the call
		case replay.DiffAdded:
			d.Added = append(d.Added, it.Row)
		case replay.DiffRemoved:
			d.Removed = append(d.Removed, it.Row)
		case replay.DiffChanged:
			d.Changed = append(d.Changed, *it)
		case replay.DiffAppeared:
			d.AnomaliesAppeared = append(d.AnomaliesAppeared, it.Anomaly)
		case replay.DiffCleared:
			d.AnomaliesCleared = append(d.AnomaliesCleared, it.Anomaly)
		}
		return nil
	}))

	// Independently: compare the two truths.
	before, after := truth(r.steps, from.step), truth(r.steps, to.step)
	var added, changed, removed []string
	for k, v := range after {
		if len(strings.Split(k, ".")) != 4 {
			continue
		}
		if w, ok := before[k]; !ok {
			added = append(added, k)
		} else if w.rev != v.rev {
			changed = append(changed, k)
		}
	}
	for k := range before {
		if _, ok := after[k]; !ok && len(strings.Split(k, ".")) == 4 {
			removed = append(removed, k)
		}
	}
	_, anomBefore := expectState(before, "")
	_, anomAfter := expectState(after, "")
	key := func(s string) string { f := strings.Fields(s); return f[0] + " " + f[1] }
	set := func(xs []string) map[string]bool {
		m := map[string]bool{}
		for _, x := range xs {
			m[key(x)] = true
		}
		return m
	}
	var appeared, cleared []string
	for _, x := range anomAfter {
		if !set(anomBefore)[key(x)] {
			appeared = append(appeared, key(x))
		}
	}
	for _, x := range anomBefore {
		if !set(anomAfter)[key(x)] {
			cleared = append(cleared, key(x))
		}
	}
	sort.Strings(added)
	sort.Strings(changed)
	sort.Strings(removed)

	names := func(rows []replay.Row) (out []string) {
		for _, r := range rows {
			out = append(out, r.Key)
		}
		return out
	}
	var gotChanged []string
	for _, c := range d.Changed {
		gotChanged = append(gotChanged, c.Row.Key)
		require.NotEqual(t, c.From.Revision, c.Row.Revision)
	}
	anoms := func(as []provisioner.Anomaly) (out []string) {
		for _, a := range as {
			out = append(out, a.Key+" "+string(a.Reason))
		}
		return out
	}
	require.Equal(t, added, names(d.Added))
	require.Equal(t, changed, gotChanged)
	require.Equal(t, removed, names(d.Removed))
	require.Equal(t, appeared, anoms(d.AnomaliesAppeared))
	require.Equal(t, cleared, anoms(d.AnomaliesCleared))
	require.NotZero(t, len(d.Added)+len(d.Changed)+len(d.Removed)+len(d.AnomaliesAppeared)+len(d.AnomaliesCleared))
	// The script's changes between those points, spelled out.
	require.Equal(t, []string{"n10.m1.config.z", "n3.m1.config.hot"}, added)
	require.Equal(t, []string{"n1.m1.config token-count"}, cleared)
}

func TestReplay_HistoryOutlivesTheBucketsHistory(t *testing.T) {
	t.Parallel()
	r := record(t)
	ctx := context.Background()
	kv, err := r.js.KeyValue(ctx, provisioner.BucketNeeds)
	require.NoError(t, err)
	kept, err := kv.History(ctx, "n3.m1.config.hot")
	require.NoError(t, err)
	require.Len(t, kept, 2, "the bucket keeps two revisions")

	l, err := replay.OpenState(r.dir)
	require.NoError(t, err)
	defer l.Close()
	h, err := l.History(provisioner.BucketNeeds, "n3.m1.config.hot")
	require.NoError(t, err)
	require.Len(t, h.Revisions, 10, "the local log keeps all ten")
	for i, rev := range h.Revisions {
		w := r.steps[10+i]
		require.Equal(t, w.seq, rev.Seq)
		require.Equal(t, provisioner.OpPut, rev.Op)
		require.Equal(t, w.op.Value, rev.Value)
		require.True(t, w.at.Equal(rev.Time))
	}
	// Deletes and purges are revisions too.
	h, err = l.History(provisioner.BucketNeeds, "n1.m1.secret.b")
	require.NoError(t, err)
	var ops []string
	for _, rev := range h.Revisions {
		ops = append(ops, rev.Op.String())
	}
	require.Equal(t, []string{"PUT", "DEL", "PUT"}, ops)
}

func TestReplay_ArchiveAnswersAsTheLocalLog(t *testing.T) {
	t.Parallel()
	r := record(t)
	ctx := context.Background()
	l, err := replay.OpenState(r.dir)
	require.NoError(t, err)
	defer l.Close()
	out := filepath.Join(t.TempDir(), "incident.mph")
	h, err := replay.ExportLog(ctx, l.DB, out, "test", nil)
	require.NoError(t, err)
	require.Equal(t, replay.ArchiveFormat, h.Format)
	require.Len(t, h.Buckets, 4)
	require.Equal(t, provisioner.BucketNeeds, h.Buckets[1].Name)
	require.Equal(t, r.steps[0].seq, h.Buckets[1].FirstSeq)
	require.Equal(t, r.steps[len(r.steps)-1].seq, h.Buckets[1].LastSeq)
	hh, err := replay.ReadArchiveHeader(out)
	require.NoError(t, err)
	require.Equal(t, h.Buckets[1].LastSeq, hh.Buckets[1].LastSeq)

	// On a fresh machine: the archive alone.
	a, err := replay.FromArchive(ctx, out, nil)
	require.NoError(t, err)
	defer a.Close()
	r.checkStates(a, "archive")
	for _, p := range r.points() {
		pt, _ := replay.ParsePoint(p.at)
		want, err := l.State(needsReq(""), pt)
		require.NoError(t, err)
		got, err := a.State(needsReq(""), pt)
		require.NoError(t, err)
		require.Equal(t, want, got, p.name)
	}
	hl, err := l.History(provisioner.BucketNeeds, "n3.m1.config.hot")
	require.NoError(t, err)
	ha, err := a.History(provisioner.BucketNeeds, "n3.m1.config.hot")
	require.NoError(t, err)
	require.Equal(t, hl, ha)
}

func TestReplay_FromTheStreamsKnowsWhatTheyDropped(t *testing.T) {
	t.Parallel()
	r := record(t)
	ctx := context.Background()
	fromNATS, err := replay.FromNATS(ctx, r.js, nil, "nats", nil)
	require.NoError(t, err)
	defer fromNATS.Close()
	out := filepath.Join(t.TempDir(), "streams.mph")
	_, err = replay.ExportNATS(ctx, r.js, nil, out, "test", nil)
	require.NoError(t, err)
	fromArchive, err := replay.FromArchive(ctx, out, nil)
	require.NoError(t, err)
	defer fromArchive.Close()

	pts := r.points()
	for _, l := range []*replay.Log{fromNATS, fromArchive} {
		// The end is exact: the streams keep every key's newest revision.
		pt, _ := replay.ParsePoint(pts[4].at)
		st, err := l.State(needsReq(""), pt)
		require.NoError(t, err, l.Source)
		wantRows, wantAnoms := expectState(truth(r.steps, pts[4].step), "")
		gotRows, gotAnoms := gotState(st)
		require.Equal(t, wantRows, gotRows, l.Source)
		require.Equal(t, wantAnoms, gotAnoms, l.Source)
		// Inside the hot key's revisions the stream dropped messages: refused, not guessed.
		pt, _ = replay.ParsePoint(pts[2].at)
		_, err = l.State(needsReq(""), pt)
		require.Equal(t, 410, query.Code(err), "%s: %v", l.Source, err)
		require.ErrorIs(t, err, store.ErrGap)
		// Before the first dropped message (the put at step 2 went when its key got two newer
		// revisions), the stream is complete.
		pt = replay.Point{Seq: r.steps[0].seq}
		st, err = l.State(needsReq(""), pt)
		require.NoError(t, err, l.Source)
		require.Len(t, st.Rows, 1)
	}
}

func TestReplay_VerbAtEqualsReplayState(t *testing.T) {
	t.Parallel()
	r := record(t)
	l, err := replay.OpenState(r.dir)
	require.NoError(t, err)
	defer l.Close()
	for _, p := range r.points() {
		pt, _ := replay.ParsePoint(p.at)
		for _, node := range []string{"", "n1"} {
			want, err := l.State(needsReq(node), pt)
			require.NoError(t, err)
			req := map[string]any{"what": "needs", "at": p.at, "limit": 2}
			if node != "" {
				req["node"] = node
			}
			for _, asMsgpack := range []bool{false, true} {
				rows, last, err := natstest.AskAll(r.nc, query.Subject, req, asMsgpack)
				require.NoError(t, err, p.name)
				require.Len(t, rows, len(want.Rows), p.name)
				for i, row := range rows {
					require.Equal(t, want.Rows[i].Key, row["key"], p.name)
					require.Equal(t, fmt.Sprint(want.Rows[i].Revision), fmt.Sprint(row["revision"]), p.name)
				}
				var anoms []string
				for _, a := range last.Anomalies {
					anoms = append(anoms, fmt.Sprintf("%s %v", a["key"], a["reason"]))
				}
				var wantAnoms []string
				for _, a := range want.Anomalies {
					wantAnoms = append(wantAnoms, a.Key+" "+a.Text())
				}
				require.Equal(t, wantAnoms, anoms, p.name)
				require.EqualValues(t, len(want.Anomalies), last.AnomaliesTotal)
				require.Equal(t, want.AsOf, last.AsOf, p.name)
			}
		}
	}

	// At the newest point the answer is the live one, rows and anomaly texts alike.
	end := r.points()[4].at
	for _, node := range []string{"", "n1", "n2"} {
		live, _, err := natstest.Ask(r.nc, query.Subject, []byte(fmt.Sprintf(`{"what":"needs","node":%q}`, node)), false)
		require.NoError(t, err)
		at, _, err := natstest.Ask(r.nc, query.Subject, []byte(fmt.Sprintf(`{"what":"needs","node":%q,"at":%q}`, node, end)), false)
		require.NoError(t, err)
		lj, _ := json.Marshal(live)
		aj, _ := json.Marshal(at)
		require.JSONEq(t, string(lj), string(aj), "node %q", node)
	}

	// Bad points are bad requests; plans have no as-of yet.
	for body, code := range map[string]int{
		`{"what":"needs","at":"yesterday"}`:               400,
		`{"what":"needs","at":"seq:x"}`:                   400,
		`{"what":"needs","at":"seq:1","min_seq":1}`:       400,
		`{"what":"plans","at":"seq:1"}`:                   400, // plans read several streams: a time only
		`{"what":"needs","at":"seq:1","after":"n9.nope"}`: 404,
	} {
		_, _, err := natstest.Ask(r.nc, query.Subject, []byte(body), false)
		var ve *natstest.VerbError
		require.ErrorAs(t, err, &ve, body)
		require.Equal(t, code, ve.Code, body)
	}

	// Trimmed past a point: 410; points from the floor on still answer, and equal what they were.
	ctx := context.Background()
	horizon := r.steps[9]
	_, err = r.seat.Store().TrimHistory(ctx, provisioner.BucketNeeds, horizon.seq, horizon.at.UnixNano())
	require.NoError(t, err)
	_, _, err = natstest.Ask(r.nc, query.Subject, []byte(fmt.Sprintf(`{"what":"needs","at":%q}`, r.points()[0].at)), false)
	var ve *natstest.VerbError
	require.ErrorAs(t, err, &ve)
	require.Equal(t, 410, ve.Code)
	require.Contains(t, ve.Description, "trimmed")
	_, _, err = natstest.Ask(r.nc, query.Subject, []byte(fmt.Sprintf(`{"what":"needs","at":%q}`, r.steps[0].at.Add(-time.Second).Format(time.RFC3339Nano))), false)
	require.ErrorAs(t, err, &ve, "a time before the first message, once trimmed, is no longer known to be empty")
	require.Equal(t, 410, ve.Code)
	for _, p := range r.points()[2:] {
		pt, _ := replay.ParsePoint(p.at)
		want, err := l.State(needsReq(""), pt) // l is a copy made before the trim
		require.NoError(t, err)
		rows, last, err := natstest.AskAll(r.nc, query.Subject, map[string]any{"what": "needs", "at": p.at}, false)
		require.NoError(t, err, p.name)
		require.Len(t, rows, len(want.Rows), p.name)
		require.Equal(t, want.AsOf, last.AsOf)
	}
}

// TestParsePoint_RFC3339 reads times as RFC 3339 writes them, lower-case t and z included, and
// refuses what it does not.
func TestParsePoint_RFC3339(t *testing.T) {
	t.Parallel()
	want := time.Date(2026, 11, 2, 3, 12, 0, 500_000_000, time.UTC)
	for _, s := range []string{"2026-11-02T03:12:00.5Z", "2026-11-02t03:12:00.5z", "2026-11-02T04:12:00.5+01:00"} {
		p, err := replay.ParsePoint(s)
		require.NoError(t, err, s)
		require.True(t, p.Time.Equal(want), "%s: %s", s, p.Time)
	}
	p, err := replay.ParsePoint("seq:42")
	require.NoError(t, err)
	require.EqualValues(t, 42, p.Seq)
	for _, s := range []string{"2026-11-02", "2026-11-02x03:12:00Z", "seq:", "seq:-1", "SEQ:4", "yesterday"} {
		_, err := replay.ParsePoint(s)
		require.Error(t, err, s)
	}
}
