package replay_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/replay"
	"github.com/novox/mesh-provisioner/store"
)

// A fill that reads the plans' inputs counts the composed-<node> buckets' messages in its total: a
// rebuild's progress went past it ("12973/12948 messages"), since the total was counted before the
// projector listed those buckets.
func TestFill_ComposedBucketsCountInTheTotal(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	sc := fixtures.Plans()
	require.NoError(t, fixtures.Load(ctx, js, append(sc.Before, sc.After...), 0, nil))
	composed := 0
	for _, op := range append(sc.Before, sc.After...) {
		if provisioner.IsComposedBucket(op.Bucket) {
			composed++
		}
	}
	require.Positive(t, composed, "the scenario writes composed buckets")

	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	opts := projector.Options{Composed: true}
	for _, s := range provisioner.ProvisionerShapes {
		opts.Buckets = append(opts.Buckets, s.Bucket)
	}
	opts.Buckets = append(opts.Buckets, provisioner.BucketHostModules, provisioner.BucketIndexerBuilds)
	var done, total int64
	unread, err := replay.Fill(ctx, js, db, opts, func(d, t int64) { done, total = d, t })
	require.NoError(t, err)
	require.Empty(t, unread)
	require.Positive(t, done)
	require.Equal(t, total, done, "every message read, and counted in the total")
}
