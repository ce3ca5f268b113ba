package projector_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// TestProjector_DeletedStreamIsConfirmedThenForgotten: a composed-<node> bucket whose stream stays
// deleted is forgotten (the store no longer holds it, its consumer ends, no reset asks for a
// rebuild). One whose stream is found missing once and then found again before a second check
// Options.Verify later is not forgotten as deleted: a single "not found" proves nothing. A transient
// "not found" of the same stream cannot be produced on demand with a real server (a restarting server
// answers no request at all), so the stream is deleted and created again between the checks: the check
// then finds the stream recreated, and the bucket is forgotten and read again from the new stream's
// first message, by the same consumer goroutine, with no reset either.
func TestProjector_DeletedStreamIsConfirmedThenForgotten(t *testing.T) {
	t.Parallel()
	const verify = 800 * time.Millisecond
	ns := natstest.RunServer(t)
	nc, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	composedBuckets(t, js, 2)
	b0, b1 := "composed-n0000", "composed-n0001"
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	resets := make(chan error, 4)
	_, pjs := natstest.Connect(t, ns.ClientURL())
	p := projector.New(pjs, db, projector.Options{Buckets: []string{}, Composed: true, Poll: 50 * time.Millisecond,
		Verify: verify, DiscoverEvery: time.Hour, OnReset: func(bucket string, reason error) {
			resets <- fmt.Errorf("%s: %w", bucket, reason)
		}})
	p.Start(ctx)
	t.Cleanup(func() {
		p.Stop()
		db.Close()
	})
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		for _, b := range []string{b0, b1} {
			if seq, synced := db.Applied(b); seq == 0 || !synced {
				return fmt.Errorf("%s: applied %d, synced %v", b, seq, synced)
			}
		}
		return nil
	})

	// Deleted for good: forgotten, without a reset.
	require.NoError(t, js.DeleteKeyValue(ctx, b1))
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if p.Tails(b1) || slices.Contains(db.Buckets(), b1) {
			return fmt.Errorf("%s not forgotten yet", b1)
		}
		return nil
	})
	select {
	case err := <-resets:
		t.Fatalf("a deleted composed bucket asked for a rebuild: %v", err)
	default:
	}
	require.True(t, p.Tails(b0))

	// Found missing once, then found again: kept.
	infos := countRequests(t, nc, "$JS.API.STREAM.INFO.KV_"+b0)
	require.NoError(t, js.DeleteKeyValue(ctx, b0))
	infos.Store(0)
	natstest.CheckFor(t, 20*time.Second, 5*time.Millisecond, func() error {
		if infos.Load() == 0 {
			return fmt.Errorf("the stream of %s not asked for since its delete", b0)
		}
		return nil
	})
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: b0, History: 1, Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	_, err = kv.Put(ctx, "web.2", []byte{0x80})
	require.NoError(t, err)
	info, err := js.Stream(ctx, "KV_"+b0)
	require.NoError(t, err)
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if cp := db.Checkpoint(b0); cp.Applied != 1 || cp.StreamCreated != info.CachedInfo().Created.UnixNano() {
			return fmt.Errorf("%s not read again from the recreated stream: %+v", b0, cp)
		}
		return nil
	})
	v, err := db.View()
	require.NoError(t, err)
	_, found, err := v.ForgottenAt(b0)
	v.Close()
	require.NoError(t, err)
	require.True(t, found, "the old stream's history is forgotten, with its mark")
	require.True(t, p.Tails(b0), "still tailed")
	require.Equal(t, []string{b0}, p.Buckets(), "tailed once; the deleted one not at all")
	select {
	case err := <-resets:
		t.Fatalf("a recreated composed bucket asked for a rebuild: %v", err)
	default:
	}
	// Still followed: a later message is read.
	_, err = kv.Put(ctx, "web.3", []byte{0x80})
	require.NoError(t, err)
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if seq, _ := db.Applied(b0); seq != 2 {
			return fmt.Errorf("%s: applied %d, want 2", b0, seq)
		}
		return nil
	})

	// Deleted for good now: forgotten, and no longer tailed. The advisory of the creation it was read
	// again after is no sign of a creation after this deletion.
	require.NoError(t, js.DeleteKeyValue(ctx, b0))
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if p.Tails(b0) || slices.Contains(db.Buckets(), b0) {
			return fmt.Errorf("%s not forgotten yet (tailed %v)", b0, p.Tails(b0))
		}
		return nil
	})
}

// TestProjector_CreatedAgainAsItIsForgotten: a composed-<node> bucket whose stream is created again in
// the instant its forgetting commits (after the check that confirmed the deletion) is read again at
// once, from the new stream's first message, not left untailed until discover's next listing (an hour
// here). Its stream-created advisory came while the bucket was still tailed, so discover's Add did
// nothing with it; without advisories (an account that may not subscribe to them) there is none at
// all. The test hook recreates the stream at that very point.
func TestProjector_CreatedAgainAsItIsForgotten(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		run  func(testing.TB) *server.Server
	}{
		{"advisories", natstest.RunServer},
		{"no advisories", natstest.RunServerSeatNoAdvisories},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ns := tc.run(t)
			admin := []nats.Option{nats.UserInfo("admin", "admin")}
			seat := []nats.Option{nats.UserInfo("seat", "seat"), nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {})}
			if tc.name == "advisories" {
				admin, seat = nil, nil
			}
			_, js := natstest.Connect(t, ns.ClientURL(), admin...)
			_, pjs := natstest.Connect(t, ns.ClientURL(), seat...)
			ctx := context.Background()
			const bucket = "composed-n0000"
			composedBuckets(t, js, 1)
			db, err := store.Open(t.TempDir(), store.Options{})
			require.NoError(t, err)
			p := projector.New(pjs, db, projector.Options{Buckets: []string{}, Composed: true, Poll: 50 * time.Millisecond,
				Verify: 500 * time.Millisecond, DiscoverEvery: time.Hour,
				OnReset: func(b string, reason error) { t.Errorf("%s asked for a rebuild: %v", b, reason) }})
			recreated := make(chan uint64, 1) // the sequence of the new stream's message
			var once sync.Once
			projector.SetAfterForget(p, func(b string) {
				once.Do(func() {
					kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: b, History: 1, Storage: jetstream.MemoryStorage})
					if err != nil {
						t.Errorf("create %s again: %v", b, err)
						close(recreated)
						return
					}
					var seq uint64
					for _, key := range []string{"web.1", "web.2"} {
						v, _ := msgpack.Marshal(map[string]any{"status": "published", "plan": key})
						if seq, err = kv.Put(ctx, key, v); err != nil {
							t.Errorf("put to %s again: %v", b, err)
						}
					}
					recreated <- seq
				})
			})
			p.Start(ctx)
			t.Cleanup(func() {
				p.Stop()
				require.NoError(t, db.Close())
			})
			natstest.CheckFor(t, 10*time.Second, 20*time.Millisecond, applied(db, bucket, 1))

			require.NoError(t, js.DeleteKeyValue(ctx, bucket))
			var seq uint64
			select {
			case seq = <-recreated:
			case <-time.After(20 * time.Second):
				t.Fatal("not forgotten within 20 s")
			}
			require.Equal(t, uint64(2), seq, "a new stream")
			info, err := js.Stream(ctx, "KV_"+bucket)
			require.NoError(t, err)
			natstest.CheckFor(t, 5*time.Second, 20*time.Millisecond, func() error {
				cp := db.Checkpoint(bucket)
				if cp.Applied != seq || cp.StreamCreated != info.CachedInfo().Created.UnixNano() {
					return fmt.Errorf("%s not read from the stream created again: checkpoint %+v, want %d of the new stream", bucket, cp, seq)
				}
				if _, synced := db.Applied(bucket); !synced {
					return fmt.Errorf("%s not synced", bucket)
				}
				return nil
			})
			require.Equal(t, []string{bucket}, p.Buckets(), "tailed, once")
			v, err := db.View()
			require.NoError(t, err)
			defer v.Close()
			_, found, err := v.ForgottenAt(bucket)
			require.NoError(t, err)
			require.True(t, found, "the old stream's history was forgotten")
		})
	}
}

// TestProjector_WakeSkipsOnABucketForgottenAndAddedAgain: a bucket forgotten (its stream deleted) is
// no longer tailed, and its channel of requests goes with it; created again, it is tailed afresh with
// a channel of its own, so a request for the sequence of a message the new stream removed unread is
// reached there as on any bucket (skipRemoved), not left to its whole wait. The listing runs once an
// hour: the bucket, parked, is woken by requests alone, and reads nothing the test does not ask for.
func TestProjector_WakeSkipsOnABucketForgottenAndAddedAgain(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	const bucket = "composed-n0000"
	composedBuckets(t, js, 1)
	p, db := parkingEvery(t, ns.ClientURL(), 200*time.Millisecond, 300*time.Millisecond, time.Hour)
	natstest.CheckFor(t, 10*time.Second, 20*time.Millisecond, applied(db, bucket, 1))
	waitParked(t, p, js, bucket)

	require.NoError(t, js.DeleteKeyValue(ctx, bucket))
	p.Wake(bucket) // a request finds it deleted: confirmed, then forgotten
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if p.Tails(bucket) {
			return fmt.Errorf("%s still tailed", bucket)
		}
		return nil
	})
	p.Wake(bucket) // a request while it is gone: nothing to tell

	composedBuckets(t, js, 1) // tailed again on its advisory, read, parked
	stream, err := js.Stream(ctx, "KV_"+bucket)
	require.NoError(t, err)
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if cp := db.Checkpoint(bucket); cp.Applied != 1 || cp.StreamCreated != stream.CachedInfo().Created.UnixNano() {
			return fmt.Errorf("checkpoint %+v, want 1 of the new stream", cp)
		}
		return nil
	})
	waitParked(t, p, js, bucket)
	kv, err := js.KeyValue(ctx, bucket)
	require.NoError(t, err)
	seq, err := kv.Put(ctx, "web.2", []byte{0x80})
	require.NoError(t, err)
	require.NoError(t, stream.Purge(ctx, jetstream.WithPurgeSubject("$KV."+bucket+".web.2")))
	p.Wake(bucket)
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, applied(db, bucket, seq))
}

// TestProjector_ForgottenBucketsLeaveNoEntries: composed-<node> buckets created, read, asked for and
// deleted, round after round, leave nothing behind in the Projector's per-bucket maps (an entry per
// forgotten bucket in its stream ends, kept for good, used to grow a seat's memory with every node a
// mesh ever decommissioned), nor in the store's known buckets.
func TestProjector_ForgottenBucketsLeaveNoEntries(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	_, pjs := natstest.Connect(t, ns.ClientURL())
	p := projector.New(pjs, db, projector.Options{Buckets: []string{}, Composed: true, Poll: 50 * time.Millisecond,
		Verify: 300 * time.Millisecond, DiscoverEvery: 200 * time.Millisecond})
	p.Start(ctx)
	t.Cleanup(func() {
		p.Stop()
		db.Close()
	})
	empty := map[string]int{}
	for k := range p.BucketEntries() {
		empty[k] = 0
	}
	states := len(db.Buckets())
	const buckets = 12
	for round := range 3 {
		composedBuckets(t, js, buckets)
		natstest.CheckFor(t, 30*time.Second, 20*time.Millisecond, func() error {
			for i := range buckets {
				b := fmt.Sprintf("composed-n%04d", i)
				if seq, synced := db.Applied(b); seq == 0 || !synced {
					return fmt.Errorf("round %d: %s: applied %d, synced %v", round, b, seq, synced)
				}
			}
			return nil
		})
		for i := range buckets {
			p.Wake(fmt.Sprintf("composed-n%04d", i)) // as a request waiting on it does
		}
		maps := p.BucketEntries()
		require.Equal(t, buckets, maps["tailed"], "round %d", round)
		require.Equal(t, buckets, maps["ends"], "round %d", round)
		for i := range buckets {
			require.NoError(t, js.DeleteKeyValue(ctx, fmt.Sprintf("composed-n%04d", i)))
		}
		natstest.CheckFor(t, 30*time.Second, 20*time.Millisecond, func() error {
			if got := p.BucketEntries(); fmt.Sprint(got) != fmt.Sprint(empty) || len(db.Buckets()) != states {
				return fmt.Errorf("round %d: after every bucket was deleted: maps %v, store buckets %v", round, got, db.Buckets())
			}
			return nil
		})
	}
}
