package projector_test

import (
	"context"
	"fmt"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/internal/streaminfo"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// restartable runs projectors of the composed-<node> buckets only, one after the other, on one state
// dir, each with a listing of its own every `every` and parking after an hour: a bucket parked at a
// start was started parked, not parked after being idle.
//
// A test that asserts a bucket stays parked lists every hour, and asks for the next listing when it
// needs one (projector.RefreshListing): parked buckets all tail again when the listing looks stopped,
// no listing completed within two intervals and two of its durations (listingRuns), and at 100 ms a
// stall of 200 ms of a loaded test process was one (TestProjector_StartsParkedWhenUnchanged failed so,
// at -test.parallel 8).
type restartable struct {
	t      *testing.T
	url    string
	dir    string
	every  time.Duration
	verify time.Duration
}

// start opens the state dir and starts a projector on it, with a hook (may be nil) set before Start;
// stop stops both, and runs at cleanup too if the test did not call it.
func (r restartable) start(afterParkRead func(p *projector.Projector, bucket string)) (*projector.Projector, *store.DB, func()) {
	r.t.Helper()
	_, pjs := natstest.Connect(r.t, r.url)
	poller := streaminfo.New(pjs)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	poller.Go(ctx, &wg, r.every, nil) // running before the projector looks, as a seat's
	db, err := store.OpenState(r.dir, store.Options{})
	require.NoError(r.t, err)
	p := projector.New(pjs, db, projector.Options{Buckets: []string{}, Composed: true, Poll: 20 * time.Millisecond,
		Verify: r.verify, DiscoverEvery: time.Hour, ParkAfter: time.Hour, Streams: poller})
	if afterParkRead != nil {
		projector.SetAfterParkRead(p, func(bucket string) { afterParkRead(p, bucket) })
	}
	p.Start(context.Background())
	done := false
	stop := func() {
		if done {
			return
		}
		done = true
		p.Stop()
		cancel()
		wg.Wait()
		require.NoError(r.t, db.Close())
	}
	r.t.Cleanup(stop)
	return p, db, stop
}

// consumerCreates counts the CONSUMER.CREATE requests of each stream that nc's account sees.
type consumerCreates struct {
	mu sync.Mutex
	n  map[string]int
}

func countConsumerCreates(t *testing.T, nc *nats.Conn) *consumerCreates {
	t.Helper()
	c := &consumerCreates{n: map[string]int{}}
	// $JS.API.CONSUMER.CREATE.<stream>.<consumer>[.<filter>]
	sub, err := nc.Subscribe("$JS.API.CONSUMER.CREATE.*.>", func(m *nats.Msg) {
		c.mu.Lock()
		c.n[tokenAt(m.Subject, 4)]++
		c.mu.Unlock()
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	require.NoError(t, nc.Flush())
	return c
}

func (c *consumerCreates) of(bucket string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n["KV_"+bucket]
}

// tokenAt is the i-th token of a subject.
func tokenAt(subject string, i int) string {
	for ; i > 0; i-- {
		for j := 0; j < len(subject); j++ {
			if subject[j] == '.' {
				subject = subject[j+1:]
				break
			}
		}
	}
	for j := 0; j < len(subject); j++ {
		if subject[j] == '.' {
			return subject[:j]
		}
	}
	return subject
}

// runToSynced starts a projector on the state dir, waits until it has read each bucket to seq and
// says it synced, and stops it.
func (r restartable) runToSynced(buckets []string, seq uint64) {
	r.t.Helper()
	_, db, stop := r.start(nil)
	for _, b := range buckets {
		waitApplied(r.t, db, b, seq)
	}
	stop()
}

// TestProjector_StartsParkedWhenUnchanged: restarted, a composed-<node> bucket whose stream the first
// listing shows as the store left it starts parked: no consumer is created for it, nor its stream
// asked for, and it says it is synced. A bucket written, purged, recreated or deleted while the
// projector was down is read at start as before; the one started parked reads what is written to it
// at the next listing.
func TestProjector_StartsParkedWhenUnchanged(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	nc, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	composedBuckets(t, js, 6)
	const (
		unchanged = "composed-n0000"
		written   = "composed-n0001"
		purged    = "composed-n0002"
		recreated = "composed-n0003"
		deleted   = "composed-n0004"
		later     = "composed-n0005" // unchanged while down, recreated once started parked
	)
	all := []string{unchanged, written, purged, recreated, deleted, later}
	r := restartable{t: t, url: ns.ClientURL(), dir: t.TempDir(), every: time.Hour, verify: 300 * time.Millisecond}
	r.runToSynced(all, 1)

	// While the projector is down.
	kv, err := js.KeyValue(ctx, written)
	require.NoError(t, err)
	_, err = kv.Put(ctx, "web.2", []byte{0x80})
	require.NoError(t, err)
	s, err := js.Stream(ctx, "KV_"+purged)
	require.NoError(t, err)
	require.NoError(t, s.Purge(ctx)) // ends where the checkpoint is, with nothing below it
	require.NoError(t, js.DeleteKeyValue(ctx, recreated))
	kvr, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: recreated, History: 1, Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	_, err = kvr.Put(ctx, "other.7", []byte{0x80}) // ends at the checkpoint's sequence, another stream
	require.NoError(t, err)
	require.NoError(t, js.DeleteKeyValue(ctx, deleted))

	creates := countConsumerCreates(t, nc)
	infos := countRequests(t, nc, "$JS.API.STREAM.INFO.KV_"+unchanged)
	p, db, _ := r.start(nil)
	waitApplied(t, db, written, 2)
	forgotten(t, db, purged)
	forgotten(t, db, recreated)
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		v, err := db.View()
		if err != nil {
			return err
		}
		defer v.Close()
		if _, live, err := v.KeyAt(recreated, "other.7", math.MaxUint64); err != nil || !live {
			return fmt.Errorf("the recreated stream's key is not read (%v)", err)
		}
		if p.Tails(deleted) || slices.Contains(db.Buckets(), deleted) {
			return fmt.Errorf("%s not forgotten yet", deleted)
		}
		return nil
	})
	require.True(t, p.Parked(unchanged), "%s started parked", unchanged)
	require.True(t, p.Parked(later), "%s started parked", later)
	seq, synced := db.Applied(unchanged)
	require.Equal(t, uint64(1), seq)
	require.True(t, synced, "a bucket started parked has caught up with its stream")
	require.Zero(t, creates.of(unchanged), "no consumer for the bucket the listing shows unchanged")
	require.Zero(t, infos.Load(), "nor a STREAM.INFO")
	require.Equal(t, 1, creates.of(written), "one consumer for the bucket written while down")
	for _, b := range []string{purged, recreated} {
		require.NotZero(t, creates.of(b), "%s read at start", b)
	}
	require.False(t, p.Parked(written), "parked only after ParkAfter, an hour here")

	// Written to now: read at the next listing, with a consumer of its own.
	kv0, err := js.KeyValue(ctx, unchanged)
	require.NoError(t, err)
	_, err = kv0.Put(ctx, "web.2", []byte{0x80})
	require.NoError(t, err)
	projector.RefreshListing(p)
	waitApplied(t, db, unchanged, 2)
	require.Equal(t, 1, creates.of(unchanged))

	// Recreated with as many messages: the next listing's creation time wakes it, and it is read again.
	require.NoError(t, js.DeleteKeyValue(ctx, later))
	kvl, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: later, History: 1, Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	_, err = kvl.Put(ctx, "other.8", []byte{0x80})
	require.NoError(t, err)
	projector.RefreshListing(p)
	forgotten(t, db, later)
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		v, err := db.View()
		if err != nil {
			return err
		}
		defer v.Close()
		if _, live, err := v.KeyAt(later, "other.8", math.MaxUint64); err != nil || !live {
			return fmt.Errorf("the recreated stream's key is not read (%v)", err)
		}
		if _, live, err := v.KeyAt(later, "web.1", math.MaxUint64); err != nil || live {
			return fmt.Errorf("the old stream's key is still held (%v)", err)
		}
		return nil
	})
}

// TestProjector_StartedParkedWokenByRequest: a bucket started parked reads at once when a request
// wakes it (min_seq), long before the next listing (an hour here); also when the request comes as it
// parks, after it looked at the listing, which showed nothing new.
func TestProjector_StartedParkedWokenByRequest(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	nc, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	composedBuckets(t, js, 2)
	b0, b1 := "composed-n0000", "composed-n0001"
	r := restartable{t: t, url: ns.ClientURL(), dir: t.TempDir(), every: time.Hour, verify: time.Hour}
	r.runToSynced([]string{b0, b1}, 1)
	kv0, err := js.KeyValue(ctx, b0)
	require.NoError(t, err)
	kv1, err := js.KeyValue(ctx, b1)
	require.NoError(t, err)

	creates := countConsumerCreates(t, nc)
	// b1: written and woken as it starts parked, after it read the listing.
	var hooked atomic.Bool
	published := make(chan error, 1)
	p, db, _ := r.start(func(p *projector.Projector, bucket string) {
		if bucket == b1 && !hooked.Swap(true) {
			_, err := kv1.Put(ctx, "web.2", []byte{0x80})
			published <- err
			p.Wake(bucket)
		}
	})
	select {
	case err := <-published:
		require.NoError(t, err)
	case <-time.After(20 * time.Second):
		t.Fatal("the bucket never started parked")
	}
	waitApplied(t, db, b1, 2)

	// b0: started parked, then written and woken.
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if !p.Parked(b0) {
			return fmt.Errorf("%s not parked", b0)
		}
		return nil
	})
	require.Zero(t, creates.of(b0))
	_, err = kv0.Put(ctx, "web.2", []byte{0x80})
	require.NoError(t, err)
	p.Wake(b0)
	waitApplied(t, db, b0, 2)
}

// TestProjector_NoStartParkedWithoutListing: a seat user denied $JS.API.STREAM.LIST never gets a
// listing: every bucket starts with a consumer, as before, and reads what is written.
func TestProjector_NoStartParkedWithoutListing(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServerDeniedStreamList(t)
	nc, js := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("admin", "admin"))
	ctx := context.Background()
	composedBuckets(t, js, 1)
	const b = "composed-n0000"
	dir := t.TempDir()
	for i := range 2 {
		creates := countConsumerCreates(t, nc)
		_, pjs := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("seat", "seat"))
		db, err := store.OpenState(dir, store.Options{})
		require.NoError(t, err)
		p := projector.New(pjs, db, projector.Options{Buckets: []string{}, Composed: true, Poll: 20 * time.Millisecond,
			Verify: 100 * time.Millisecond, ParkAfter: time.Hour})
		p.Start(ctx)
		waitApplied(t, db, b, uint64(1+i))
		natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
			if n := creates.of(b); n != 1 {
				return fmt.Errorf("%d consumers created", n)
			}
			return nil
		})
		require.False(t, p.Parked(b))
		kv, err := js.KeyValue(ctx, b)
		require.NoError(t, err)
		_, err = kv.Put(ctx, "web.2", []byte{0x80})
		require.NoError(t, err)
		waitApplied(t, db, b, uint64(2+i))
		p.Stop()
		require.NoError(t, db.Close())
	}
}

// TestProjector_NoStartParkedWithoutStreamCreation: a checkpoint that does not know which stream it
// was read from (no creation time) cannot tell that stream from one created again with as many
// messages: the bucket tails as before, with a consumer, rather than park on a listing it cannot
// judge.
func TestProjector_NoStartParkedWithoutStreamCreation(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	nc, js := natstest.Connect(t, ns.ClientURL())
	composedBuckets(t, js, 1)
	const b = "composed-n0000"
	r := restartable{t: t, url: ns.ClientURL(), dir: t.TempDir(), every: 100 * time.Millisecond, verify: time.Hour}
	db, err := store.OpenState(r.dir, store.Options{})
	require.NoError(t, err)
	require.NoError(t, db.Apply(b, []provisioner.Message{{Seq: 1, Time: time.Now().UnixNano(), Key: "web.1", Op: provisioner.OpPut, Value: []byte{0x80}}}, 0, true))
	require.Zero(t, db.Checkpoint(b).StreamCreated)
	require.NoError(t, db.Close())
	creates := countConsumerCreates(t, nc)
	p, db, _ := r.start(nil)
	waitApplied(t, db, b, 1)
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if n := creates.of(b); n != 1 {
			return fmt.Errorf("%d consumers created", n)
		}
		return nil
	})
	require.False(t, p.Parked(b))
}

// TestProjector_WokenWhileWaitingForTheFirstListing: a request (Wake) for a bucket that waits to
// start parked makes it read at once, not once the first listing has come: a listing of thousands of
// streams on a loaded cluster takes seconds, one that gets no answer up to two of its intervals, and a
// node engine that published a composition as the seat restarted asks with a wait_ms of its own.
// Before, the bucket kept the wake and read only after that listing (here one that gets no answer,
// given up after its first page is 5 s late): the request waited for it, or timed out.
func TestProjector_WokenWhileWaitingForTheFirstListing(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	composedBuckets(t, js, 1)
	const b = "composed-n0000"
	r := restartable{t: t, url: ns.ClientURL(), dir: t.TempDir(), every: 100 * time.Millisecond, verify: time.Hour}
	r.runToSynced([]string{b}, 1)

	// The listing's requests go to a subject that the test holds and never answers.
	lnc, _ := natstest.Connect(t, ns.ClientURL())
	held, err := lnc.SubscribeSync("held.API.>")
	require.NoError(t, err)
	require.NoError(t, lnc.Flush())
	ljs, err := jetstream.NewWithAPIPrefix(lnc, "held.API")
	require.NoError(t, err)
	poller := streaminfo.New(ljs)
	natstest.RunPoller(t, poller, time.Hour)
	_, pjs := natstest.Connect(t, ns.ClientURL())
	db, err := store.OpenState(r.dir, store.Options{})
	require.NoError(t, err)
	p := startProjector(t, pjs, db, projector.Options{Buckets: []string{}, Composed: true, Poll: 20 * time.Millisecond,
		Verify: time.Hour, DiscoverEvery: time.Hour, ParkAfter: time.Hour, Streams: poller})
	_, err = held.NextMsg(10 * time.Second) // the listing is asked for, and held
	require.NoError(t, err)

	kv, err := js.KeyValue(ctx, b)
	require.NoError(t, err)
	_, err = kv.Put(ctx, "web.2", []byte{0x80})
	require.NoError(t, err)
	p.Wake(b)
	natstest.CheckFor(t, 20*time.Second, 5*time.Millisecond, func() error {
		if seq, _ := db.Applied(b); seq == 2 {
			return nil
		}
		if poller.Failures() > 0 {
			t.Fatalf("%s read only once the first listing was given up", b)
		}
		return fmt.Errorf("%s not read yet", b)
	})
}

// TestProjector_WakeBeforeTheBucketRuns: a Wake that comes after Start and before the bucket's own
// goroutine has run is kept. The seat answers the verb as soon as Start returns, and with thousands of
// buckets their goroutines run a while after it; a node engine's min_seq asked then, for a composition
// written after the listing read its stream, used to be lost: the bucket started parked on that
// listing and read it only at the next one.
func TestProjector_WakeBeforeTheBucketRuns(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	composedBuckets(t, js, 1)
	const b = "composed-n0000"
	r := restartable{t: t, url: ns.ClientURL(), dir: t.TempDir(), every: time.Hour, verify: time.Hour}
	r.runToSynced([]string{b}, 1)

	_, pjs := natstest.Connect(t, ns.ClientURL())
	poller := streaminfo.New(pjs)
	natstest.RunPoller(t, poller, time.Hour)
	db, err := store.OpenState(r.dir, store.Options{})
	require.NoError(t, err)
	p := projector.New(pjs, db, projector.Options{Buckets: []string{}, Composed: true, Poll: 20 * time.Millisecond,
		Verify: time.Hour, DiscoverEvery: time.Hour, ParkAfter: time.Hour, Streams: poller})
	release := make(chan struct{})
	projector.SetBeforeRun(p, func(bucket string) {
		if bucket == b {
			<-release
		}
	})
	p.Start(ctx)
	released := false
	t.Cleanup(func() {
		if !released {
			close(release)
		}
		p.Stop()
		require.NoError(t, db.Close())
	})
	natstest.CheckFor(t, 20*time.Second, 5*time.Millisecond, func() error {
		if !p.Discovered() {
			return fmt.Errorf("the streams are not listed yet")
		}
		return nil
	})
	// Written after the listing read the stream, asked for before the bucket's goroutine runs.
	kv, err := js.KeyValue(ctx, b)
	require.NoError(t, err)
	_, err = kv.Put(ctx, "web.2", []byte{0x80})
	require.NoError(t, err)
	p.Wake(b)
	released = true
	close(release)
	waitApplied(t, db, b, 2)
}

// TestProjector_StartsParkedWhenItsRemovedEndIsUnchanged: a bucket whose stream's last sequence is no
// message (purged here) parked once read, and restarted with the stream as it was, starts parked like
// any unchanged bucket: no consumer is created for it. Before, its checkpoint, short of that last
// sequence for good, took it for a stream written while the projector was down, and every start set a
// consumer up for it again.
func TestProjector_StartsParkedWhenItsRemovedEndIsUnchanged(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	nc, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	bucket, kv, stream := composedEndingOnAPurge(t, js)

	info, err := stream.Info(ctx)
	require.NoError(t, err)

	r := restartable{t: t, url: ns.ClientURL(), dir: t.TempDir(), every: time.Hour, verify: time.Hour}
	r.runToSynced([]string{bucket}, 1)
	// What parking it told the store (TestProjector_QuietStreamWhoseLastMessageIsGoneParksOnceRead):
	// its stream ends at 2, removed unread.
	db, err := store.OpenState(r.dir, store.Options{})
	require.NoError(t, err)
	require.NoError(t, db.TailRemoved(bucket, info.State.LastSeq, info.Created.UnixNano()))
	end, ok := db.RemovedEnd(bucket)
	require.True(t, ok)
	require.Equal(t, uint64(2), end)
	require.NoError(t, db.Close())

	creates := countConsumerCreates(t, nc)
	p, db, _ := r.start(nil)
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if !p.Parked(bucket) {
			return fmt.Errorf("%s not parked", bucket)
		}
		return nil
	})
	waitApplied(t, db, bucket, 1)
	require.Zero(t, creates.of(bucket), "a consumer created for the bucket")

	// Written to, it is woken by the listing and reads the write.
	_, err = kv.Put(ctx, "web.3", []byte{0x80})
	require.NoError(t, err)
	projector.RefreshListing(p)
	waitApplied(t, db, bucket, 3)
}

// TestProjector_StartsParkedAfterASkipThenARemovedEnd: a request's min_seq skipped a first message
// removed unread (the checkpoint moved over it, its gap left open: skipRemoved), and a parking later
// recorded a second removed end past the checkpoint (removedUnread, by hand here as in the test
// above). Restarted with the stream as it was, the bucket starts parked. Before, the open gap, which
// starts below the checkpoint + 1 since the skip, hid the removed end (store.DB.RemovedEnd), and every
// start set a consumer up for the bucket again.
func TestProjector_StartsParkedAfterASkipThenARemovedEnd(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	nc, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	composedBuckets(t, js, 1)
	const bucket = "composed-n0000"
	kv, err := js.KeyValue(ctx, bucket)
	require.NoError(t, err)
	stream, err := js.Stream(ctx, "KV_"+bucket)
	require.NoError(t, err)
	removeUnread := func(key string) uint64 {
		seq, err := kv.Put(ctx, key, []byte{0x80})
		require.NoError(t, err)
		require.NoError(t, stream.Purge(ctx, jetstream.WithPurgeSubject("$KV."+bucket+"."+key)))
		return seq
	}

	first := removeUnread("web.2")
	r := restartable{t: t, url: ns.ClientURL(), dir: t.TempDir(), every: time.Hour, verify: time.Hour}
	p, db, stop := r.start(nil)
	waitApplied(t, db, bucket, 1)
	p.Wake(bucket) // a request for min_seq 2
	waitApplied(t, db, bucket, first)
	stop()

	second := removeUnread("web.3")
	info, err := stream.Info(ctx)
	require.NoError(t, err)
	require.Equal(t, second, info.State.LastSeq)
	db, err = store.OpenState(r.dir, store.Options{})
	require.NoError(t, err)
	require.NoError(t, db.TailRemoved(bucket, info.State.LastSeq, info.Created.UnixNano()))
	v, err := db.View()
	require.NoError(t, err)
	m, err := v.HistoryMarks(bucket)
	v.Close()
	require.NoError(t, err)
	require.Equal(t, []store.Gap{{From: 2, OpenedAt: second + 1}}, m.Gaps, "one gap, from the first removal on")
	require.NoError(t, db.Close())

	creates := countConsumerCreates(t, nc)
	p, db, _ = r.start(nil)
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if !p.Parked(bucket) {
			return fmt.Errorf("%s not parked", bucket)
		}
		return nil
	})
	waitApplied(t, db, bucket, first)
	require.Zero(t, creates.of(bucket), "a consumer created for the bucket")

	// Written to, it is woken by the listing and reads the write.
	next, err := kv.Put(ctx, "web.4", []byte{0x80})
	require.NoError(t, err)
	projector.RefreshListing(p)
	waitApplied(t, db, bucket, next)
}
