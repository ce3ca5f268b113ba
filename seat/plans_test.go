package seat_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go/micro"
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

// The golden answers of what: plans live under testdata/plans. Regenerate them with
//
//	go test ./seat -run TestPlans_Golden -update
//
// and read the diff: every row is explained in fixtures.Plans.
var update = flag.Bool("update", false, "rewrite the golden files under testdata/")

// startPlansSeat starts a seat with plans on, on its own connection. Streams are listed for
// composed-<node> buckets once, at start: a bucket created later is found by its stream-created
// advisory, which is what the tests prove.
func (h *harness) startPlansSeat(dir string) (*seat.Seat, func()) {
	h.t.Helper()
	return h.startPlansSeatWith(dir, projector.Options{Poll: 50 * time.Millisecond, DiscoverEvery: time.Hour})
}

// startPlansSeatWith is startPlansSeat with the projector's options.
func (h *harness) startPlansSeatWith(dir string, po projector.Options) (*seat.Seat, func()) {
	h.t.Helper()
	nc, js := natstest.Connect(h.t, h.url)
	db, err := store.OpenState(dir, store.Options{})
	require.NoError(h.t, err)
	st, err := seat.Start(context.Background(), nc, js, db, seat.Config{Plans: true, Projector: po})
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
	return st, stop
}

// waitPlansCaughtUp waits until the seat has applied every plans' input stream to its end, and says
// so in its answers.
func (h *harness) waitPlansCaughtUp(st *seat.Seat) {
	h.t.Helper()
	ctx := context.Background()
	natstest.CheckFor(h.t, 20*time.Second, 20*time.Millisecond, func() error {
		last, err := h.planInputsLastSeq(ctx)
		if err != nil {
			return err
		}
		for bucket, l := range last {
			if seq, _ := st.Store().Applied(bucket); seq < l { // the store of the last rebuild
				return fmt.Errorf("%s: applied %d of %d", bucket, seq, l)
			}
		}
		if !st.PlansSynced("") {
			return fmt.Errorf("plans not synced")
		}
		return nil
	})
}

// askPlans asks the verb once and decodes the answer into plain values that compare alike from JSON
// and MessagePack: numbers as json.Number, times as RFC 3339 strings, bytes as base64. An error
// answer is a *natstest.VerbError.
func (h *harness) askPlans(req map[string]any, asMsgpack bool) (map[string]any, error) {
	h.t.Helper()
	body, err := natstest.Body(req, asMsgpack)
	require.NoError(h.t, err)
	msg, err := h.nc.Request(query.Subject, body, 10*time.Second)
	require.NoError(h.t, err)
	if code := msg.Header.Get(micro.ErrorCodeHeader); code != "" {
		n, _ := strconv.Atoi(code)
		return nil, &natstest.VerbError{Code: n, Description: msg.Header.Get(micro.ErrorHeader)}
	}
	var v any
	if asMsgpack {
		require.NoError(h.t, msgpack.Unmarshal(msg.Data, &v), "a MessagePack answer")
	} else {
		dec := json.NewDecoder(bytes.NewReader(msg.Data))
		dec.UseNumber()
		require.NoError(h.t, dec.Decode(&v), "a JSON answer: %s", msg.Data)
	}
	return plain(v).(map[string]any), nil
}

func plain(v any) any {
	switch x := v.(type) {
	case map[string]any:
		out := make(map[string]any, len(x))
		for k, e := range x {
			out[k] = plain(e)
		}
		return out
	case []any:
		out := make([]any, len(x))
		for i, e := range x {
			out[i] = plain(e)
		}
		return out
	case time.Time:
		return x.UTC().Format(time.RFC3339Nano)
	case []byte:
		return base64.StdEncoding.EncodeToString(x)
	case int8, int16, int32, int64, uint8, uint16, uint32, uint64, int, uint:
		return json.Number(fmt.Sprint(x))
	case float32, float64:
		return json.Number(fmt.Sprint(x))
	}
	return v
}

// askAllPlans follows next through every page and returns the rows and the last page.
func (h *harness) askAllPlans(req map[string]any, asMsgpack bool) ([]any, map[string]any) {
	h.t.Helper()
	r := map[string]any{}
	for k, v := range req {
		r[k] = v
	}
	var rows []any
	for {
		a, err := h.askPlans(r, asMsgpack)
		require.NoError(h.t, err, "%v", r)
		page, _ := a["rows"].([]any)
		rows = append(rows, page...)
		next, _ := a["next"].(string)
		if next == "" {
			return rows, a
		}
		r["after"] = next
	}
}

// planRequests are the plans questions the golden files hold, by name.
var planRequests = []struct {
	name string
	req  map[string]any
}{
	{"all", map[string]any{"what": "plans"}},
	{"node edge-1", map[string]any{"what": "plans", "node": "edge-1"}},
	{"node edge-2", map[string]any{"what": "plans", "node": "edge-2"}},
	{"node edge-3", map[string]any{"what": "plans", "node": "edge-3"}},
	{"module web", map[string]any{"what": "plans", "module": "web"}},
	{"node edge-2 module web", map[string]any{"what": "plans", "node": "edge-2", "module": "web"}},
	{"node no-such-node", map[string]any{"what": "plans", "node": "no-such-node"}},
}

// answers asks every plans request, checks that MessagePack answers the same as JSON and that paging
// walks the same rows, and returns the JSON answers by name.
func (h *harness) planAnswers() map[string]any {
	h.t.Helper()
	out := map[string]any{}
	for _, pr := range planRequests {
		a, err := h.askPlans(pr.req, false)
		require.NoError(h.t, err, pr.name)
		require.Empty(h.t, a["next"], "%s: one page", pr.name)
		m, err := h.askPlans(pr.req, true)
		require.NoError(h.t, err, pr.name)
		require.Equal(h.t, a, m, "%s: MessagePack answers what JSON does", pr.name)
		for _, limit := range []int{1, 3} {
			req := map[string]any{"limit": limit}
			for k, v := range pr.req {
				req[k] = v
			}
			for _, asMsgpack := range []bool{false, true} {
				rows, _ := h.askAllPlans(req, asMsgpack)
				if len(rows) == 0 {
					rows = []any{}
				}
				require.Equal(h.t, a["rows"], rows, "%s: pages of %d rows walk the same rows", pr.name, limit)
			}
		}
		out[pr.name] = a
	}
	return out
}

// checkCreated checks that every entry's created is the time of the composition message it names,
// as the stream holds it, and then replaces it with a placeholder: golden files hold no clock.
func (h *harness) checkCreated(answers map[string]any) {
	h.t.Helper()
	ctx := context.Background()
	times := map[string]string{}
	for name, a := range answers {
		rows, _ := a.(map[string]any)["rows"].([]any)
		for _, r := range rows {
			row := r.(map[string]any)
			for _, which := range []string{"current", "newest"} {
				e, ok := row[which].(map[string]any)
				if !ok {
					continue
				}
				created, ok := e["created"].(string)
				if !ok {
					require.NotContains(h.t, e, "revision", "%s: %s of %s: an entry with a revision has created", name, which, row["key"])
					continue
				}
				bucket := provisioner.ComposedPrefix + row["node"].(string)
				id := bucket + "@" + e["revision"].(json.Number).String()
				want, ok := times[id]
				if !ok {
					stream, err := h.js.Stream(ctx, provisioner.StreamName(bucket))
					require.NoError(h.t, err)
					seq, _ := strconv.ParseUint(e["revision"].(json.Number).String(), 10, 64)
					msg, err := stream.GetMsg(ctx, seq)
					require.NoError(h.t, err)
					want = msg.Time.UTC().Format(time.RFC3339Nano)
					times[id] = want
				}
				require.Equal(h.t, want, created, "%s: %s of %s: created is the composition's time", name, which, row["key"])
				e["created"] = "<the composition's time>"
			}
		}
	}
}

// golden compares answers with testdata/plans/<name>.json, or writes it with -update.
func (h *harness) golden(name string, answers map[string]any) {
	h.t.Helper()
	path := filepath.Join("testdata", "plans", name+".json")
	got, err := json.MarshalIndent(answers, "", "  ")
	require.NoError(h.t, err)
	got = append(got, '\n')
	if *update {
		require.NoError(h.t, os.MkdirAll(filepath.Dir(path), 0o755))
		require.NoError(h.t, os.WriteFile(path, got, 0o644))
		h.t.Logf("wrote %s", path)
		return
	}
	want, err := os.ReadFile(path)
	require.NoError(h.t, err, "no golden file: run go test ./seat -run TestPlans_Golden -update")
	require.JSONEq(h.t, string(want), string(got), "%s: regenerate with go test ./seat -run TestPlans_Golden -update, and review the diff", path)
}

// TestPlans_Golden walks through every rule of CONTRACT section 6 on the mesh of fixtures.Plans, and
// compares the answers with the golden files: before the seat starts, and after changes made while it
// runs, among them a composed-<node> bucket created then.
func TestPlans_Golden(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	sc := fixtures.Plans()
	h.load(sc.Before)
	st, _ := h.startPlansSeat(t.TempDir())
	h.waitPlansCaughtUp(st)
	before := h.planAnswers()
	h.checkCreated(before)
	h.golden("before", before)

	late := provisioner.ComposedPrefix + sc.LateNode
	require.False(t, st.Projector.Tails(late), "%s does not exist yet", late)
	h.load(sc.After)
	natstest.CheckFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		if !st.Projector.Tails(late) {
			return fmt.Errorf("%s not picked up", late)
		}
		return nil
	})
	h.waitPlansCaughtUp(st)
	after := h.planAnswers()
	h.checkCreated(after)
	h.golden("after", after)
}

// planRow finds one row of an answer by key.
func planRow(t *testing.T, a map[string]any, key string) map[string]any {
	t.Helper()
	rows, _ := a["rows"].([]any)
	for _, r := range rows {
		if row := r.(map[string]any); row["key"] == key {
			return row
		}
	}
	t.Fatalf("no row %s in %v", key, a["rows"])
	return nil
}

// TestPlans_Rules checks the rules on the golden scenario by name, so that a golden file regenerated
// without care cannot hide a broken rule.
func TestPlans_Rules(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	sc := fixtures.Plans()
	h.load(sc.Before)
	st, _ := h.startPlansSeat(t.TempDir())
	h.waitPlansCaughtUp(st)
	a, err := h.askPlans(map[string]any{"what": "plans"}, false)
	require.NoError(t, err)

	type want struct {
		key, which, status, because, build string
	}
	check := func(a map[string]any, cases []want) {
		t.Helper()
		for _, w := range cases {
			row := planRow(t, a, w.key)
			e, ok := row[w.which].(map[string]any)
			if w.status == "" {
				require.False(t, ok, "%s: no %s entry", w.key, w.which)
				continue
			}
			require.True(t, ok, "%s: a %s entry", w.key, w.which)
			require.Equal(t, w.status, e["status"], "%s %s status", w.key, w.which)
			if w.because != "" {
				require.Equal(t, w.because, e["held_because"], "%s %s held_because", w.key, w.which)
			} else {
				require.NotContains(t, e, "held_because", "%s %s", w.key, w.which)
			}
			if w.build == "" {
				require.NotContains(t, e, "build", "%s %s: no plan ever seen", w.key, w.which)
				require.NotContains(t, e, "plan", "%s %s: no plan ever seen", w.key, w.which)
				continue
			}
			require.Equal(t, json.Number(w.build), e["build"], "%s %s build", w.key, w.which)
			plan, _ := e["plan"].(map[string]any)
			require.Contains(t, fmt.Sprint(plan["image"]), ":"+w.build, "%s %s: the plan of build %s", w.key, w.which, w.build)
		}
	}
	check(a, []want{
		{"edge-1.web", "current", "published", "", "1042"},
		{"edge-1.web", "newest", "", "", ""},
		{"edge-1.api", "current", "held", "refused", "2000"},
		{"edge-1.db", "current", "published", "", "3004"},
		{"edge-1.cache", "current", "published", "", "10"},
		{"edge-1.cache", "newest", "published", "", "12"},
		{"edge-1.queue", "newest", "held", "refused", "21"},
		{"edge-1.auth", "current", "held", "refused", ""},
		{"edge-1.auth", "newest", "held", "refused", ""},
		{"edge-2.web", "current", "held", "refused", "1042"},
		{"edge-2.api", "current", "held", "missing", "1999"},
		{"edge-2.cache", "current", "published", "", "9"},
		{"edge-3.web", "current", "held", "missing", ""},
	})
	require.NotContains(t, planRow(t, a, "edge-2.cache"), "want", "a want out of shape is not read")

	anoms := map[string]bool{}
	for _, x := range a["anomalies"].([]any) {
		an := x.(map[string]any)
		code, _, _ := strings.Cut(an["reason"].(string), ":")
		anoms[fmt.Sprintf("%s %s %s", an["bucket"], an["key"], code)] = true
	}
	require.Equal(t, map[string]bool{
		"composed-edge-2 web token-count":          true,
		"composed-edge-2 web.latest bad-build":     true,
		"composed-edge-2 api.2002 bad-value":       true,
		"mesh-host_modules edge-2 token-count":     true,
		"mesh-host_modules edge-2.cache bad-value": true,
		"mesh-indexer_builds a.b token-count":      true,
		"mesh-indexer_builds legacy bad-value":     true,
	}, anoms)

	h.load(sc.After)
	h.waitPlansCaughtUp(st)
	a, err = h.askPlans(map[string]any{"what": "plans"}, false)
	require.NoError(t, err)
	check(a, []want{
		{"edge-1.api", "current", "published", "", "2001"},
		{"edge-1.web", "newest", "held", "pending", ""},
		{"edge-2.web", "newest", "held", "missing", ""},
		{"edge-3.web", "current", "published", "", "1042"},
	})
	// Narrowed by node, anomalies are the node's: composed-<node> by the bucket's name. The keys of
	// composed-edge-2 start with a module (web, api), never with edge-2: only the bucket names the node.
	a, err = h.askPlans(map[string]any{"what": "plans", "node": "edge-2"}, false)
	require.NoError(t, err)
	var edge2 []string
	for _, x := range a["anomalies"].([]any) {
		an := x.(map[string]any)
		if an["bucket"] == "composed-edge-2" {
			edge2 = append(edge2, an["key"].(string))
		}
	}
	require.Equal(t, []string{"api.2002", "web", "web.latest"}, edge2, "composed-edge-2's anomalies, in byte order of raw key")
	a, err = h.askPlans(map[string]any{"what": "plans", "node": "edge-1"}, false)
	require.NoError(t, err)
	for _, x := range a["anomalies"].([]any) {
		an := x.(map[string]any)
		require.NotEqual(t, "composed-edge-2", an["bucket"])
		if an["bucket"] == provisioner.BucketHostModules {
			require.True(t, strings.HasPrefix(an["key"].(string), "edge-1"), "%v", an)
		}
	}
}

// TestPlans_RestartAndRebuild: the plans answers after a restart on the same state dir, and after a
// rebuild from the streams into a fresh one, equal those before.
func TestPlans_RestartAndRebuild(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	sc := fixtures.Plans()
	h.load(sc.Before)
	dir := t.TempDir()
	st, stop := h.startPlansSeat(dir)
	h.waitPlansCaughtUp(st)
	h.load(sc.After)
	h.waitPlansCaughtUp(st)
	before := h.planAnswers()
	stop()

	st, stop = h.startPlansSeat(dir)
	h.waitPlansCaughtUp(st)
	require.Zero(t, st.Projector.Applied(), "resumed from the checkpoints: nothing to apply again")
	require.Equal(t, before, h.planAnswers(), "after a restart")
	stop()

	st, _ = h.startPlansSeat(t.TempDir())
	h.waitPlansCaughtUp(st)
	require.Equal(t, before, h.planAnswers(), "after a rebuild from the streams")
}

// TestPlans_Verb covers min_seq, cursors and bad requests of plans.
func TestPlans_Verb(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	sc := fixtures.Plans()
	h.load(sc.Before)
	st, _ := h.startPlansSeat(t.TempDir())
	h.waitPlansCaughtUp(st)

	// A node engine publishes a composition and sees it in its node's plans at once.
	kv, err := h.js.KeyValue(context.Background(), provisioner.ComposedPrefix+"edge-1")
	require.NoError(t, err)
	val, err := msgpack.Marshal(map[string]any{"status": "published", "plan": "db 3005"})
	require.NoError(t, err)
	seq, err := kv.Put(context.Background(), "db.3005", val)
	require.NoError(t, err)
	a, err := h.askPlans(map[string]any{"what": "plans", "node": "edge-1", "module": "db", "min_seq": seq, "wait_ms": 5000}, false)
	require.NoError(t, err)
	require.Equal(t, json.Number(fmt.Sprint(seq)), a["as_of"].(map[string]any)["composed-edge-1"])
	cur := planRow(t, a, "edge-1.db")["current"].(map[string]any)
	require.Equal(t, "published", cur["status"])
	require.Equal(t, json.Number("3005"), cur["build"])
	require.Equal(t, "db 3005", cur["plan"])

	var ve *natstest.VerbError
	_, err = h.askPlans(map[string]any{"what": "plans", "node": "edge-1", "min_seq": seq + 1000, "wait_ms": 50}, false)
	require.ErrorAs(t, err, &ve)
	require.Equal(t, 504, ve.Code)
	_, err = h.askPlans(map[string]any{"what": "plans", "min_seq": 1}, false)
	require.ErrorAs(t, err, &ve)
	require.Equal(t, 400, ve.Code, "min_seq of plans needs the node")
	_, err = h.askPlans(map[string]any{"what": "plans", "after": "edge-9.web"}, false)
	require.ErrorAs(t, err, &ve)
	require.Equal(t, 404, ve.Code, "a cursor that names no row")
	_, err = h.askPlans(map[string]any{"what": "plans", "node": "edge-2", "after": "edge-1.web"}, false)
	require.ErrorAs(t, err, &ve)
	require.Equal(t, 404, ve.Code, "a cursor outside the narrowing")
	_, err = h.askPlans(map[string]any{"what": "plans", "kind": "config"}, false)
	require.ErrorAs(t, err, &ve)
	require.Equal(t, 400, ve.Code)

	// A row whose host key is deleted is gone; its node's anomalies stay the node's.
	hm, err := h.js.KeyValue(context.Background(), provisioner.BucketHostModules)
	require.NoError(t, err)
	require.NoError(t, hm.Delete(context.Background(), "edge-1.auth"))
	natstest.CheckFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		a, err := h.askPlans(map[string]any{"what": "plans", "node": "edge-1", "module": "auth"}, false)
		if err != nil {
			return err
		}
		if rows := a["rows"].([]any); len(rows) != 0 {
			return fmt.Errorf("edge-1.auth still answers")
		}
		return nil
	})
}

// TestPlans_MinSeqSeesOwnComposition: a node engine that publishes compositions one after another,
// each read back at once with min_seq, finds each in its node's plans: an answer whose as_of holds the
// sequence holds the composition. The tail, caught up and woken by the request, looked for messages
// removed unread (projector skipRemoved) and took the consumer's pending count, which the server raises
// a moment after the write is stored, for the stream's word: it moved the checkpoint over the write
// unread, and the answer named its sequence with the plan before it (TestPlans_Verb, 4 in 600 runs
// under load before 3a4f1fd). Each round here is one more chance at that moment.
func TestPlans_MinSeqSeesOwnComposition(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.load(fixtures.Plans().Before)
	st, _ := h.startPlansSeat(t.TempDir())
	h.waitPlansCaughtUp(st)
	kv, err := h.js.KeyValue(context.Background(), provisioner.ComposedPrefix+"edge-1")
	require.NoError(t, err)
	for i := 0; i < 20; i++ {
		plan := fmt.Sprintf("db 3005 #%d", i)
		seq, err := kv.Put(context.Background(), "db.3005", mp(t, map[string]any{"status": "published", "plan": plan}))
		require.NoError(t, err)
		a, err := h.askPlans(map[string]any{"what": "plans", "node": "edge-1", "module": "db", "min_seq": seq, "wait_ms": 5000}, false)
		require.NoError(t, err)
		require.Equal(t, json.Number(fmt.Sprint(seq)), a["as_of"].(map[string]any)["composed-edge-1"], "round %d", i)
		cur := planRow(t, a, "edge-1.db")["current"].(map[string]any)
		require.Equal(t, json.Number(fmt.Sprint(seq)), cur["revision"], "round %d: the answer's as_of holds the write, so its plan does: %v", i, cur)
		require.Equal(t, plan, cur["plan"], "round %d", i)
	}
}

// TestPlans_OneCompositionRecomputesOneRow: in a mesh of many nodes and modules, a change to one
// module's composition on one node recomputes that one row, and the answer shows it.
func TestPlans_OneCompositionRecomputesOneRow(t *testing.T) {
	t.Parallel()
	const nodes, modules = 40, 20
	h := newHarness(t)
	var ops []fixtures.Op
	for m := 0; m < modules; m++ {
		ops = append(ops, fixtures.Op{Bucket: provisioner.BucketIndexerBuilds, Key: fmt.Sprintf("mod-%02d", m), Op: provisioner.OpPut, Value: mp(t, map[string]any{"newest": 101})})
	}
	for n := 0; n < nodes; n++ {
		node := fmt.Sprintf("n%03d", n)
		for m := 0; m < modules; m++ {
			mod := fmt.Sprintf("mod-%02d", m)
			ops = append(ops,
				fixtures.Op{Bucket: provisioner.ComposedPrefix + node, Key: mod + ".100", Op: provisioner.OpPut, Value: mp(t, map[string]any{"status": "published", "plan": node + mod})},
				fixtures.Op{Bucket: provisioner.BucketHostModules, Key: node + "." + mod, Op: provisioner.OpPut, Value: mp(t, map[string]any{"want": 100, "have": 100})})
		}
	}
	h.load(ops)
	st, _ := h.startPlansSeat(t.TempDir())
	h.waitPlansCaughtUp(st)
	before := st.DB.PlanStats().RowsRecomputed

	kv, err := h.js.KeyValue(context.Background(), provisioner.ComposedPrefix+"n017")
	require.NoError(t, err)
	seq, err := kv.Put(context.Background(), "mod-07.101", mp(t, map[string]any{"status": "published", "plan": "new"}))
	require.NoError(t, err)
	a, err := h.askPlans(map[string]any{"what": "plans", "node": "n017", "module": "mod-07", "min_seq": seq, "wait_ms": 5000}, false)
	require.NoError(t, err)
	require.Equal(t, "new", planRow(t, a, "n017.mod-07")["newest"].(map[string]any)["plan"])
	require.EqualValues(t, 1, st.DB.PlanStats().RowsRecomputed-before, "one composition recomputes one row of %d", nodes*modules)
}

func mp(t *testing.T, v any) []byte {
	t.Helper()
	b, err := msgpack.Marshal(v)
	require.NoError(t, err)
	return b
}

// TestPlans_SurvivesSIGKILL: a seat process killed with SIGKILL, with no chance to flush or close,
// comes back on its state dir with the same plans answers. The seat runs in a child process (this
// test binary, running TestPlans_KillHelper), on the parent's nats-server.
func TestPlans_SurvivesSIGKILL(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	sc := fixtures.Plans()
	h.load(sc.Before)
	dir := t.TempDir()

	cmd := exec.Command(os.Args[0], "-test.run=^TestPlans_KillHelper$", "-test.count=1")
	cmd.Env = append(os.Environ(), "PLANS_HELPER_URL="+h.url, "PLANS_HELPER_DIR="+dir)
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	cmd.Stderr = os.Stderr
	require.NoError(t, cmd.Start())
	killed := false
	t.Cleanup(func() {
		if !killed {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
	ready := make(chan error, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if sc.Text() == "READY" {
				ready <- nil
				_, _ = io.Copy(io.Discard, out)
				return
			}
		}
		ready <- fmt.Errorf("helper ended before it was ready: %v", sc.Err())
	}()
	select {
	case err := <-ready:
		require.NoError(t, err)
	case <-time.After(60 * time.Second):
		t.Fatal("helper not ready within 60s")
	}

	// While the child runs: more changes, among them a new composed-<node> bucket.
	h.load(sc.After)
	h.waitVerbCaughtUp()
	before := h.planAnswers()

	require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
	_ = cmd.Wait()
	killed = true

	// Batches are committed without a sync, so the last ones may be lost with the process; each is lost
	// with its checkpoint, and the restarted seat applies them again from the streams.
	st, _ := h.startPlansSeat(dir)
	h.waitPlansCaughtUp(st)
	t.Logf("applied again after the kill: %d messages", st.Projector.Applied())
	require.LessOrEqual(t, st.Projector.Applied(), int64(len(sc.After)), "resumed from the checkpoints on disk")
	require.Equal(t, before, h.planAnswers(), "after SIGKILL and restart")
}

// waitVerbCaughtUp waits until the seat answering the verb, wherever it runs, says every plans' input
// stream is applied to its end.
func (h *harness) waitVerbCaughtUp() {
	h.t.Helper()
	ctx := context.Background()
	natstest.CheckFor(h.t, 20*time.Second, 20*time.Millisecond, func() error {
		a, err := h.askPlans(map[string]any{"what": "plans"}, false)
		if err != nil {
			return err
		}
		if a["synced"] != true {
			return fmt.Errorf("not synced")
		}
		asOf := a["as_of"].(map[string]any)
		last, err := h.planInputsLastSeq(ctx)
		if err != nil {
			return err
		}
		for bucket, l := range last {
			if got := fmt.Sprint(asOf[bucket]); got != fmt.Sprint(l) {
				return fmt.Errorf("%s: as_of %s, stream at %d", bucket, got, l)
			}
		}
		return nil
	})
}

// planInputsLastSeq reads the last sequence of every plans' input bucket's stream.
func (h *harness) planInputsLastSeq(ctx context.Context) (map[string]uint64, error) {
	last := map[string]uint64{}
	names := h.js.StreamNames(ctx)
	for name := range names.Name() {
		bucket := strings.TrimPrefix(name, "KV_")
		if !provisioner.IsPlanInput(bucket) {
			continue
		}
		stream, err := h.js.Stream(ctx, name)
		if err != nil {
			return nil, err
		}
		info, err := stream.Info(ctx)
		if err != nil {
			return nil, err
		}
		last[bucket] = info.State.LastSeq
	}
	return last, names.Err()
}

// TestPlans_KillHelper is the seat process of TestPlans_SurvivesSIGKILL; on its own it skips.
func TestPlans_KillHelper(t *testing.T) {
	url, dir := os.Getenv("PLANS_HELPER_URL"), os.Getenv("PLANS_HELPER_DIR")
	if url == "" {
		t.Skip("the seat process of TestPlans_SurvivesSIGKILL")
	}
	h := &harness{t: t, url: url}
	h.nc, h.js = natstest.Connect(t, url)
	st, _ := h.startPlansSeat(dir)
	h.waitPlansCaughtUp(st)
	// What it applied so far is on disk; what comes next may still be in memory when it is killed.
	require.NoError(t, st.DB.Flush())
	fmt.Println("READY")
	select {} // until killed
}

// TestPlans_At: plans asked at a time answer what the live seat answered then, from the event log,
// after the inputs have moved on (the verb's at, and so `replay state plans --at`).
func TestPlans_At(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	sc := fixtures.Plans()
	h.load(sc.Before)
	st, _ := h.startPlansSeat(t.TempDir())
	h.waitPlansCaughtUp(st)
	then := map[string][]any{}
	for _, pr := range planRequests {
		rows, _ := h.askAllPlans(pr.req, false)
		then[pr.name] = rows
	}
	at := time.Now().UTC()
	time.Sleep(5 * time.Millisecond) // the next message is stamped after at
	h.load(sc.After)
	h.waitPlansCaughtUp(st)
	changed := false
	for _, pr := range planRequests {
		now, _ := h.askAllPlans(pr.req, false)
		if fmt.Sprint(now) != fmt.Sprint(then[pr.name]) {
			changed = true
		}
		for _, asMsgpack := range []bool{false, true} {
			for _, limit := range []int{1000, 2} {
				req := map[string]any{"at": at.Format(time.RFC3339Nano), "limit": limit}
				for k, v := range pr.req {
					req[k] = v
				}
				rows, _ := h.askAllPlans(req, asMsgpack)
				require.Equal(t, fmt.Sprint(then[pr.name]), fmt.Sprint(rows), "%s at %s (msgpack %v, limit %d)", pr.name, at, asMsgpack, limit)
			}
		}
	}
	require.True(t, changed, "the scenario's second part changes the plans, so at is tested against something")

	// From the streams and from an archive of them, as from the local log: the plans' inputs are among
	// the buckets they read by default.
	archive := filepath.Join(t.TempDir(), "incident.mph")
	_, err := replay.ExportNATS(context.Background(), h.js, nil, archive, "test", nil)
	require.NoError(t, err)
	fromArchive, err := replay.FromArchive(context.Background(), archive, nil)
	require.NoError(t, err)
	defer fromArchive.Close()
	fromNATS, err := replay.FromNATS(context.Background(), h.js, nil, "test", nil)
	require.NoError(t, err)
	defer fromNATS.Close()
	for name, l := range map[string]*replay.Log{"archive": fromArchive, "nats": fromNATS} {
		body, _ := json.Marshal(map[string]any{"what": "plans", "at": at.Format(time.RFC3339Nano)})
		out, err := l.Ask(body)
		require.NoError(t, err, name)
		var v any
		dec := json.NewDecoder(bytes.NewReader(out))
		dec.UseNumber()
		require.NoError(t, dec.Decode(&v))
		rows := plain(v).(map[string]any)["rows"]
		require.Equal(t, fmt.Sprint(then["all"]), fmt.Sprint(rows), "plans at %s from %s", at, name)
	}

	// A sequence names one stream, and plans read several.
	_, err = h.askPlans(map[string]any{"what": "plans", "at": "seq:3"}, false)
	var ve *natstest.VerbError
	require.ErrorAs(t, err, &ve)
	require.Equal(t, 400, ve.Code)
}

// TestPlans_AtAfterRetention: once retention has trimmed the plans' inputs' logs to their newest
// message, plans asked at a time at or above the floor still answer what the live seat answers. Among
// the rows is edge-2.web, whose refusal overwrote the published composition of the same build: the
// live seat holds it at the plan the refusal overwrote, and so must the answer rebuilt from the log.
func TestPlans_AtAfterRetention(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	sc := fixtures.Plans()
	h.load(sc.Before)
	h.load(sc.After)
	st, _ := h.startPlansSeat(t.TempDir())
	h.waitPlansCaughtUp(st)
	live := map[string][]any{}
	for _, pr := range planRequests {
		live[pr.name], _ = h.askAllPlans(pr.req, false)
	}
	at := time.Now().UTC()

	// The retention's clock an hour ahead: every bucket's log is trimmed to its newest message.
	ctx := context.Background()
	r := store.NewRetention(st.DB, store.RetentionOptions{MaxAge: time.Minute, Now: func() time.Time { return at.Add(time.Hour) }})
	deleted, err := r.Apply(ctx)
	require.NoError(t, err)
	require.Positive(t, deleted)
	last, err := h.planInputsLastSeq(ctx)
	require.NoError(t, err)
	v, err := st.DB.View()
	require.NoError(t, err)
	for bucket, l := range last {
		m, err := v.HistoryMarks(bucket)
		require.NoError(t, err)
		require.Equal(t, l, m.Floor, "%s is trimmed to its newest message", bucket)
	}
	v.Close()

	for _, pr := range planRequests {
		now, _ := h.askAllPlans(pr.req, false)
		require.Equal(t, fmt.Sprint(live[pr.name]), fmt.Sprint(now), "%s: the live answer is unchanged by the trim", pr.name)
		req := map[string]any{"at": at.Format(time.RFC3339Nano)}
		for k, v := range pr.req {
			req[k] = v
		}
		rows, _ := h.askAllPlans(req, false)
		want, got := rowsByKey(live[pr.name]), rowsByKey(rows)
		for key, row := range want {
			require.Equal(t, row, got[key], "%s at %s, after the trim: row %s", pr.name, at, key)
		}
		require.Len(t, got, len(want), "%s at %s, after the trim", pr.name, at)
	}
}

// rowsByKey is each row of an answer, printed, by its key.
func rowsByKey(rows []any) map[string]string {
	out := map[string]string{}
	for _, r := range rows {
		row := r.(map[string]any)
		out[row["key"].(string)] = fmt.Sprint(row)
	}
	return out
}

// TestPlans_AtAfterRetentionBuildsWrittenDifferently: a build written two ways (m5.0042 and m5.42)
// is one build, and the newest message of either is the composition at it. A delete or a purge of
// one spelling after the other published holds the module live (held missing, at the plan the delete
// left, or with none after the purge); once retention has trimmed the log, plans asked at a time at
// or above the floor answer the same, not the publication of the other spelling.
func TestPlans_AtAfterRetentionBuildsWrittenDifferently(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	c := provisioner.ComposedPrefix + "n1"
	comp := func(plan string) []byte { return mp(t, map[string]any{"status": "published", "plan": plan}) }
	h.load([]fixtures.Op{
		{Bucket: c, Key: "m5.0042", Value: comp("m5 42"), Op: provisioner.OpPut},
		{Bucket: c, Key: "m5.42", Op: provisioner.OpDelete},
		{Bucket: c, Key: "m6.07", Value: comp("m6 7"), Op: provisioner.OpPut},
		{Bucket: c, Key: "m6.7", Op: provisioner.OpPurge},
		{Bucket: provisioner.BucketHostModules, Key: "n1.m5", Value: mp(t, map[string]any{"want": 42}), Op: provisioner.OpPut},
		{Bucket: provisioner.BucketHostModules, Key: "n1.m6", Value: mp(t, map[string]any{"want": 7}), Op: provisioner.OpPut},
	})
	st, _ := h.startPlansSeat(t.TempDir())
	h.waitPlansCaughtUp(st)
	live, _ := h.askAllPlans(map[string]any{"what": "plans"}, false)
	a := map[string]any{"rows": live}
	for key, plan := range map[string]any{"n1.m5": "m5 42", "n1.m6": nil} {
		cur := planRow(t, a, key)["current"].(map[string]any)
		require.Equal(t, "held", cur["status"], "%s live", key)
		require.Equal(t, "missing", cur["held_because"], "%s live", key)
		require.Equal(t, plan, cur["plan"], "%s live", key)
	}
	at := time.Now().UTC()

	// The retention's clock an hour ahead: every bucket's log is trimmed to its newest message.
	r := store.NewRetention(st.DB, store.RetentionOptions{MaxAge: time.Minute, Now: func() time.Time { return at.Add(time.Hour) }})
	_, err := r.Apply(context.Background())
	require.NoError(t, err)
	v, err := st.DB.View()
	require.NoError(t, err)
	m, err := v.HistoryMarks(c)
	v.Close()
	require.NoError(t, err)
	require.EqualValues(t, 4, m.Floor, "%s is trimmed to its newest message", c)

	rows, _ := h.askAllPlans(map[string]any{"what": "plans", "at": at.Format(time.RFC3339Nano)}, false)
	require.Equal(t, rowsByKey(live), rowsByKey(rows), "plans at %s, after the trim, answer what the live seat does", at)
}

// TestPlans_MinSeqWakesAParkedBucket: a node engine that publishes a composition to its idle, parked
// composed-<node> bucket (no consumer: projector/park.go) and asks with min_seq sees it at once, not at
// the next listing (an hour away here).
func TestPlans_MinSeqWakesAParkedBucket(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	sc := fixtures.Plans()
	h.load(sc.Before)
	st, _ := h.startPlansSeatWith(t.TempDir(), projector.Options{Poll: 20 * time.Millisecond, DiscoverEvery: time.Hour,
		Verify: time.Hour, ParkAfter: 100 * time.Millisecond})
	h.waitPlansCaughtUp(st)
	const bucket = provisioner.ComposedPrefix + "edge-1"
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if !st.Current().Parked(bucket) {
			return fmt.Errorf("%s not parked", bucket)
		}
		return nil
	})
	require.GreaterOrEqual(t, st.Stats().BucketsParked, 1, "$SRV.STATS counts it")

	kv, err := h.js.KeyValue(context.Background(), bucket)
	require.NoError(t, err)
	val, err := msgpack.Marshal(map[string]any{"status": "published", "plan": "db 3005"})
	require.NoError(t, err)
	seq, err := kv.Put(context.Background(), "db.3005", val)
	require.NoError(t, err)
	a, err := h.askPlans(map[string]any{"what": "plans", "node": "edge-1", "module": "db", "min_seq": seq, "wait_ms": 5000}, true)
	require.NoError(t, err)
	require.Equal(t, json.Number(fmt.Sprint(seq)), a["as_of"].(map[string]any)[bucket])
	require.Equal(t, json.Number("3005"), planRow(t, a, "edge-1.db")["current"].(map[string]any)["build"])
}

// TestPlans_PlanJSONCannotShow: a plan that is MessagePack JSON has no form for (a NaN deep in it, a
// string not UTF-8) answers in JSON as plan null and plan_raw, its bytes as published, live and as of
// a time; never as null alone, nor with U+FFFD for its bad bytes, which would say another plan.
// MessagePack answers carry it as it is.
func TestPlans_PlanJSONCannotShow(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	plans := map[string]any{
		"nan":    map[string]any{"steps": []any{1, map[string]any{"limit": math.NaN()}}},
		"latin1": map[string]any{"motd": "caf\xe9"},
		"key":    map[string]any{"k\xff": 1},
		"ok":     map[string]any{"steps": []any{1, "café"}},
	}
	var ops []fixtures.Op
	for mod, plan := range plans {
		ops = append(ops,
			fixtures.Op{Bucket: provisioner.ComposedPrefix + "e1", Key: mod + ".100", Op: provisioner.OpPut, Value: mp(t, map[string]any{"status": "published", "plan": plan})},
			fixtures.Op{Bucket: provisioner.BucketHostModules, Key: "e1." + mod, Op: provisioner.OpPut, Value: mp(t, map[string]any{"want": 100})})
	}
	h.load(ops)
	st, _ := h.startPlansSeat(t.TempDir())
	h.waitPlansCaughtUp(st)
	at := time.Now().UTC().Format(time.RFC3339Nano)
	for _, req := range []map[string]any{{"what": "plans", "node": "e1"}, {"what": "plans", "node": "e1", "at": at}} {
		a, err := h.askPlans(req, false)
		require.NoError(t, err)
		for mod, plan := range plans {
			cur := planRow(t, a, "e1."+mod)["current"].(map[string]any)
			require.Equal(t, "published", cur["status"], "%v %s", req, mod)
			if mod == "ok" {
				require.Equal(t, map[string]any{"steps": []any{json.Number("1"), "café"}}, cur["plan"], req)
				require.NotContains(t, cur, "plan_raw", req)
				continue
			}
			require.Contains(t, cur, "plan", "%v %s", req, mod)
			require.Nil(t, cur["plan"], "%v %s", req, mod)
			require.Equal(t, base64.StdEncoding.EncodeToString(mp(t, plan)), cur["plan_raw"], "%v %s: the plan's bytes as published", req, mod)
		}
		// MessagePack: the plan as it is.
		body, err := natstest.Body(req, true)
		require.NoError(t, err)
		msg, err := h.nc.Request(query.Subject, body, 10*time.Second)
		require.NoError(t, err)
		var ans struct {
			Rows []struct {
				Key     string                        `msgpack:"key"`
				Current map[string]msgpack.RawMessage `msgpack:"current"`
			} `msgpack:"rows"`
		}
		require.NoError(t, msgpack.Unmarshal(msg.Data, &ans), "%v", req)
		require.Len(t, ans.Rows, len(plans))
		for _, r := range ans.Rows {
			mod := strings.TrimPrefix(r.Key, "e1.")
			require.Equal(t, msgpack.RawMessage(mp(t, plans[mod])), r.Current["plan"], "%v %s", req, mod)
			require.NotContains(t, r.Current, "plan_raw", "%v %s", req, mod)
		}
	}
}
