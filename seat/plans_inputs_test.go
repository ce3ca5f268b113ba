package seat_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/seat"
)

// planInputs writes the plans' input buckets through the KV API, as the node engine, the host and the
// indexer do.
type planInputs struct {
	h   *harness
	kvs map[string]jetstream.KeyValue
}

func (h *harness) planInputs() *planInputs {
	return &planInputs{h: h, kvs: map[string]jetstream.KeyValue{}}
}

func (p *planInputs) kv(bucket string) jetstream.KeyValue {
	p.h.t.Helper()
	if kv, ok := p.kvs[bucket]; ok {
		return kv
	}
	kv, err := p.h.js.CreateOrUpdateKeyValue(context.Background(), jetstream.KeyValueConfig{Bucket: bucket, History: 8})
	require.NoError(p.h.t, err)
	p.kvs[bucket] = kv
	return kv
}

func (p *planInputs) put(bucket, key string, v any) {
	p.h.t.Helper()
	_, err := p.kv(bucket).Put(context.Background(), key, mp(p.h.t, v))
	require.NoError(p.h.t, err)
}

func (p *planInputs) comp(node, key, status string, plan any) {
	p.h.t.Helper()
	v := map[string]any{"status": status}
	if plan != nil {
		v["plan"] = plan
	}
	p.put(provisioner.ComposedPrefix+node, key, v)
}

func (p *planInputs) host(key string, v map[string]any) {
	p.h.t.Helper()
	p.put(provisioner.BucketHostModules, key, v)
}

func (p *planInputs) newest(module string, n any) {
	p.h.t.Helper()
	p.put(provisioner.BucketIndexerBuilds, module, map[string]any{"newest": n})
}

func (p *planInputs) del(bucket, key string) {
	p.h.t.Helper()
	require.NoError(p.h.t, p.kv(bucket).Delete(context.Background(), key))
}

func (p *planInputs) purge(bucket, key string) {
	p.h.t.Helper()
	require.NoError(p.h.t, p.kv(bucket).Purge(context.Background(), key))
}

// entry is a plan entry of a row, printed short: status[/held_because][@build:plan].
func entry(row map[string]any, which string) string {
	e, ok := row[which].(map[string]any)
	if !ok {
		return "-"
	}
	s := e["status"].(string)
	if hb, ok := e["held_because"]; ok {
		s += "/" + hb.(string)
	}
	if b, ok := e["build"]; ok {
		s += fmt.Sprintf("@%v:%v", b, e["plan"])
	}
	return s
}

// planRows is every row of the live answer, by key.
func (h *harness) planRows(req map[string]any) map[string]map[string]any {
	h.t.Helper()
	rows, _ := h.askAllPlans(req, false)
	out := map[string]map[string]any{}
	for _, r := range rows {
		row := r.(map[string]any)
		out[row["key"].(string)] = row
	}
	return out
}

// anomalyCodes are the anomalies of a plans answer, as "bucket key code".
func anomalyCodes(a map[string]any) []string {
	var out []string
	for _, x := range a["anomalies"].([]any) {
		an := x.(map[string]any)
		code, _, _ := strings.Cut(an["reason"].(string), ":")
		out = append(out, fmt.Sprintf("%s %s %s", an["bucket"], an["key"], code))
	}
	return out
}

// crossCheck: the live answer equals one asked at a time after the last message (from the event log),
// and the projection of a seat rebuilt from the streams; it returns the live answer.
func (h *harness) crossCheck(st *seat.Seat) map[string]any {
	h.t.Helper()
	h.waitPlansCaughtUp(st)
	live, err := h.askPlans(map[string]any{"what": "plans"}, false)
	require.NoError(h.t, err)
	at := time.Now().UTC().Format(time.RFC3339Nano)
	then, err := h.askPlans(map[string]any{"what": "plans", "at": at}, false)
	require.NoError(h.t, err)
	require.Equal(h.t, jsonOf(h.t, live["rows"]), jsonOf(h.t, then["rows"]), "plans at %s answer the live rows", at)
	require.Equal(h.t, anomalyCodes(live), anomalyCodes(then), "plans at %s answer the live anomalies", at)
	// The rebuilt seat's projection is read directly: the verb's queue group could send the question to
	// either seat. It is stopped afterwards, so the verb has one seat again.
	fresh, stop := h.startPlansSeat(h.t.TempDir())
	h.waitPlansCaughtUp(fresh)
	v, err := fresh.Store().View()
	require.NoError(h.t, err)
	var e query.Encoder
	e.Reset(query.FormatJSON)
	require.NoError(h.t, query.AnswerPlans(v, &query.Request{What: "plans"}, &e, true))
	v.Close()
	stop()
	var rebuilt map[string]any
	dec := json.NewDecoder(bytes.NewReader(e.Bytes()))
	dec.UseNumber()
	require.NoError(h.t, dec.Decode(&rebuilt))
	require.Equal(h.t, jsonOf(h.t, live["rows"]), jsonOf(h.t, rebuilt["rows"]), "a rebuild from the streams answers the live rows")
	require.Equal(h.t, anomalyCodes(live), anomalyCodes(rebuilt), "a rebuild from the streams answers the live anomalies")
	return live
}

func jsonOf(t *testing.T, v any) string {
	b, err := json.Marshal(v)
	require.NoError(t, err)
	return string(b)
}

// expectPlans waits for the seat to catch up and checks rows' entries: key -> "current | newest".
func (h *harness) expectPlans(st *seat.Seat, want map[string]string) {
	h.t.Helper()
	h.waitPlansCaughtUp(st)
	rows := h.planRows(map[string]any{"what": "plans"})
	for key, w := range want {
		row, ok := rows[key]
		if w == "" {
			require.False(h.t, ok, "%s: no row", key)
			continue
		}
		require.True(h.t, ok, "%s: a row", key)
		require.Equal(h.t, w, entry(row, "current")+" | "+entry(row, "newest"), "%s: %v", key, row)
	}
}

// TestPlans_InputsEndToEnd walks CONTRACT section 6 through the KV API and the verb, in three phases,
// and after each checks that plans asked at a time after the last message, and a seat rebuilt from
// the streams, answer the live rows and anomalies: builds compared as numbers (999 < 1000, 0042 is
// 42), inputs arriving in any order (the newest and a composition before the host row), a deleted
// composition held at its published revision, a purged one forgotten, a purged newest build and
// deleted or purged host rows, and anomalies of each input that clear when fixed or deleted.
func TestPlans_InputsEndToEnd(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	in := h.planInputs()
	st, _ := h.startPlansSeat(t.TempDir())
	const n1 = "n1"
	c1 := provisioner.ComposedPrefix + n1

	// Builds are numbers.
	in.comp(n1, "a.999", "published", "a999")
	in.comp(n1, "a.1000", "published", "a1000")
	in.host("n1.a", map[string]any{"want": 1000, "have": 999})
	in.newest("a", 1000)
	in.comp(n1, "b.0042", "published", "b42")
	in.host("n1.b", map[string]any{"want": "42"})
	// Order: the newest and a composition before the host row.
	in.newest("e", 7)
	in.comp(n1, "e.7", "published", "e7")
	in.host("n1.e", map[string]any{"want": 5})
	// Deletes.
	in.comp(n1, "f.1", "published", "f1")
	in.comp(n1, "f.2", "published", "f2")
	in.host("n1.f", map[string]any{"want": 2})
	in.newest("g", 9)
	in.comp(n1, "g.9", "published", "g9")
	in.host("n1.g", map[string]any{"want": 3})
	in.host("n1.h", map[string]any{"want": 3})
	// Anomalies.
	in.comp(n1, "x.1", "bogus", "x1")
	in.comp(n1, "x.y", "published", "xy")
	in.host("n1.z", map[string]any{"want": "latest", "have": 4})
	in.newest("q", "x")
	in.comp("n2", "w.1", "bogus", nil)
	in.host("n2", map[string]any{"want": 1})
	h.expectPlans(st, map[string]string{
		"n1.a": "published@1000:a1000 | -",
		"n1.b": "published@42:b42 | -",
		"n1.e": "held/missing | published@7:e7",
		"n1.f": "published@2:f2 | -",
		"n1.g": "held/missing | published@9:g9",
		"n1.h": "held/missing | -",
		"n1.z": "held/missing | -",
	})
	a := h.crossCheck(st)
	require.Equal(t, []string{
		"composed-n1 x.1 bad-value", "composed-n1 x.y bad-build", "composed-n2 w.1 bad-value",
		"mesh-host_modules n1.z bad-value", "mesh-host_modules n2 token-count", "mesh-indexer_builds q bad-value",
	}, anomalyCodes(a))
	a, err := h.askPlans(map[string]any{"what": "plans", "node": "n2"}, false)
	require.NoError(t, err)
	require.Equal(t, []string{"composed-n2 w.1 bad-value", "mesh-host_modules n2 token-count", "mesh-indexer_builds q bad-value"}, anomalyCodes(a))

	// Second phase.
	in.comp(n1, "b.42", "refused", "b42r") // the same build written otherwise: its newest message
	in.comp(n1, "e.5", "pending", nil)
	in.comp(n1, "e.4", "published", "e4")
	in.del(c1, "f.2")
	in.purge(provisioner.BucketIndexerBuilds, "g")
	in.del(provisioner.BucketHostModules, "n1.h")
	in.comp(n1, "x.1", "published", "x1")
	in.del(c1, "x.y")
	in.host("n1.z", map[string]any{"want": 4, "have": 4})
	in.purge(provisioner.BucketIndexerBuilds, "q")
	h.expectPlans(st, map[string]string{
		"n1.b": "held/refused@42:b42 | -",
		"n1.e": "held/pending@4:e4 | published@7:e7",
		"n1.f": "held/missing@2:f2 | -",
		"n1.g": "held/missing | -",
		"n1.h": "",
		"n1.z": "held/missing | -",
	})
	a = h.crossCheck(st)
	require.Equal(t, []string{"composed-n2 w.1 bad-value", "mesh-host_modules n2 token-count"}, anomalyCodes(a))
	require.NotContains(t, h.planRows(map[string]any{"what": "plans"})["n1.g"], "newest_build")

	// Third phase.
	in.purge(c1, "f.2")
	in.comp(n1, "e.5", "published", "e5")
	in.purge(provisioner.BucketHostModules, "n1.g")
	h.expectPlans(st, map[string]string{
		"n1.e": "published@5:e5 | published@7:e7",
		"n1.f": "held/missing@1:f1 | -",
		"n1.g": "",
	})
	h.crossCheck(st)
}

// TestPlans_DeletedComposedBucketIsForgotten: a composed-<node> bucket deleted after the seat read it
// no longer holds the node's history, so a seat answers what one that never read it answers (the
// node's rows held missing with no plan, none of the bucket's anomalies), not the plans it read
// before; seats sharing the verb, one started before the delete and one after, answer alike. The
// seat forgets the bucket in place: no rebuild, the same store, every other bucket's event log kept.
// Plans asked at a time before the forgetting are refused (410) for that node and for every node,
// and answered for another node; a seat restarted on a state dir that holds the deleted bucket
// forgets it too. The bucket created again is read from its start, live and at a time.
func TestPlans_DeletedComposedBucketIsForgotten(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	in := h.planInputs()
	po := projector.Options{Poll: 50 * time.Millisecond, DiscoverEvery: time.Hour, Verify: 200 * time.Millisecond}
	st, _ := h.startPlansSeatWith(t.TempDir(), po)
	c3 := provisioner.ComposedPrefix + "n3"
	in.put(provisioner.BucketNeeds, "n3.m.pkg.x", map[string]any{"v": 1})
	in.comp("n3", "m.1", "published", "m1")
	in.comp("n3", "bad", "published", "m1")
	in.host("n3.m", map[string]any{"want": 1})
	in.comp("n4", "m.1", "published", "n4m1")
	in.host("n4.m", map[string]any{"want": 1})
	h.expectPlans(st, map[string]string{"n3.m": "published@1:m1 | -", "n4.m": "published@1:n4m1 | -"})
	// A second seat, down while the bucket is deleted.
	downDir := t.TempDir()
	down, stopDown := h.startPlansSeatWith(downDir, po)
	h.expectPlans(down, map[string]string{"n3.m": "published@1:m1 | -"})
	stopDown()

	// A time after every message so far, before the delete.
	before := time.Now().UTC().Format(time.RFC3339Nano)
	n4Before, err := h.askPlans(map[string]any{"what": "plans", "node": "n4", "at": before}, false)
	require.NoError(t, err)
	require.Equal(t, "published@1:n4m1", entry(planRow(t, n4Before, "n4.m"), "current"))
	db := st.Store()

	ctx := context.Background()
	require.NoError(t, h.js.DeleteKeyValue(ctx, c3))
	delete(in.kvs, c3)
	forgotten := func(st *seat.Seat) func() error {
		return func() error {
			if st.Current().Tails(c3) || slices.Contains(st.Store().Buckets(), c3) {
				return fmt.Errorf("%s not forgotten yet", c3)
			}
			return nil
		}
	}
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, forgotten(st))
	require.Zero(t, st.Rebuilds(), "forgotten in place, not rebuilt")
	require.Same(t, db, st.Store(), "the same store")
	h.expectPlans(st, map[string]string{"n3.m": "held/missing | -", "n4.m": "published@1:n4m1 | -"})
	live, err := h.askPlans(map[string]any{"what": "plans"}, false)
	require.NoError(t, err)
	require.Empty(t, anomalyCodes(live), "no anomalies of a deleted bucket")
	require.Equal(t, "0", fmt.Sprint(live["as_of"].(map[string]any)[c3]), "as a seat that never read it: nothing applied")

	// The other buckets' event logs still answer from before.
	needs, err := h.askAt("needs", before, false)
	require.NoError(t, err)
	require.Len(t, needs.Rows, 1)
	require.Equal(t, "n3.m.pkg.x", needs.Rows[0]["key"])
	// Plans before the forgetting: refused for the node and for every node, exact for another node.
	h.goneAt(before, "n3")
	h.goneAt(before, "")
	h.goneAt(before, "", "module", "m")
	n4Again, err := h.askPlans(map[string]any{"what": "plans", "node": "n4", "at": before}, false)
	require.NoError(t, err)
	require.Equal(t, jsonOf(t, n4Before["rows"]), jsonOf(t, n4Again["rows"]))
	require.Equal(t, anomalyCodes(n4Before), anomalyCodes(n4Again))
	// After it: the live answer.
	then, err := h.askPlans(map[string]any{"what": "plans", "at": time.Now().UTC().Format(time.RFC3339Nano)}, false)
	require.NoError(t, err)
	require.Equal(t, jsonOf(t, live["rows"]), jsonOf(t, then["rows"]))
	require.NoError(t, st.Stop())

	// Restarted on a state dir that holds the deleted bucket: forgotten too, without a rebuild.
	down, _ = h.startPlansSeatWith(downDir, po)
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, forgotten(down))
	require.Zero(t, down.Rebuilds())
	h.expectPlans(down, map[string]string{"n3.m": "held/missing | -", "n4.m": "published@1:n4m1 | -"})
	h.goneAt(before, "n3")
	afterForgot := time.Now().UTC().Format(time.RFC3339Nano)
	a, err := h.askPlans(map[string]any{"what": "plans", "node": "n3", "at": afterForgot}, false)
	require.NoError(t, err)
	require.Equal(t, "held/missing", entry(planRow(t, a, "n3.m"), "current"))
	restarted, err := h.askPlans(map[string]any{"what": "plans"}, false)
	require.NoError(t, err)
	require.Equal(t, jsonOf(t, live["rows"]), jsonOf(t, restarted["rows"]), "the seat that forgot live and the restarted one answer alike")
	// And alike a seat started fresh on the same streams (crossCheck leaves it answering too).
	h.crossCheck(down)

	// Created again: read from its first message, live and at a time.
	in.comp("n3", "m.1", "published", "again")
	h.expectPlans(down, map[string]string{"n3.m": "published@1:again | -", "n4.m": "published@1:n4m1 | -"})
	require.True(t, down.Current().Tails(c3))
	seq, _ := down.Store().Applied(c3)
	require.Equal(t, uint64(1), seq)
	a, err = h.askPlans(map[string]any{"what": "plans", "node": "n3", "at": afterForgot}, false)
	require.NoError(t, err)
	require.Equal(t, "held/missing", entry(planRow(t, a, "n3.m"), "current"), "before it was created again")
	h.crossCheck(down)
	require.Zero(t, down.Rebuilds())
}

// goneAt asks plans at a time, for a node (every node when empty) and more fields, and expects 410.
func (h *harness) goneAt(at, node string, more ...string) {
	h.t.Helper()
	req := map[string]any{"what": "plans", "at": at}
	if node != "" {
		req["node"] = node
	}
	for i := 0; i+1 < len(more); i += 2 {
		req[more[i]] = more[i+1]
	}
	_, err := h.askPlans(req, false)
	var ve *natstest.VerbError
	require.ErrorAs(h.t, err, &ve, "plans %v", req)
	require.Equal(h.t, 410, ve.Code, "plans %v: %s", req, ve.Description)
}
