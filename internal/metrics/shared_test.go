package metrics_test

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/metrics"
	"github.com/novox/mesh-provisioner/internal/metrics/metricstest"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/internal/streaminfo"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/registry"
	"github.com/novox/mesh-provisioner/seat"
	"github.com/novox/mesh-provisioner/store"
)

// apiCounter counts the JetStream API requests of an account by kind (STREAM.LIST, STREAM.INFO,
// CONSUMER.CREATE, ...), from a plain subscriber on $JS.API.> that receives every request sent in it.
type apiCounter struct {
	mu sync.Mutex
	n  map[string]int64
}

func countAPI(t *testing.T, nc *nats.Conn) *apiCounter {
	t.Helper()
	c := &apiCounter{n: map[string]int64{}}
	sub, err := nc.Subscribe("$JS.API.>", func(m *nats.Msg) {
		tok := strings.Split(strings.TrimPrefix(m.Subject, "$JS.API."), ".")
		kind := tok[0]
		if len(tok) > 1 && kind != "INFO" {
			kind += "." + tok[1]
		}
		c.mu.Lock()
		c.n[kind]++
		c.mu.Unlock()
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	require.NoError(t, nc.Flush())
	return c
}

// window counts the requests sent while d passes.
func (c *apiCounter) window(d time.Duration) map[string]int64 {
	c.mu.Lock()
	c.n = map[string]int64{}
	c.mu.Unlock()
	time.Sleep(d)
	c.mu.Lock()
	defer c.mu.Unlock()
	out := c.n
	c.n = map[string]int64{}
	return out
}

func (c *apiCounter) get(kind string) int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[kind]
}

// TestMetrics_SeatListsStreamsOncePerInterval: a seat serving with metrics lists every stream's info
// once per interval (the shorter of the metrics' poll and the projector's check) for all of them: its
// projector's stream checks, the lag metric, and the second projector of a rebuild, while the rebuild
// runs and after. Wired as serve wires them; the requests are counted on $JS.API.> by a subscriber of
// the same account.
func TestMetrics_SeatListsStreamsOncePerInterval(t *testing.T) {
	const poll = 200 * time.Millisecond
	const intervals = 10
	ns := natstest.RunServer(t)
	url := ns.ClientURL()
	nc, js := natstest.Connect(t, url)
	ctx := context.Background()
	require.NoError(t, fixtures.Load(ctx, js, mesh.Ops(), 256, nil))
	_, err := registry.New(js, provisioner.Registry, time.Hour, nil).Pass(ctx)
	require.NoError(t, err)
	api := countAPI(t, nc)

	// The seat talks to JetStream through a gate (open), which the rebuild below holds part of.
	g := newGate(t, url)
	g.Open()
	snc, _ := natstest.Connect(t, url)
	gated, err := jetstream.NewWithAPIPrefix(snc, gatePrefix)
	require.NoError(t, err)

	streams := streaminfo.New(gated)
	m := metrics.New(metrics.Options{Streams: streams, Poll: poll})
	m.Start()
	t.Cleanup(m.Stop)
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	st, err := seat.Start(ctx, snc, gated, db, seat.Config{Streams: streams, ListEvery: m.Poll(),
		Projector: projector.Options{Poll: 50 * time.Millisecond, Verify: poll}})
	require.NoError(t, err)
	srv := serveSeat(t, m, st, db, g.Release) // a consumer create held unanswered would hold the stop up

	caughtUp := func() error {
		fams, err := metricstest.Scrape(srv.Addr())
		if err != nil {
			return err
		}
		for _, s := range provisioner.ProvisionerShapes {
			applied, _ := fams.Value("mesh_provisioner_bucket_applied_sequence", "bucket", s.Bucket)
			lag, ok := fams.Value("mesh_provisioner_bucket_lag", "bucket", s.Bucket)
			if synced, _ := fams.Value("mesh_provisioner_bucket_synced", "bucket", s.Bucket); !ok || applied == 0 || lag != 0 || synced != 1 {
				return fmt.Errorf("%s: applied %v, lag %v (%v), synced %v", s.Bucket, applied, lag, ok, synced)
			}
		}
		return nil
	}
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, caughtUp)

	listings := func(phase string) {
		t.Helper()
		got := api.window(intervals * poll)
		t.Logf("%s, over %d intervals of %v: %v", phase, intervals, poll, got)
		// One listing per interval for the whole seat (the streams fit one page), not one per reader:
		// the projector's checks and the metrics listing each would be twice that, three times with a
		// rebuild's projector.
		require.LessOrEqual(t, got["STREAM.LIST"], int64(intervals+2), "%s: one listing per interval", phase)
		require.GreaterOrEqual(t, got["STREAM.LIST"], int64(intervals/2), "%s: listed every interval", phase)
	}
	listings("serving")

	// A rebuild: the applied bucket is recreated. The rebuild's projector is held before its collect
	// consumer exists (its create waits at the gate; the old projector's collect consumer is healthy
	// and asks for none), so the seat runs two projectors meanwhile.
	holdCollect := gatePrefix + ".CONSUMER.CREATE." + provisioner.StreamName(provisioner.BucketCollect) + "."
	g.Hold(func(subject string) bool { return strings.HasPrefix(subject, holdCollect) })
	require.NoError(t, js.DeleteKeyValue(ctx, provisioner.BucketApplied))
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.BucketApplied, History: 8})
	require.NoError(t, err)
	_, err = kv.Put(ctx, fixtures.NodeName(1)+".mod-new", []byte{0x80})
	require.NoError(t, err)
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if len(g.Held()) == 0 {
			return fmt.Errorf("the rebuild's projector has not asked for its collect consumer yet")
		}
		return nil
	})
	require.Zero(t, st.Rebuilds())
	listings("rebuilding, two projectors")
	require.Zero(t, st.Rebuilds(), "the rebuild was held throughout")

	g.Release()
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if st.Rebuilds() == 0 {
			return fmt.Errorf("not rebuilt yet")
		}
		return caughtUp()
	})
	listings("after the rebuild")
}

// TestMetrics_LagFollowsStreamsWithoutListPermission: a seat user denied $JS.API.STREAM.LIST gets no
// listing, so the lag metric asks the streams themselves: the fixed buckets every poll, the others a
// bounded share per poll, those read longest ago first. The gauges follow new messages instead of
// keeping the last value listed, and each bucket's age gauge says how old its reading is.
func TestMetrics_LagFollowsStreamsWithoutListPermission(t *testing.T) {
	const poll = 100 * time.Millisecond
	const composed = 12
	const perPoll = 3
	ns := natstest.RunServerDeniedStreamList(t)
	url := ns.ClientURL()
	ctx := context.Background()
	anc, ajs := natstest.Connect(t, url, nats.UserInfo("admin", "admin"))

	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	var fixed, others []string
	for _, s := range provisioner.ProvisionerShapes {
		fixed = append(fixed, s.Bucket)
	}
	for i := range composed {
		others = append(others, fmt.Sprintf("composed-n%02d", i))
	}
	kvs := map[string]jetstream.KeyValue{}
	for _, b := range append(append([]string{}, fixed...), others...) {
		kv, err := ajs.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: b, History: 1, Storage: jetstream.MemoryStorage})
		require.NoError(t, err)
		kvs[b] = kv
		_, err = kv.Put(ctx, "n1.web", []byte{0x80})
		require.NoError(t, err)
		// The projection has applied that one message.
		require.NoError(t, db.Apply(b, []provisioner.Message{{Seq: 1, Time: 1, Key: "n1.web", Op: provisioner.OpPut, Value: []byte{0x80}}}, 1, false))
	}
	api := countAPI(t, anc)

	// The seat's listing, run by its owner (here the test), fails: the user may not list.
	_, sjs := natstest.Connect(t, url, nats.UserInfo("seat", "seat"))
	streams := streaminfo.New(sjs)
	natstest.RunPoller(t, streams, poll)
	m := metrics.New(metrics.Options{Streams: streams, Poll: poll, ReadsPerPoll: perPoll})
	m.SetSource(storeSource{db})
	m.Start()
	t.Cleanup(m.Stop)
	srv, err := metrics.Listen("127.0.0.1:0", m.Handler(), nil)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, srv.Close()) })

	// follows waits until every bucket's gauges say its stream's last sequence is want[bucket] and
	// its lag that minus the one message applied.
	follows := func(want map[string]float64) {
		t.Helper()
		natstest.CheckFor(t, 20*time.Second, poll/2, func() error {
			fams, err := metricstest.Scrape(srv.Addr())
			if err != nil {
				return err
			}
			for b, w := range want {
				last, ok := gaugeOf(fams, m, "mesh_provisioner_bucket_stream_last_sequence", b)
				lag, _ := gaugeOf(fams, m, "mesh_provisioner_bucket_lag", b)
				if !ok || last != w || lag != w-1 {
					return fmt.Errorf("%s: stream last %v (%v), lag %v; the stream's last sequence is %v", b, last, ok, lag, w)
				}
				if _, ok := gaugeOf(fams, m, "mesh_provisioner_bucket_stream_info_age_seconds", b); !ok {
					return fmt.Errorf("%s: no age", b)
				}
			}
			return nil
		})
	}
	want := map[string]float64{}
	for b := range kvs {
		want[b] = 1
	}
	follows(want)
	require.Zero(t, api.get("STREAM.LIST"), "the listing is denied: the server never sees it")

	// More messages while the projection applies none: the lag grows, on the fixed buckets and on
	// the others alike.
	for _, b := range []string{provisioner.BucketNeeds, "composed-n07"} {
		for i := range 3 {
			// Other keys: with history 1, a new revision of n1.web would remove the message before it
			// from the stream, and messages removed before the seat read them are no lag.
			_, err := kvs[b].Put(ctx, fmt.Sprintf("n%d.web", i+2), []byte{0x80})
			require.NoError(t, err)
		}
		want[b] = 4
	}
	follows(want)

	// The fixed buckets are read every poll; all together, a poll sends at most one request per fixed
	// bucket and perPoll for the others.
	const polls = 10
	got := api.window(polls * poll)
	t.Logf("listing denied, over %d polls with %d fixed and %d other buckets, %d reads a poll: %v", polls, len(fixed), composed, perPoll, got)
	require.LessOrEqual(t, got["STREAM.INFO"], int64((polls+1)*(len(fixed)+perPoll)), "a bounded number of stream infos a poll")
	require.GreaterOrEqual(t, got["STREAM.INFO"], int64(polls/2*len(fixed)), "the fixed buckets are read every poll")
	fams, err := metricstest.Scrape(srv.Addr())
	require.NoError(t, err)
	var ages []string
	for _, b := range append(append([]string{}, fixed...), others...) {
		age, ok := gaugeOf(fams, m, "mesh_provisioner_bucket_stream_info_age_seconds", b)
		require.True(t, ok, b)
		ages = append(ages, fmt.Sprintf("%s=%.2fs", b, age))
		if slices.Contains(fixed, b) {
			require.Less(t, age, 5.0, "%s is read every poll", b)
		}
	}
	sort.Strings(ages)
	t.Logf("ages: %v", ages)
}
