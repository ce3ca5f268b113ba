package seat_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
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
	"github.com/novox/mesh-provisioner/seat"
)

// TestPlans_RebuildWhileParked: a fixed bucket recreated makes the seat rebuild while composed-<node>
// buckets are parked. The old projector stops with its buckets parked, the new one reads them and
// parks them too, and a composition written after the swap is read by the listing alone (the stream
// checks' listing, 300 ms here).
func TestPlans_RebuildWhileParked(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	sc := fixtures.Plans()
	h.load(sc.Before)
	st, stop := h.startPlansSeatWith(t.TempDir(), projector.Options{Poll: 20 * time.Millisecond, DiscoverEvery: time.Hour,
		Verify: 300 * time.Millisecond, ParkAfter: 100 * time.Millisecond})
	h.waitPlansCaughtUp(st)
	const bucket = provisioner.ComposedPrefix + "edge-1"
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if !st.Current().Parked(bucket) {
			return fmt.Errorf("%s not parked", bucket)
		}
		return nil
	})
	old := st.Current()
	ctx := context.Background()
	recreateHostModules(t, h, sc)
	natstest.CheckFor(t, 20*time.Second, time.Millisecond, func() error {
		if st.Rebuilds() == 0 {
			return errors.New("not rebuilt yet")
		}
		return nil
	})
	require.NotSame(t, old, st.Current())
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if !st.Current().Parked(bucket) {
			return fmt.Errorf("%s not parked", bucket)
		}
		return nil
	})
	kv, err := h.js.KeyValue(ctx, bucket)
	require.NoError(t, err)
	val, err := msgpack.Marshal(map[string]any{"status": "published", "plan": "db 3005"})
	require.NoError(t, err)
	seq, err := kv.Put(ctx, "db.3005", val)
	require.NoError(t, err)
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if a, _ := st.Store().Applied(bucket); a < seq {
			return fmt.Errorf("applied %d", a)
		}
		return nil
	})
	stop()
}

// TestPlans_WakeAtARebuildsSwap: a request with min_seq for a node whose bucket is parked in a
// rebuild's projector, asked as the rebuild swaps in (the old projector stopped, the verb not moved
// yet), is answered from the rebuilt store: its wake must reach the rebuild's projector, not only the
// stopped one. The listing runs once an hour here, so only the wake can make the bucket read.
func TestPlans_WakeAtARebuildsSwap(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	sc := fixtures.Plans()
	h.load(sc.Before)
	st, _ := h.startPlansSeatWith(t.TempDir(), projector.Options{Poll: 20 * time.Millisecond, DiscoverEvery: time.Hour,
		Verify: time.Hour, ParkAfter: 100 * time.Millisecond})
	h.waitPlansCaughtUp(st)
	const bucket = provisioner.ComposedPrefix + "edge-1"
	ctx := context.Background()
	kv, err := h.js.KeyValue(ctx, bucket)
	require.NoError(t, err)
	val, err := msgpack.Marshal(map[string]any{"status": "published", "plan": "db 3005"})
	require.NoError(t, err)
	// The hook runs on the rebuild's goroutine: it reports to the test, which asserts.
	type swapped struct {
		parked bool
		seq    uint64
		err    error
	}
	at := make(chan swapped, 1)
	seat.SetBeforeSwap(st, func(next *projector.Projector) {
		var w swapped
		for deadline := time.Now().Add(20 * time.Second); !w.parked && time.Now().Before(deadline); {
			if w.parked = next.Parked(bucket); !w.parked {
				time.Sleep(20 * time.Millisecond)
			}
		}
		if w.parked {
			w.seq, w.err = kv.Put(ctx, "db.3005", val)
			seat.Wake(st, bucket)
		}
		at <- w
	})
	recreateHostModules(t, h, sc)
	var w swapped
	select {
	case w = <-at:
	case <-time.After(30 * time.Second):
		t.Fatal("no rebuild swapped in")
	}
	require.True(t, w.parked, "%s parked in the rebuild's projector", bucket)
	require.NoError(t, w.err)
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if a, _ := st.Store().Applied(bucket); a < w.seq {
			return fmt.Errorf("%s: applied %d, want %d", bucket, a, w.seq)
		}
		return nil
	})
}

// recreateHostModules deletes the mesh-host_modules bucket and creates it again with what it held:
// the seat finds its stream recreated, and rebuilds.
func recreateHostModules(t *testing.T, h *harness, sc fixtures.PlansScenario) {
	t.Helper()
	ctx := context.Background()
	kvm, err := h.js.KeyValue(ctx, provisioner.BucketHostModules)
	require.NoError(t, err)
	cfg, err := kvm.Status(ctx)
	require.NoError(t, err)
	require.NoError(t, h.js.DeleteKeyValue(ctx, provisioner.BucketHostModules))
	_, err = h.js.CreateKeyValue(ctx, cfg.(*jetstream.KeyValueBucketStatus).Config())
	require.NoError(t, err)
	var again []fixtures.Op
	for _, op := range sc.Before {
		if op.Bucket == provisioner.BucketHostModules {
			again = append(again, op)
		}
	}
	h.load(again)
}

// TestPlans_RestartStartsParked: a seat restarted on a mesh whose composed-<node> buckets did not
// change while it was down sets no consumer up for any of them: each starts parked, the plans say
// synced, and a node engine's min_seq request for a composition it just wrote is answered at once
// (the listing runs once an hour here: only the request's wake makes the bucket read).
func TestPlans_RestartStartsParked(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	sc := fixtures.Plans()
	h.load(sc.Before)
	dir := t.TempDir()
	po := projector.Options{Poll: 20 * time.Millisecond, DiscoverEvery: time.Hour, Verify: time.Hour, ParkAfter: time.Hour}
	st, stop := h.startPlansSeatWith(dir, po)
	h.waitPlansCaughtUp(st)
	var composed []string
	for _, b := range st.Store().Buckets() {
		if strings.HasPrefix(b, provisioner.ComposedPrefix) {
			composed = append(composed, b)
		}
	}
	require.NotEmpty(t, composed)
	stop()

	var mu sync.Mutex
	creates := map[string]int{} // stream -> CONSUMER.CREATE requests
	sub, err := h.nc.Subscribe("$JS.API.CONSUMER.CREATE.*.>", func(m *nats.Msg) {
		mu.Lock()
		creates[strings.Split(m.Subject, ".")[4]]++
		mu.Unlock()
	})
	require.NoError(t, err)
	defer sub.Unsubscribe()
	require.NoError(t, h.nc.Flush())
	st, _ = h.startPlansSeatWith(dir, po)
	h.waitPlansCaughtUp(st)
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		for _, b := range composed {
			if !st.Current().Parked(b) {
				return fmt.Errorf("%s not parked", b)
			}
		}
		return nil
	})
	require.Equal(t, len(composed), st.Stats().BucketsParked)
	mu.Lock()
	for _, b := range composed {
		require.Zero(t, creates[provisioner.StreamName(b)], "consumers created for %s", b)
	}
	require.NotZero(t, creates[provisioner.StreamName(provisioner.BucketHostModules)], "the fixed buckets tail")
	mu.Unlock()

	const bucket = provisioner.ComposedPrefix + "edge-1"
	require.Contains(t, composed, bucket)
	kv, err := h.js.KeyValue(context.Background(), bucket)
	require.NoError(t, err)
	val, err := msgpack.Marshal(map[string]any{"status": "published", "plan": "db 3005"})
	require.NoError(t, err)
	seq, err := kv.Put(context.Background(), "db.3005", val)
	require.NoError(t, err)
	a, err := h.askPlans(map[string]any{"what": "plans", "node": "edge-1", "module": "db", "min_seq": seq, "wait_ms": 5000}, true)
	require.NoError(t, err)
	require.Equal(t, json.Number(fmt.Sprint(seq)), a["as_of"].(map[string]any)[bucket])
	require.Equal(t, true, a["synced"])
	require.Equal(t, json.Number("3005"), planRow(t, a, "edge-1.db")["current"].(map[string]any)["build"])
}
