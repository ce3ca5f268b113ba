package registry_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/registry"
)

// TestWriter_PurgeWithoutRollup: CONTRACT section 1, KV-Operation: PURGE removes its key, with or
// without the Nats-Rollup the KV API adds (session 18, h141). A kind purged by hand without it is
// written again, in one write, although the stream still holds its put; a stray purged so is already
// removed and gets no delete marker of its own; after that a pass writes nothing (section 4: an
// unchanged kind gets no new revision).
func TestWriter_PurgeWithoutRollup(t *testing.T) {
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	w := registry.New(js, provisioner.Registry, time.Hour, nil)
	_, err := w.Pass(ctx)
	require.NoError(t, err)
	purge := func(key string) {
		m := nats.NewMsg(provisioner.SubjectPrefix(provisioner.BucketRegistry) + key)
		m.Header.Set("KV-Operation", "PURGE")
		_, err := js.PublishMsg(ctx, m)
		require.NoError(t, err)
	}
	e, ok := provisioner.Registry.Lookup("config")
	require.True(t, ok)
	_, err = js.Publish(ctx, provisioner.SubjectPrefix(provisioner.BucketRegistry)+"gadget", e.Value())
	require.NoError(t, err)
	n, err := w.Pass(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n, "the stray is deleted")
	_, err = js.Publish(ctx, provisioner.SubjectPrefix(provisioner.BucketRegistry)+"widget", e.Value())
	require.NoError(t, err)
	purge("config")
	purge("widget")
	require.Error(t, equalsContract(t, js), "config is removed")
	before := messages(t, js)
	require.EqualValues(t, 2, before["config"], "the put and the purge: nothing rolled up")

	n, err = w.Pass(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n, "config written again, the purged stray left as it is")
	require.NoError(t, equalsContract(t, js))
	after := messages(t, js)
	require.EqualValues(t, 3, after["config"])
	require.EqualValues(t, 2, after["widget"], "its put and its purge, no delete marker")
	n, err = w.Pass(ctx)
	require.NoError(t, err)
	require.Zero(t, n, "and then nothing")
}
