package metrics_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/metrics"
	"github.com/novox/mesh-provisioner/internal/metrics/metricstest"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/internal/streaminfo"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/seat"
	"github.com/novox/mesh-provisioner/store"
)

// TestMetrics_ForgottenBucketLeavesNoGauges: the per-bucket gauges of a composed-<node> bucket whose
// stream was deleted (its node decommissioned) go once the seat has forgotten it, and stay gone when
// the verb is asked to wait for that node's bucket (plans with min_seq), or for a node that never had
// one: such a wait made the store list the bucket again, at applied 0 and not synced, for good.
// A bucket read again after a purge keeps its gauges, at its new position.
func TestMetrics_ForgottenBucketLeavesNoGauges(t *testing.T) {
	const poll = 100 * time.Millisecond
	ns := natstest.RunServer(t)
	url := ns.ClientURL()
	nc, js := natstest.Connect(t, url)
	ctx := context.Background()
	for _, b := range []string{"composed-n3", "composed-n4"} {
		kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: b, History: 2})
		require.NoError(t, err)
		_, err = kv.Put(ctx, "m.1", []byte{0x81, 0xa6, 's', 't', 'a', 't', 'u', 's', 0xa9, 'p', 'u', 'b', 'l', 'i', 's', 'h', 'e', 'd'})
		require.NoError(t, err)
	}

	snc, sjs := natstest.Connect(t, url)
	streams := streaminfo.New(sjs)
	m := metrics.New(metrics.Options{Streams: streams, Poll: poll})
	m.Start()
	t.Cleanup(m.Stop)
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	st, err := seat.Start(ctx, snc, sjs, db, seat.Config{Streams: streams, ListEvery: m.Poll(), Plans: true,
		Projector: projector.Options{Poll: 50 * time.Millisecond, Verify: 200 * time.Millisecond, DiscoverEvery: time.Hour}})
	require.NoError(t, err)
	srv := serveSeat(t, m, st, db)

	// gauges waits until the metrics show exactly the buckets want (of composed-*), taken together
	// under bucket="composed-*", and composed-n4 at applied sequence n4.
	gauges := func(n4 float64, want ...string) {
		t.Helper()
		natstest.CheckFor(t, 20*time.Second, poll/2, func() error {
			fams, err := metricstest.Scrape(srv.Addr())
			if err != nil {
				return err
			}
			var got []string
			for _, b := range m.Shown() {
				if strings.HasPrefix(b, provisioner.ComposedPrefix) {
					got = append(got, b)
				}
			}
			slices.Sort(got)
			if !slices.Equal(got, want) {
				return fmt.Errorf("the metrics show %v, want %v", got, want)
			}
			if n, _ := fams.Value("mesh_provisioner_composed_buckets"); n != float64(len(want)) {
				return fmt.Errorf("mesh_provisioner_composed_buckets %v, want %d", n, len(want))
			}
			if applied, _ := gaugeOf(fams, m, "mesh_provisioner_bucket_applied_sequence", "composed-n4"); applied != n4 {
				return fmt.Errorf("composed-n4 applied %v, want %v", applied, n4)
			}
			if lag, _ := gaugeOf(fams, m, "mesh_provisioner_bucket_lag", "composed-n4"); lag != 0 {
				return fmt.Errorf("composed-n4 lag %v", lag)
			}
			return nil
		})
	}
	gauges(1, "composed-n3", "composed-n4")

	require.NoError(t, js.DeleteKeyValue(ctx, "composed-n3"))
	gauges(1, "composed-n4")
	// Waits on the verb for the forgotten node's bucket, and for a node that never had one.
	for _, node := range []string{"n3", "n9"} {
		_, _, err := natstest.Ask(nc, query.Subject, []byte(fmt.Sprintf(`{"what":"plans","node":%q,"min_seq":1,"wait_ms":1}`, node)), false)
		var ve *natstest.VerbError
		require.ErrorAs(t, err, &ve)
		require.Equal(t, 504, ve.Code)
	}
	gauges(1, "composed-n4")

	// Purged: forgotten, read again, and still there, at the stream's last sequence.
	s, err := js.Stream(ctx, provisioner.StreamName("composed-n4"))
	require.NoError(t, err)
	require.NoError(t, s.Purge(ctx))
	natstest.CheckFor(t, 20*time.Second, poll/2, func() error {
		v, err := st.Store().View()
		if err != nil {
			return err
		}
		defer v.Close()
		if _, found, err := v.ForgottenAt("composed-n4"); err != nil || !found {
			return fmt.Errorf("composed-n4 not forgotten yet (%v)", err)
		}
		return nil
	})
	gauges(1, "composed-n4")
	require.Zero(t, st.Rebuilds())
}

// TestMetrics_BucketsParked: the gauge counts the composed-<node> buckets idle without a consumer.
func TestMetrics_BucketsParked(t *testing.T) {
	ns := natstest.RunServer(t)
	url := ns.ClientURL()
	_, js := natstest.Connect(t, url)
	ctx := context.Background()
	for _, b := range []string{"composed-n1", "composed-n2"} {
		kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: b, History: 2})
		require.NoError(t, err)
		_, err = kv.Put(ctx, "m.1", []byte{0x80})
		require.NoError(t, err)
	}
	snc, sjs := natstest.Connect(t, url)
	streams := streaminfo.New(sjs)
	m := metrics.New(metrics.Options{Streams: streams, Poll: 100 * time.Millisecond})
	m.Start()
	t.Cleanup(m.Stop)
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	st, err := seat.Start(ctx, snc, sjs, db, seat.Config{Streams: streams, ListEvery: m.Poll(), Plans: true,
		Projector: projector.Options{Poll: 20 * time.Millisecond, DiscoverEvery: time.Hour, ParkAfter: 100 * time.Millisecond}})
	require.NoError(t, err)
	srv := serveSeat(t, m, st, db)
	natstest.CheckFor(t, 20*time.Second, 50*time.Millisecond, func() error {
		fams, err := metricstest.Scrape(srv.Addr())
		if err != nil {
			return err
		}
		if v, ok := fams.Value("mesh_provisioner_buckets_parked"); !ok || v != 2 {
			return fmt.Errorf("buckets parked: %v (%v)", v, ok)
		}
		return nil
	})
}
