package metrics_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/metrics"
	"github.com/novox/mesh-provisioner/internal/metrics/metricstest"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/store"
)

// storeSource is a seat as the metrics read it: a store, nothing else.
type storeSource struct{ db *store.DB }

func (s storeSource) Store() *store.DB       { return s.db }
func (s storeSource) MessagesApplied() int64 { return 0 }
func (s storeSource) Unsynced() []string     { return nil }

// TestMetrics_PollListsStreamsNotEachBucket: with hundreds of buckets, each poll of the streams' last
// sequences is one listing (about 256 stream infos a request), not one STREAM.INFO request per bucket,
// and the lag still comes out per bucket. A plain subscriber of the same account counts the requests.
// gaugeOf is a per-bucket gauge of a bucket: the scrape's for a fixed bucket; for a composed-<node>
// bucket, which the scrape takes together under bucket="composed-*", the metrics' own reading.
func gaugeOf(fams metricstest.Families, m *metrics.Metrics, name, bucket string) (float64, bool) {
	if provisioner.IsComposedBucket(bucket) {
		return m.BucketGauge(name, bucket)
	}
	return fams.Value(name, "bucket", bucket)
}

func TestMetrics_PollListsStreamsNotEachBucket(t *testing.T) {
	const buckets = 300
	const poll = 100 * time.Millisecond
	ns := natstest.RunServer(t)
	nc, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	for i := range buckets {
		b := fmt.Sprintf("composed-n%04d", i)
		kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: b, History: 1, Storage: jetstream.MemoryStorage})
		require.NoError(t, err)
		for range i % 3 {
			_, err = kv.Put(ctx, "web.1", []byte{0x80})
			require.NoError(t, err)
		}
		// The projection has applied one message of each bucket (none of those still empty).
		if i%3 > 0 {
			require.NoError(t, db.Apply(b, []provisioner.Message{{Seq: 1, Time: 1, Key: "web.1", Op: provisioner.OpPut, Value: []byte{0x80}}}, 1, false))
		}
	}
	// A bucket whose stream does not exist: no lag.
	require.NoError(t, db.Apply("composed-gone", []provisioner.Message{{Seq: 1, Time: 1, Key: "web.1", Op: provisioner.OpPut, Value: []byte{0x80}}}, 1, false))

	var infos, lists atomic.Int64
	for subj, n := range map[string]*atomic.Int64{"$JS.API.STREAM.INFO.>": &infos, "$JS.API.STREAM.LIST": &lists} {
		sub, err := nc.Subscribe(subj, func(*nats.Msg) { n.Add(1) })
		require.NoError(t, err)
		defer sub.Unsubscribe()
	}
	require.NoError(t, nc.Flush())

	_, mjs := natstest.Connect(t, ns.ClientURL())
	m := metrics.New(metrics.Options{JetStream: mjs, Poll: poll})
	m.SetSource(storeSource{db})
	started := time.Now()
	m.Start()
	defer m.Stop()
	srv, err := metrics.Listen("127.0.0.1:0", m.Handler(), nil)
	require.NoError(t, err)
	defer srv.Close()

	// Several polls, then every bucket's figures from a whole listing: under load a listing of 300
	// streams can take longer than a poll, so the scrape is polled for rather than slept for.
	want := map[int][2]float64{1: {1, 0}, 2: {2, 1}, 298: {1, 0}, 299: {2, 1}}
	var fams metricstest.Families
	natstest.CheckFor(t, 30*time.Second, poll, func() error {
		if time.Since(started) < 5*poll {
			return fmt.Errorf("fewer than 5 polls")
		}
		var err error
		if fams, err = metricstest.Scrape(srv.Addr()); err != nil {
			return err
		}
		for i, want := range want {
			b := fmt.Sprintf("composed-n%04d", i)
			last, ok := gaugeOf(fams, m, "mesh_provisioner_bucket_stream_last_sequence", b)
			lag, _ := gaugeOf(fams, m, "mesh_provisioner_bucket_lag", b)
			if !ok || [2]float64{last, lag} != want {
				return fmt.Errorf("%s: last %v lag %v (listed: %v), want %v", b, last, lag, ok, want)
			}
		}
		return nil
	})
	polls := int64(time.Since(started) / poll)
	gotInfos, gotLists := infos.Load(), lists.Load()
	t.Logf("over %d polls with %d buckets: %d STREAM.INFO, %d STREAM.LIST requests", polls, buckets, gotInfos, gotLists)
	require.Zero(t, gotInfos, "no stream info per bucket")
	require.Positive(t, gotLists)
	require.LessOrEqual(t, gotLists, (polls+2)*(buckets/256+1), "at most one listing per poll, of about 256 streams a page")
	require.NotContains(t, m.Shown(), "composed-n0000", "a bucket the projection has not seen has no metrics")
	last, ok := gaugeOf(fams, m, "mesh_provisioner_bucket_stream_last_sequence", "composed-gone")
	require.True(t, ok)
	require.Zero(t, last)
	errs, _ := fams.Value("mesh_provisioner_stream_info_errors_total")
	require.Zero(t, errs)
}
