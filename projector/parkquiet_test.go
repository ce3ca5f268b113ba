package projector_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/internal/streaminfo"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// quietFor is how long the tests below take a stream's last message to be older than the server
// says (projector.SetAged): far past their ParkAfter of an hour.
const quietFor = 2 * time.Hour

// parkingQuiet runs a projector of the composed-<node> buckets only, parking after an hour, on a
// listing every 100 ms read through poller's JetStream (nil: pjs), with the streams of the buckets
// in aged taken for quiet for quietFor; setup sets hooks before Start. Its debug log goes to the
// returned buffer. It stops as the test ends.
func parkingQuiet(t *testing.T, pjs, listing jetstream.JetStream, aged []string, setup func(p *projector.Projector)) (*projector.Projector, *store.DB, *natstest.LogBuffer) {
	t.Helper()
	return parkingQuietEvery(t, pjs, listing, 100*time.Millisecond, aged, setup)
}

// parkingQuietEvery is parkingQuiet with the listing every `every`.
func parkingQuietEvery(t *testing.T, pjs, listing jetstream.JetStream, every time.Duration, aged []string, setup func(p *projector.Projector)) (*projector.Projector, *store.DB, *natstest.LogBuffer) {
	t.Helper()
	if listing == nil {
		listing = pjs
	}
	poller := streaminfo.New(listing)
	natstest.RunPoller(t, poller, every)
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	logs := &natstest.LogBuffer{}
	p := projector.New(pjs, db, projector.Options{Buckets: []string{}, Composed: true, Poll: 20 * time.Millisecond,
		Verify: time.Hour, DiscoverEvery: time.Hour, ParkAfter: time.Hour, Streams: poller,
		Logger: slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	projector.SetAged(p, func(bucket string) time.Duration {
		for _, b := range aged {
			if b == bucket {
				return quietFor
			}
		}
		return 0
	})
	if setup != nil {
		setup(p)
	}
	p.Start(context.Background())
	t.Cleanup(func() {
		p.Stop()
		db.Close()
	})
	return p, db, logs
}

// stillTailing asserts that a bucket is not parked and keeps its one consumer while its tail runs a
// good many Poll ticks (20 ms each): a bucket that could park would have by then.
func stillTailing(t *testing.T, p *projector.Projector, js jetstream.JetStream, buckets ...string) {
	t.Helper()
	time.Sleep(300 * time.Millisecond)
	for _, b := range buckets {
		require.False(t, p.Parked(b), "%s parked", b)
		require.Equal(t, 1, consumers(t, js, b), "%s keeps its consumer", b)
	}
}

// TestProjector_QuietStreamParksOnceRead: on a fresh store (a first start, a rebuild), a bucket whose
// stream has taken no message for longer than ParkAfter parks as soon as it has read it, with one
// consumer created, rather than keep that consumer idle for ParkAfter more (an hour here). A bucket
// written just now keeps its consumer, and so does a quiet one written as its tail starts: the write
// read makes it a bucket written just now.
func TestProjector_QuietStreamParksOnceRead(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	nc, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	composedBuckets(t, js, 3)
	const quiet, fresh, written = "composed-n0000", "composed-n0001", "composed-n0002"
	kv, err := js.KeyValue(ctx, written)
	require.NoError(t, err)
	creates := countConsumerCreates(t, nc)
	_, pjs := natstest.Connect(t, ns.ClientURL())
	var once sync.Once
	// The listing every hour: the one at start is all the parking needs, and at 100 ms a stall of the
	// test process of 200 ms looked like a listing that stopped, which woke the parked bucket for a
	// second consumer (2, not 1, under -race on a loaded machine).
	p, db, _ := parkingQuietEvery(t, pjs, nil, time.Hour, []string{quiet, written}, func(p *projector.Projector) {
		// Called as a tail has its stream's info, before its consumer is created: a write now is read by
		// the consumer, past that info.
		projector.SetAged(p, func(bucket string) time.Duration {
			switch bucket {
			case quiet:
				return quietFor
			case written:
				once.Do(func() {
					if _, err := kv.Put(ctx, "web.2", []byte{0x80}); err != nil {
						t.Error(err)
					}
				})
				return quietFor
			}
			return 0
		})
	})
	waitApplied(t, db, quiet, 1)
	waitParked(t, p, js, quiet)
	require.Equal(t, 1, creates.of(quiet))

	waitApplied(t, db, fresh, 1)
	waitApplied(t, db, written, 2)
	stillTailing(t, p, js, fresh, written)
}

// TestProjector_WriteRacingAQuietParking: a quiet bucket parks as soon as it has read its stream, and
// a message written meanwhile is read: one written after the tail had nothing more to read and
// before the parking read its stream's info is in that info, and the bucket tails again; one written
// after that info was read is reported by the next listing, which wakes the bucket.
func TestProjector_WriteRacingAQuietParking(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	composedBuckets(t, js, 2)
	const before, after = "composed-n0000", "composed-n0001"
	put := func(bucket, key string) { // on the projector's goroutine
		kv, err := js.KeyValue(ctx, bucket)
		if err == nil {
			_, err = kv.Put(ctx, key, []byte{0x80})
		}
		if err != nil {
			t.Error(err)
		}
	}
	var onceBefore, onceAfter sync.Once
	var parkedBefore, parkedAfter atomic.Bool
	_, pjs := natstest.Connect(t, ns.ClientURL())
	p, db, _ := parkingQuiet(t, pjs, nil, []string{before, after}, func(p *projector.Projector) {
		projector.SetBeforeParkRead(p, func(bucket string) {
			if bucket == before {
				onceBefore.Do(func() {
					parkedBefore.Store(true)
					put(before, "web.2")
				})
			}
		})
		projector.SetAfterParkRead(p, func(bucket string) {
			if bucket == after {
				onceAfter.Do(func() {
					parkedAfter.Store(true)
					put(after, "web.2")
				})
			}
		})
	})
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if !parkedBefore.Load() || !parkedAfter.Load() {
			return errors.New("the quiet buckets did not park once read")
		}
		return nil
	})
	waitApplied(t, db, before, 2)
	waitApplied(t, db, after, 2)
	// Woken by the listing, the bucket written after the info it parked on finds its stream quiet
	// (for the test) and parks again once it has read it.
	waitParked(t, p, js, after)
}

// failingInfo is a JetStream whose STREAM.INFO requests fail while fail is set, as they do on a
// JetStream API too loaded to answer within the request's bound; its listings answer.
type failingInfo struct {
	jetstream.JetStream
	fail  *atomic.Bool
	asked *atomic.Int64
}

func (j failingInfo) Stream(ctx context.Context, name string) (jetstream.Stream, error) {
	if j.fail.Load() {
		j.asked.Add(1)
		return nil, fmt.Errorf("stream %s: %w", name, context.DeadlineExceeded)
	}
	return j.JetStream.Stream(ctx, name)
}

// TestProjector_ParkingWhoseInfoFails: a parking bucket whose own STREAM.INFO fails tails again with
// a new consumer, and says why; and the tail after it waits ParkAfter before it parks again, however
// quiet its stream: a parking that keeps failing costs a consumer per ParkAfter, not one per Poll.
func TestProjector_ParkingWhoseInfoFails(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	nc, js := natstest.Connect(t, ns.ClientURL())
	composedBuckets(t, js, 1)
	const b = "composed-n0000"
	creates := countConsumerCreates(t, nc)
	_, pjs := natstest.Connect(t, ns.ClientURL())
	var fail atomic.Bool
	var asked atomic.Int64
	fail.Store(true)
	// The parking reads its stream's info through the listing's Poller; the tail asks its own.
	p, db, logs := parkingQuiet(t, pjs, failingInfo{JetStream: pjs, fail: &fail, asked: &asked}, []string{b}, nil)
	waitApplied(t, db, b, 1)
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if creates.of(b) < 2 {
			return fmt.Errorf("%d consumers created, %d infos failed", creates.of(b), asked.Load())
		}
		return nil
	})
	stillTailing(t, p, js, b)
	require.Equal(t, 2, creates.of(b), "one consumer again, not one per Poll")
	require.Equal(t, int64(1), asked.Load(), "one parking tried")
	require.True(t, strings.Contains(logs.String(), "not parked: its stream's info could not be read"), "logs:\n%s", logs.String())
}

// TestProjector_RequestKeepsAQuietBucketReading: a request waiting for its min_seq wakes a parked
// bucket (Wake), or finds it reading; either way the bucket must read the write the request waits
// for when it comes within the request's wait, not park again on its stream's quiet as soon as it
// has read what there is and leave that write to a listing (an hour away here: the request would be
// answered 504). A bucket a request asked for waits ParkAfter after the request before it parks, as
// a bucket woken by one always did before quiet streams parked once read.
func TestProjector_RequestKeepsAQuietBucketReading(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		parked bool // the request comes while the bucket is parked; else while its first tail reads
	}{{"woken from parked", true}, {"asked while reading", false}} {
		t.Run(tc.name, func(t *testing.T) {
			ns := natstest.RunServer(t)
			nc, js := natstest.Connect(t, ns.ClientURL())
			ctx := context.Background()
			composedBuckets(t, js, 1)
			const b = "composed-n0000"
			kv, err := js.KeyValue(ctx, b)
			require.NoError(t, err)
			creates := countConsumerCreates(t, nc)
			var once sync.Once
			put := func() { // the write the request waits for (min_seq 2)
				once.Do(func() {
					if _, err := kv.Put(ctx, "web.2", []byte{0x80}); err != nil {
						t.Error(err)
					}
				})
			}
			var parkings atomic.Int64
			_, pjs := natstest.Connect(t, ns.ClientURL())
			var p *projector.Projector
			p, db, _ := parkingQuietEvery(t, pjs, nil, time.Hour, []string{b}, func(pp *projector.Projector) {
				projector.SetAfterParkRead(pp, func(bucket string) {
					// A parking after the request: the write comes after the info it parks on, so
					// only the listing, an hour away, would wake it.
					if n := parkings.Add(1); (tc.parked && n == 2) || (!tc.parked && n == 1) {
						put()
					}
				})
				if !tc.parked {
					projector.SetBeforePending(pp, func(bucket string, seq, pending uint64) {
						pp.Wake(bucket) // a request asks for the bucket as its first tail reads
					})
				}
			})
			if tc.parked {
				waitApplied(t, db, b, 1)
				waitParked(t, p, js, b)
				p.Wake(b) // a request waits for min_seq 2
				natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
					if n := creates.of(b); n != 2 {
						return fmt.Errorf("%d consumers created", n)
					}
					return nil
				})
			} else {
				waitApplied(t, db, b, 1)
			}
			stillTailing(t, p, js, b)
			put()
			waitApplied(t, db, b, 2)
		})
	}
}

// TestProjector_QuietStreamWhoseLastMessageIsGoneParksOnceRead: a quiet stream whose last sequence is
// no message any more (purged here; a TTL or a rollup leaves the same) parks as soon as its bucket
// has read what is left, with one consumer created, like any quiet stream. Before, the early park
// waited for the checkpoint to reach the info's last sequence, which no message carries: the bucket
// kept its consumer for ParkAfter (an hour here), then tailed again once more for ParkAfter, as if a
// message had come after it read the end.
func TestProjector_QuietStreamWhoseLastMessageIsGoneParksOnceRead(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	nc, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	bucket, _, stream := composedEndingOnAPurge(t, js)
	info, err := stream.Info(ctx)
	require.NoError(t, err)
	require.Equal(t, uint64(2), info.State.LastSeq)
	require.Equal(t, uint64(1), info.State.Msgs)

	creates := countConsumerCreates(t, nc)
	_, pjs := natstest.Connect(t, ns.ClientURL())
	// The listing every hour, as TestProjector_QuietStreamParksOnceRead's: the count of consumers must
	// not take a stall for a stopped listing.
	p, db, _ := parkingQuietEvery(t, pjs, nil, time.Hour, []string{bucket}, nil)
	waitApplied(t, db, bucket, 1)
	waitParked(t, p, js, bucket)
	require.Equal(t, 1, creates.of(bucket), "one consumer created for the bucket")
}

// TestProjector_WakeSkipsMessagesRemovedUnread: a request waiting for a sequence of a parked bucket
// whose stream's last messages were removed before they were read (purged here; a TTL without a
// marker leaves the same) wakes it (Wake), and the tail, finding nothing left up to the stream's last
// sequence, moves the checkpoint there (docs/decisions.md, "min_seq of a message removed unread"), so
// that the request is answered. Before, the checkpoint stayed at the last message read for good.
func TestProjector_WakeSkipsMessagesRemovedUnread(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	bucket, kv, _ := composedEndingOnAPurge(t, js)

	_, pjs := natstest.Connect(t, ns.ClientURL())
	p, db, _ := parkingQuiet(t, pjs, nil, []string{bucket}, nil)
	waitApplied(t, db, bucket, 1)
	waitParked(t, p, js, bucket)

	p.Wake(bucket)
	waitApplied(t, db, bucket, 2)
	v, err := db.View()
	require.NoError(t, err)
	m, err := v.HistoryMarks(bucket)
	v.Close()
	require.NoError(t, err)
	require.ErrorIs(t, m.Check(2), store.ErrGap, "the removed message's point is not rebuilt")

	// The next write is read as any other.
	_, err = kv.Put(ctx, "web.3", []byte{0x80})
	require.NoError(t, err)
	p.Wake(bucket)
	waitApplied(t, db, bucket, 3)
}

// oneComposedOfTwo makes one composed-<node> bucket, composed-n0000, of two messages: web.1 at 1
// (composedBuckets) and web.2 at 2.
func oneComposedOfTwo(t *testing.T, js jetstream.JetStream) jetstream.KeyValue {
	t.Helper()
	ctx := context.Background()
	composedBuckets(t, js, 1)
	kv, err := js.KeyValue(ctx, "composed-n0000")
	require.NoError(t, err)
	_, err = kv.Put(ctx, "web.2", []byte{0x80})
	require.NoError(t, err)
	return kv
}

// composedEndingOnAPurge makes one composed-<node> bucket whose stream's last sequence, 2, is no
// message: web.1 at 1 (composedBuckets), web.2 at 2, its subject then purged (a stream purge, no
// marker; a TTL without a marker or a rollup leaves the same).
func composedEndingOnAPurge(t *testing.T, js jetstream.JetStream) (string, jetstream.KeyValue, jetstream.Stream) {
	t.Helper()
	ctx := context.Background()
	const bucket = "composed-n0000"
	kv := oneComposedOfTwo(t, js)
	stream, err := js.Stream(ctx, "KV_"+bucket)
	require.NoError(t, err)
	require.NoError(t, stream.Purge(ctx, jetstream.WithPurgeSubject("$KV."+bucket+".web.2")))
	return bucket, kv, stream
}
