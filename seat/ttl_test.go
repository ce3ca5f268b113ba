package seat_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/replay"
)

// TestSeat_TTLExpiryEndToEnd: a need put with a per-key TTL (kv.Create with jetstream.KeyTTL), or
// aged out by the bucket's MaxAge, expires on the server, which writes a subject delete marker
// (Nats-Marker-Reason, no KV-Operation, an empty body) in its place. The marker removes the row and
// clears the anomaly of an out-of-shape key that expired the same way; the answer as of a time before
// the expiry still shows both, as of a time after it neither; and a seat that rebuilds its state dir
// from the streams answers the same, live and as of both times.
//
// The markers must stay in the stream until the rebuild has read them: one removed before (its own
// TTL, or the bucket's MaxAge) leaves nothing to say the keys expired, and the answers as of after
// the expiry are 410, as they should be. Each marker lives a minute (LimitMarkerTTL), so key-ttl's
// bucket keeps a history of 1, where the server leaves a key's own TTL as it is (with more it raises
// it to the marker's); max-age's MaxAge is lifted once both markers are there. With a marker of a
// second and a history of 4, markers gone before the rebuild read them failed both cases under the
// race detector on a loaded machine (session 16).
func TestSeat_TTLExpiryEndToEnd(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		maxAge  time.Duration // the bucket's TTL; 0: each key's own
		history uint8
	}{{name: "key-ttl", history: 1}, {name: "max-age", maxAge: time.Second, history: 4}} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			ctx := context.Background()
			cfg := jetstream.KeyValueConfig{Bucket: provisioner.BucketNeeds, History: tc.history, TTL: tc.maxAge, LimitMarkerTTL: time.Minute}
			kv, err := h.js.CreateKeyValue(ctx, cfg)
			require.NoError(t, err)
			require.NoError(t, fixtures.CreateBuckets(ctx, h.js, provisioner.BucketApplied, provisioner.BucketCollect))
			dir := t.TempDir()
			st, stop := h.startSeat(dir)
			h.waitCaughtUp(st)

			const good, bad, kept = "n1.m1.config.a", "n1.m1.bad", "n1.m1.config.kept"
			put := func(key string) uint64 {
				if tc.maxAge > 0 {
					seq, err := kv.Put(ctx, key, []byte{0x80})
					require.NoError(t, err)
					return seq
				}
				seq, err := kv.Create(ctx, key, []byte{0x80}, jetstream.KeyTTL(time.Second))
				require.NoError(t, err)
				return seq
			}
			put(good)
			last := put(bad)
			if tc.maxAge == 0 { // a key without a TTL stays: the markers remove only their own keys
				last, err = kv.Put(ctx, kept, []byte{0x80})
				require.NoError(t, err)
			}
			keys := []string{}
			if tc.maxAge == 0 {
				keys = []string{kept}
			}
			live := map[string]any{"what": "needs", "node": "n1", "min_seq": last, "wait_ms": 5000}
			a, err := h.askErr(live, false)
			require.NoError(t, err)
			require.Equal(t, append([]string{good}, keys...), rowKeys(a.Rows), "projected before they expire")
			require.Equal(t, []string{bad}, rowKeys(a.Anomalies))
			before := time.Now().UTC()

			// Both expire: the server writes a marker for each, with no KV-Operation.
			stream, err := h.js.Stream(ctx, provisioner.StreamName(provisioner.BucketNeeds))
			require.NoError(t, err)
			var markers uint64
			natstest.CheckFor(t, 15*time.Second, 10*time.Millisecond, func() error {
				markers = 0
				for _, key := range []string{good, bad} {
					m, err := stream.GetLastMsgForSubject(ctx, provisioner.SubjectPrefix(provisioner.BucketNeeds)+key)
					if err != nil {
						return err
					}
					if m.Header.Get(jetstream.MarkerReasonHeader) == "" {
						return fmt.Errorf("%s: no marker yet: seq %d %v %q", key, m.Sequence, m.Header, m.Data)
					}
					if m.Header.Get(provisioner.HeaderKVOperation) != "" || len(m.Data) != 0 {
						return fmt.Errorf("%s: the marker is not as the server writes them: %v %q", key, m.Header, m.Data)
					}
					markers = max(markers, m.Sequence)
				}
				return nil
			})
			if tc.maxAge > 0 {
				// MaxAge would age the markers out a second after they came, before the rebuild
				// reads them.
				cfg.TTL = 0
				_, err := h.js.UpdateKeyValue(ctx, cfg)
				require.NoError(t, err)
				info, err := stream.Info(ctx)
				require.NoError(t, err)
				require.LessOrEqual(t, info.State.FirstSeq, markers-1, "both markers are kept")
			}
			after := time.Now().UTC()
			// The answers as of a time compare by message time, which has the server's precision.
			time.Sleep(10 * time.Millisecond)

			check := func(stage string, rebuilt bool) {
				t.Helper()
				a, err := h.askErr(map[string]any{"what": "needs", "node": "n1", "min_seq": markers, "wait_ms": 5000}, false)
				require.NoError(t, err, stage)
				require.Equal(t, keys, rowKeys(a.Rows), "%s: the markers removed the expired keys", stage)
				require.Empty(t, rowKeys(a.Anomalies), "%s: the expired out-of-shape key's anomaly is cleared", stage)
				require.Zero(t, a.AnomaliesTotal, stage)
				a, err = h.askErr(map[string]any{"what": "needs", "node": "n1", "at": before.Format(time.RFC3339Nano)}, false)
				if rebuilt {
					// The streams no longer hold the expired puts: a state dir read from them cannot
					// tell what was there before, and says so.
					require.Equal(t, 410, verbCode(err), "%s: as of before the expiry: %v", stage, err)
				} else {
					require.NoError(t, err, stage)
					require.Equal(t, append([]string{good}, keys...), rowKeys(a.Rows), "%s: as of before the expiry", stage)
					require.Equal(t, []string{bad}, rowKeys(a.Anomalies), "%s: as of before the expiry", stage)
				}
				a, err = h.askErr(map[string]any{"what": "needs", "node": "n1", "at": after.Format(time.RFC3339Nano)}, false)
				require.NoError(t, err, stage)
				require.Equal(t, keys, rowKeys(a.Rows), "%s: as of after the expiry", stage)
				require.Empty(t, rowKeys(a.Anomalies), "%s: as of after the expiry", stage)
			}
			check("live", false)
			// Forensics from the streams and from an archive of them agree: the expired keys are gone.
			archive := filepath.Join(t.TempDir(), "ttl.mph")
			_, err = replay.ExportNATS(ctx, h.js, nil, archive, "test", nil)
			require.NoError(t, err)
			fromArchive, err := replay.FromArchive(ctx, archive, nil)
			require.NoError(t, err)
			defer fromArchive.Close()
			fromNATS, err := replay.FromNATS(ctx, h.js, nil, "test", nil)
			require.NoError(t, err)
			defer fromNATS.Close()
			for name, l := range map[string]*replay.Log{"archive": fromArchive, "nats": fromNATS} {
				for _, at := range []string{after.Format(time.RFC3339Nano), fmt.Sprintf("seq:%d", markers)} {
					body, _ := json.Marshal(map[string]any{"what": "needs", "node": "n1", "at": at})
					out, err := l.Ask(body)
					require.NoError(t, err, "%s at %s", name, at)
					var a natstest.Answer
					require.NoError(t, json.Unmarshal(out, &a), "%s at %s", name, at)
					require.Equal(t, keys, rowKeys(a.Rows), "%s at %s", name, at)
					require.Empty(t, rowKeys(a.Anomalies), "%s at %s", name, at)
				}
			}
			stop()
			require.NoError(t, os.RemoveAll(dir))
			st, _ = h.startSeat(dir)
			h.waitCaughtUp(st)
			check("rebuilt from the streams", true)
		})
	}
}

// rowKeys is the key of each row or anomaly row, in answer order.
func rowKeys(rows []map[string]any) []string {
	out := []string{}
	for _, r := range rows {
		out = append(out, fmt.Sprint(r["key"]))
	}
	return out
}

// TestPlans_TTLExpiryEndToEnd: a composition put with a per-key TTL into a composed-<node> bucket with
// markers expires as a need does: its marker forgets the build (the stream no longer holds its
// history), so the module is held missing with no plan kept, and the anomaly of an out-of-shape
// composition that expired too is cleared; as of before the expiry the plan shows, after it not, from
// the seat's log and from the streams.
func TestPlans_TTLExpiryEndToEnd(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	require.NoError(t, fixtures.CreateBuckets(ctx, h.js, provisioner.BucketHostModules, provisioner.BucketIndexerBuilds))
	const bucket = provisioner.ComposedPrefix + "n1"
	// Markers of a minute, with a history of 1 so that the compositions' TTL of a second stays as it is
	// (TestSeat_TTLExpiryEndToEnd says why): the markers are still in the stream when it is read.
	kv, err := h.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: bucket, History: 1, LimitMarkerTTL: time.Minute})
	require.NoError(t, err)
	h.load([]fixtures.Op{
		{Bucket: provisioner.BucketHostModules, Key: "n1.web", Op: provisioner.OpPut, Value: mp(t, map[string]any{"want": 5})},
		{Bucket: provisioner.BucketIndexerBuilds, Key: "web", Op: provisioner.OpPut, Value: mp(t, map[string]any{"newest": 5})},
	})
	// The seat starts and catches up before the compositions are put: their second lasts from the
	// puts to the ask below, and a seat started inside it (a plans seat, under the race detector on a
	// loaded machine) outlasted it, so the ask found them expired already.
	st, _ := h.startPlansSeat(t.TempDir())
	h.waitPlansCaughtUp(st)
	for _, key := range []string{"web.5", "web.x"} {
		_, err := kv.Create(ctx, key, mp(t, map[string]any{"status": "published", "plan": map[string]any{"image": "web:5"}}), jetstream.KeyTTL(time.Second))
		require.NoError(t, err)
	}
	h.waitPlansCaughtUp(st)
	current := func(a map[string]any) map[string]any {
		t.Helper()
		e, _ := planRow(t, a, "n1.web")["current"].(map[string]any)
		return e
	}
	anomalies := func(a map[string]any) []string {
		out := []string{}
		for _, r := range a["anomalies"].([]any) {
			out = append(out, fmt.Sprint(r.(map[string]any)["key"]))
		}
		return out
	}
	req := map[string]any{"what": "plans", "node": "n1"}
	a, err := h.askPlans(req, false)
	require.NoError(t, err)
	require.Equal(t, "published", current(a)["status"], "before the expiry")
	require.Equal(t, json.Number("5"), current(a)["build"])
	require.Equal(t, []string{"web.x"}, anomalies(a))
	before := time.Now().UTC()

	stream, err := h.js.Stream(ctx, provisioner.StreamName(bucket))
	require.NoError(t, err)
	natstest.CheckFor(t, 15*time.Second, 50*time.Millisecond, func() error {
		for _, key := range []string{"web.5", "web.x"} {
			m, err := stream.GetLastMsgForSubject(ctx, provisioner.SubjectPrefix(bucket)+key)
			if err != nil {
				return err
			}
			if m.Header.Get(jetstream.MarkerReasonHeader) == "" {
				return fmt.Errorf("%s: no marker yet", key)
			}
		}
		return nil
	})
	after := time.Now().UTC()
	time.Sleep(10 * time.Millisecond)
	h.waitPlansCaughtUp(st)

	expired := func(a map[string]any, stage string) {
		t.Helper()
		require.Equal(t, "held", current(a)["status"], stage)
		require.Equal(t, "missing", current(a)["held_because"], stage)
		require.NotContains(t, current(a), "plan", "%s: the marker forgot the build's history", stage)
		require.Empty(t, anomalies(a), "%s: the expired out-of-shape composition's anomaly is cleared", stage)
	}
	a, err = h.askPlans(req, false)
	require.NoError(t, err)
	expired(a, "live")
	a, err = h.askPlans(map[string]any{"what": "plans", "node": "n1", "at": before.Format(time.RFC3339Nano)}, false)
	require.NoError(t, err)
	require.Equal(t, "published", current(a)["status"], "as of before the expiry")
	require.Equal(t, []string{"web.x"}, anomalies(a), "as of before the expiry")
	a, err = h.askPlans(map[string]any{"what": "plans", "node": "n1", "at": after.Format(time.RFC3339Nano)}, false)
	require.NoError(t, err)
	expired(a, "as of after the expiry")

	fromNATS, err := replay.FromNATS(ctx, h.js, nil, "test", nil)
	require.NoError(t, err)
	defer fromNATS.Close()
	body, _ := json.Marshal(map[string]any{"what": "plans", "node": "n1", "at": after.Format(time.RFC3339Nano)})
	out, err := fromNATS.Ask(body)
	require.NoError(t, err)
	var v any
	dec := json.NewDecoder(bytes.NewReader(out))
	dec.UseNumber()
	require.NoError(t, dec.Decode(&v))
	expired(plain(v).(map[string]any), "from the streams, as of after the expiry")
}
