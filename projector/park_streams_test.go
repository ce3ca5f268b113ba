package projector_test

import (
	"context"
	"fmt"
	"math"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/internal/streaminfo"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// What a parked bucket's stream can go through, each found by the listing alone (park.go).

// forgotten waits until a composed-<node> bucket has been forgotten in place and read again.
func forgotten(t *testing.T, db *store.DB, bucket string) {
	t.Helper()
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		v, err := db.View()
		if err != nil {
			return err
		}
		defer v.Close()
		if _, found, err := v.ForgottenAt(bucket); err != nil || !found {
			return fmt.Errorf("%s not forgotten (%v)", bucket, err)
		}
		return nil
	})
}

// TestProjector_ParkedBucketStreamRecreated: a node reinstalled deletes its bucket and creates it
// again within one listing, and writes as many messages as before, so the new stream ends at the
// same sequence: its creation time tells it apart, and the bucket is read again from it.
func TestProjector_ParkedBucketStreamRecreated(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	composedBuckets(t, js, 1)
	const b = "composed-n0000"
	p, db := parking(t, ns.ClientURL(), 200*time.Millisecond, 300*time.Millisecond)
	waitApplied(t, db, b, 1)
	waitParked(t, p, js, b)
	require.NoError(t, js.DeleteKeyValue(ctx, b))
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: b, History: 1, Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	_, err = kv.Put(ctx, "other.7", []byte{0x80})
	require.NoError(t, err)
	forgotten(t, db, b)
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		v, err := db.View()
		if err != nil {
			return err
		}
		defer v.Close()
		if _, live, err := v.KeyAt(b, "web.1", math.MaxUint64); err != nil || live {
			return fmt.Errorf("the old stream's key is still held (%v)", err)
		}
		if _, live, err := v.KeyAt(b, "other.7", math.MaxUint64); err != nil || !live {
			return fmt.Errorf("the new stream's key is not answered (%v)", err)
		}
		return nil
	})
	waitParked(t, p, js, b)
}

// TestProjector_ParkedBucketKeyPurgedOrAged: a key purged (a message) and messages removed by the
// bucket's age limit (no message; the listing's first sequence moves) each wake a parked bucket.
func TestProjector_ParkedBucketKeyPurgedOrAged(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	const b = "composed-n0000"
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: b, History: 1, Storage: jetstream.MemoryStorage, TTL: 2 * time.Second})
	require.NoError(t, err)
	for _, k := range []string{"web.1", "web.2"} {
		_, err = kv.Put(ctx, k, []byte{0x80})
		require.NoError(t, err)
	}
	p, db := parking(t, ns.ClientURL(), 200*time.Millisecond, 300*time.Millisecond)
	waitApplied(t, db, b, 2)
	waitParked(t, p, js, b)
	require.NoError(t, kv.Purge(ctx, "web.1"))
	waitApplied(t, db, b, 3)
	waitParked(t, p, js, b)
	// Aged out: the projection no longer equals the bucket, which is read again (forget.go).
	forgotten(t, db, b)
	waitParked(t, p, js, b)
}

// TestProjector_ParkedBucketServerRestart: the server restarts while a bucket is parked, briefly
// (the listing still counts as running: the bucket stays parked) or for longer than two listings
// (every parked bucket tails again, and parks once the listing is back). Either way what is written
// after the restart is read, and the stream, back as it was, is not read again from scratch.
func TestProjector_ParkedBucketServerRestart(t *testing.T) {
	t.Parallel()
	for _, every := range []time.Duration{100 * time.Millisecond, 3 * time.Second} {
		t.Run("listing every "+every.String(), func(t *testing.T) {
			listen := fmt.Sprintf("127.0.0.1:%d", natstest.FreePort(t))
			dir := t.TempDir()
			ns := natstest.RunServerAt(t, listen, dir, "")
			nc, js := natstest.Connect(t, ns.ClientURL())
			ctx := context.Background()
			const b = "composed-n0000"
			kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: b, History: 1})
			require.NoError(t, err)
			_, err = kv.Put(ctx, "web.1", []byte{0x80})
			require.NoError(t, err)
			p, db := parkingEvery(t, ns.ClientURL(), 200*time.Millisecond, 300*time.Millisecond, every)
			waitApplied(t, db, b, 1)
			waitParked(t, p, js, b)
			ns.Shutdown()
			ns.WaitForShutdown()
			natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
				if nc.Status() == nats.CONNECTED {
					return fmt.Errorf("the restart is not noticed yet")
				}
				return nil
			})
			natstest.RunServerAt(t, listen, dir, "")
			natstest.CheckFor(t, 20*time.Second, 50*time.Millisecond, func() error {
				pctx, cancel := context.WithTimeout(ctx, time.Second)
				defer cancel()
				_, err := kv.Put(pctx, "web.2", []byte{0x80})
				return err
			})
			waitApplied(t, db, b, 2)
			waitParked(t, p, js, b)
			v, err := db.View()
			require.NoError(t, err)
			defer v.Close()
			_, found, err := v.ForgottenAt(b)
			require.NoError(t, err)
			require.False(t, found, "the stream came back as it was: nothing to read again")
		})
	}
}

// TestProjector_ParkedBucketsListedInPages: with more streams than one page of the listing (256),
// a write to a bucket on any page wakes it.
func TestProjector_ParkedBucketsListedInPages(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	const n = 300
	composedBuckets(t, js, n)
	p, db := parking(t, ns.ClientURL(), 300*time.Millisecond, 300*time.Millisecond)
	natstest.CheckFor(t, 60*time.Second, 50*time.Millisecond, func() error {
		if c := p.ParkedCount(); c != n {
			return fmt.Errorf("%d of %d parked", c, n)
		}
		return nil
	})
	for _, i := range []int{0, 150, 299} {
		b := fmt.Sprintf("composed-n%04d", i)
		kv, err := js.KeyValue(ctx, b)
		require.NoError(t, err)
		_, err = kv.Put(ctx, "web.2", []byte{0x80})
		require.NoError(t, err)
		waitApplied(t, db, b, 2)
	}
}

// TestProjector_NoParkingWithoutListing: a seat user denied $JS.API.STREAM.LIST never gets a listing,
// so nothing would tell a parked bucket its stream changed: no bucket parks, whether the Projector
// lists itself or shares a listing, and a write is read at once.
func TestProjector_NoParkingWithoutListing(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServerDeniedStreamList(t)
	_, js := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("admin", "admin"))
	ctx := context.Background()
	composedBuckets(t, js, 2)
	const b = "composed-n0000"
	kv, err := js.KeyValue(ctx, b)
	require.NoError(t, err)
	for i, shared := range []bool{false, true} {
		_, pjs := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("seat", "seat"))
		o := projector.Options{Buckets: []string{}, Composed: true, Poll: 20 * time.Millisecond, Verify: 100 * time.Millisecond,
			ParkAfter: 100 * time.Millisecond}
		if shared {
			poller := streaminfo.New(pjs)
			natstest.RunPoller(t, poller, 100*time.Millisecond)
			o.Streams = poller
		}
		db, err := store.Open(t.TempDir(), store.Options{})
		require.NoError(t, err)
		p := projector.New(pjs, db, o)
		p.Start(ctx)
		waitApplied(t, db, b, uint64(1+i))
		time.Sleep(500 * time.Millisecond) // five ParkAfter: an idle bucket would have parked by now
		require.Zero(t, p.ParkedCount(), "shared listing %v", shared)
		_, err = kv.Put(ctx, "web.2", []byte{0x80})
		require.NoError(t, err)
		waitApplied(t, db, b, uint64(2+i))
		p.Stop()
		require.NoError(t, db.Close())
	}
}

// TestProjector_WokenBucketOfARecreatedStream: a parked bucket whose stream is deleted and created
// again (a node reinstalled), then written and waited on by a request before any listing shows the
// new stream, reads the new stream from its first message. The listing's info, read before the
// recreation, is of the old stream: a tail that took it created its consumer by name on the new stream
// from the old checkpoint, and answered the request with the old stream's keys and the new stream's
// messages past that checkpoint, its first ones never read, until a listing came (here, an hour).
func TestProjector_WokenBucketOfARecreatedStream(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	const b = "composed-n0000"
	oneComposedOfTwo(t, js)
	_, pjs := natstest.Connect(t, ns.ClientURL())
	// One listing, at start: none shows the new stream.
	p, db, _ := parkingQuietEvery(t, pjs, nil, time.Hour, []string{b}, nil)
	waitApplied(t, db, b, 2)
	waitParked(t, p, js, b)

	require.NoError(t, js.DeleteKeyValue(ctx, b))
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: b, History: 1, Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	for _, k := range []string{"api.1", "api.2", "api.3"} {
		_, err = kv.Put(ctx, k, []byte{0x80})
		require.NoError(t, err)
	}
	p.Wake(b) // a request waits for sequence 3 of the new stream
	waitApplied(t, db, b, 3)
	answersTheNewStreamOnly(t, db, b)
}

// gatedSetup is a JetStream whose tails' setting up (STREAM.INFO for a handle, or CONSUMER.CREATE by
// the stream's name) waits, while armed, until the test opens the gate: the test stages what the
// stream goes through before the tail sets up. held is told each time one waits.
type gatedSetup struct {
	jetstream.JetStream
	armed *atomic.Bool
	held  chan struct{}
	gate  chan struct{}
}

func (j gatedSetup) wait(ctx context.Context) {
	if !j.armed.Load() {
		return
	}
	select {
	case j.held <- struct{}{}:
	default:
	}
	select {
	case <-j.gate:
	case <-ctx.Done():
	}
}

func (j gatedSetup) Stream(ctx context.Context, name string) (jetstream.Stream, error) {
	j.wait(ctx)
	return j.JetStream.Stream(ctx, name)
}

func (j gatedSetup) CreateConsumer(ctx context.Context, stream string, cfg jetstream.ConsumerConfig) (jetstream.Consumer, error) {
	j.wait(ctx)
	return j.JetStream.CreateConsumer(ctx, stream, cfg)
}

// TestProjector_TailAfterItsStreamWasRecreated: a bucket reading (not parked) whose stream is deleted
// loses its consumer with it; the stream is created again and written before the bucket's next tail
// sets up, and no listing has shown the new stream yet. The next tail reads the new stream from its
// first message. The listing's info, read before the deletion, is of the old stream: a tail that took
// it created its consumer by name on the new stream from the old checkpoint, and answered the old
// stream's keys with the new one's messages past that checkpoint until a listing came (an hour here).
func TestProjector_TailAfterItsStreamWasRecreated(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	const b = "composed-n0000"
	oneComposedOfTwo(t, js)
	_, pjs := natstest.Connect(t, ns.ClientURL())
	var armed atomic.Bool
	gated := gatedSetup{JetStream: pjs, armed: &armed, held: make(chan struct{}, 1), gate: make(chan struct{})}
	// One listing, at start, through a JetStream of its own; the bucket's stream is not quiet: it
	// keeps reading, and the tail's setting up goes through the gate.
	p, db, _ := parkingQuietEvery(t, gated, pjs, time.Hour, nil, nil)
	waitApplied(t, db, b, 2)
	require.False(t, p.Parked(b))

	armed.Store(true)
	require.NoError(t, js.DeleteKeyValue(ctx, b))
	select {
	case <-gated.held: // the consumer went with the stream: the next tail sets up
	case <-time.After(30 * time.Second):
		t.Fatal("the bucket's tail did not set up again after its stream was deleted")
	}
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: b, History: 1, Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	for _, k := range []string{"api.1", "api.2", "api.3"} {
		_, err = kv.Put(ctx, k, []byte{0x80})
		require.NoError(t, err)
	}
	armed.Store(false)
	close(gated.gate)
	waitApplied(t, db, b, 3)
	answersTheNewStreamOnly(t, db, b)
}

// answersTheNewStreamOnly checks that a bucket whose stream was deleted (it held web.1 and web.2) and
// created again (api.1 to api.3) answers the new stream's keys alone, at its sequence 3.
func answersTheNewStreamOnly(t *testing.T, db *store.DB, b string) {
	t.Helper()
	v, err := db.View()
	require.NoError(t, err)
	defer v.Close()
	for _, k := range []string{"web.1", "web.2"} {
		_, live, err := v.KeyAt(b, k, math.MaxUint64)
		require.NoError(t, err)
		require.False(t, live, "%s of the deleted stream is answered at sequence 3 of the new one", k)
	}
	for _, k := range []string{"api.1", "api.2", "api.3"} {
		_, live, err := v.KeyAt(b, k, math.MaxUint64)
		require.NoError(t, err)
		require.True(t, live, "%s of the new stream is not answered at its sequence 3", k)
	}
}
