package projector_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// TestProjector_CatchUpHoldsCompactionsUntilItEnds: a bucket far behind its stream holds the store's
// compactions back while it catches up, and lets them go once it has applied the stream's end.
func TestProjector_CatchUpHoldsCompactionsUntilItEnds(t *testing.T) {
	defer func(old uint64) { store.CatchUpBehind = old }(store.CatchUpBehind)
	store.CatchUpBehind = 500

	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	needs := (fixtures.Mesh{Seed: 1, Nodes: 20, Modules: 5, NeedsPerModule: 20}).OpsOf(provisioner.BucketNeeds)
	require.NoError(t, fixtures.Load(ctx, js, needs, 1024, nil))

	for run := 0; run < 3; run++ {
		db, err := store.Open(t.TempDir(), store.Options{})
		require.NoError(t, err)
		p := projector.New(js, db, projector.Options{Buckets: []string{provisioner.BucketNeeds}, BatchSize: 256, Poll: 50 * time.Millisecond})
		p.Start(ctx)
		held := false
		require.Eventually(t, func() bool {
			held = held || db.CompactionsHeld()
			seq, synced := db.Applied(provisioner.BucketNeeds)
			return synced && seq == uint64(len(needs))
		}, time.Minute, time.Millisecond)
		require.True(t, held, "run %d: compactions were held while the bucket caught up", run)
		require.Eventually(t, func() bool { return !db.CompactionsHeld() }, 10*time.Second, 10*time.Millisecond,
			"run %d: a caught-up bucket lets compactions go", run)
		p.Stop()
		require.NoError(t, db.Close())
	}
}
