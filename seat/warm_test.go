package seat_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/seat"
	"github.com/novox/mesh-provisioner/store"
)

// TestSeat_LookupsAfterTheCatchUpCompactionReadNoBlock: the compaction after a catch-up rewrites every
// table, so Pebble's block cache holds none of their blocks; the seat reads the rows into it right
// after, so the node lookups that follow read no block from the tables (before, each lookup read and
// decompressed every block of its rows: at 1,000,000 keys about twice a warm lookup's CPU).
func TestSeat_LookupsAfterTheCatchUpCompactionReadNoBlock(t *testing.T) {
	compactAfter := seat.CompactAfter
	seat.CompactAfter = 1000
	t.Cleanup(func() { seat.CompactAfter = compactAfter })

	h := newHarness(t)
	mesh := fixtures.Mesh{Seed: 11, Nodes: 40, Modules: 25, NeedsPerModule: 10, Collections: 1} // 10,000 needs, 250 a node

	logs := &natstest.LogBuffer{}
	nc, js := natstest.Connect(t, h.url)
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	st, err := seat.Start(context.Background(), nc, js, db, seat.Config{Logger: slog.New(slog.NewTextHandler(logs, nil)), WriteRegistry: true,
		Projector: projector.Options{Poll: 50 * time.Millisecond, Verify: 200 * time.Millisecond}})
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, st.Stop())
		require.NoError(t, db.Close())
	})
	// The mesh is loaded once the registry is written: before it, every need would be an unanswered-kind
	// anomaly, whose rows a lookup reads (they are not read into the cache), and which the registry's
	// arrival would delete (tombstones, which Pebble compacts again later on its own).
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if passes, _ := st.Registry.Stats(); passes == 0 {
			return fmt.Errorf("registry not written yet")
		}
		return nil
	})
	h.load(mesh.Ops())
	h.waitCaughtUp(st)
	natstest.CheckFor(t, 60*time.Second, 20*time.Millisecond, func() error {
		if !strings.Contains(logs.String(), "compacted after catch-up") {
			return fmt.Errorf("no compaction after the catch-up yet")
		}
		return nil
	})

	before, err := st.Store().PebbleMetrics()
	require.NoError(t, err)
	for i := range mesh.Nodes {
		rows, _, err := natstest.AskAll(h.nc, "mesh-provisioner.provisioning", map[string]any{"what": "needs", "node": fixtures.NodeName(i)}, true)
		require.NoError(t, err)
		require.Len(t, rows, 250)
	}
	after, err := st.Store().PebbleMetrics()
	require.NoError(t, err)
	require.Greater(t, after.BlockCache.Hits, before.BlockCache.Hits, "the lookups read through the block cache")
	require.Zero(t, after.BlockCache.Misses-before.BlockCache.Misses, "blocks the lookups read from the tables")
}
