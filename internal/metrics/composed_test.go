package metrics_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
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
	"github.com/novox/mesh-provisioner/seat"
	"github.com/novox/mesh-provisioner/store"
)

// TestMetrics_ComposedBucketsTakenTogether: a seat with plans holds a composed-<node> bucket per node,
// thousands on a mesh; each made six series or more (applied, synced, stream last, age, lag,
// anomalies by reason), scraped every 15 s. The fixed buckets keep a series each; the composed ones
// are taken together under bucket="composed-*" (sums, synced only when all are, the oldest reading),
// with how many there are, are behind, are not synced, and the largest lag: the series a scrape
// carries do not grow with the mesh.
func TestMetrics_ComposedBucketsTakenTogether(t *testing.T) {
	const composed = 300
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	published := []byte{0x81, 0xa6, 's', 't', 'a', 't', 'u', 's', 0xa9, 'p', 'u', 'b', 'l', 'i', 's', 'h', 'e', 'd'}
	// A fixed bucket, applied up to its stream's end.
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.BucketNeeds, Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	_, err = kv.Put(ctx, "n1.web.config.a", []byte{0x80})
	require.NoError(t, err)
	require.NoError(t, db.Apply(provisioner.BucketNeeds, []provisioner.Message{{Seq: 1, Time: 1, Key: "n1.web.config.a", Op: provisioner.OpPut, Value: []byte{0x80}}}, 1, false))
	db.SetSynced(provisioner.BucketNeeds, true)
	for i := range composed {
		b := fmt.Sprintf("composed-n%04d", i)
		msgs := []provisioner.Message{{Seq: 1, Time: 1, Key: "web.1", Op: provisioner.OpPut, Value: published}}
		if i%30 == 0 { // ten buckets with a key out of shape
			msgs = append(msgs, provisioner.Message{Seq: 2, Time: 1, Key: "web", Op: provisioner.OpPut, Value: published})
		}
		require.NoError(t, db.Apply(b, msgs, 1, false))
		db.SetSynced(b, i%100 != 1) // three not synced
	}
	// Three composed buckets whose streams hold more than was applied: lags 1, 2 and 3.
	for i := 1; i <= 3; i++ {
		kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: fmt.Sprintf("composed-n%04d", i+10), Storage: jetstream.MemoryStorage})
		require.NoError(t, err)
		for j := 0; j <= i; j++ {
			_, err = kv.Put(ctx, fmt.Sprintf("web.%d", j+1), published)
			require.NoError(t, err)
		}
	}

	streams := streaminfo.New(js)
	natstest.RunPoller(t, streams, 100*time.Millisecond)
	m := metrics.New(metrics.Options{Streams: streams, Poll: 100 * time.Millisecond})
	m.SetSource(storeSource{db})
	m.Start()
	t.Cleanup(m.Stop)
	srv, err := metrics.Listen("127.0.0.1:0", m.Handler(), nil)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, srv.Close()) })

	var fams metricstest.Families
	natstest.CheckFor(t, 20*time.Second, 50*time.Millisecond, func() error {
		if fams, err = metricstest.Scrape(srv.Addr()); err != nil {
			return err
		}
		if v, _ := fams.Value("mesh_provisioner_bucket_lag", "bucket", metrics.ComposedLabel); v != 6 {
			return fmt.Errorf("composed lag %v, want 1+2+3", v)
		}
		return nil
	})

	// No series names a composed-<node> bucket.
	series := 0
	for name, fam := range fams {
		series += len(fam.GetMetric())
		for _, b := range fams.LabelValues(name, "bucket") {
			require.False(t, provisioner.IsComposedBucket(b), "%s has a series of %s", name, b)
		}
	}
	t.Logf("%d composed buckets: %d series in all", composed, series)
	require.Less(t, series, 150, "the series do not grow with the composed buckets")

	want := map[string]float64{
		"mesh_provisioner_composed_buckets":          composed,
		"mesh_provisioner_composed_buckets_unsynced": 3,
		"mesh_provisioner_composed_buckets_behind":   3,
		"mesh_provisioner_composed_lag_max":          3,
	}
	for name, w := range want {
		v, ok := fams.Value(name)
		require.True(t, ok, name)
		require.Equal(t, w, v, name)
	}
	for name, w := range map[string]float64{
		"mesh_provisioner_bucket_applied_sequence":     composed + 10, // 1 each, 2 for the ten with a bad key
		"mesh_provisioner_bucket_synced":               0,
		"mesh_provisioner_bucket_stream_last_sequence": 2 + 3 + 4,
		"mesh_provisioner_bucket_lag":                  6,
	} {
		v, ok := fams.Value(name, "bucket", metrics.ComposedLabel)
		require.True(t, ok, name)
		require.Equal(t, w, v, name)
	}
	_, ok := fams.Value("mesh_provisioner_bucket_stream_info_age_seconds", "bucket", metrics.ComposedLabel)
	require.True(t, ok)
	var anomalies float64
	for _, reason := range fams.LabelValues("mesh_provisioner_anomaly_rows", "reason") {
		if v, ok := fams.Value("mesh_provisioner_anomaly_rows", "bucket", metrics.ComposedLabel, "reason", reason); ok {
			anomalies += v
			require.Equal(t, "token-count", reason)
		}
	}
	require.EqualValues(t, 10, anomalies)
	// The three behind apply nothing: how long shows (one bucket stuck among thousands would not move
	// the sums); once they catch up, nothing is stuck.
	natstest.CheckFor(t, 20*time.Second, 50*time.Millisecond, func() error {
		fams, err := metricstest.Scrape(srv.Addr())
		if err != nil {
			return err
		}
		if v, _ := fams.Value("mesh_provisioner_composed_stuck_seconds"); v <= 0 {
			return fmt.Errorf("stuck for %v", v)
		}
		return nil
	})
	for i := 1; i <= 3; i++ {
		b := fmt.Sprintf("composed-n%04d", i+10)
		var msgs []provisioner.Message
		for j := 1; j <= i; j++ {
			msgs = append(msgs, provisioner.Message{Seq: uint64(j + 1), Time: 1, Key: fmt.Sprintf("web.%d", j+1), Op: provisioner.OpPut, Value: published})
		}
		require.NoError(t, db.Apply(b, msgs, 1, false))
	}
	natstest.CheckFor(t, 20*time.Second, 50*time.Millisecond, func() error {
		fams, err := metricstest.Scrape(srv.Addr())
		if err != nil {
			return err
		}
		stuck, _ := fams.Value("mesh_provisioner_composed_stuck_seconds")
		behind, _ := fams.Value("mesh_provisioner_composed_buckets_behind")
		if stuck != 0 || behind != 0 {
			return fmt.Errorf("stuck for %v, %v behind", stuck, behind)
		}
		return nil
	})

	// The fixed bucket keeps its own series.
	v, ok := fams.Value("mesh_provisioner_bucket_applied_sequence", "bucket", provisioner.BucketNeeds)
	require.True(t, ok)
	require.EqualValues(t, 1, v)
	lag, ok := fams.Value("mesh_provisioner_bucket_lag", "bucket", provisioner.BucketNeeds)
	require.True(t, ok)
	require.Zero(t, lag)
}

// TestMetrics_ReadyDespiteOneComposedBucketUnread: one node's composed-<node> bucket that the seat
// cannot read (here a stream that refuses another consumer; in a cluster, one without a leader, or a
// permission missing for it) kept the whole seat unready for as long as it lasted: mesh_provisioner_ready
// 0, MeshProvisionerNotReady paging, a rollout waiting, while every other node's plans answered. A
// composed bucket whose tail fails and is retried does not hold /readyz; the body still names it,
// and the composed gauges count it as not synced. A fixed bucket still does
// (TestDocs_RunbookPermissionError).
func TestMetrics_ReadyDespiteOneComposedBucketUnread(t *testing.T) {
	ns := natstest.RunServer(t)
	url := ns.ClientURL()
	_, ajs := natstest.Connect(t, url)
	ctx := context.Background()
	published := []byte{0x81, 0xa6, 's', 't', 'a', 't', 'u', 's', 0xa9, 'p', 'u', 'b', 'l', 'i', 's', 'h', 'e', 'd'}
	kv, err := ajs.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "composed-n1", Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	_, err = kv.Put(ctx, "web.1", published)
	require.NoError(t, err)
	composedHeldByAnother(t, ajs, published)
	snc, sjs := natstest.Connect(t, url)
	streams := streaminfo.New(sjs)
	m := metrics.New(metrics.Options{Streams: streams, Poll: 100 * time.Millisecond})
	m.Start()
	t.Cleanup(m.Stop)
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	st, err := seat.Start(ctx, snc, sjs, db, seat.Config{Streams: streams, ListEvery: m.Poll(), Plans: true,
		Projector: projector.Options{Poll: 20 * time.Millisecond, DiscoverEvery: time.Hour}})
	require.NoError(t, err)
	srv := serveSeat(t, m, st, db)

	natstest.CheckFor(t, 30*time.Second, 50*time.Millisecond, func() error {
		code, body, err := metricstest.Get("http://" + srv.Addr() + "/readyz")
		if err != nil {
			return err
		}
		if code != 200 || !strings.Contains(body, "composed-n2") {
			return fmt.Errorf("readyz %d: %s", code, body)
		}
		return nil
	})
	_, synced := db.Applied("composed-n1")
	require.True(t, synced)
	_, synced = db.Applied("composed-n2")
	require.False(t, synced, "composed-n2 cannot be read")
	fams, err := metricstest.Scrape(srv.Addr())
	require.NoError(t, err)
	ready, _ := fams.Value("mesh_provisioner_ready")
	require.EqualValues(t, 1, ready)
	unsynced, _ := fams.Value("mesh_provisioner_composed_buckets_unsynced")
	require.EqualValues(t, 1, unsynced)
}

// TestMetrics_ReadyWaitsOutOneComposedFailure: a composed-<node> bucket's first failure is often
// transient (its first consumer creation timed out on a loaded server); readiness let go of it at
// once, so a starting seat said ready with that node's plans unsynced, and unready again once the
// retry worked and the bucket caught up. It lets go after 3 failures in a row,
// and keeps letting go while the bucket, read again, catches up.
func TestMetrics_ReadyWaitsOutOneComposedFailure(t *testing.T) {
	ns := natstest.RunServer(t)
	url := ns.ClientURL()
	_, ajs := natstest.Connect(t, url)
	ctx := context.Background()
	published := []byte{0x81, 0xa6, 's', 't', 'a', 't', 'u', 's', 0xa9, 'p', 'u', 'b', 'l', 'i', 's', 'h', 'e', 'd'}
	s2 := composedHeldByAnother(t, ajs, published)

	snc, sjs := natstest.Connect(t, url)
	streams := streaminfo.New(sjs)
	m := metrics.New(metrics.Options{Streams: streams, Poll: 100 * time.Millisecond})
	m.Start()
	t.Cleanup(m.Stop)
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	// The bucket's tail tells each failure before it counts it: at the n-th, n-1 are counted.
	wired := make(chan struct{})
	var wire sync.Once
	t.Cleanup(func() { wire.Do(func() { close(wired) }) }) // a failed start stops the seat: let its tail end
	var mu sync.Mutex
	readyAt := map[int]error{}
	failures := 0
	onErr := func(bucket string, _ error) {
		if bucket != "composed-n2" {
			return
		}
		<-wired
		mu.Lock()
		defer mu.Unlock()
		failures++
		if failures > projector.FailingAfter+1 {
			return
		}
		readyAt[failures] = m.Ready()
		if failures == projector.FailingAfter+1 {
			// The consumer's slot frees: the next try reads the bucket.
			if err := s2.DeleteConsumer(ctx, "other"); err != nil {
				t.Errorf("delete the other consumer: %v", err)
			}
		}
	}
	st, err := seat.Start(ctx, snc, sjs, db, seat.Config{Streams: streams, ListEvery: m.Poll(), Plans: true,
		Projector: projector.Options{Poll: 20 * time.Millisecond, DiscoverEvery: time.Hour, OnTailError: onErr}})
	require.NoError(t, err)
	serveSeat(t, m, st, db)
	wire.Do(func() { close(wired) })

	natstest.CheckFor(t, 30*time.Second, 50*time.Millisecond, func() error {
		if _, synced := db.Applied("composed-n2"); !synced {
			return fmt.Errorf("composed-n2 not synced")
		}
		return m.Ready()
	})
	mu.Lock()
	defer mu.Unlock()
	for n := 2; n <= projector.FailingAfter; n++ {
		require.Error(t, readyAt[n], "ready after %d failures of composed-n2", n-1)
		require.Contains(t, readyAt[n].Error(), "not synced yet: composed-n2")
	}
	require.NoError(t, readyAt[projector.FailingAfter+1], "not ready after %d failures of composed-n2", projector.FailingAfter)
}

// composedHeldByAnother makes composed-n2, one published composition, on a stream that takes one
// consumer, which someone else holds ("other"): a seat's tail of it fails, and is retried, until the
// slot is freed.
func composedHeldByAnother(t *testing.T, ajs jetstream.JetStream, published []byte) jetstream.Stream {
	t.Helper()
	s2 := composedOfOneConsumer(t, ajs, published)
	_, err := s2.CreateConsumer(context.Background(), jetstream.ConsumerConfig{Durable: "other"})
	require.NoError(t, err)
	return s2
}

// composedOfOneConsumer makes composed-n2, one published composition, on a stream that takes one
// consumer, free for now.
func composedOfOneConsumer(t *testing.T, ajs jetstream.JetStream, published []byte) jetstream.Stream {
	t.Helper()
	ctx := context.Background()
	s2, err := ajs.CreateStream(ctx, jetstream.StreamConfig{Name: "KV_composed-n2", Subjects: []string{"$KV.composed-n2.>"},
		MaxMsgsPerSubject: 1, AllowRollup: true, DenyDelete: true, AllowDirect: true, Storage: jetstream.MemoryStorage, MaxConsumers: 1})
	require.NoError(t, err)
	_, err = ajs.Publish(ctx, "$KV.composed-n2.web.1", published)
	require.NoError(t, err)
	return s2
}
