package projector_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// TestProjector_DiscoversComposedByListing: an account that may not subscribe to JetStream's
// advisories still tails every composed-<node> bucket, those there at start and those created later,
// found by listing the streams.
func TestProjector_DiscoversComposedByListing(t *testing.T) {
	conf := filepath.Join(t.TempDir(), "nats.conf")
	require.NoError(t, os.WriteFile(conf, []byte(`
accounts {
  MESH {
    jetstream: enabled
    users = [
      {user: seat, password: seat, permissions: {subscribe: {deny: ["$JS.EVENT.>"]}}}
      {user: node, password: node}
    ]
  }
}
`), 0o644))
	ns := natstest.RunServerAt(t, "127.0.0.1:-1", t.TempDir(), conf)
	_, nodeJS := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("node", "node"))
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

	applied := func(bucket string, seq uint64) func() error {
		return func() error {
			if have, _ := db.Applied(bucket); have < seq {
				return fmt.Errorf("%s: applied %d of %d", bucket, have, seq)
			}
			return nil
		}
	}
	natstest.CheckFor(t, 10*time.Second, 20*time.Millisecond, applied("composed-a", 1))
	require.True(t, p.Discovered())

	seq := put("composed-b", "web.2")
	natstest.CheckFor(t, 10*time.Second, 20*time.Millisecond, applied("composed-b", seq))
	require.Equal(t, []string{"composed-a", "composed-b"}, p.Buckets(), "each bucket tailed once, and nothing else")

	p.Stop() // returns once every consumer and the discovery loop have stopped
	v, err := db.View()
	require.NoError(t, err)
	defer v.Close()
	var n int
	require.NoError(t, v.Checkpoints(provisioner.ComposedPrefix, func(string, store.Checkpoint) { n++ }))
	require.Equal(t, 2, n)
}
