package projector_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/internal/streaminfo"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// TestProjector_DiscoversComposedByListing: an account that may not subscribe to JetStream's
// advisories still tails every composed-<node> bucket, those there at start and those created later,
// found by listing the streams.
func TestProjector_DiscoversComposedByListing(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServerSeatNoAdvisories(t)
	_, nodeJS := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("admin", "admin"))
	_, seatJS := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("seat", "seat"))
	ctx := context.Background()

	put := func(bucket, key string) uint64 {
		t.Helper()
		kv, err := nodeJS.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: bucket, History: 4})
		require.NoError(t, err)
		v, err := msgpack.Marshal(map[string]any{"status": "published", "plan": key})
		require.NoError(t, err)
		seq, err := kv.Put(ctx, key, v)
		require.NoError(t, err)
		return seq
	}
	// A bucket that is not composed-<node> is not tailed.
	_, err := nodeJS.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "other"})
	require.NoError(t, err)
	put("composed-a", "web.1")

	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	p := projector.New(seatJS, db, projector.Options{Buckets: []string{}, Composed: true, DiscoverEvery: 100 * time.Millisecond, Poll: 50 * time.Millisecond})
	require.False(t, p.Discovered())
	p.Start(ctx)
	defer p.Stop()

	natstest.CheckFor(t, 10*time.Second, 20*time.Millisecond, applied(db, "composed-a", 1))
	require.True(t, p.Discovered())

	seq := put("composed-b", "web.2")
	natstest.CheckFor(t, 10*time.Second, 20*time.Millisecond, applied(db, "composed-b", seq))
	require.Equal(t, []string{"composed-a", "composed-b"}, p.Buckets(), "each bucket tailed once, and nothing else")
	var each []string
	require.True(t, p.EachBucket(func(b string) bool { each = append(each, b); return true }))
	require.ElementsMatch(t, p.Buckets(), each, "EachBucket visits what Buckets lists")
	visited := 0
	require.False(t, p.EachBucket(func(string) bool { visited++; return false }))
	require.Equal(t, 1, visited, "EachBucket stops when told")

	p.Stop() // returns once every consumer and the discovery loop have stopped
	v, err := db.View()
	require.NoError(t, err)
	defer v.Close()
	var n int
	require.NoError(t, v.Checkpoints(provisioner.ComposedPrefix, func(string, store.Checkpoint) { n++ }))
	require.Equal(t, 2, n)
}

// TestProjector_DiscoveryReadsTheSharedListing: with the stream listing shared (a seat's), discovery
// takes the composed-<node> names from it and sends no STREAM.NAMES of its own; it still finds a bucket
// created later (here the account may not subscribe to advisories, so only a listing can). Where the
// listing is denied, discovery lists the names itself. The requests are counted on $JS.API.> by a
// subscriber of the account.
func TestProjector_DiscoveryReadsTheSharedListing(t *testing.T) {
	t.Parallel()
	const every = 100 * time.Millisecond
	const intervals = 10
	run := func(t *testing.T, ns *server.Server, admin, seat []nats.Option, listDelay ...time.Duration) (names, lists int64) {
		nc, js := natstest.Connect(t, ns.ClientURL(), admin...)
		_, pjs := natstest.Connect(t, ns.ClientURL(), seat...)
		var streams *streaminfo.Poller
		if len(listDelay) > 0 {
			streams = streaminfo.New(slowListing{JetStream: pjs, delay: listDelay[0]})
			natstest.RunPoller(t, streams, every)
		}
		ctx, cancel := context.WithCancel(context.Background())
		put := func(bucket string) uint64 {
			t.Helper()
			kv, err := js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: bucket, Storage: jetstream.MemoryStorage})
			require.NoError(t, err)
			v, err := msgpack.Marshal(map[string]any{"status": "published", "plan": bucket})
			require.NoError(t, err)
			seq, err := kv.Put(ctx, "web.1", v)
			require.NoError(t, err)
			return seq
		}
		put("composed-a")
		namesReq := countRequests(t, nc, "$JS.API.STREAM.NAMES")
		listReq := countRequests(t, nc, "$JS.API.STREAM.LIST")

		// Discovery every three listings, as serve's 30 s to its 5 s or 10 s.
		p, db := startWithListing(t, ctx, cancel, pjs, every, projector.Options{Buckets: []string{}, Composed: true,
			DiscoverEvery: 3 * every, Verify: every, Poll: 20 * time.Millisecond, Streams: streams})
		natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, applied(db, "composed-a", 1))
		require.True(t, p.Discovered())

		namesReq.Store(0)
		listReq.Store(0)
		time.Sleep(intervals * every) // a window to count in, not a wait for a condition
		names, lists = namesReq.Load(), listReq.Load()
		t.Logf("over %d listing intervals of %v, discovery every %v: %d STREAM.NAMES, %d STREAM.LIST", intervals, every, 3*every, names, lists)

		seq := put("composed-b")
		natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, applied(db, "composed-b", seq))
		require.Equal(t, []string{"composed-a", "composed-b"}, p.Buckets())
		return names, lists
	}

	t.Run("listed", func(t *testing.T) {
		ns := natstest.RunServerSeatNoAdvisories(t)
		quiet := nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {})
		names, lists := run(t, ns, []nats.Option{nats.UserInfo("admin", "admin")}, []nats.Option{nats.UserInfo("seat", "seat"), quiet})
		require.Zero(t, names, "discovery reads the shared listing")
		require.LessOrEqual(t, lists, int64(intervals+2), "one listing per interval, discovery's included")
		require.Positive(t, lists)
	})
	t.Run("listed slower than its interval", func(t *testing.T) {
		// A listing of thousands of streams can take longer than its interval and still runs:
		// discovery waits for it rather than listing the names itself at each pass.
		ns := natstest.RunServerSeatNoAdvisories(t)
		quiet := nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {})
		names, _ := run(t, ns, []nats.Option{nats.UserInfo("admin", "admin")}, []nats.Option{nats.UserInfo("seat", "seat"), quiet}, 6*every)
		require.Zero(t, names, "discovery reads the shared listing")
	})
	t.Run("listing denied", func(t *testing.T) {
		ns := natstest.RunServerDeniedStreamList(t)
		quiet := nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {})
		names, _ := run(t, ns, []nats.Option{nats.UserInfo("admin", "admin")}, []nats.Option{nats.UserInfo("seat", "seat"), quiet})
		require.Positive(t, names, "without a listing discovery lists the names itself")
	})
}

// applied is a natstest.CheckFor condition: the store has applied a bucket up to seq.
func applied(db *store.DB, bucket string, seq uint64) func() error {
	return func() error {
		if have, _ := db.Applied(bucket); have < seq {
			return fmt.Errorf("%s: applied %d of %d", bucket, have, seq)
		}
		return nil
	}
}

// startWithListing starts a Projector with opts beside a stream listing of its own every `every`, as
// the seat runs them, on a fresh store; cleanup stops the projector, cancels ctx, closes the store, and
// then stops the listing.
func startWithListing(t *testing.T, ctx context.Context, cancel context.CancelFunc, js jetstream.JetStream, every time.Duration,
	opts projector.Options) (*projector.Projector, *store.DB) {
	t.Helper()
	if opts.Streams == nil {
		opts.Streams = streaminfo.New(js)
		natstest.RunPoller(t, opts.Streams, every) // stopped after the projector, whose cleanup comes later
	}
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	p := projector.New(js, db, opts)
	p.Start(ctx)
	t.Cleanup(func() {
		p.Stop()
		cancel()
		require.NoError(t, db.Close())
	})
	return p, db
}
