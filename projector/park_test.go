package projector_test

import (
	"context"
	"fmt"
	"math"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/internal/streaminfo"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// consumers is how many consumers a bucket's stream has.
func consumers(t *testing.T, js jetstream.JetStream, bucket string) int {
	t.Helper()
	s, err := js.Stream(context.Background(), "KV_"+bucket)
	require.NoError(t, err)
	return s.CachedInfo().State.Consumers
}

// waitParked waits until a bucket is parked and its stream has no consumer left.
func waitParked(t *testing.T, p *projector.Projector, js jetstream.JetStream, bucket string) {
	t.Helper()
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if !p.Parked(bucket) {
			return fmt.Errorf("%s not parked", bucket)
		}
		if n := consumers(t, js, bucket); n != 0 {
			return fmt.Errorf("%s parked with %d consumers", bucket, n)
		}
		return nil
	})
}

func waitApplied(t *testing.T, db *store.DB, bucket string, seq uint64) {
	t.Helper()
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if have, synced := db.Applied(bucket); have != seq || !synced {
			return fmt.Errorf("%s: applied %d, synced %v; want %d", bucket, have, synced, seq)
		}
		return nil
	})
}

// TestProjector_IdleComposedBucketParks: an idle composed-<node> bucket gives its consumer up, and a
// listing that reports its stream changed makes it tail again, whatever changed: a new message, a
// purge, a deletion. The fixed buckets keep their consumers.
func TestProjector_IdleComposedBucketParks(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	composedBuckets(t, js, 1)
	const b = "composed-n0000"
	fixed, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "mesh-host_modules", Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	_, err = fixed.Put(ctx, "n0000.web", []byte{0x80})
	require.NoError(t, err)
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	_, pjs := natstest.Connect(t, ns.ClientURL())
	p := projector.New(pjs, db, projector.Options{Buckets: []string{"mesh-host_modules"}, Composed: true, Poll: 20 * time.Millisecond,
		Verify: 200 * time.Millisecond, DiscoverEvery: time.Hour, ParkAfter: 200 * time.Millisecond})
	p.Start(ctx)
	t.Cleanup(func() {
		p.Stop()
		db.Close()
	})
	waitApplied(t, db, b, 1)
	waitParked(t, p, js, b)
	require.False(t, p.Parked("mesh-host_modules"), "only composed-<node> buckets park")
	require.Equal(t, 1, consumers(t, js, "mesh-host_modules"))

	// A new message: read at the next listing, then parked again.
	kv, err := js.KeyValue(ctx, b)
	require.NoError(t, err)
	_, err = kv.Put(ctx, "web.2", []byte{0x81, 0xa1, 'x', 0x01})
	require.NoError(t, err)
	waitApplied(t, db, b, 2)
	waitParked(t, p, js, b)

	// A purge of the whole stream sends no message: the listing's first sequence says it, and the
	// bucket is forgotten and read again from its (empty) stream.
	s, err := js.Stream(ctx, "KV_"+b)
	require.NoError(t, err)
	require.NoError(t, s.Purge(ctx))
	forgotten(t, db, b)
	waitParked(t, p, js, b)

	// Deleted: forgotten, no longer tailed.
	require.NoError(t, js.DeleteKeyValue(ctx, b))
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if p.Tails(b) || slices.Contains(db.Buckets(), b) {
			return fmt.Errorf("%s not forgotten yet", b)
		}
		return nil
	})
}

// TestProjector_ParkedBucketWokenOrListingStopped: Wake (a request waiting for the bucket's min_seq)
// makes a parked bucket read at once, long before the next listing; and once the listing stops, every
// parked bucket tails again and none parks, since nothing would tell it its stream changed.
func TestProjector_ParkedBucketWokenOrListingStopped(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	composedBuckets(t, js, 2)
	b0, b1 := "composed-n0000", "composed-n0001"
	_, pjs := natstest.Connect(t, ns.ClientURL())
	// The listing runs on a connection of its own, closed to make every listing fail, as a listing
	// denied or unanswered does: Run goes on, trying.
	lnc, ljs := natstest.Connect(t, ns.ClientURL())
	poller := streaminfo.New(ljs)
	natstest.RunPoller(t, poller, 150*time.Millisecond)
	p, db := parkingOn(t, pjs, poller, 200*time.Millisecond, time.Hour)
	waitApplied(t, db, b0, 1)
	waitParked(t, p, js, b0)

	// Woken: read without a listing that reports the change (the listing stops first, and a stopped
	// listing wakes parked buckets only after two of its intervals).
	kv, err := js.KeyValue(ctx, b0)
	require.NoError(t, err)
	lnc.Close()
	_, err = kv.Put(ctx, "web.2", []byte{0x80})
	require.NoError(t, err)
	p.Wake(b0)
	waitApplied(t, db, b0, 2)

	// The listing stopped: every bucket tails again, with a consumer, and stays so.
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		for _, b := range []string{b0, b1} {
			if p.Parked(b) || consumers(t, js, b) != 1 {
				return fmt.Errorf("%s: parked %v, %d consumers", b, p.Parked(b), consumers(t, js, b))
			}
		}
		return nil
	})
	time.Sleep(400 * time.Millisecond) // two ParkAfter: an idle bucket would have parked by now
	require.False(t, p.Parked(b1), "no bucket parks while the listing is stopped")
	_, err = kv.Put(ctx, "web.3", []byte{0x80})
	require.NoError(t, err)
	waitApplied(t, db, b0, 3)
}

// parking runs a projector of the composed-<node> buckets only, into a store of its own, with the
// stream listing of a Poller it shares (every 100 ms, as a seat's) and parking after parkAfter.
// The projector and the listing stop as the test ends.
func parking(t *testing.T, url string, parkAfter, verify time.Duration) (*projector.Projector, *store.DB) {
	t.Helper()
	return parkingEvery(t, url, parkAfter, verify, 100*time.Millisecond)
}

// parkingEvery is parking with the listing every `every`.
func parkingEvery(t *testing.T, url string, parkAfter, verify, every time.Duration) (*projector.Projector, *store.DB) {
	t.Helper()
	_, pjs := natstest.Connect(t, url)
	poller := streaminfo.New(pjs)
	natstest.RunPoller(t, poller, every)
	return parkingOn(t, pjs, poller, parkAfter, verify)
}

// parkingOn is parking on a connection and a listing the test runs as it likes.
func parkingOn(t *testing.T, pjs jetstream.JetStream, poller *streaminfo.Poller, parkAfter, verify time.Duration) (*projector.Projector, *store.DB) {
	t.Helper()
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	p := projector.New(pjs, db, projector.Options{Buckets: []string{}, Composed: true, Poll: 20 * time.Millisecond,
		Verify: verify, DiscoverEvery: time.Hour, ParkAfter: parkAfter, Streams: poller})
	p.Start(context.Background())
	t.Cleanup(func() {
		p.Stop()
		db.Close()
	})
	return p, db
}

// TestProjector_PurgedJustBeforeParking: a stream purged after the bucket's last check and before it
// parks sends no message, and its listing changes no more once the bucket has parked on it: the
// purge must be found as the bucket parks, not when the node next writes. The stream checks are an
// hour apart here, so the purge always comes after the last one.
func TestProjector_PurgedJustBeforeParking(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	composedBuckets(t, js, 1)
	const b = "composed-n0000"
	p, db := parking(t, ns.ClientURL(), time.Second, time.Hour)
	waitApplied(t, db, b, 1)
	s, err := js.Stream(ctx, "KV_"+b)
	require.NoError(t, err)
	require.NoError(t, s.Purge(ctx))
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		v, err := db.View()
		if err != nil {
			return err
		}
		defer v.Close()
		if _, found, err := v.ForgottenAt(b); err != nil || !found {
			return fmt.Errorf("the purge of %s was not found (parked %v, %v)", b, p.Parked(b), err)
		}
		return nil
	})
	waitParked(t, p, js, b)
}

// TestProjector_WakeWhileParking: a node engine publishes a composition and asks for it with min_seq
// while its idle bucket is parking, after the park read its stream's info and before it waits: the
// Wake must not be lost. The listing runs once an hour here, so only the Wake can make the bucket read.
func TestProjector_WakeWhileParking(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	composedBuckets(t, js, 1)
	const b = "composed-n0000"
	kv, err := js.KeyValue(ctx, b)
	require.NoError(t, err)
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	_, pjs := natstest.Connect(t, ns.ClientURL())
	poller := streaminfo.New(pjs)
	natstest.RunPoller(t, poller, time.Hour)
	p := projector.New(pjs, db, projector.Options{Buckets: []string{}, Composed: true, Poll: 20 * time.Millisecond,
		Verify: time.Hour, DiscoverEvery: time.Hour, ParkAfter: 200 * time.Millisecond, Streams: poller})
	var once sync.Once
	published := make(chan error, 1)
	projector.SetAfterParkRead(p, func(bucket string) {
		once.Do(func() {
			_, err := kv.Put(ctx, "web.2", []byte{0x80})
			published <- err
			p.Wake(bucket)
		})
	})
	p.Start(ctx)
	t.Cleanup(func() {
		p.Stop()
		db.Close()
	})
	select {
	case err := <-published:
		require.NoError(t, err)
	case <-time.After(20 * time.Second):
		t.Fatal("the bucket never parked")
	}
	waitApplied(t, db, b, 2)
	waitParked(t, p, js, b)
}

// TestProjector_ParksPastMessagesRemovedUnread: a composition written with a TTL to a parked bucket
// expires, and so does the marker its expiry left, before the listing wakes the bucket: the stream's
// last sequence stays past anything the bucket can read. The bucket must park again, not tail and
// give up in turn for good, and its log must know what it never read. The listing runs only when
// the test lists.
func TestProjector_ParksPastMessagesRemovedUnread(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	nc, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	const b = "composed-n0000"
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: b, History: 1, Storage: jetstream.MemoryStorage,
		LimitMarkerTTL: time.Second})
	require.NoError(t, err)
	_, err = kv.Put(ctx, "web.1", []byte{0x80})
	require.NoError(t, err)
	_, pjs := natstest.Connect(t, ns.ClientURL())
	poller := streaminfo.New(pjs)
	_, err = poller.List(ctx)
	require.NoError(t, err)
	p, db := parkingOn(t, pjs, poller, 200*time.Millisecond, time.Hour)
	waitApplied(t, db, b, 1)
	waitParked(t, p, js, b)

	_, err = kv.Create(ctx, "web.2", []byte{0x80}, jetstream.KeyTTL(time.Second))
	require.NoError(t, err)
	s, err := js.Stream(ctx, "KV_"+b)
	require.NoError(t, err)
	natstest.CheckFor(t, 20*time.Second, 50*time.Millisecond, func() error {
		st := s.CachedInfo().State
		if _, err := s.Info(ctx); err != nil {
			return err
		}
		if st = s.CachedInfo().State; st.LastSeq != 3 || st.Msgs != 1 {
			return fmt.Errorf("the composition and its marker not expired yet: last %d, %d messages", st.LastSeq, st.Msgs)
		}
		return nil
	})
	creates := countRequests(t, nc, "$JS.API.CONSUMER.CREATE.KV_"+b+".>")
	_, err = poller.List(ctx)
	require.NoError(t, err)
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if creates.Load() == 0 {
			return fmt.Errorf("not woken yet")
		}
		if !p.Parked(b) || consumers(t, js, b) != 0 {
			return fmt.Errorf("woken (%d consumers created), not parked again", creates.Load())
		}
		return nil
	})
	seq, _ := db.Applied(b)
	require.Equal(t, uint64(1), seq, "nothing was left to read")
	// The log knows the composition and its marker were removed unread: no point among them is
	// rebuilt as if they had never been.
	v, err := db.View()
	require.NoError(t, err)
	defer v.Close()
	marks, err := v.HistoryMarks(b)
	require.NoError(t, err)
	require.True(t, slices.ContainsFunc(marks.Gaps, func(g store.Gap) bool { return g.Holds(2) && g.Holds(3) }), "gaps %+v", marks.Gaps)
}

// TestProjector_ParkedKeyExpiredUnread: a composition written with a TTL expires while its bucket is
// parked, and the marker its expiry left expires too before the listing wakes the bucket, while
// another key stays: no message the bucket can read says the key went. The stream's first sequence
// is past the key's message, and nothing is left to read up to its last: the key must go from the
// projection, as it went from the bucket.
func TestProjector_ParkedKeyExpiredUnread(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	const b = "composed-n0000"
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: b, History: 1, Storage: jetstream.MemoryStorage,
		LimitMarkerTTL: time.Second})
	require.NoError(t, err)
	_, pjs := natstest.Connect(t, ns.ClientURL())
	poller := streaminfo.New(pjs)
	_, err = poller.List(ctx)
	require.NoError(t, err)
	p, db := parkingOn(t, pjs, poller, 200*time.Millisecond, time.Hour)
	_, err = kv.Create(ctx, "web.1", []byte{0x80}, jetstream.KeyTTL(2*time.Second))
	require.NoError(t, err)
	_, err = kv.Put(ctx, "web.2", []byte{0x80})
	require.NoError(t, err)
	waitApplied(t, db, b, 2)
	waitParked(t, p, js, b)
	live := func(key string) bool {
		v, err := db.View()
		require.NoError(t, err)
		defer v.Close()
		_, live, err := v.KeyAt(b, key, math.MaxUint64)
		require.NoError(t, err)
		return live
	}
	require.True(t, live("web.1"), "read before it expired")

	s, err := js.Stream(ctx, "KV_"+b)
	require.NoError(t, err)
	natstest.CheckFor(t, 20*time.Second, 50*time.Millisecond, func() error {
		info, err := s.Info(ctx)
		if err != nil {
			return err
		}
		if st := info.State; st.FirstSeq != 2 || st.LastSeq != 3 || st.Msgs != 1 {
			return fmt.Errorf("web.1 and its marker not expired yet: first %d, last %d, %d messages", st.FirstSeq, st.LastSeq, st.Msgs)
		}
		return nil
	})
	_, err = poller.List(ctx)
	require.NoError(t, err)
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if live("web.1") {
			return fmt.Errorf("web.1 expired from the bucket, still held by the projection (parked %v)", p.Parked(b))
		}
		return nil
	})
	waitParked(t, p, js, b)
	require.True(t, live("web.2"), "the key that stayed is read again")
}

// slowListing is a JetStream whose stream listings each start late, as the JetStream API of a large
// cluster answers a listing of thousands of streams: a listing takes longer than its interval.
type slowListing struct {
	jetstream.JetStream
	delay time.Duration
}

func (j slowListing) ListStreams(ctx context.Context, opts ...jetstream.StreamListOpt) jetstream.StreamInfoLister {
	select {
	case <-time.After(j.delay):
	case <-ctx.Done():
	}
	return j.JetStream.ListStreams(ctx, opts...)
}

// TestProjector_ParksWithAListingSlowerThanItsInterval: a listing that takes longer than its
// interval still runs: buckets park, and a write to one is read by the listing. Taken for a listing
// that stopped, it woke every parked bucket at each tick and let none park.
func TestProjector_ParksWithAListingSlowerThanItsInterval(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	composedBuckets(t, js, 2)
	const b = "composed-n0000"
	_, pjs := natstest.Connect(t, ns.ClientURL())
	poller := streaminfo.New(slowListing{JetStream: pjs, delay: 300 * time.Millisecond})
	natstest.RunPoller(t, poller, 100*time.Millisecond)
	p, db := parkingOn(t, pjs, poller, 200*time.Millisecond, time.Hour)
	waitApplied(t, db, b, 1)
	waitParked(t, p, js, b)
	waitParked(t, p, js, "composed-n0001")
	kv, err := js.KeyValue(ctx, b)
	require.NoError(t, err)
	_, err = kv.Put(ctx, "web.2", []byte{0x80})
	require.NoError(t, err)
	waitApplied(t, db, b, 2)
	waitParked(t, p, js, b)
}
