package seat_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/nats-io/nats.go/micro"
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
	"github.com/novox/mesh-provisioner/internal/verbcheck"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/seat"
	"github.com/novox/mesh-provisioner/store"
)

// testMesh is small enough to compare every answer in both formats, large enough to page.
var testMesh = fixtures.Mesh{Seed: 7, Nodes: 24, Modules: 4, NeedsPerModule: 3, Collections: 4, BadKeys: 3, BadValues: 2}

type harness struct {
	t   *testing.T
	url string
	nc  *nats.Conn
	js  jetstream.JetStream
}

func newHarness(t *testing.T) *harness {
	ns := natstest.RunServer(t)
	nc, js := natstest.Connect(t, ns.ClientURL())
	return &harness{t: t, url: ns.ClientURL(), nc: nc, js: js}
}

// startSeat opens the state dir and starts a seat on its own connection; the returned stop stops the
// seat and closes the store, and runs at cleanup too if the test did not call it.
func (h *harness) startSeat(dir string) (*seat.Seat, func()) {
	h.t.Helper()
	return h.startSeatWith(dir, projector.Options{})
}

// startSeatWith is startSeat with the projector's options (Poll and Verify are the harness's).
func (h *harness) startSeatWith(dir string, popts projector.Options) (*seat.Seat, func()) {
	h.t.Helper()
	nc, js := natstest.Connect(h.t, h.url)
	db, err := store.OpenState(dir, store.Options{})
	require.NoError(h.t, err)
	popts.Poll, popts.Verify = 50*time.Millisecond, 200*time.Millisecond
	st, err := seat.Start(context.Background(), nc, js, db, seat.Config{WriteRegistry: true, Projector: popts})
	require.NoError(h.t, err)
	done := false
	stop := func() {
		if done {
			return
		}
		done = true
		require.NoError(h.t, st.Stop())
		require.NoError(h.t, db.Close())
		nc.Close()
	}
	h.t.Cleanup(stop)
	natstest.CheckFor(h.t, 10*time.Second, 10*time.Millisecond, func() error {
		if passes, _ := st.Registry.Stats(); passes == 0 {
			return fmt.Errorf("registry not written yet")
		}
		return nil
	})
	return st, stop
}

// waitCaughtUp waits until every provisioner bucket's projection has applied its stream's last
// sequence, after the seat's registry writer (if it has one) ended its first pass, written or failed:
// before that the registry stream's end moves on, and with it the needs' unanswered-kind anomalies.
func (h *harness) waitCaughtUp(st *seat.Seat) {
	h.t.Helper()
	natstest.CheckFor(h.t, 20*time.Second, 20*time.Millisecond, func() error {
		if st.Registry != nil {
			if passes, _ := st.Registry.Stats(); passes == 0 && st.Registry.Failures() == 0 {
				return fmt.Errorf("registry not written yet")
			}
		}
		for _, s := range provisioner.ProvisionerShapes {
			stream, err := h.js.Stream(context.Background(), provisioner.StreamName(s.Bucket))
			if err != nil {
				return err
			}
			info, err := stream.Info(context.Background())
			if err != nil {
				return err
			}
			seq, synced := st.Store().Applied(s.Bucket)
			if !synced || seq < info.State.LastSeq {
				return fmt.Errorf("%s: applied %d of %d, synced %v", s.Bucket, seq, info.State.LastSeq, synced)
			}
		}
		return nil
	})
}

func (h *harness) load(ops []fixtures.Op) {
	h.t.Helper()
	require.NoError(h.t, fixtures.Load(context.Background(), h.js, ops, 256, nil))
}

// kvEntry is a key as the KV API reads it: the independent truth the verb is compared with.
type kvEntry struct {
	key     string
	value   []byte
	rev     uint64
	created time.Time
}

func (h *harness) bucket(name string) map[string]kvEntry {
	h.t.Helper()
	ctx := context.Background()
	kv, err := h.js.KeyValue(ctx, name)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		return map[string]kvEntry{}
	}
	require.NoError(h.t, err)
	lister, err := kv.ListKeys(ctx)
	require.NoError(h.t, err)
	out := map[string]kvEntry{}
	for k := range lister.Keys() {
		e, err := kv.Get(ctx, k)
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			continue
		}
		require.NoError(h.t, err)
		out[k] = kvEntry{key: k, value: e.Value(), rev: e.Revision(), created: e.Created()}
	}
	return out
}

// shapeOK and isMsgpack are the independent truth's rules (internal/verbcheck), not the seat's.
var (
	shapeOK   = verbcheck.Shape
	isMsgpack = verbcheck.IsMsgpack
)

type expectRow struct {
	e     kvEntry
	parts map[string]string
}

// expect computes, from the KV API's view, the rows and anomalies a request must answer.
func (h *harness) expect(req map[string]any) ([]expectRow, map[string]string) {
	what, _ := req["what"].(string)
	if what == "" {
		what = "registry"
	}
	shape, _ := provisioner.ShapeOfWhat(provisioner.What(what))
	entries := h.bucket(shape.Bucket)
	registry := h.bucket(provisioner.BucketRegistry)
	str := func(k string) string {
		s, _ := req[k].(string)
		if k == "module" && s == "" {
			s, _ = req["contributor"].(string)
		}
		return s
	}
	var rows []expectRow
	anomalies := map[string]string{} // key + " " + reason -> ""
	for _, e := range entries {
		parts, bad := shapeOK(shape.Bucket, e.key)
		node := strings.SplitN(e.key, ".", 2)[0]
		if str("node") == "" || str("node") == node {
			if bad != "" {
				anomalies[e.key+" "+bad] = ""
			} else {
				if !isMsgpack(e.value) {
					anomalies[e.key+" value-not-msgpack"] = ""
				}
				if shape.Bucket == provisioner.BucketNeeds {
					if _, ok := registry[parts["kind"]]; !ok {
						anomalies[e.key+" unanswered-kind"] = ""
					}
				}
			}
		}
		if bad != "" {
			continue
		}
		match := true
		for _, f := range []struct{ req, part string }{{"node", "node"}, {"kind", "kind"}, {"collection", "collection"}} {
			if v := str(f.req); v != "" && parts[f.part] != v {
				match = false
			}
		}
		if m := str("module"); m != "" {
			field := "module"
			if what == "collect" {
				field = "contributor"
			}
			if what == "registry" {
				var reg map[string]any
				_ = msgpack.Unmarshal(e.value, &reg)
				if reg["module"] != m {
					match = false
				}
			} else if parts[field] != m {
				match = false
			}
		}
		if match {
			rows = append(rows, expectRow{e: e, parts: parts})
		}
	}
	sort.Slice(rows, func(i, j int) bool { return rows[i].e.key < rows[j].e.key })
	return rows, anomalies
}

// checkAnswer asks a request through every page, in JSON and in MessagePack, and compares rows and
// anomalies with what the KV API holds.
func (h *harness) checkAnswer(req map[string]any) {
	h.t.Helper()
	want, wantAnoms := h.expect(req)
	for _, asMsgpack := range []bool{false, true} {
		name := fmt.Sprintf("%v msgpack=%v", req, asMsgpack)
		rows, last, err := natstest.AskAll(h.nc, query.Subject, req, asMsgpack)
		require.NoError(h.t, err, name)
		require.Len(h.t, rows, len(want), name)
		for i, row := range rows {
			w := want[i]
			require.Equal(h.t, w.e.key, row["key"], name)
			require.EqualValues(h.t, fmt.Sprint(w.e.rev), fmt.Sprint(row["revision"]), name)
			for part, v := range w.parts {
				require.Equal(h.t, v, row[part], "%s: %s of %s", name, part, w.e.key)
			}
			checkCreated(h.t, w.e.created, row["created"], name)
			checkValue(h.t, w.e.value, row, asMsgpack, name)
		}
		got := map[string]string{}
		for _, a := range last.Anomalies {
			reason, _ := a["reason"].(string)
			code, _, _ := strings.Cut(reason, ":")
			got[fmt.Sprint(a["key"])+" "+code] = ""
		}
		require.Equal(h.t, wantAnoms, got, name+": anomalies")
		require.EqualValues(h.t, len(wantAnoms), last.AnomaliesTotal, name)
	}
}

func checkCreated(t *testing.T, want time.Time, got any, name string) {
	t.Helper()
	switch g := got.(type) {
	case string:
		ts, err := time.Parse(time.RFC3339Nano, g)
		require.NoError(t, err, name)
		require.True(t, want.Equal(ts), "%s: created %v, want %v", name, ts, want)
	case time.Time:
		require.True(t, want.Equal(g), "%s: created %v, want %v", name, g, want)
	default:
		t.Fatalf("%s: created is %T", name, got)
	}
}

func checkValue(t *testing.T, raw []byte, row map[string]any, asMsgpack bool, name string) {
	t.Helper()
	if !isMsgpack(raw) {
		require.Nil(t, row["value"], name)
		if asMsgpack {
			require.Equal(t, raw, row["value_raw"], name)
		} else {
			require.Equal(t, base64.StdEncoding.EncodeToString(raw), row["value_raw"], name)
		}
		return
	}
	_, hasRaw := row["value_raw"]
	require.False(t, hasRaw, name)
	var v any
	require.NoError(t, msgpack.Unmarshal(raw, &v))
	if asMsgpack {
		require.Equal(t, v, row["value"], name)
		return
	}
	wantJSON, err := json.Marshal(v)
	require.NoError(t, err)
	gotJSON, err := json.Marshal(row["value"])
	require.NoError(t, err)
	require.JSONEq(t, string(wantJSON), string(gotJSON), name)
}

// requests lists every what with every narrowing it takes, on names the test mesh holds.
func requests() []map[string]any {
	n1, n2 := fixtures.NodeName(3), fixtures.NodeName(17)
	m1 := fixtures.ModuleName(2)
	return []map[string]any{
		{}, {"what": "registry", "kind": "config"}, {"what": "registry", "module": "mesh-vault"},
		{"what": "registry", "module": "<provider-module>"}, // the value's module, which no key token holds
		{"what": "needs"}, {"what": "needs", "node": n1}, {"what": "needs", "node": n1, "module": m1},
		{"what": "needs", "module": m1}, {"what": "needs", "kind": "secret"}, {"what": "needs", "node": n2, "kind": "dir"},
		{"what": "needs", "module": m1, "kind": "port"}, {"what": "needs", "node": "no-such-node"},
		{"what": "applied"}, {"what": "applied", "node": n1}, {"what": "applied", "node": n1, "module": m1}, {"what": "applied", "module": m1},
		{"what": "collect"}, {"what": "collect", "node": n2}, {"what": "collect", "collection": "shell:zsh:normal"},
		{"what": "collect", "collection": "é"}, {"what": "collect", "collection": "a=b", "node": n1},
		{"what": "collect", "contributor": m1}, {"what": "collect", "module": m1, "collection": "path with space"},
	}
}

func TestSeat_AnswersEqualBuckets(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.load(testMesh.Ops())
	st, _ := h.startSeat(t.TempDir())
	h.waitCaughtUp(st)
	for _, req := range requests() {
		for _, limit := range []int{1000, 7} {
			r := map[string]any{"limit": limit}
			for k, v := range req {
				r[k] = v
			}
			h.checkAnswer(r)
		}
	}
}

func TestSeat_DeletesAndPurges(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ops := testMesh.Ops()
	h.load(ops)
	st, _ := h.startSeat(t.TempDir())
	h.waitCaughtUp(st)

	// Delete and purge every tenth put, including the out-of-shape keys and bad values, which must
	// clear their anomalies.
	var more []fixtures.Op
	for i, op := range ops {
		if i%10 == 0 || strings.Contains(op.Key, "bad") || strings.Contains(op.Key, "raw") {
			kind := provisioner.OpDelete
			if i%20 == 0 {
				kind = provisioner.OpPurge
			}
			more = append(more, fixtures.Op{Bucket: op.Bucket, Key: op.Key, Op: kind})
		}
	}
	h.load(more)
	h.waitCaughtUp(st)
	for _, req := range requests() {
		h.checkAnswer(req)
	}
	// No anomalies are left: every out-of-shape key and bad value was deleted.
	for _, what := range []string{"needs", "applied", "collect"} {
		a, _, err := natstest.Ask(h.nc, query.Subject, []byte(`{"what":"`+what+`"}`), false)
		require.NoError(t, err)
		require.Empty(t, a.Anomalies, what)
		require.Zero(t, a.AnomaliesTotal, what)
	}
}

func TestSeat_TTLMarkerRemovesKey(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	// A bucket whose keys age out after a second, with markers: the server removes an aged key and
	// writes a marker with Nats-Marker-Reason in its place.
	kv, err := h.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.BucketApplied, History: 4, TTL: time.Second, LimitMarkerTTL: time.Minute})
	require.NoError(t, err)
	require.NoError(t, fixtures.CreateBuckets(ctx, h.js, provisioner.BucketNeeds, provisioner.BucketCollect))
	st, _ := h.startSeat(t.TempDir())
	seq, err := kv.Put(ctx, "n00001.mod-ttl", []byte{0x01})
	require.NoError(t, err)
	a, _, err := natstest.Ask(h.nc, query.Subject, []byte(fmt.Sprintf(`{"what":"applied","min_seq":%d,"wait_ms":2000}`, seq)), false)
	require.NoError(t, err)
	require.Len(t, a.Rows, 1, "the put is projected before it ages out")

	stream, err := h.js.Stream(ctx, provisioner.StreamName(provisioner.BucketApplied))
	require.NoError(t, err)
	var marker uint64
	natstest.CheckFor(t, 10*time.Second, 50*time.Millisecond, func() error {
		info, err := stream.Info(ctx)
		if err != nil {
			return err
		}
		if info.State.LastSeq <= seq {
			return fmt.Errorf("no marker yet")
		}
		m, err := stream.GetMsg(ctx, info.State.LastSeq)
		if err != nil {
			return err
		}
		if m.Header.Get(jetstream.MarkerReasonHeader) == "" {
			return fmt.Errorf("last message is no marker")
		}
		marker = info.State.LastSeq
		return nil
	})
	a, _, err = natstest.Ask(h.nc, query.Subject, []byte(fmt.Sprintf(`{"what":"applied","min_seq":%d,"wait_ms":2000}`, marker)), false)
	require.NoError(t, err)
	require.Empty(t, a.Rows, "the marker removed the key")
	require.EqualValues(t, marker, a.AsOf)
	_ = st
}

func TestSeat_RestartResumesFromCheckpoint(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ops := testMesh.Ops()
	h.load(ops)
	dir := t.TempDir()
	st, stop := h.startSeat(dir)
	h.waitCaughtUp(st)
	first := st.Projector.Applied()
	require.Positive(t, first)
	stop()

	// While the seat is down: puts, deletes and purges.
	var more []fixtures.Op
	for i := 0; i < 30; i++ {
		op := ops[i*7]
		switch i % 3 {
		case 0:
			more = append(more, fixtures.Op{Bucket: op.Bucket, Key: op.Key, Op: provisioner.OpPut, Value: []byte{0x92, 0x01, byte(i)}})
		case 1:
			more = append(more, fixtures.Op{Bucket: op.Bucket, Key: op.Key, Op: provisioner.OpDelete})
		case 2:
			more = append(more, fixtures.Op{Bucket: op.Bucket, Key: op.Key, Op: provisioner.OpPurge})
		}
	}
	more = append(more, fixtures.Op{Bucket: provisioner.BucketNeeds, Key: "n00002.late", Op: provisioner.OpPut, Value: []byte{0xc0}})
	h.load(more)

	st, _ = h.startSeat(dir)
	h.waitCaughtUp(st)
	// Resumed from the checkpoint: it applied what came while it was down, not the whole stream again.
	require.EqualValues(t, len(more), st.Projector.Applied(), "messages applied after the restart")
	for _, req := range requests() {
		h.checkAnswer(req)
	}
}

func TestSeat_MinSeqSeesOwnWrite(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.load(testMesh.Ops())
	st, _ := h.startSeat(t.TempDir())
	h.waitCaughtUp(st)
	kv, err := h.js.KeyValue(context.Background(), provisioner.BucketNeeds)
	require.NoError(t, err)
	for i := 0; i < 20; i++ {
		key := fmt.Sprintf("n09999.mod-new.config.k%02d", i)
		val, _ := msgpack.Marshal(map[string]int{"i": i})
		seq, err := kv.Put(context.Background(), key, val)
		require.NoError(t, err)
		req := fmt.Sprintf(`{"what":"needs","node":"n09999","min_seq":%d,"wait_ms":2000}`, seq)
		a, _, err := natstest.Ask(h.nc, query.Subject, []byte(req), false)
		require.NoError(t, err)
		require.GreaterOrEqual(t, a.AsOf, seq)
		require.Len(t, a.Rows, i+1, "the client's own write is in the answer")
		require.Equal(t, key, a.Rows[i]["key"])
	}
	// A sequence that will not come within wait_ms is 504.
	_, _, err = natstest.Ask(h.nc, query.Subject, []byte(`{"what":"needs","min_seq":99999999,"wait_ms":50}`), false)
	var ve *natstest.VerbError
	require.ErrorAs(t, err, &ve)
	require.Equal(t, 504, ve.Code)
}

func TestSeat_BadRequests(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.load(testMesh.Ops())
	st, _ := h.startSeat(t.TempDir())
	h.waitCaughtUp(st)
	mp := func(v any) []byte { b, _ := msgpack.Marshal(v); return b }
	cases := []struct {
		name string
		body []byte
		mp   bool
		code int
	}{
		{"malformed JSON", []byte(`{"what":`), false, 400},
		{"not an object", []byte(`["needs"]`), false, 400},
		{"trailing data", []byte(`{"what":"needs"} {}`), false, 400},
		{"unknown field", []byte(`{"what":"needs","nod":"n1"}`), false, 400},
		{"wrong type", []byte(`{"what":"needs","limit":"ten"}`), false, 400},
		{"unknown what", []byte(`{"what":"wants"}`), false, 400},
		{"collection with needs", []byte(`{"what":"needs","collection":"shell"}`), false, 400},
		{"node with registry", []byte(`{"what":"registry","node":"n1"}`), false, 400},
		{"limit 0", []byte(`{"what":"needs","limit":0}`), false, 400},
		{"limit 100000", []byte(`{"what":"needs","limit":100000}`), false, 400},
		{"wait_ms too long", []byte(`{"what":"needs","min_seq":1,"wait_ms":10001}`), false, 400},
		{"malformed MessagePack", []byte{0x82, 0xa4, 'w', 'h', 'a', 't'}, true, 400},
		{"MessagePack unknown field", mp(map[string]any{"what": "needs", "x": 1}), true, 400},
		{"MessagePack wrong type", mp(map[string]any{"what": "needs", "node": 12}), true, 400},
		{"MessagePack limit 0", mp(map[string]any{"what": "needs", "limit": 0}), true, 400},
		{"not JSON nor MessagePack", []byte("what=needs"), false, 400},
		{"cursor that does not exist", []byte(`{"what":"needs","after":"n00000.nope.config.x"}`), false, 404},
		{"collection with registry", []byte(`{"what":"registry","collection":"shell"}`), false, 400},
		{"collection with applied", []byte(`{"what":"applied","collection":"shell"}`), false, 400},
		{"collection with plans", []byte(`{"what":"plans","collection":"shell"}`), false, 400},
		{"contributor with needs", []byte(`{"what":"needs","contributor":"mod-001"}`), false, 400},
		{"contributor and module differ", []byte(`{"what":"collect","contributor":"mod-001","module":"mod-002"}`), false, 400},
		{"kind with applied", []byte(`{"what":"applied","kind":"config"}`), false, 400},
		{"kind with collect", []byte(`{"what":"collect","kind":"config"}`), false, 400},
		{"node not a token", []byte(`{"what":"needs","node":"n1.m1"}`), false, 400},
		{"negative min_seq", []byte(`{"what":"needs","min_seq":-1}`), false, 400},
		{"what of the wrong type", []byte(`{"what":1}`), false, 400},
		// Every error of a MessagePack request is a MessagePack map (Ask decodes the body as one).
		{"MessagePack unknown what", mp(map[string]any{"what": "wants"}), true, 400},
		{"MessagePack array", mp([]any{"needs", "n1"}), true, 400},
		{"MessagePack nil", mp(nil), true, 400},
		{"MessagePack cursor that does not exist", mp(map[string]any{"what": "needs", "after": "n00000.nope.config.x"}), true, 404},
		{"MessagePack min_seq not reached", mp(map[string]any{"what": "needs", "min_seq": 99999999, "wait_ms": 20}), true, 504},
		{"MessagePack at that is no point", mp(map[string]any{"what": "needs", "at": "seq:x"}), true, 400},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := natstest.Ask(h.nc, query.Subject, tc.body, tc.mp)
			var ve *natstest.VerbError
			require.ErrorAs(t, err, &ve)
			require.Equal(t, tc.code, ve.Code)
			require.NotEmpty(t, ve.Description)
			require.Equal(t, ve.Description, ve.Body, "the body says the error too")
			// The server keeps serving.
			a, _, err := natstest.Ask(h.nc, query.Subject, nil, false)
			require.NoError(t, err)
			require.Equal(t, "registry", a.What)
		})
	}
	// The requests that cannot be decoded are answered in micro's handler, so micro counts them as the
	// endpoint's errors (nats micro stats); the others are found by the workers, after it returned.
	decodeErrors := 0
	for _, tc := range cases {
		if _, _, err := query.DecodeRequest(tc.body); err != nil {
			decodeErrors++
		}
	}
	require.Greater(t, decodeErrors, 20)
	msg, err := h.nc.Request("$SRV.STATS."+query.ServiceName, nil, 5*time.Second)
	require.NoError(t, err)
	var stats micro.Stats
	require.NoError(t, json.Unmarshal(msg.Data, &stats))
	require.Len(t, stats.Endpoints, 1)
	require.Equal(t, decodeErrors, stats.Endpoints[0].NumErrors, "errors micro counted")
	require.NotEmpty(t, stats.Endpoints[0].LastError)
	// The seat's stats data counts every answer by code, the errors found while answering too.
	want := map[string]int64{}
	for _, tc := range cases {
		want[fmt.Sprint(tc.code)]++
	}
	require.Greater(t, want["404"]+want["504"], int64(1))
	var data seat.Stats
	require.NoError(t, json.Unmarshal(stats.Endpoints[0].Data, &data))
	for code, n := range want {
		require.Equal(t, n, data.AnswersByCode[code], "answers of code %s", code)
	}
	require.GreaterOrEqual(t, data.AnswersByCode["200"], int64(len(cases)), "the registry asked after each case")
}

// startBenchSeat starts a seat for a benchmark on its own connection and state dir.
func startBenchSeat(tb testing.TB, url string) (*seat.Seat, func()) {
	nc, js := natstest.Connect(tb, url)
	db, err := store.OpenState(tb.TempDir(), store.Options{})
	if err != nil {
		tb.Fatal(err)
	}
	st, err := seat.Start(context.Background(), nc, js, db, seat.Config{WriteRegistry: true})
	if err != nil {
		tb.Fatal(err)
	}
	return st, func() { st.Stop(); db.Close() }
}
