package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/replay"
	"github.com/novox/mesh-provisioner/seat"
	"github.com/novox/mesh-provisioner/store"
)

// The forensics model test: a seeded history of puts, overwrites, deletes, purges, TTL markers,
// out-of-shape keys and values that are not MessagePack, published to real buckets while a seat reads
// them, recorded here message by message (sequence, server time, subject, operation, data). The
// history of every key and what changed between many pairs of points are then asked of every source
// (the seat's log, the streams, an archive of each) and compared with what the record alone says, by
// rules written out plainly below rather than with the code's parser or fold.

// fmsg is one recorded message.
type fmsg struct {
	bucket, key string
	op          provisioner.Op
	value       []byte
	seq         uint64
	time        time.Time
}

func (m fmsg) natsMsg() *nats.Msg {
	msg := nats.NewMsg("$KV." + m.bucket + "." + m.key)
	switch m.op {
	case provisioner.OpDelete:
		msg.Header.Set("KV-Operation", "DEL")
	case provisioner.OpPurge:
		msg.Header.Set("KV-Operation", "PURGE")
		msg.Header.Set("Nats-Rollup", "sub")
	case provisioner.OpExpire:
		msg.Header.Set("Nats-Marker-Reason", "MaxAge")
	default:
		msg.Data = m.value
	}
	return msg
}

// The record's buckets keep fmHistory revisions of a key: older ones leave the streams (and --nats
// knows them as gaps), never the seat's log, which reads every phase before the next.
const fmHistory = 6

var fmKeys = map[string][]string{
	provisioner.BucketNeeds: {"n1.m1.config.a", "n1.m1.secret.b", "n1.m2.zzkind.a", "n2.m1.config.a", "n2.m2.port.x",
		"n1.m1.config", "n2.a.b.c.d", "n10.m1.config.a", "n1.m1.config.hot"},
	provisioner.BucketApplied: {"n1.m1", "n1.m2", "n2.m1", "n1", "n2.m1.x"},
	provisioner.BucketCollect: {"n1.shell=3Azsh.m1", "n1.plain.m2", "n2.a=2Eb.m1", "n1.c", "n2.x.y.z"},
}

// fmTokens is each bucket's token count (CONTRACT section 1); the keys above hold no other fault.
var fmTokens = map[string]int{provisioner.BucketNeeds: 4, provisioner.BucketApplied: 2, provisioner.BucketCollect: 3}

// fmTable is the registry table's kinds (CONTRACT section 4); zzkind is none of them.
var fmTable = []string{"config", "secret", "bound", "consumers", "collected", "shell", "environment", "contribution",
	"dir", "access", "port", "seat", "machine"}

var fmNotMsgpack = [][]byte{{0xc1}, {0x92, 0x01}, {0xa3, 'a'}}

// fmPhase draws one phase: no key is written fmHistory times in a phase, and only a key not written in
// the phase is purged, so the seat, which reads each phase to its end before the next, reads every
// message the streams later drop.
func fmPhase(r *rand.Rand, n int) []fmsg {
	var out []fmsg
	count := map[string]int{}
	buckets := []string{provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect}
	for len(out) < n {
		b := buckets[r.IntN(len(buckets))]
		key := fmKeys[b][r.IntN(len(fmKeys[b]))]
		if r.IntN(3) == 0 {
			b, key = provisioner.BucketNeeds, "n1.m1.config.hot"
		}
		id := b + " " + key
		if count[id] >= fmHistory-1 {
			continue
		}
		m := fmsg{bucket: b, key: key, op: provisioner.OpPut}
		switch x := r.IntN(20); {
		case x < 2:
			m.op = provisioner.OpDelete
		case x < 3 && count[id] == 0:
			m.op = provisioner.OpPurge
		case x < 4:
			m.op = provisioner.OpExpire
		case x < 6:
			m.value = fmNotMsgpack[r.IntN(len(fmNotMsgpack))]
		default:
			v, err := msgpack.Marshal(map[string]any{"n": r.IntN(1000), "s": strings.Repeat("v", r.IntN(4))})
			if err != nil {
				panic(err)
			}
			m.value = v
		}
		if m.op == provisioner.OpPurge {
			count[id] = fmHistory // nothing more of the key in this phase
		} else {
			count[id]++
		}
		out = append(out, m)
	}
	return out
}

// fmRecord publishes the phases one message at a time (each with its server time read back), waiting
// for the seat to apply each phase before the next.
type fmRecord struct {
	msgs    []fmsg
	created map[string]time.Time // each stream's creation time
}

// bucketMsgs is the record of one bucket.
func (r *fmRecord) bucketMsgs(bucket string) []fmsg {
	var out []fmsg
	for _, m := range r.msgs {
		if m.bucket == bucket {
			out = append(out, m)
		}
	}
	return out
}

// inStream reports whether a message of the record is still in its stream: not followed by a purge of
// its key, nor by fmHistory more messages of it (the KV history limit, per subject).
func inStream(msgs []fmsg, i int) bool {
	later := 0
	for _, m := range msgs[i+1:] {
		if m.key != msgs[i].key {
			continue
		}
		if m.op == provisioner.OpPurge {
			return false
		}
		if later++; later >= fmHistory {
			return false
		}
	}
	return true
}

// fmSource is what one source holds of a bucket: every message (the seat's log), or those the stream
// still holds; and the points it rebuilds exactly.
type fmSource struct {
	name         string
	streams      bool              // holds what the streams hold
	floors       map[string]uint64 // per bucket: the floor the log was trimmed to (none: 0)
	log          *replay.Log
	revs         revisionSource    // the history's source when not log: the bucket's stream itself
	firstMissing map[string]uint64 // per bucket: the first sequence the stream dropped (0: none)
	last         map[string]uint64 // per bucket: the stream's last sequence
}

// exact reports whether the source rebuilds bucket as of n: the seat's log every point; the streams'
// every point before the first message they dropped, and from their last message on (the projector's
// gap closes at the message read with nothing pending, store/doc.go).
func (s fmSource) exact(bucket string, n uint64) bool {
	if n < s.floors[bucket] {
		return false
	}
	fm := s.firstMissing[bucket]
	return !s.streams || fm == 0 || n < fm || n >= s.last[bucket]
}

// fmRow is a row as the model holds it.
type fmRow struct {
	key   string
	rev   uint64
	time  time.Time
	value []byte
}

// modelAt is a bucket's keys as of sequence n: each key's newest message at or below n, when a put.
func modelAt(msgs []fmsg, n uint64) map[string]fmRow {
	st := map[string]fmRow{}
	for _, m := range msgs {
		if m.seq > n {
			break
		}
		if m.op == provisioner.OpPut {
			st[m.key] = fmRow{key: m.key, rev: m.seq, time: m.time, value: m.value}
		} else {
			delete(st, m.key)
		}
	}
	return st
}

// modelSeqAt is the last sequence of msgs stamped at or before t; 0 when none is.
func modelSeqAt(msgs []fmsg, t time.Time) uint64 {
	var n uint64
	for _, m := range msgs {
		if !m.time.After(t) {
			n = m.seq
		}
	}
	return n
}

func modelNotMsgpack(v []byte) bool {
	for _, b := range fmNotMsgpack {
		if bytes.Equal(v, b) {
			return true
		}
	}
	return false
}

// modelAnomalies is the anomaly rows of a state, "key reason revision", narrowed by node (the raw
// key's first token).
func modelAnomalies(bucket string, st map[string]fmRow, node string) map[string]uint64 {
	out := map[string]uint64{}
	for k, r := range st {
		toks := strings.Split(k, ".")
		if node != "" && toks[0] != node {
			continue
		}
		if len(toks) != fmTokens[bucket] {
			out[k+" token-count"] = r.rev
			continue
		}
		if modelNotMsgpack(r.value) {
			out[k+" value-not-msgpack"] = r.rev
		}
		if bucket == provisioner.BucketNeeds && !slices.Contains(fmTable, toks[2]) {
			out[k+" unanswered-kind"] = r.rev
		}
	}
	return out
}

// diffJSON is replay diff --json.
type diffJSON struct {
	What    string `json:"what"`
	From    uint64 `json:"from_as_of"`
	To      uint64 `json:"to_as_of"`
	Added   []rowJ `json:"added"`
	Changed []struct {
		Key  string `json:"key"`
		From rowJ   `json:"from"`
		To   rowJ   `json:"to"`
	} `json:"changed"`
	Removed           []rowJ `json:"removed"`
	AnomaliesAppeared []struct {
		Key      string `json:"key"`
		Revision uint64 `json:"revision"`
		Reason   string `json:"reason"`
	} `json:"anomalies_appeared"`
	AnomaliesCleared []struct {
		Key      string `json:"key"`
		Revision uint64 `json:"revision"`
		Reason   string `json:"reason"`
	} `json:"anomalies_cleared"`
}

type rowJ struct {
	Key      string          `json:"key"`
	Revision uint64          `json:"revision"`
	Created  time.Time       `json:"created"`
	Value    json.RawMessage `json:"value"`
	ValueRaw []byte          `json:"value_raw"`
}

// line is a row as compared: key, revision, time, value bytes.
func (r rowJ) line(t *testing.T) string {
	v := r.ValueRaw
	if string(r.Value) != "null" || v == nil {
		var x any
		require.NoError(t, json.Unmarshal(r.Value, &x))
		v = canon(x)
	}
	return fmt.Sprintf("%s %d %s %x", r.Key, r.Revision, r.Created.UTC().Format(time.RFC3339Nano), v)
}

func (r fmRow) line() string {
	return fmt.Sprintf("%s %d %s %x", r.key, r.rev, r.time.UTC().Format(time.RFC3339Nano), r.valueBytes())
}

// fmPoint is a point as asked and the sequence the model resolves it to, or gone when the source cannot
// rebuild it.
type fmPoint struct {
	text string
	seq  uint64
	time bool
}

// resolve is the sequence a point names in msgs, and whether src answers it (a time also needs the
// message after it known: whether it came before the time is otherwise not known).
func resolve(src fmSource, bucket string, msgs []fmsg, created time.Time, p fmPoint) (uint64, bool) {
	last := msgs[len(msgs)-1].seq
	if !p.time {
		n := min(p.seq, last)
		return n, src.exact(bucket, n)
	}
	t, err := time.Parse(time.RFC3339Nano, p.text)
	if err != nil {
		panic(err)
	}
	n := modelSeqAt(msgs, t)
	if n == 0 && t.Before(created) && src.floors[bucket] == 0 {
		return 0, true
	}
	return n, src.exact(bucket, n) && (n == last || src.exact(bucket, n+1))
}

func TestReplayCommand_HistoryAndDiffAgainstAModel(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	url := ns.ClientURL()
	nc, js := natstest.Connect(t, url)
	ctx := context.Background()
	rec := &fmRecord{created: map[string]time.Time{}}
	streams := map[string]jetstream.Stream{}
	buckets := []string{provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect}
	for _, b := range buckets {
		_, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: b, History: fmHistory})
		require.NoError(t, err)
		s, err := js.Stream(ctx, provisioner.StreamName(b))
		require.NoError(t, err)
		streams[b] = s
		rec.created[b] = s.CachedInfo().Created
	}

	dir := filepath.Join(t.TempDir(), "state")
	db, err := store.OpenState(dir, store.Options{})
	require.NoError(t, err)
	snc, sjs := natstest.Connect(t, url)
	st, err := seat.Start(ctx, snc, sjs, db, seat.Config{WriteRegistry: true, Projector: projector.Options{Poll: 20 * time.Millisecond}})
	require.NoError(t, err)
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			require.NoError(t, st.Stop())
			require.NoError(t, db.Close())
		}
	}
	t.Cleanup(stop)
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		if seq, _ := db.Applied(provisioner.BucketRegistry); seq < uint64(len(provisioner.Registry.Entries)) {
			return fmt.Errorf("registry applied %d", seq)
		}
		return nil
	})

	r := rand.New(rand.NewPCG(27, 2026))
	for phase := 0; phase < 12; phase++ {
		msgs := fmPhase(r, 60)
		for i := range msgs {
			ack, err := js.PublishMsg(ctx, msgs[i].natsMsg())
			require.NoError(t, err)
			raw, err := streams[msgs[i].bucket].GetMsg(ctx, ack.Sequence)
			require.NoError(t, err)
			msgs[i].seq, msgs[i].time = ack.Sequence, raw.Time
		}
		rec.msgs = append(rec.msgs, msgs...)
		natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
			for _, b := range buckets {
				bm := rec.bucketMsgs(b)
				if len(bm) == 0 {
					continue
				}
				if seq, _ := db.Applied(b); seq < bm[len(bm)-1].seq {
					return fmt.Errorf("%s applied %d of %d", b, seq, bm[len(bm)-1].seq)
				}
			}
			return nil
		})
	}

	// The sources.
	stateLog, err := replay.OpenState(dir)
	require.NoError(t, err)
	defer stateLog.Close()
	natsLog, err := replay.FromNATS(ctx, js, nil, "nats", nil)
	require.NoError(t, err)
	defer natsLog.Close()
	stateArchive := filepath.Join(t.TempDir(), "state.mph")
	_, err = replay.ExportLog(ctx, stateLog.DB, stateArchive, "test", nil)
	require.NoError(t, err)
	natsArchive := filepath.Join(t.TempDir(), "nats.mph")
	_, err = replay.ExportNATS(ctx, js, nil, natsArchive, "test", nil)
	require.NoError(t, err)
	fromStateArchive, err := replay.FromArchive(ctx, stateArchive, nil)
	require.NoError(t, err)
	defer fromStateArchive.Close()
	fromNATSArchive, err := replay.FromArchive(ctx, natsArchive, nil)
	require.NoError(t, err)
	defer fromNATSArchive.Close()

	firstMissing, last := map[string]uint64{}, map[string]uint64{}
	for _, b := range buckets {
		bm := rec.bucketMsgs(b)
		last[b] = bm[len(bm)-1].seq
		for i := range bm {
			if !inStream(bm, i) {
				firstMissing[b] = bm[i].seq
				break
			}
		}
		require.NotZero(t, firstMissing[b], "%s: the streams dropped messages", b)
	}
	sources := []fmSource{
		{name: "state", log: stateLog},
		{name: "nats", streams: true, log: natsLog, firstMissing: firstMissing, last: last},
		{name: "archive of state", log: fromStateArchive},
		{name: "archive of nats", streams: true, log: fromNATSArchive, firstMissing: firstMissing, last: last},
	}

	// The history of every key; replay history --nats reads the key's own messages from the stream.
	for _, src := range sources {
		checkHistories(t, rec, src)
	}
	checkHistories(t, rec, fmSource{name: "stream", streams: true, revs: streamRevisions{js: js}, firstMissing: firstMissing, last: last})

	// What changed between pairs of points, by sequence and by time.
	zones := []*time.Location{time.UTC, time.FixedZone("", 5*3600+30*60), time.FixedZone("", -7*3600)}
	checkDiffs(t, r, rec, sources, firstMissing, nil)

	// The verb's at on the live seat answers what the model says, by sequence and by time.
	bm := rec.bucketMsgs(provisioner.BucketNeeds)
	for i := 0; i < 10; i++ {
		m := bm[r.IntN(len(bm))]
		for _, at := range []string{fmt.Sprintf("seq:%d", m.seq), m.time.In(zones[i%3]).Format(time.RFC3339Nano)} {
			rows, ans, err := natstest.AskAll(nc, query.Subject, map[string]any{"what": "needs", "at": at, "limit": 3}, i%2 == 0)
			require.NoError(t, err, at)
			var got, want []string
			for _, row := range rows {
				got = append(got, fmt.Sprintf("%v %v", row["key"], row["revision"]))
			}
			for k, r := range modelAt(bm, m.seq) {
				if len(strings.Split(k, ".")) == 4 {
					want = append(want, fmt.Sprintf("%s %d", k, r.rev))
				}
			}
			sort.Strings(want)
			require.Equal(t, want, got, "at %s", at)
			require.Equal(t, m.seq, ans.AsOf, "at %s", at)
		}
	}

	// Trimmed: the log and an archive of it answer from the floor on, and keep of every key, at or
	// below the floor, its newest message when a put.
	floors := map[string]uint64{}
	for _, b := range buckets {
		bm := rec.bucketMsgs(b)
		h := bm[len(bm)/2]
		floors[b] = h.seq
		_, err := db.TrimHistory(ctx, b, h.seq, h.time.UnixNano())
		require.NoError(t, err)
	}
	// The trim commits without a sync, as the seat's own does: a copy made beside a running seat an
	// instant later may read the log as it was just before. Stopped, the seat's store is all on disk.
	stop()
	trimmed, err := replay.OpenState(dir)
	require.NoError(t, err)
	defer trimmed.Close()
	trimmedArchive := filepath.Join(t.TempDir(), "trimmed.mph")
	_, err = replay.ExportLog(ctx, trimmed.DB, trimmedArchive, "test", nil)
	require.NoError(t, err)
	fromTrimmedArchive, err := replay.FromArchive(ctx, trimmedArchive, nil)
	require.NoError(t, err)
	defer fromTrimmedArchive.Close()
	trimmedSources := []fmSource{{name: "trimmed state", log: trimmed, floors: floors},
		{name: "archive of trimmed state", log: fromTrimmedArchive, floors: floors}}
	for _, src := range trimmedSources {
		checkHistories(t, rec, src)
	}
	checkDiffs(t, r, rec, trimmedSources, firstMissing, floors)
}

// valueBytes is the value as JSON output can say it: MessagePack read into JSON and written again (a
// JSON number is a float), or the raw bytes when it is not MessagePack.
// checkHistories compares the history of every key a source holds with the record: every message of
// the key, or those the stream still holds; below a floor, only the key's newest message at or below
// it, when a put.
func checkHistories(t *testing.T, rec *fmRecord, src fmSource) {
	t.Helper()
	for _, b := range []string{provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect} {
		bm := rec.bucketMsgs(b)
		floor := src.floors[b]
		for _, key := range fmKeys[b] {
			var want []string
			for i, m := range bm {
				if m.key != key || (src.streams && !inStream(bm, i)) {
					continue
				}
				if m.seq <= floor {
					newest := true
					for _, o := range bm[i+1:] {
						if o.key == key && o.seq <= floor {
							newest = false
						}
					}
					if !newest || m.op != provisioner.OpPut {
						continue
					}
				}
				line := fmt.Sprintf("%d %s %s", m.seq, m.time.UTC().Format(time.RFC3339Nano), m.op)
				if m.op == provisioner.OpPut {
					line += fmt.Sprintf(" %x", fmRow{value: m.value}.valueBytes())
				}
				want = append(want, line)
			}
			var revs revisionSource = src.log
			if src.revs != nil {
				revs = src.revs
			}
			got, marks := historyOf(t, revs, src.name, b, key)
			require.Equal(t, want, got, "%s: history of %s %s", src.name, b, key)
			// What the log cannot show: the floor, and the streams' one gap, from the first message
			// they dropped to their last message, where the read caught up.
			wantMarks := fmt.Sprintf("floor %d gaps []", floor)
			if src.streams {
				wantMarks = fmt.Sprintf("floor %d gaps [{%d %d}]", floor, src.firstMissing[b], src.last[b])
			}
			require.Equal(t, wantMarks, marks, "%s: history of %s %s", src.name, b, key)
		}
	}
}

func (r fmRow) valueBytes() []byte {
	v := r.value
	if modelNotMsgpack(v) {
		return v
	}
	var x any
	if err := msgpack.Unmarshal(v, &x); err != nil {
		panic(err)
	}
	b, err := json.Marshal(x)
	if err != nil {
		panic(err)
	}
	var y any
	if err := json.Unmarshal(b, &y); err != nil {
		panic(err)
	}
	return canon(y)
}

// canon writes a value as MessagePack with its map keys sorted, so that equal values compare equal.
func canon(x any) []byte {
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	enc.SetSortMapKeys(true)
	if err := enc.Encode(x); err != nil {
		panic(err)
	}
	return buf.Bytes()
}

// historyOf runs replay history --json on a log, as "seq time op [value hex]" lines, and checks the
// table says as many revisions.
func historyOf(t *testing.T, l revisionSource, source, bucket, key string) ([]string, string) {
	t.Helper()
	var out bytes.Buffer
	c := &ReplayCommand{Stdout: &out, Stderr: io.Discard, jsonOut: true}
	err := c.runHistory(context.Background(), l, source, bucket, key)
	var h struct {
		Revisions []struct {
			Revision uint64          `json:"revision"`
			Time     time.Time       `json:"time"`
			Op       string          `json:"op"`
			Value    json.RawMessage `json:"value"`
			ValueRaw []byte          `json:"value_raw"`
		} `json:"revisions"`
		Floor uint64 `json:"floor"`
		Gaps  []struct {
			From uint64 `json:"from"`
			To   uint64 `json:"to"`
		} `json:"gaps"`
	}
	require.NoError(t, json.Unmarshal(out.Bytes(), &h), "%s: %v", out.String(), err)
	var lines []string
	for _, r := range h.Revisions {
		line := fmt.Sprintf("%d %s %s", r.Revision, r.Time.UTC().Format(time.RFC3339Nano), r.Op)
		if r.Op == "PUT" {
			v := r.ValueRaw
			if v == nil {
				var x any
				require.NoError(t, json.Unmarshal(r.Value, &x))
				v = canon(x)
			}
			line += fmt.Sprintf(" %x", v)
		}
		lines = append(lines, line)
	}
	if len(lines) == 0 {
		var ve *verbError
		require.ErrorAs(t, err, &ve)
		require.Equal(t, 404, ve.code)
	} else {
		require.NoError(t, err)
	}
	// The table says the same count.
	out.Reset()
	c.jsonOut = false
	_ = c.runHistory(context.Background(), l, source, bucket, key)
	require.Contains(t, out.String(), fmt.Sprintf("\n%d revisions of %s", len(lines), key))
	return lines, fmt.Sprintf("floor %d gaps %v", h.Floor, h.Gaps)
}

// checkDiff asks replay diff --json of a source and compares it with the model.
func checkDiff(t *testing.T, src fmSource, bucket string, msgs []fmsg, created time.Time, pf, pt fmPoint, node string, seen map[string]int) {
	t.Helper()
	name := fmt.Sprintf("%s: diff %s --from %s --to %s --node %q", src.name, bucket, pf.text, pt.text, node)
	shape, _ := provisioner.ShapeOf(bucket)
	what := string(shape.What)
	req := query.Request{What: what, Node: node}
	from, err := replay.ParsePoint(pf.text)
	require.NoError(t, err)
	to, err := replay.ParsePoint(pt.text)
	require.NoError(t, err)
	var out bytes.Buffer
	c := &ReplayCommand{Stdout: &out, Stderr: io.Discard, jsonOut: true, from: pf.text, to: pt.text}
	err = c.runDiff(context.Background(), src.log, req, from, to)

	nf, okf := resolve(src, bucket, msgs, created, pf)
	nt, okt := resolve(src, bucket, msgs, created, pt)
	if !okf || !okt {
		var ve *verbError
		require.ErrorAs(t, err, &ve, "%s: want 410 (model as of %d/%v to %d/%v), got %s", name, nf, okf, nt, okt, out.String())
		require.Equal(t, 410, ve.code, name)
		seen[src.name+" 410"]++
		return
	}
	if nf > nt {
		var ue *usageError
		require.ErrorAs(t, err, &ue, "%s: from after to", name)
		seen["reversed"]++
		return
	}
	require.NoError(t, err, name)
	var d diffJSON
	require.NoError(t, json.Unmarshal(out.Bytes(), &d), name)
	require.Equal(t, nf, d.From, "%s: from_as_of", name)
	require.Equal(t, nt, d.To, "%s: to_as_of", name)

	a, b := modelAt(msgs, nf), modelAt(msgs, nt)
	inShape := func(k string) bool {
		toks := strings.Split(k, ".")
		return len(toks) == fmTokens[bucket] && (node == "" || toks[0] == node)
	}
	var added, changed, removed []string
	for k, rb := range b {
		if !inShape(k) {
			continue
		}
		if ra, ok := a[k]; !ok {
			added = append(added, rb.line())
		} else if ra.rev != rb.rev {
			changed = append(changed, ra.line()+" -> "+rb.line())
		}
	}
	for k, ra := range a {
		if _, ok := b[k]; !ok && inShape(k) {
			removed = append(removed, ra.line())
		}
	}
	sort.Strings(added)
	sort.Strings(changed)
	sort.Strings(removed)
	var gotAdded, gotChanged, gotRemoved []string
	for _, r := range d.Added {
		gotAdded = append(gotAdded, r.line(t))
	}
	for _, ch := range d.Changed {
		require.Equal(t, ch.Key, ch.To.Key, name)
		gotChanged = append(gotChanged, ch.From.line(t)+" -> "+ch.To.line(t))
	}
	for _, r := range d.Removed {
		gotRemoved = append(gotRemoved, r.line(t))
	}
	require.Equal(t, added, gotAdded, "%s: added", name)
	require.Equal(t, changed, gotChanged, "%s: changed", name)
	require.Equal(t, removed, gotRemoved, "%s: removed", name)

	ma, mb := modelAnomalies(bucket, a, node), modelAnomalies(bucket, b, node)
	var appeared, cleared []string
	for id, rev := range mb {
		if _, ok := ma[id]; !ok {
			appeared = append(appeared, fmt.Sprintf("%s %d", id, rev))
		}
	}
	for id, rev := range ma {
		if _, ok := mb[id]; !ok {
			cleared = append(cleared, fmt.Sprintf("%s %d", id, rev))
		}
	}
	sort.Strings(appeared)
	sort.Strings(cleared)
	var gotAppeared, gotCleared []string
	for _, x := range d.AnomaliesAppeared {
		code, _, _ := strings.Cut(x.Reason, ":")
		gotAppeared = append(gotAppeared, fmt.Sprintf("%s %s %d", x.Key, code, x.Revision))
	}
	for _, x := range d.AnomaliesCleared {
		code, _, _ := strings.Cut(x.Reason, ":")
		gotCleared = append(gotCleared, fmt.Sprintf("%s %s %d", x.Key, code, x.Revision))
	}
	sort.Strings(gotAppeared)
	sort.Strings(gotCleared)
	require.Equal(t, appeared, gotAppeared, "%s: anomalies appeared", name)
	require.Equal(t, cleared, gotCleared, "%s: anomalies cleared", name)

	if len(added)+len(changed)+len(removed) > 0 && len(appeared)+len(cleared) > 0 {
		seen[src.name+" rows and anomalies changed"]++
	}
	// The table says the same counts.
	out.Reset()
	c.jsonOut = false
	require.NoError(t, c.runDiff(context.Background(), src.log, req, from, to), name)
	if len(added)+len(changed)+len(removed)+len(appeared)+len(cleared) == 0 {
		require.Contains(t, out.String(), "no changes", name)
	} else {
		require.Contains(t, out.String(), fmt.Sprintf("%d added, %d changed, %d removed; %d anomalies appeared, %d cleared",
			len(added), len(changed), len(removed), len(appeared), len(cleared)), name)
	}
}

// checkDiffs asks each source what changed between random pairs of points, chosen among edge points
// (before the stream, before its first message, its last, past it, the first message the streams
// dropped, the floor) and messages' own times and sequences.
func checkDiffs(t *testing.T, r *rand.Rand, rec *fmRecord, sources []fmSource, firstMissing, floors map[string]uint64) {
	t.Helper()
	zones := []*time.Location{time.UTC, time.FixedZone("", 5*3600+30*60), time.FixedZone("", -7*3600)}
	seen := map[string]int{}
	for _, b := range []string{provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect} {
		bm := rec.bucketMsgs(b)
		lastSeq := bm[len(bm)-1].seq
		points := []fmPoint{{text: "seq:0"}, {text: "seq:1", seq: 1},
			{text: fmt.Sprintf("seq:%d", lastSeq), seq: lastSeq}, {text: fmt.Sprintf("seq:%d", lastSeq+10), seq: lastSeq + 10},
			{text: fmt.Sprintf("seq:%d", firstMissing[b]-1), seq: firstMissing[b] - 1},
			{text: fmt.Sprintf("seq:%d", firstMissing[b]), seq: firstMissing[b]}}
		timePoint := func(tm time.Time) fmPoint {
			return fmPoint{text: tm.In(zones[r.IntN(len(zones))]).Format(time.RFC3339Nano), time: true}
		}
		points = append(points,
			timePoint(rec.created[b].Add(-time.Second)),              // before the stream
			timePoint(bm[0].time.Add(-time.Nanosecond)),              // after the stream's creation, before its first message
			timePoint(bm[len(bm)-1].time.Add(time.Hour)),             // after the last
			timePoint(bm[len(bm)-1].time),                            // the last, exactly
			timePoint(time.Date(9999, 12, 31, 0, 0, 0, 0, time.UTC)), // past every message
		)
		if f := floors[b]; f > 0 {
			for _, m := range bm {
				if m.seq == f {
					points = append(points, fmPoint{text: fmt.Sprintf("seq:%d", f), seq: f}, fmPoint{text: fmt.Sprintf("seq:%d", f-1), seq: f - 1},
						timePoint(m.time), timePoint(m.time.Add(-time.Nanosecond)))
				}
			}
		}
		for i := 0; i < 14; i++ {
			m := bm[r.IntN(len(bm))]
			points = append(points, fmPoint{text: fmt.Sprintf("seq:%d", m.seq), seq: m.seq})
			switch i % 3 {
			case 0:
				points = append(points, timePoint(m.time)) // exactly a message's time: included
			case 1:
				points = append(points, timePoint(m.time.Add(-time.Nanosecond)))
			default:
				points = append(points, timePoint(m.time.Add(time.Nanosecond)))
			}
		}
		for _, src := range sources {
			for i := 0; i < 60; i++ {
				pf, pt := points[r.IntN(len(points))], points[r.IntN(len(points))]
				nf, _ := resolve(fmSource{}, b, bm, rec.created[b], pf)
				nt, _ := resolve(fmSource{}, b, bm, rec.created[b], pt)
				if nf > nt && i%5 != 0 {
					pf, pt = pt, pf // mostly in order; every fifth pair as drawn
				}
				node := ""
				if i%4 == 0 {
					node = "n1"
				}
				checkDiff(t, src, b, bm, rec.created[b], pf, pt, node, seen)
			}
		}
	}
	// The draw reached every outcome of every source.
	for _, src := range sources {
		require.NotZero(t, seen[src.name+" rows and anomalies changed"], "%s: %v", src.name, seen)
		if src.streams || floors != nil {
			require.NotZero(t, seen[src.name+" 410"], "%s: %v", src.name, seen)
		}
	}
	require.NotZero(t, seen["reversed"], "%v", seen)
}
