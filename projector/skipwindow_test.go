package projector_test

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
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// pauseTail pauses the one consumer a bucket's stream has (its tail's) for an hour: the server
// delivers it nothing more, so that a message written meanwhile and removed is removed unread, as it
// is when a removal comes before the server delivered the message (a put and its purge in a row).
func pauseTail(t *testing.T, js jetstream.JetStream, bucket string) string {
	t.Helper()
	ctx := context.Background()
	stream, err := js.Stream(ctx, provisioner.StreamName(bucket))
	require.NoError(t, err)
	var names []string
	for name := range stream.ConsumerNames(ctx).Name() {
		names = append(names, name)
	}
	require.Len(t, names, 1, "the tail's consumer")
	_, err = js.PauseConsumer(ctx, provisioner.StreamName(bucket), names[0], time.Now().Add(time.Hour))
	require.NoError(t, err)
	return names[0]
}

// putAndRemove puts a key of a bucket and purges its subject from the stream (no marker left), and
// returns the put's sequence.
func putAndRemove(t *testing.T, js jetstream.JetStream, bucket, key string) uint64 {
	t.Helper()
	ctx := context.Background()
	kv, err := js.KeyValue(ctx, bucket)
	require.NoError(t, err)
	seq, err := kv.Put(ctx, key, []byte{0x80})
	require.NoError(t, err)
	stream, err := js.Stream(ctx, provisioner.StreamName(bucket))
	require.NoError(t, err)
	require.NoError(t, stream.Purge(ctx, jetstream.WithPurgeSubject(provisioner.SubjectPrefix(bucket)+key)))
	return seq
}

// waitReached waits until a bucket's projection has applied seq (or past it), synced or not.
func waitReached(t *testing.T, db *store.DB, bucket string, seq uint64) {
	t.Helper()
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if have, _ := db.Applied(bucket); have < seq {
			return fmt.Errorf("%s: applied %d, want %d", bucket, have, seq)
		}
		return nil
	})
}

// TestProjector_SkipOutlivesTheTailARequestWokeIt: CONTRACT section 3, min_seq. A request waits on a
// bucket (Wake) for a write its tail has not read; the tail fails (its consumer deleted: a NATS
// restart, an operator) and the write is removed (its subject purged) before the next tail's consumer
// exists. The next tail has nothing to read, and the stream holds nothing up to min_seq: the request
// is reached (skipRemoved), as it would have been on the tail it woke. Before, the skip's window
// lived and died with the tail that took the request's Wake: the next tail never looked, and the
// request waited its whole wait_ms for a 504.
func TestProjector_SkipOutlivesTheTailARequestWokeIt(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServerSeatDenied(t)
	ctx := context.Background()
	_, js := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("admin", "admin"))
	const bucket = provisioner.BucketApplied
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: bucket})
	require.NoError(t, err)
	first, err := kv.Put(ctx, "n1.a", []byte{0x80})
	require.NoError(t, err)

	// The seat's user, whose requests a denial drops unanswered: a short timeout fails them soon.
	snc, _ := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("seat", "seat"))
	pjs, err := jetstream.New(snc, jetstream.WithDefaultTimeout(time.Second))
	require.NoError(t, err)
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, db.Close()) })
	failed := make(chan error, 64)
	p := projector.New(pjs, db, projector.Options{Buckets: []string{bucket}, Poll: 20 * time.Millisecond, Verify: time.Hour,
		OnTailError: func(_ string, err error) {
			select {
			case failed <- err:
			default:
			}
		}})
	p.Start(ctx)
	t.Cleanup(p.Stop)
	waitApplied(t, db, bucket, first)

	// The tail's consumer delivers nothing more; a write comes, and a request waits for it. The tail
	// takes the request: it asks the stream for the first message past its checkpoint (the write, still
	// held).
	name := pauseTail(t, js, bucket)
	write, err := kv.Put(ctx, "n1.b", []byte{0x80})
	require.NoError(t, err)
	var gets atomic.Int64
	sub, err := js.Conn().Subscribe("$JS.API.STREAM.MSG.GET."+provisioner.StreamName(bucket), func(*nats.Msg) { gets.Add(1) })
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	require.NoError(t, js.Conn().Flush())
	p.Wake(bucket)
	natstest.CheckFor(t, 20*time.Second, 10*time.Millisecond, func() error {
		if gets.Load() == 0 {
			return fmt.Errorf("the tail has not asked the stream for its next message")
		}
		return nil
	})

	// The tail fails, and no new one can start (consumer creations denied) until the write is gone.
	natstest.DenySeat(t, ns, "$JS.API.CONSUMER.CREATE.>")
	require.NoError(t, js.DeleteConsumer(ctx, provisioner.StreamName(bucket), name))
	natstest.Receive(t, failed, 20*time.Second, "the tail's failure")
	stream, err := js.Stream(ctx, provisioner.StreamName(bucket))
	require.NoError(t, err)
	require.NoError(t, stream.Purge(ctx, jetstream.WithPurgeSubject(provisioner.SubjectPrefix(bucket)+"n1.b")))
	natstest.DenySeat(t, ns)

	waitReached(t, db, bucket, write)
}

// TestProjector_SkipsASecondRemovalBeforeAnyRead: CONTRACT section 3, min_seq. A tail whose consumer
// had nothing to deliver at its creation (the messages past the checkpoint removed while the
// projector was down) skips them for a request (skipRemoved); a second write is then removed before
// the server delivered it, and a request waits for it. The stream holds nothing up to it: it is
// reached. Before, a tail that had skipped but read nothing counted as not caught up (no message
// read with nothing pending after it, and its checkpoint no longer the one it started from), and no
// later request was ever skipped on it: 504 after the whole wait_ms.
func TestProjector_SkipsASecondRemovalBeforeAnyRead(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	ctx := context.Background()
	_, js := natstest.Connect(t, ns.ClientURL())
	const bucket = provisioner.BucketApplied
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: bucket})
	require.NoError(t, err)
	first, err := kv.Put(ctx, "n1.a", []byte{0x80})
	require.NoError(t, err)
	dir := t.TempDir()
	start := func() (*projector.Projector, *store.DB, func()) {
		_, pjs := natstest.Connect(t, ns.ClientURL())
		db, err := store.Open(dir, store.Options{})
		require.NoError(t, err)
		p := projector.New(pjs, db, projector.Options{Buckets: []string{bucket}, Poll: 20 * time.Millisecond, Verify: time.Hour})
		p.Start(ctx)
		done := false
		stop := func() {
			if !done {
				done = true
				p.Stop()
				require.NoError(t, db.Close())
			}
		}
		t.Cleanup(stop)
		return p, db, stop
	}
	_, db, stop := start()
	waitApplied(t, db, bucket, first)
	stop()

	removed := putAndRemove(t, js, bucket, "n1.b")
	p, db, _ := start()
	natstest.CheckFor(t, 20*time.Second, 10*time.Millisecond, func() error {
		if n := consumers(t, js, bucket); n != 1 {
			return fmt.Errorf("%d consumers", n)
		}
		return nil
	})
	p.Wake(bucket)
	waitReached(t, db, bucket, removed)

	pauseTail(t, js, bucket)
	again := putAndRemove(t, js, bucket, "n1.c")
	p.Wake(bucket)
	waitReached(t, db, bucket, again)
}

// TestProjector_SkipsWhenThePendingMessageWasRemovedUnread: CONTRACT section 3, min_seq. The tail read a
// message whose pending count said one more was to come, and that one was removed before the server
// delivered it (its subject purged). A request waits for it: the stream holds nothing past the
// checkpoint, and it is reached. Before, the tail counted as caught up only once a message said
// nothing was pending after it, which no message ever did: the request waited its whole wait_ms for a
// 504, and so did every request on the bucket until its next write.
func TestProjector_SkipsWhenThePendingMessageWasRemovedUnread(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	ctx := context.Background()
	_, js := natstest.Connect(t, ns.ClientURL())
	const bucket = provisioner.BucketApplied
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: bucket})
	require.NoError(t, err)
	first, err := kv.Put(ctx, "n1.a", []byte{0x80})
	require.NoError(t, err)
	// The projector's connection goes through a proxy that can hold back what the server sends it; it
	// pulls one message at a time, so the server delivers the next only when asked again.
	proxy := natstest.RunProxy(t, ns.Addr().String())
	_, pjs := natstest.Connect(t, proxy.URL())
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, db.Close()) })
	p := projector.New(pjs, db, projector.Options{Buckets: []string{bucket}, Poll: 20 * time.Millisecond, Verify: time.Hour, PullMessages: 1})
	p.Start(ctx)
	t.Cleanup(p.Stop)
	waitApplied(t, db, bucket, first)

	name := pauseTail(t, js, bucket)
	read, err := kv.Put(ctx, "n1.b", []byte{0x80})
	require.NoError(t, err)
	_, err = kv.Put(ctx, "n1.c", []byte{0x80})
	require.NoError(t, err)
	// Delivered with one message pending after it, and held back on its way; the one pending is
	// removed before the projector can pull it.
	proxy.Hold()
	_, err = js.ResumeConsumer(ctx, provisioner.StreamName(bucket), name)
	require.NoError(t, err)
	natstest.CheckFor(t, 20*time.Second, 10*time.Millisecond, func() error {
		ci, err := js.Consumer(ctx, provisioner.StreamName(bucket), name)
		if err != nil {
			return err
		}
		if d := ci.CachedInfo().Delivered.Stream; d != read {
			return fmt.Errorf("delivered up to %d", d)
		}
		return nil
	})
	stream, err := js.Stream(ctx, provisioner.StreamName(bucket))
	require.NoError(t, err)
	require.NoError(t, stream.Purge(ctx, jetstream.WithPurgeSubject(provisioner.SubjectPrefix(bucket)+"n1.c")))
	proxy.Release()
	waitReached(t, db, bucket, read)

	removed := lastSeq(t, stream)
	p.Wake(bucket)
	waitReached(t, db, bucket, removed)
}

// lastSeq is a stream's last sequence as its info says now.
func lastSeq(t *testing.T, s jetstream.Stream) uint64 {
	t.Helper()
	info, err := s.Info(context.Background())
	require.NoError(t, err)
	return info.State.LastSeq
}
