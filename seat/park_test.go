package seat_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

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
