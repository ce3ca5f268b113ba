package projector

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/store"
)

// TestLeave_AnnouncedBeforeItLeft: a stream-created advisory that came while a forgotten bucket was
// still tailed (discover's Add then did nothing with it) tails the bucket again as it leaves, though
// its stream cannot be found yet (nats-server sends the advisory before it registers the stream); the
// new consumer reads the stream once it is found. Without the advisory, a bucket whose stream is not
// found leaves for good. There is no discovery here (Options.Composed is off): only leave can tail it.
func TestLeave_AnnouncedBeforeItLeft(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	p := New(js, db, Options{Buckets: []string{}, Poll: 20 * time.Millisecond, Verify: time.Minute})
	ctx, cancel := context.WithCancel(context.Background())
	p.Start(ctx)
	t.Cleanup(func() {
		cancel()
		p.Stop()
		require.NoError(t, db.Close())
	})

	// As runBucket holds a bucket when its forgetting has committed: tailed, its channel registered.
	forgotten := func(bucket string, announced bool) {
		p.mu.Lock()
		p.tailed[bucket] = true
		p.mu.Unlock()
		created, stop := p.waitCreated(bucket)
		defer stop()
		if announced {
			p.mu.Lock()
			p.waiting[bucket] <- struct{}{}
			p.mu.Unlock()
		}
		p.leave(ctx, bucket, created, p.log)
	}

	forgotten("composed-gone", false)
	require.False(t, p.Tails("composed-gone"), "no advisory, no stream: it leaves")

	const bucket = "composed-back"
	forgotten(bucket, true)
	require.True(t, p.Tails(bucket), "announced: tailed again, its stream not found yet")
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: bucket, Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	seq, err := kv.Put(ctx, "web.1", []byte{0x80})
	require.NoError(t, err)
	natstest.CheckFor(t, 5*time.Second, 20*time.Millisecond, func() error {
		if have, _ := db.Applied(bucket); have < seq {
			return context.DeadlineExceeded
		}
		return nil
	})
}
