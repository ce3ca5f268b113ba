package seat_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
)

// TestPlans_ComposedBucketThatCannotBeResumedIsReadAgain: a composed-<node> bucket whose stream can no
// longer be resumed from the checkpoint, but still exists, is forgotten in place and read again from
// its stream's first message; the seat does not rebuild. Three ways a node's bucket gets there: it is
// deleted and created again within the confirmation window (a node reinstalled: "recreated"), its
// stream is purged while the seat reads it (a live key's message removed), or messages past the
// checkpoint are removed while the seat is down (the stream starts past the checkpoint + 1). Each
// time: the same store, no rebuild, the needs' log still answering at a point before; the live plans
// equal a seat's started fresh on the same streams and the plans at now; plans at a time before the
// forgetting are 410 for that node and for every node, and exact for another node; at a time after
// it, exact (the answer then, even after a later write).
func TestPlans_ComposedBucketThatCannotBeResumedIsReadAgain(t *testing.T) {
	t.Parallel()
	const n3 = "n3"
	c3 := provisioner.ComposedPrefix + n3
	po := projector.Options{Poll: 50 * time.Millisecond, DiscoverEvery: time.Hour, Verify: 200 * time.Millisecond}
	ctx := context.Background()
	cases := []struct {
		name string
		// down: the seat is stopped before change and started again after it.
		down   bool
		change func(h *harness, in *planInputs)
		// want: n3.m's entries once it was read again.
		want string
	}{
		{name: "recreated", change: func(h *harness, in *planInputs) {
			require.NoError(h.t, h.js.DeleteKeyValue(ctx, c3))
			delete(in.kvs, c3)
			in.comp(n3, "m.1", "published", "again")
		}, want: "published@1:again | -"},
		{name: "purged", change: func(h *harness, in *planInputs) {
			s, err := h.js.Stream(ctx, provisioner.StreamName(c3))
			require.NoError(h.t, err)
			require.NoError(h.t, s.Purge(ctx))
		}, want: "held/missing | -"},
		{name: "purged past the checkpoint while down", down: true, change: func(h *harness, in *planInputs) {
			in.comp(n3, "m.2", "published", "m2")
			in.comp(n3, "m.1", "refused", nil)
			s, err := h.js.Stream(ctx, provisioner.StreamName(c3))
			require.NoError(h.t, err)
			info, err := s.Info(ctx)
			require.NoError(h.t, err)
			require.NoError(h.t, s.Purge(ctx, jetstream.WithPurgeSequence(info.State.LastSeq)))
		}, want: "held/refused | -"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			in := h.planInputs()
			dir := t.TempDir()
			st, stop := h.startPlansSeatWith(dir, po)
			in.put(provisioner.BucketNeeds, "n3.m.pkg.x", map[string]any{"v": 1})
			in.comp(n3, "m.1", "published", "m1")
			in.comp(n3, "bad", "published", "m1")
			in.host("n3.m", map[string]any{"want": 1})
			in.comp("n4", "m.1", "published", "n4m1")
			in.host("n4.m", map[string]any{"want": 1})
			h.expectPlans(st, map[string]string{"n3.m": "published@1:m1 | -", "n4.m": "published@1:n4m1 | -"})

			before := time.Now().UTC().Format(time.RFC3339Nano)
			n4Before, err := h.askPlans(map[string]any{"what": "plans", "node": "n4", "at": before}, false)
			require.NoError(t, err)
			require.Equal(t, "published@1:n4m1", entry(planRow(t, n4Before, "n4.m"), "current"))
			n3Before, err := h.askPlans(map[string]any{"what": "plans", "node": n3, "at": before}, false)
			require.NoError(t, err)
			require.Equal(t, "published@1:m1", entry(planRow(t, n3Before, "n3.m"), "current"))

			if tc.down {
				stop()
			}
			tc.change(h, in)
			if tc.down {
				st, _ = h.startPlansSeatWith(dir, po)
			}
			db := st.Store()
			natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
				v, err := st.Store().View()
				if err != nil {
					return err
				}
				defer v.Close()
				if _, found, err := v.ForgottenAt(c3); err != nil || !found {
					return fmt.Errorf("%s not forgotten yet (%v)", c3, err)
				}
				return nil
			})
			h.expectPlans(st, map[string]string{"n3.m": tc.want, "n4.m": "published@1:n4m1 | -"})
			require.Zero(t, st.Rebuilds(), "forgotten in place, not rebuilt")
			require.Same(t, db, st.Store(), "the same store")
			require.True(t, st.Current().Tails(c3), "still tailed")
			var live map[string]any
			if s, err := h.js.Stream(ctx, provisioner.StreamName(c3)); err == nil && s.CachedInfo().State.Msgs > 0 {
				live = h.crossCheck(st) // live == plans at now == a seat fresh on the same streams
			} else {
				// Emptied: a fresh seat never reads up to the stream's last sequence, which crossCheck
				// waits for. It is compared once the bucket has a message again, below.
				require.NoError(t, err)
				live, err = h.askPlans(map[string]any{"what": "plans"}, false)
				require.NoError(t, err)
				now, err := h.askPlans(map[string]any{"what": "plans", "at": time.Now().UTC().Format(time.RFC3339Nano)}, false)
				require.NoError(t, err)
				require.Equal(t, jsonOf(t, live["rows"]), jsonOf(t, now["rows"]))
				require.Equal(t, anomalyCodes(live), anomalyCodes(now))
			}
			require.Equal(t, tc.want, entry(planRow(t, live, "n3.m"), "current")+" | "+entry(planRow(t, live, "n3.m"), "newest"))
			require.Zero(t, st.Rebuilds())

			// The needs' log still answers from before.
			needs, err := h.askAt("needs", before, false)
			require.NoError(t, err)
			require.Len(t, needs.Rows, 1)
			// Plans before the forgetting: 410 for the node and for every node; exact for another node.
			h.goneAt(before, n3)
			h.goneAt(before, "")
			n4Again, err := h.askPlans(map[string]any{"what": "plans", "node": "n4", "at": before}, false)
			require.NoError(t, err)
			require.Equal(t, jsonOf(t, n4Before["rows"]), jsonOf(t, n4Again["rows"]))
			require.Equal(t, anomalyCodes(n4Before), anomalyCodes(n4Again))

			// After it: exact, also once the bucket has moved on.
			after := time.Now().UTC().Format(time.RFC3339Nano)
			in.comp(n3, "m.1", "published", "later")
			h.expectPlans(st, map[string]string{"n3.m": "published@1:later | -"})
			for _, node := range []string{n3, ""} {
				req := map[string]any{"what": "plans", "at": after}
				if node != "" {
					req["node"] = node
				}
				then, err := h.askPlans(req, false)
				require.NoError(t, err, "plans at %s after the forgetting, node %q", after, node)
				require.Equal(t, tc.want, entry(planRow(t, then, "n3.m"), "current")+" | "+entry(planRow(t, then, "n3.m"), "newest"))
				if node == "" {
					require.Equal(t, "published@1:n4m1", entry(planRow(t, then, "n4.m"), "current"))
				}
			}
			h.crossCheck(st)
			require.Zero(t, st.Rebuilds())
		})
	}
}

// TestPlans_AtOfOneNodeReadsOnlyItsComposedBucket: plans at a time, asked for one node, read that
// node's composed-<node> bucket alone of the compositions, since no other node's rows or anomalies
// come from another. Another node's bucket whose log cannot rebuild the time (its stream removed
// messages before the seat read them) refused them with 410 before.
func TestPlans_AtOfOneNodeReadsOnlyItsComposedBucket(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	in := h.planInputs()
	ctx := context.Background()
	in.comp("n4", "m.1", "published", "n4m1")
	in.host("n4.m", map[string]any{"want": 1})
	in.host("n3.m", map[string]any{"want": 2})
	in.comp("n3", "m.1", "published", "m1")
	mid := time.Now().UTC().Format(time.RFC3339Nano)
	in.comp("n3", "m.2", "published", "m2")
	s, err := h.js.Stream(ctx, provisioner.StreamName(provisioner.ComposedPrefix+"n3"))
	require.NoError(t, err)
	require.NoError(t, s.Purge(ctx, jetstream.WithPurgeSequence(2))) // m.1 removed before the seat reads it
	st, _ := h.startPlansSeat(t.TempDir())
	h.expectPlans(st, map[string]string{"n3.m": "published@2:m2 | -", "n4.m": "published@1:n4m1 | -"})

	a, err := h.askPlans(map[string]any{"what": "plans", "node": "n4", "at": mid}, false)
	require.NoError(t, err, "n3's gap does not concern n4")
	require.Equal(t, "published@1:n4m1", entry(planRow(t, a, "n4.m"), "current"))
	h.goneAt(mid, "n3")
	h.goneAt(mid, "")
}
