package seat_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
)

// TestSeat_TTLOverAnOlderRevisionExpires: nats-server writes a TTL marker only when the expiring
// message is its subject's only one left; a put with a per-message TTL over a key whose older revision
// or delete the bucket keeps (History 5) is removed without one. The seat asks the stream once the put
// is due, and answers what the bucket answers again: the older revision with its own revision, nothing
// for a Create on a deleted key, the anomalies with them; a TTL'd put overwritten before it expired
// stays the later put. A seat that read the puts from the stream's history (as a rebuild reads them),
// stopped before they expired and started after, finds them again (its store kept them) and answers
// the same. One server, one wait for every key.
func TestSeat_TTLOverAnOlderRevisionExpires(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	const bucket = provisioner.BucketNeeds
	kv, err := h.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: bucket, History: 5, LimitMarkerTTL: time.Second})
	require.NoError(t, err)
	require.NoError(t, fixtures.CreateBuckets(ctx, h.js, provisioner.BucketApplied, provisioner.BucketCollect))
	stream, err := h.js.Stream(ctx, provisioner.StreamName(bucket))
	require.NoError(t, err)

	// live runs throughout; restarted starts on an empty state dir once the puts are in the stream
	// (it reads them as a rebuild does), is stopped, and started again after they expired. Both serve
	// the verb, so restarted is stopped before live is asked.
	liveDir, restartedDir := t.TempDir(), t.TempDir()
	live, stopLive := h.startSeat(liveDir)

	const (
		older    = "n1.m1.config.older"   // v1, then v2 with a TTL: v1 again
		created  = "n1.m1.config.created" // put, delete, Create with a TTL: gone
		rewrote  = "n1.m1.config.rewrote" // v1, v2 with a TTL, v3 before it expires: v3
		notMsgp  = "n1.m1.config.notmsgp" // v1, then a TTL'd value that is not MessagePack: v1, no anomaly
		oddShape = "n1.m1.odd"            // out of shape: put, delete, Create with a TTL: no anomaly
		plain    = "n1.m1.config.plain"   // no TTL at all: stays
	)
	v1, v2, v3 := mp(t, map[string]any{"v": 1}), mp(t, map[string]any{"v": 2}), mp(t, map[string]any{"v": 3})
	put := func(key string, value []byte) uint64 {
		seq, err := kv.Put(ctx, key, value)
		require.NoError(t, err)
		return seq
	}
	putTTL := func(key string, value []byte) uint64 {
		ack, err := h.js.Publish(ctx, provisioner.SubjectPrefix(bucket)+key, value, jetstream.WithMsgTTL(time.Second))
		require.NoError(t, err)
		return ack.Sequence
	}
	createTTL := func(key string, value []byte) uint64 {
		put(key, value)
		require.NoError(t, kv.Delete(ctx, key))
		seq, err := kv.Create(ctx, key, value, jetstream.KeyTTL(time.Second))
		require.NoError(t, err)
		return seq
	}
	olderSeq := put(older, v1)
	expiring := []uint64{putTTL(older, v2)}
	expiring = append(expiring, createTTL(created, v1))
	put(rewrote, v1)
	expiring = append(expiring, putTTL(rewrote, v2))
	notMsgpSeq := put(notMsgp, v1)
	expiring = append(expiring, putTTL(notMsgp, []byte{0xc1}))
	expiring = append(expiring, createTTL(oddShape, v1))
	rewroteSeq := put(rewrote, v3)
	plainSeq := put(plain, v1)

	restarted, stopRestarted := h.startSeat(restartedDir)
	a, err := h.askErr(map[string]any{"what": "needs", "node": "n1", "min_seq": plainSeq, "wait_ms": 5000}, false)
	require.NoError(t, err)
	require.Equal(t, []string{created, notMsgp, older, plain, rewrote}, rowKeys(a.Rows), "before they expire")
	require.Equal(t, []string{notMsgp, oddShape}, rowKeys(a.Anomalies), "before they expire")
	h.waitCaughtUp(restarted)
	t.Logf("the seat to restart stops with %d pending expiries", restarted.Store().Expiries())
	stopRestarted()

	// The server removes the TTL'd puts without a marker: each key's last message is older.
	natstest.CheckFor(t, 15*time.Second, 50*time.Millisecond, func() error {
		for i, key := range []string{older, created, rewrote, notMsgp, oddShape} {
			m, err := stream.GetLastMsgForSubject(ctx, provisioner.SubjectPrefix(bucket)+key)
			if err != nil {
				return err
			}
			if m.Header.Get(jetstream.MarkerReasonHeader) != "" {
				return fmt.Errorf("%s: a marker at %d: the server writes one here now", key, m.Sequence)
			}
			if key != rewrote && m.Sequence >= expiring[i] {
				return fmt.Errorf("%s: the TTL'd put at %d is still there", key, m.Sequence)
			}
		}
		if _, err := stream.GetMsg(ctx, expiring[2]); err == nil {
			return fmt.Errorf("%s: the overwritten TTL'd put at %d is still there", rewrote, expiring[2])
		}
		return nil
	})

	check := func(stage string) {
		t.Helper()
		natstest.CheckFor(t, 15*time.Second, 50*time.Millisecond, func() error {
			a, err := h.askErr(map[string]any{"what": "needs", "node": "n1"}, false)
			if err != nil {
				return err
			}
			if keys := rowKeys(a.Rows); !slices.Equal(keys, []string{notMsgp, older, plain, rewrote}) {
				return fmt.Errorf("rows %v", keys)
			}
			if keys := rowKeys(a.Anomalies); len(keys) != 0 {
				return fmt.Errorf("anomalies %v", keys)
			}
			return nil
		})
		a, err := h.askErr(map[string]any{"what": "needs", "node": "n1"}, false)
		require.NoError(t, err, stage)
		revs := map[string]string{}
		for _, r := range a.Rows {
			revs[fmt.Sprint(r["key"])] = fmt.Sprint(r["revision"])
			if r["key"] != plain {
				want := map[string]string{older: "1", notMsgp: "1", rewrote: "3"}[fmt.Sprint(r["key"])]
				require.Equal(t, "map[v:"+want+"]", fmt.Sprint(r["value"]), "%s: %s", stage, r["key"])
			}
		}
		require.Equal(t, map[string]string{older: fmt.Sprint(olderSeq), notMsgp: fmt.Sprint(notMsgpSeq), rewrote: fmt.Sprint(rewroteSeq), plain: fmt.Sprint(plainSeq)}, revs,
			"%s: each key answers the revision the bucket answers again", stage)
		// As of the newest point the log holds, the same: the log says what the live rows say.
		at, err := h.askErr(map[string]any{"what": "needs", "node": "n1", "at": fmt.Sprintf("seq:%d", plainSeq)}, false)
		require.NoError(t, err, stage)
		require.Equal(t, rowKeys(a.Rows), rowKeys(at.Rows), "%s: as of seq:%d", stage, plainSeq)
		for i := range a.Rows {
			require.Equal(t, a.Rows[i]["revision"], at.Rows[i]["revision"], "%s: as of seq:%d", stage, plainSeq)
		}
		require.Empty(t, rowKeys(at.Anomalies), "%s: as of seq:%d", stage, plainSeq)
	}
	check("live")
	stopLive()

	restarted, _ = h.startSeat(restartedDir)
	h.waitCaughtUp(restarted)
	check("restarted after the expiry")
	_ = live
}

// TestPlans_TTLOverAnOlderRevisionExpires: the plans' inputs expire as the needs do. A module's want
// written with a TTL over its older want (mesh-host_modules) is the older want again once the server
// removed it without a marker; a published composition written with a TTL over an older one of the
// same build (composed-<node>, History 5) leaves the build's history, so the bucket is read again from
// its stream and the module's plan is the older composition's, as a rebuild finds it.
func TestPlans_TTLOverAnOlderRevisionExpires(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	require.NoError(t, fixtures.CreateBuckets(ctx, h.js, provisioner.BucketIndexerBuilds))
	const composed = provisioner.ComposedPrefix + "n1"
	cfg := jetstream.KeyValueConfig{History: 5, LimitMarkerTTL: time.Second}
	cfg.Bucket = provisioner.BucketHostModules
	hosts, err := h.js.CreateKeyValue(ctx, cfg)
	require.NoError(t, err)
	cfg.Bucket = composed
	comps, err := h.js.CreateKeyValue(ctx, cfg)
	require.NoError(t, err)
	st, _ := h.startPlansSeat(t.TempDir())

	putTTL := func(bucket, key string, value []byte) uint64 {
		ack, err := h.js.Publish(ctx, provisioner.SubjectPrefix(bucket)+key, value, jetstream.WithMsgTTL(time.Second))
		require.NoError(t, err)
		return ack.Sequence
	}
	_, err = hosts.Put(ctx, "n1.web", mp(t, map[string]any{"want": 5}))
	require.NoError(t, err)
	hostTTL := putTTL(provisioner.BucketHostModules, "n1.web", mp(t, map[string]any{"want": 6}))
	_, err = hosts.Put(ctx, "n1.db", mp(t, map[string]any{"want": 7}))
	require.NoError(t, err)
	olderComp, err := comps.Put(ctx, "db.7", mp(t, map[string]any{"status": "published", "plan": "db:7a"}))
	require.NoError(t, err)
	compTTL := putTTL(composed, "db.7", mp(t, map[string]any{"status": "published", "plan": "db:7b"}))
	h.waitPlansCaughtUp(st)

	entry := func(a map[string]any, key string) (want, plan, rev string) {
		row := planRow(t, a, key)
		cur, _ := row["current"].(map[string]any)
		return fmt.Sprint(row["want"]), fmt.Sprint(cur["plan"]), fmt.Sprint(cur["revision"])
	}
	a, err := h.askPlans(map[string]any{"what": "plans", "node": "n1"}, false)
	require.NoError(t, err)
	want, _, _ := entry(a, "n1.web")
	require.Equal(t, "6", want, "before it expires")
	_, plan, _ := entry(a, "n1.db")
	require.Equal(t, "db:7b", plan, "before it expires")

	natstest.CheckFor(t, 15*time.Second, 50*time.Millisecond, func() error {
		for bucket, seq := range map[string]uint64{provisioner.BucketHostModules: hostTTL, composed: compTTL} {
			s, err := h.js.Stream(ctx, provisioner.StreamName(bucket))
			if err != nil {
				return err
			}
			if _, err := s.GetMsg(ctx, seq); err == nil {
				return fmt.Errorf("%s: the TTL'd put at %d is still there", bucket, seq)
			}
		}
		return nil
	})
	natstest.CheckFor(t, 15*time.Second, 50*time.Millisecond, func() error {
		a, err := h.askPlans(map[string]any{"what": "plans", "node": "n1"}, false)
		if err != nil {
			return err
		}
		if want, _, _ := entry(a, "n1.web"); want != "5" {
			return fmt.Errorf("n1.web wants %s", want)
		}
		if _, plan, rev := entry(a, "n1.db"); plan != "db:7a" || rev != fmt.Sprint(olderComp) {
			return fmt.Errorf("n1.db: plan %s at %s", plan, rev)
		}
		return nil
	})
}
