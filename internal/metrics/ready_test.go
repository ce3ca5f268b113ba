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
	"github.com/novox/mesh-provisioner/seat"
	"github.com/novox/mesh-provisioner/store"
)

// publishedComp is a composition's value, status published.
var publishedComp = []byte{0x81, 0xa6, 's', 't', 'a', 't', 'u', 's', 0xa9, 'p', 'u', 'b', 'l', 'i', 's', 'h', 'e', 'd'}

// gatedPlansSeat starts a seat with plans whose JetStream API goes through a gate (open), with the
// metrics of serve, and serves them; the gate releases what it holds before the seat stops.
func gatedPlansSeat(t *testing.T, url string, verify time.Duration) (*gate, *metrics.Metrics, *seat.Seat, *store.DB, *metrics.Server) {
	t.Helper()
	g := newGate(t, url)
	g.Open()
	snc, _ := natstest.Connect(t, url)
	gated, err := jetstream.NewWithAPIPrefix(snc, gatePrefix)
	require.NoError(t, err)
	streams := streaminfo.New(gated)
	m := metrics.New(metrics.Options{Streams: streams, Poll: 100 * time.Millisecond})
	m.Start()
	t.Cleanup(m.Stop)
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	st, err := seat.Start(context.Background(), snc, gated, db, seat.Config{Streams: streams, ListEvery: m.Poll(), Plans: true,
		Projector: projector.Options{Poll: 20 * time.Millisecond, Verify: verify, DiscoverEvery: time.Hour}})
	require.NoError(t, err)
	srv := serveSeat(t, m, st, db, g.Release)
	return g, m, st, db, srv
}

// readyz is /readyz's code and body.
func readyz(t *testing.T, srv *metrics.Server) (int, string) {
	t.Helper()
	code, body, err := metricstest.Get("http://" + srv.Addr() + "/readyz")
	require.NoError(t, err)
	return code, body
}

// TestMetrics_ReadyWaitsForTheComposedBucketsListed: a seat with plans finds its composed-<node>
// buckets in its first listing of the streams; until then it tails none of them. /readyz said 200 as
// soon as the fixed buckets had caught up, before that listing came (a mesh of thousands of streams
// lists in pages; a listing the server does not answer is given up after seconds), while every plans
// answer said synced: false; then 503 once the listing found the buckets, then 200 again. It waits
// for the listing.
func TestMetrics_ReadyWaitsForTheComposedBucketsListed(t *testing.T) {
	ns := natstest.RunServer(t)
	url := ns.ClientURL()
	_, js := natstest.Connect(t, url)
	ctx := context.Background()
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "composed-n1", Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	_, err = kv.Put(ctx, "web.1", publishedComp)
	require.NoError(t, err)

	g := newGate(t, url)
	// The listings (of every stream's info, and of the names discovery falls back to) wait.
	g.Hold(func(subject string) bool {
		return strings.HasPrefix(subject, gatePrefix+".STREAM.LIST") || strings.HasPrefix(subject, gatePrefix+".STREAM.NAMES")
	})
	g.Open()
	snc, _ := natstest.Connect(t, url)
	gated, err := jetstream.NewWithAPIPrefix(snc, gatePrefix)
	require.NoError(t, err)
	streams := streaminfo.New(gated)
	m := metrics.New(metrics.Options{Streams: streams, Poll: 100 * time.Millisecond})
	m.Start()
	t.Cleanup(m.Stop)
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	st, err := seat.Start(ctx, snc, gated, db, seat.Config{Streams: streams, ListEvery: m.Poll(), Plans: true,
		Projector: projector.Options{Poll: 20 * time.Millisecond, DiscoverEvery: time.Hour}})
	require.NoError(t, err)
	srv := serveSeat(t, m, st, db, g.Release)

	fixed := []string{provisioner.BucketHostModules, provisioner.BucketIndexerBuilds}
	for _, s := range provisioner.ProvisionerShapes {
		fixed = append(fixed, s.Bucket)
	}
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		for _, b := range fixed {
			if _, synced := db.Applied(b); !synced {
				return fmt.Errorf("%s not synced", b)
			}
		}
		if len(g.Held()) == 0 {
			return fmt.Errorf("no listing asked yet")
		}
		return nil
	})
	require.False(t, st.Current().Discovered(), "the listing is held")
	code, body := readyz(t, srv)
	require.Equal(t, 503, code, "ready before the composed buckets were listed: %s", body)
	require.Contains(t, body, "composed-<node> buckets")
	fams, err := metricstest.Scrape(srv.Addr())
	require.NoError(t, err)
	ready, _ := fams.Value("mesh_provisioner_ready")
	require.Zero(t, ready)
	require.False(t, st.Stats().Synced, "$SRV.STATS' synced")

	g.Release()
	natstest.CheckFor(t, 30*time.Second, 20*time.Millisecond, func() error {
		if code, body := readyz(t, srv); code != 200 {
			return fmt.Errorf("readyz %d: %s", code, body)
		}
		return nil
	})
	_, synced := db.Applied("composed-n1")
	require.True(t, synced, "ready with composed-n1 read")
}

// TestMetrics_ReadyThroughComposedBucketsReadAgain: once a seat is ready, a composed-<node> bucket
// that has to be read again, or for the first time, is one node's plans catching up, routine on a
// mesh of thousands of nodes: a bucket recreated (a node reinstalled), purged under the projection (a
// node engine dropping its compositions), or created (a node added). Each made /readyz 503 and
// mesh_provisioner_ready 0 until it had caught up: a seat of the queue group out of rotation, and
// MeshProvisionerNotReady on its way, for one node. They are not waited for once the seat has been
// ready; /readyz names them, and the composed gauges count them. A fixed bucket still is.
func TestMetrics_ReadyThroughComposedBucketsReadAgain(t *testing.T) {
	ns := natstest.RunServer(t)
	url := ns.ClientURL()
	_, js := natstest.Connect(t, url)
	ctx := context.Background()
	kvs := map[string]jetstream.KeyValue{}
	for _, b := range []string{"composed-n1", "composed-n2", "composed-n9"} {
		kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: b, History: 2, Storage: jetstream.MemoryStorage})
		require.NoError(t, err)
		for _, k := range []string{"web.1", "web.2"} {
			_, err = kv.Put(ctx, k, publishedComp)
			require.NoError(t, err)
		}
		kvs[b] = kv
	}
	g, m, st, db, srv := gatedPlansSeat(t, url, 200*time.Millisecond)
	natstest.CheckFor(t, 30*time.Second, 20*time.Millisecond, func() error {
		if code, body := readyz(t, srv); code != 200 {
			return fmt.Errorf("readyz %d: %s", code, body)
		}
		return nil
	})

	// From now on the consumers of these buckets wait at the gate: each stays unsynced.
	again := []string{"composed-n1", "composed-n2", "composed-n3"}
	g.Hold(func(subject string) bool {
		for _, b := range again {
			if strings.HasPrefix(subject, gatePrefix+".CONSUMER.CREATE."+provisioner.StreamName(b)+".") {
				return true
			}
		}
		return false
	})
	// n1 recreated, n2 purged under what the projection holds, n3 created.
	require.NoError(t, js.DeleteKeyValue(ctx, "composed-n1"))
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "composed-n1", History: 2, Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	_, err = kv.Put(ctx, "web.3", publishedComp)
	require.NoError(t, err)
	s2, err := js.Stream(ctx, provisioner.StreamName("composed-n2"))
	require.NoError(t, err)
	require.NoError(t, s2.Purge(ctx))
	kv, err = js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "composed-n3", History: 2, Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	_, err = kv.Put(ctx, "web.1", publishedComp)
	require.NoError(t, err)

	natstest.CheckFor(t, 30*time.Second, 20*time.Millisecond, func() error {
		held := g.Held()
		for _, b := range again {
			if _, synced := db.Applied(b); synced {
				return fmt.Errorf("%s still synced", b)
			}
			if !slices.ContainsFunc(held, func(s string) bool { return strings.Contains(s, "."+provisioner.StreamName(b)+".") }) {
				return fmt.Errorf("%s: no consumer create held yet (%v)", b, held)
			}
		}
		return nil
	})
	for _, b := range again {
		require.False(t, st.Failing(b), "%s: no tail failed yet", b)
	}
	code, body := readyz(t, srv)
	require.Equal(t, 200, code, "one node's bucket read again made the seat unready: %s", body)
	for _, b := range again {
		require.Contains(t, body, b, "/readyz names what it does not wait for")
	}
	fams, err := metricstest.Scrape(srv.Addr())
	require.NoError(t, err)
	ready, _ := fams.Value("mesh_provisioner_ready")
	require.EqualValues(t, 1, ready)
	unsynced, _ := fams.Value("mesh_provisioner_composed_buckets_unsynced")
	require.EqualValues(t, len(again), unsynced)

	// A fixed bucket is still waited for.
	db.SetSynced(provisioner.BucketNeeds, false)
	err = m.Ready()
	db.SetSynced(provisioner.BucketNeeds, true)
	require.Error(t, err)
	require.Contains(t, err.Error(), "not synced yet: "+provisioner.BucketNeeds)
	require.NotContains(t, strings.SplitN(err.Error(), "\n", 2)[0], "composed-n", "only the fixed bucket is waited for")

	g.Release()
	natstest.CheckFor(t, 30*time.Second, 20*time.Millisecond, func() error {
		for _, b := range again {
			if _, synced := db.Applied(b); !synced {
				return fmt.Errorf("%s not synced", b)
			}
		}
		code, body := readyz(t, srv)
		if code != 200 || strings.Contains(body, "composed-n") {
			return fmt.Errorf("readyz %d: %s", code, body)
		}
		return nil
	})
}

// TestMetrics_ReadyzNamesASyncedComposedBucketThatCannotBeRead: a composed-<node> bucket the seat had
// read, idle (parked) for days, whose stream then changes and can no longer be read (here the stream
// takes one consumer, which someone else holds; in a mesh, a permission taken from the seat, a
// stream without a leader): the seat stays ready, rightly, and the bucket falls behind.
// MeshProvisionerComposedStuck fires and says /readyz names the bucket, but /readyz named only the
// buckets not synced, and this one was synced long ago: nothing but a log line, once, at the first
// failure, said which node. /readyz names every composed bucket whose tail fails and is retried,
// and mesh_provisioner_composed_buckets_failing counts them.
func TestMetrics_ReadyzNamesASyncedComposedBucketThatCannotBeRead(t *testing.T) {
	ns := natstest.RunServer(t)
	url := ns.ClientURL()
	_, js := natstest.Connect(t, url)
	ctx := context.Background()
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "composed-n1", Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	_, err = kv.Put(ctx, "web.1", publishedComp)
	require.NoError(t, err)
	s2 := composedOfOneConsumer(t, js, publishedComp)

	snc, sjs := natstest.Connect(t, url)
	streams := streaminfo.New(sjs)
	m := metrics.New(metrics.Options{Streams: streams, Poll: 100 * time.Millisecond})
	m.Start()
	t.Cleanup(m.Stop)
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	st, err := seat.Start(ctx, snc, sjs, db, seat.Config{Streams: streams, ListEvery: m.Poll(), Plans: true,
		Projector: projector.Options{Poll: 20 * time.Millisecond, DiscoverEvery: time.Hour, ParkAfter: 200 * time.Millisecond}})
	require.NoError(t, err)
	srv := serveSeat(t, m, st, db)
	natstest.CheckFor(t, 30*time.Second, 20*time.Millisecond, func() error {
		if code, body := readyz(t, srv); code != 200 {
			return fmt.Errorf("readyz %d: %s", code, body)
		}
		if !st.Current().Parked("composed-n2") {
			return fmt.Errorf("composed-n2 not parked yet")
		}
		return nil
	})

	// Someone else takes the stream's one consumer, once the parked seat's is gone from the server
	// (parking deletes it; the server may count it a moment longer); a composition comes.
	natstest.CheckFor(t, 30*time.Second, 20*time.Millisecond, func() error {
		info, err := s2.Info(ctx)
		if err != nil {
			return err
		}
		if info.State.Consumers != 0 {
			return fmt.Errorf("the stream still counts %d consumers", info.State.Consumers)
		}
		return nil
	})
	_, err = s2.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: "other"})
	require.NoError(t, err)
	_, err = js.Publish(ctx, "$KV.composed-n2.web.2", publishedComp)
	require.NoError(t, err)
	natstest.CheckFor(t, 30*time.Second, 20*time.Millisecond, func() error {
		code, body := readyz(t, srv)
		if code != 200 || !strings.Contains(body, "cannot be read (retried; not waited for): composed-n2") {
			return fmt.Errorf("readyz %d: %s", code, body)
		}
		fams, err := metricstest.Scrape(srv.Addr())
		if err != nil {
			return err
		}
		if n, _ := fams.Value("mesh_provisioner_composed_buckets_failing"); n != 1 {
			return fmt.Errorf("%v composed buckets failing", n)
		}
		return nil
	})
	_, synced := db.Applied("composed-n2")
	require.True(t, synced, "read before: still synced as the answers say")
	seq, _ := db.Applied("composed-n2")
	require.EqualValues(t, 1, seq, "the composition not read")

	// The slot frees: it is read, and named no more.
	require.NoError(t, s2.DeleteConsumer(ctx, "other"))
	natstest.CheckFor(t, 30*time.Second, 20*time.Millisecond, func() error {
		if seq, _ := db.Applied("composed-n2"); seq != 2 {
			return fmt.Errorf("composed-n2 applied %d", seq)
		}
		code, body := readyz(t, srv)
		if code != 200 || strings.Contains(body, "composed-n2") {
			return fmt.Errorf("readyz %d: %s", code, body)
		}
		fams, err := metricstest.Scrape(srv.Addr())
		if err != nil {
			return err
		}
		if n, _ := fams.Value("mesh_provisioner_composed_buckets_failing"); n != 0 {
			return fmt.Errorf("%v composed buckets failing", n)
		}
		return nil
	})
}

// TestMetrics_ReadyzForgetsAnUnreadableBucketWhoseStreamWasDeleted: a node's composed-<node> bucket
// the seat never could read (its stream's one consumer taken) is named "cannot be read"; then the node
// is decommissioned and its stream deleted. The bucket has nothing left to read, yet /readyz named it
// and mesh_provisioner_composed_buckets_failing counted it for as long as the seat ran: its tail's
// failures were kept once it waited for a stream to be created.
func TestMetrics_ReadyzForgetsAnUnreadableBucketWhoseStreamWasDeleted(t *testing.T) {
	ns := natstest.RunServer(t)
	url := ns.ClientURL()
	_, js := natstest.Connect(t, url)
	ctx := context.Background()
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "composed-n1", Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	_, err = kv.Put(ctx, "web.1", publishedComp)
	require.NoError(t, err)
	composedHeldByAnother(t, js, publishedComp)

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
	natstest.CheckFor(t, 30*time.Second, 20*time.Millisecond, func() error {
		code, body := readyz(t, srv)
		if code != 200 || !strings.Contains(body, "cannot be read (retried; not waited for): composed-n2") {
			return fmt.Errorf("readyz %d: %s", code, body)
		}
		return nil
	})

	// The node is decommissioned.
	require.NoError(t, js.DeleteStream(ctx, "KV_composed-n2"))
	natstest.CheckFor(t, 30*time.Second, 20*time.Millisecond, func() error {
		code, body := readyz(t, srv)
		if code != 200 || strings.Contains(body, "composed-n2") {
			return fmt.Errorf("readyz %d: %s", code, body)
		}
		fams, err := metricstest.Scrape(srv.Addr())
		if err != nil {
			return err
		}
		if n, _ := fams.Value("mesh_provisioner_composed_buckets_failing"); n != 0 {
			return fmt.Errorf("%v composed buckets failing", n)
		}
		return nil
	})
}
