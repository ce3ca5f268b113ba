package projector_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// TestProjector_HoldOfAGapIsReleasedWithoutAnEndRead: CONTRACT section 3, min_seq. A bucket with a
// history of 1 written on and on: the tail read 1, then 3 (the write at 2 was removed unread, by 4:
// the store holds every min_seq from 2 on, store.DB.Reach), and each message it reads has more after
// it, as when writes never stop; its tail has never read a message with nothing pending after it. A
// request waits on the bucket (Wake) once the tail has read 6: the tail asks the stream where it ends
// (7), and the hold ends once the tail has read that far. Before, only a message with nothing pending
// after it (or one read after such a message) had the tail ask: a bucket written on and on, on a tail
// started behind it, held every min_seq from 2 on, and each request waited its wait_ms for a 504 with
// its own write applied.
func TestProjector_HoldOfAGapIsReleasedWithoutAnEndRead(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	ctx := context.Background()
	_, js := natstest.Connect(t, ns.ClientURL())
	const bucket = provisioner.BucketApplied
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: bucket, History: 1})
	require.NoError(t, err)
	put := func(key string) uint64 {
		t.Helper()
		v, err := msgpack.Marshal(key)
		require.NoError(t, err)
		seq, err := kv.Put(ctx, key, v)
		require.NoError(t, err)
		return seq
	}
	for i, key := range []string{"n1.b", "n1.a", "n1.c", "n1.a", "n1.d", "n1.e", "n1.f"} {
		require.Equal(t, uint64(i+1), put(key)) // 4 removes 2: the history is 1
	}
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, db.Close()) })

	// The reader stops after handing 6 over until told, then after 7 for good: it never reads a
	// message with nothing pending after it.
	at6, stop := make(chan struct{}), make(chan struct{})
	p := projector.New(js, db, projector.Options{Buckets: []string{bucket}, Poll: 20 * time.Millisecond, Verify: time.Hour, PullMessages: 1})
	projector.SetBeforePending(p, func(_ string, seq, pending uint64) {
		select {
		case <-stop:
			return // the test is over: its cleanup lets the reader go on to 8, the stream's last
		default:
		}
		if pending == 0 {
			t.Errorf("%d read with nothing pending after it", seq)
		}
		switch seq {
		case 6:
			select {
			case <-at6:
			case <-stop:
			}
		case 7:
			<-stop
		}
	})
	p.Start(ctx)
	t.Cleanup(func() { close(stop); p.Stop() })
	waitApplied := func(want uint64) {
		t.Helper()
		natstest.CheckFor(t, 20*time.Second, 10*time.Millisecond, func() error {
			if applied, _ := db.Applied(bucket); applied != want {
				return fmt.Errorf("applied %d, want %d", applied, want)
			}
			return nil
		})
	}
	waitApplied(6)
	require.Equal(t, uint64(1), db.Reach(bucket), "2 removed unread, what removed it maybe not read")

	p.Wake(bucket) // a request with min_seq 6 waits
	natstest.CheckFor(t, 20*time.Second, 10*time.Millisecond, func() error {
		if held, until := db.Held(bucket); held != 2 || until != 7 {
			return fmt.Errorf("held from %d until %d, want from 2 until 7", held, until)
		}
		return nil
	})
	require.Equal(t, uint64(8), put("n1.g")) // one more again
	// The server counts 8 as pending for the tail's consumer on a goroutine of its own, after the
	// put's ack (nats-server's signalConsumersLoop): 7, pulled before that, comes with nothing pending
	// after it (seen under the race detector on a loaded machine). Released once the consumer counts
	// both 7 and 8.
	stream, err := js.Stream(ctx, provisioner.StreamName(bucket))
	require.NoError(t, err)
	natstest.CheckFor(t, 20*time.Second, 10*time.Millisecond, func() error {
		var counts []uint64
		for ci := range stream.ListConsumers(ctx).Info() {
			counts = append(counts, ci.NumPending)
		}
		if len(counts) != 1 || counts[0] != 2 {
			return fmt.Errorf("the consumers count %v pending, want one counting 2 (7 and 8)", counts)
		}
		return nil
	})
	close(at6)
	waitApplied(7)
	require.Equal(t, uint64(7), db.Reach(bucket))
}
