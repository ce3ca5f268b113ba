package seat_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/replay"
)

// Tests of clauses the contract audit of session 18 (h141, docs/decisions.md) found pinned only in
// part.

// TestSeat_PurgeWithoutRollupAndMarkerWithABody: CONTRACT section 1, "A message with header
// KV-Operation: DEL or PURGE removes the key from the projection (PURGE also comes with Nats-Rollup:
// sub). A TTL marker (Nats-Marker-Reason set, any value) removes it as well." Every other test's PURGE
// carried the rollup, and every marker was empty: here a PURGE published by hand without Nats-Rollup
// (so the stream keeps the key's earlier messages) and a marker that carries a body remove their keys
// and clear their anomalies, live, as of a point (before the removals the keys answer, after them
// not), in replay from every source, and in a seat that reads the streams from the start.
func TestSeat_PurgeWithoutRollupAndMarkerWithABody(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	n := provisioner.BucketNeeds
	_, err := h.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: n, History: 10})
	require.NoError(t, err)
	require.NoError(t, fixtures.CreateBuckets(ctx, h.js, provisioner.BucketApplied, provisioner.BucketCollect))
	dir := t.TempDir()
	st, stop := h.startSeat(dir)

	h.rawMsg(n, "n1.m.config.purged", nil, mp(t, "p"))
	h.rawMsg(n, "n1.m.config.raw", nil, []byte{0xc1})  // value-not-msgpack
	h.rawMsg(n, "n1.m.config.marked", nil, mp(t, "m")) //
	h.rawMsg(n, "n1.out-of-shape", nil, mp(t, "bad"))  // token-count
	before := h.rawMsg(n, "n1.m.config.kept", nil, mp(t, "k"))
	h.waitCaughtUp(st)

	purge := nats.Header{"KV-Operation": {"PURGE"}}
	h.rawMsg(n, "n1.m.config.purged", purge, nil)
	h.rawMsg(n, "n1.m.config.raw", purge, nil)
	h.rawMsg(n, "n1.m.config.marked", nats.Header{jetstream.MarkerReasonHeader: {"MaxAge"}}, mp(t, "a body"))
	h.rawMsg(n, "n1.out-of-shape", nats.Header{jetstream.MarkerReasonHeader: {"Remove"}}, []byte{0xc1})
	h.waitCaughtUp(st)
	// Without Nats-Rollup the stream keeps every put: the purge removed nothing from it.
	stream, err := h.js.Stream(ctx, provisioner.StreamName(n))
	require.NoError(t, err)
	info, err := stream.Info(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 9, info.State.Msgs, "no message rolled up")
	// Nor is the purge taken for a stream that lost messages: the stream checks that run meanwhile
	// (every 200 ms here) start no rebuild.
	time.Sleep(700 * time.Millisecond)
	require.Zero(t, st.Rebuilds())

	check := func(what string, req map[string]any, rows []string, anomalies int) {
		t.Helper()
		for _, asMsgpack := range []bool{false, true} {
			body, err := natstest.Body(req, asMsgpack)
			require.NoError(t, err)
			a, _, err := natstest.Ask(h.nc, query.Subject, body, asMsgpack)
			require.NoError(t, err, "%s msgpack=%v", what, asMsgpack)
			var keys []string
			for _, r := range a.Rows {
				keys = append(keys, r["key"].(string))
			}
			require.Equal(t, rows, keys, "%s msgpack=%v", what, asMsgpack)
			require.EqualValues(t, anomalies, a.AnomaliesTotal, "%s msgpack=%v", what, asMsgpack)
		}
	}
	check("live", map[string]any{"what": "needs"}, []string{"n1.m.config.kept"}, 0)
	check("as of before the removals", map[string]any{"what": "needs", "at": fmt.Sprintf("seq:%d", before)},
		[]string{"n1.m.config.kept", "n1.m.config.marked", "n1.m.config.purged", "n1.m.config.raw"}, 2)
	check("as of the end", map[string]any{"what": "needs", "at": fmt.Sprintf("seq:%d", info.State.LastSeq)},
		[]string{"n1.m.config.kept"}, 0)

	// Replay from the streams, an archive of them, the state dir's log and an archive of that agrees.
	fromNATS, fromNATSArchive, fromState, fromStateArchive := h.replaySources(t, dir)
	for _, l := range []*replay.Log{fromNATS, fromNATSArchive, fromState, fromStateArchive} {
		got, err := logKeys(t, l, fmt.Sprintf("seq:%d", before))
		require.NoError(t, err, l.Source)
		require.Equal(t, []string{"n1.m.config.kept", "n1.m.config.marked", "n1.m.config.purged", "n1.m.config.raw", "n1.out-of-shape"}, got, l.Source)
		got, err = logKeys(t, l, fmt.Sprintf("seq:%d", info.State.LastSeq))
		require.NoError(t, err, l.Source)
		require.Equal(t, []string{"n1.m.config.kept"}, got, l.Source)
	}

	// A seat that reads the streams from their start finds the same.
	stop()
	st2, _ := h.startSeat(t.TempDir())
	h.waitCaughtUp(st2)
	check("rebuilt", map[string]any{"what": "needs"}, []string{"n1.m.config.kept"}, 0)
	// It read the puts before the purges from the stream: a purge without rollup removed none of
	// them, so the points before it are known (not 410, as after a purge whose rollup removed the put
	// before the seat read it).
	check("rebuilt, as of before the removals", map[string]any{"what": "needs", "at": fmt.Sprintf("seq:%d", before)},
		[]string{"n1.m.config.kept", "n1.m.config.marked", "n1.m.config.purged", "n1.m.config.raw"}, 2)
}

// TestSeat_EveryNarrowingAWhatDoesNotTakeIs400: CONTRACT section 3, request table: node for every
// what but registry, contributor and collection for collect only, kind for registry and needs only
// (docs/protocol.md reads a narrowing a what does not take as a bad request; the contract names
// collection outside collect). Tested before for some pairs and in JSON alone; here every pair of
// what and field, in both formats, the error in the micro headers and again as the body, in the
// request's format; and each pair a what does take answers.
func TestSeat_EveryNarrowingAWhatDoesNotTakeIs400(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	require.NoError(t, fixtures.CreateBuckets(context.Background(), h.js, provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect))
	st, _ := h.startSeat(t.TempDir())
	h.waitCaughtUp(st)
	takes := map[string]map[string]bool{
		"registry": {"kind": true},
		"needs":    {"node": true, "kind": true},
		"applied":  {"node": true},
		"collect":  {"node": true, "contributor": true, "collection": true},
		"plans":    {"node": true},
	}
	for what, fields := range takes {
		for _, field := range []string{"node", "contributor", "collection", "kind"} {
			for _, f := range wireFormats {
				req := map[string]any{"what": what, field: "x"}
				if !fields[field] {
					wireFails(t, h.nc, wireBody(t, req, f.msgpack), f.msgpack, 400)
					continue
				}
				if what == "plans" {
					continue // this seat reads no plans; the request was decoded, and passed
				}
				w := wireOK(t, h.nc, req, f.msgpack)
				require.Empty(t, wireRows(t, w), "%s %v", f.name, req)
			}
		}
	}
	// contributor and module name one field of collect: the same value is one narrowing, two values
	// are a bad request, in MessagePack too.
	for _, f := range wireFormats {
		wireOK(t, h.nc, map[string]any{"what": "collect", "module": "m", "contributor": "m"}, f.msgpack)
		wireFails(t, h.nc, wireBody(t, map[string]any{"what": "collect", "module": "m", "contributor": "n"}, f.msgpack), f.msgpack, 400)
	}
}

// TestSeat_CollectAndAppliedAnomaliesNarrowedByNodeAlone: CONTRACT section 3, anomalies are "narrowed
// by node alone". Pinned before for needs (module and kind narrow rows, not anomalies); here for
// collect, whose collection, contributor and module narrow rows only (a bad escape stays said
// whatever collection is asked), and for applied, whose module does.
func TestSeat_CollectAndAppliedAnomaliesNarrowedByNodeAlone(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	require.NoError(t, fixtures.CreateBuckets(ctx, h.js, provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect))
	st, _ := h.startSeat(t.TempDir())
	C, A := provisioner.BucketCollect, provisioner.BucketApplied
	h.rawMsg(C, "c1.shell=3Azsh.modA", nil, mp(t, "ok"))
	h.rawMsg(C, "c1.bad=Z.modA", nil, mp(t, "bad-escape"))
	h.rawMsg(C, "c1.=FF.modB", nil, mp(t, "bad-escape"))
	h.rawMsg(C, "c1.shell.modA", nil, []byte{0xc1}) // value-not-msgpack, a row too
	h.rawMsg(C, "c1", nil, mp(t, "token-count"))
	h.rawMsg(C, "c2.bad=.modA", nil, mp(t, "another node"))
	h.rawMsg(A, "a1.m1", nil, mp(t, "ok"))
	h.rawMsg(A, "a1.m2", nil, []byte{0x92, 0x01})
	h.rawMsg(A, "a1.m3.x", nil, mp(t, "token-count"))
	h.rawMsg(A, "a2.m1.x", nil, mp(t, "another node"))
	h.waitCaughtUp(st)

	c1 := []string{"c1", "c1.=FF.modB", "c1.bad=Z.modA", "c1.shell.modA"}
	a1 := []string{"a1.m2", "a1.m3.x"}
	for _, f := range wireFormats {
		for _, tc := range []struct {
			req         map[string]any
			rows, anoms []string
		}{
			{map[string]any{"what": "collect", "node": "c1"}, []string{"c1.shell.modA", "c1.shell=3Azsh.modA"}, c1},
			{map[string]any{"what": "collect", "node": "c1", "collection": "shell:zsh"}, []string{"c1.shell=3Azsh.modA"}, c1},
			{map[string]any{"what": "collect", "node": "c1", "collection": "nothing", "contributor": "modZ"}, nil, c1},
			{map[string]any{"what": "collect", "node": "c1", "module": "modB"}, nil, c1},
			{map[string]any{"what": "collect", "collection": "nothing"}, nil, append(append([]string{}, c1...), "c2.bad=.modA")},
			{map[string]any{"what": "applied", "node": "a1", "module": "m1"}, []string{"a1.m1"}, a1},
			{map[string]any{"what": "applied", "node": "a1", "module": "nope"}, nil, a1},
		} {
			w := wireOK(t, h.nc, tc.req, f.msgpack)
			require.Equal(t, tc.rows, wireKeys(t, w), "%s %v", f.name, tc.req)
			var anoms []string
			for _, a := range w.body["anomalies"].([]any) {
				anoms = append(anoms, a.(map[string]any)["key"].(string))
			}
			require.Equal(t, tc.anoms, anoms, "%s %v", f.name, tc.req)
			require.EqualValues(t, len(tc.anoms), wireUint(t, w.body["anomalies_total"]), "%s %v", f.name, tc.req)
		}
	}
}

// TestPlans_PurgeWithoutRollupForgetsTheBuild: CONTRACT section 1's removals on a plans input. A
// composition purged by hand without Nats-Rollup (the stream still holds its published revision) is
// removed as a KV purge is: the build is missing, and (docs/decisions.md, "a purge or a TTL marker
// forgets the build") its plan is not kept, live and in a seat that reads the streams from their
// start, where the published revision comes before the purge; as of before the purge it is published.
func TestPlans_PurgeWithoutRollupForgetsTheBuild(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	composed := provisioner.ComposedPrefix + "n1"
	for _, b := range []string{composed, provisioner.BucketHostModules, provisioner.BucketIndexerBuilds} {
		_, err := h.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: b, History: 10})
		require.NoError(t, err)
	}
	h.rawMsg(provisioner.BucketHostModules, "n1.web", nil, mp(t, map[string]any{"want": 10}))
	published := h.rawMsg(composed, "web.10", nil, mp(t, map[string]any{"status": "published", "plan": "web 10"}))
	st, stop := h.startPlansSeat(t.TempDir())
	h.waitPlansCaughtUp(st)
	h.rawMsg(composed, "web.10", nats.Header{"KV-Operation": {"PURGE"}}, nil)
	h.waitPlansCaughtUp(st)

	current := func(req map[string]any) map[string]any {
		t.Helper()
		var out map[string]any
		for _, asMsgpack := range []bool{false, true} {
			a, err := h.askPlans(req, asMsgpack)
			require.NoError(t, err, "%v", req)
			rows := a["rows"].([]any)
			require.Len(t, rows, 1, "%v", req)
			cur := rows[0].(map[string]any)["current"].(map[string]any)
			delete(cur, "created")
			if out != nil {
				require.Equal(t, out, cur, "%v: MessagePack answers what JSON does", req)
			}
			out = cur
		}
		return out
	}
	missing := map[string]any{"status": "held", "held_because": "missing"}
	require.Equal(t, missing, current(map[string]any{"what": "plans"}), "live")
	asOfPublished := current(map[string]any{"what": "plans", "at": h.msgTime(composed, published).UTC().Format(time.RFC3339Nano)})
	require.Equal(t, "published", asOfPublished["status"])
	require.Equal(t, "web 10", asOfPublished["plan"])

	stop()
	st2, _ := h.startPlansSeat(t.TempDir())
	h.waitPlansCaughtUp(st2)
	require.Equal(t, missing, current(map[string]any{"what": "plans"}), "read from the streams' start")
}
