package projector

import (
	"testing"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/internal/streamread"
	"github.com/novox/mesh-provisioner/store"
)

// TestSizes_EveryTailBoundedByBytesAndCount: a fixed bucket's tail pulls by bytes and holds at most
// fixedPull messages (a bound in bytes alone has nats.go allocate a channel of a million messages per
// tail: 60-80 MiB more peak RSS at 1,000,000 keys); a composed-<node> bucket's pulls are a count the
// largest messages fit in the bound; Options.PullMessages is a count alone.
func TestSizes_EveryTailBoundedByBytesAndCount(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })

	p := New(js, db, Options{})
	batch, pull, bytes := p.sizes(provisioner.BucketNeeds)
	require.Equal(t, 4096, batch)
	require.Equal(t, fixedPull, pull)
	require.Equal(t, streamread.PullBytes(js.Conn(), 0), bytes)

	largest := int(js.Conn().MaxPayload()) + streamread.Overhead
	batch, pull, bytes = p.sizes(provisioner.ComposedPrefix + "n1")
	require.Equal(t, composedBatchSize, batch)
	require.Equal(t, min(composedPull, streamread.PullBytes(js.Conn(), 0)/largest), pull)
	require.Zero(t, bytes)

	p = New(js, db, Options{PullMessages: 16})
	_, pull, bytes = p.sizes(provisioner.BucketNeeds)
	require.Equal(t, 16, pull)
	require.Zero(t, bytes)
}
