package seat_test

import (
	"fmt"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/fixtures"
)

// TestPlans_AtKeepsItsStoreAcrossPages: a walk of plans at a point a page at a time filled a new
// temporary store from every plans' input for each page, seconds of CPU a page on a large mesh. The
// seat now keeps the store its first page filled: the same one is there after every page. A time
// after the newest event follows the projection (the plans applied since are answered, not the
// store kept for the same time before), and Stop removes the stores kept.
func TestPlans_AtKeepsItsStoreAcrossPages(t *testing.T) {
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp) // the seat's temporary stores of plans, counted here
	dirs := func() []string {
		ms, err := filepath.Glob(filepath.Join(tmp, "mesh-provisioner-plans-at-*"))
		require.NoError(t, err)
		return ms
	}
	h := newHarness(t)
	sc := fixtures.Plans()
	h.load(sc.Before)
	st, stop := h.startPlansSeat(t.TempDir())
	h.waitPlansCaughtUp(st)

	const future = "2100-01-01T00:00:00Z"
	// walk asks every page of plans at future, and checks that the first page kept one new store, the
	// same after every page.
	walk := func() []any {
		before := map[string]bool{}
		for _, d := range dirs() {
			before[d] = true
		}
		req := map[string]any{"what": "plans", "at": future, "limit": 2}
		var rows []any
		kept := ""
		for page := 0; ; page++ {
			a, err := h.askPlans(req, false)
			require.NoError(t, err)
			got, _ := a["rows"].([]any)
			rows = append(rows, got...)
			var added []string
			for _, d := range dirs() {
				if !before[d] {
					added = append(added, d)
				}
			}
			require.Len(t, added, 1, "page %d: the store the walk's first page filled is kept", page)
			if kept == "" {
				kept = added[0]
			}
			require.Equal(t, kept, added[0], "page %d filled a store again", page)
			next, _ := a["next"].(string)
			if next == "" {
				return rows
			}
			req["after"] = next
		}
	}
	live, _ := h.askAllPlans(map[string]any{"what": "plans"}, false)
	require.Greater(t, len(live), 2, "more than a page")
	require.Equal(t, fmt.Sprint(live), fmt.Sprint(walk()))
	require.Len(t, dirs(), 1)

	h.load(sc.After)
	h.waitPlansCaughtUp(st)
	liveAfter, _ := h.askAllPlans(map[string]any{"what": "plans"}, false)
	require.NotEqual(t, fmt.Sprint(live), fmt.Sprint(liveAfter), "the scenario's second part changes the plans")
	require.Equal(t, fmt.Sprint(liveAfter), fmt.Sprint(walk()), "the plans applied since, not those kept before")
	require.Len(t, dirs(), 2)

	// One more put in a bucket every answer read already: only its sequence moves.
	h.planInputs().host("edge-1.extra", map[string]any{"want": 1})
	h.waitPlansCaughtUp(st)
	liveThen, _ := h.askAllPlans(map[string]any{"what": "plans"}, false)
	require.Len(t, liveThen, len(liveAfter)+1)
	require.Equal(t, fmt.Sprint(liveThen), fmt.Sprint(walk()), "the row put since, not the store kept before")
	require.Len(t, dirs(), 3)

	stop()
	require.Empty(t, dirs(), "Stop removes the stores kept")
}
