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

// TestSeat_RestartAfterKeysRewrittenWhileDownDoesNotRebuild: a bucket with the KV API's default
// history of 1 keeps only the newest message of each key, so when every key the seat read was
// written twice while it was down, the stream starts past the checkpoint + 1 with nothing lost. The
// seat resumed from it once rebuilt the whole projection (minutes at millions of keys) and started
// its event log afresh, so plans as of a time before the restart were gone (the log now holds a gap
// where the stream removed messages unread, so only times before them are answered). Now it resumes, answers
// what a fresh seat does, and still answers as of a time before; a purge that removed a key the
// projection still holds is still found, and rebuilds.
func TestSeat_RestartAfterKeysRewrittenWhileDownDoesNotRebuild(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	ix, err := h.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.BucketIndexerBuilds})
	require.NoError(t, err)
	hm, err := h.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.BucketHostModules})
	require.NoError(t, err)
	in := h.planInputs()
	var mid string // a time between a's messages and b's
	for _, m := range []string{"a", "b"} {
		if m == "b" {
			mid = time.Now().UTC().Format(time.RFC3339Nano)
		}
		in.comp("n1", m+".1", "published", m+"1")
		_, err := ix.Put(ctx, m, mp(t, map[string]any{"newest": 1}))
		require.NoError(t, err)
		_, err = hm.Put(ctx, "n1."+m, mp(t, map[string]any{"want": 1}))
		require.NoError(t, err)
	}
	po := projector.Options{Poll: 50 * time.Millisecond, DiscoverEvery: time.Hour, Verify: 200 * time.Millisecond}
	dir := t.TempDir()
	st, stop := h.startPlansSeatWith(dir, po)
	h.expectPlans(st, map[string]string{"n1.a": "published@1:a1 | -", "n1.b": "published@1:b1 | -"})
	stop()

	for i := 2; i <= 3; i++ {
		for _, m := range []string{"a", "b"} {
			_, err := ix.Put(ctx, m, mp(t, map[string]any{"newest": i}))
			require.NoError(t, err)
		}
	}
	s, err := h.js.Stream(ctx, provisioner.StreamName(provisioner.BucketIndexerBuilds))
	require.NoError(t, err)
	info, err := s.Info(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 5, info.State.FirstSeq, "3 and 4 were superseded before the seat read them")

	st, stop = h.startPlansSeatWith(dir, po)
	h.expectPlans(st, map[string]string{"n1.a": "published@1:a1 | held/missing", "n1.b": "published@1:b1 | held/missing"})
	// Resumed where it was, not rebuilt: a rebuild stops the bucket at its checkpoint until the new
	// generation, read from the streams, is swapped in.
	require.Zero(t, st.Rebuilds(), "nothing the projection rests on was removed")
	a, err := h.askPlans(map[string]any{"what": "plans", "at": mid}, false)
	require.NoError(t, err, "the event log from before the restart is kept")
	require.Len(t, a["rows"], 1)
	require.Equal(t, "published@1:a1 | -", entry(planRow(t, a, "n1.a"), "current")+" | "+entry(planRow(t, a, "n1.a"), "newest"))
	live, err := h.askPlans(map[string]any{"what": "plans"}, false)
	require.NoError(t, err)
	stop()
	fresh, stopFresh := h.startPlansSeatWith(t.TempDir(), po)
	h.waitPlansCaughtUp(fresh)
	again, err := h.askPlans(map[string]any{"what": "plans"}, false)
	require.NoError(t, err)
	require.Equal(t, jsonOf(t, live["rows"]), jsonOf(t, again["rows"]), "a seat started fresh answers alike")
	stopFresh()

	// While down: a's newest rewritten twice, then the stream purged below it: b's newest, which the
	// projection still holds, is gone. Found once the bucket is read to its end: a rebuild.
	for i := 4; i <= 5; i++ {
		_, err = ix.Put(ctx, "a", mp(t, map[string]any{"newest": i}))
		require.NoError(t, err)
	}
	info, err = s.Info(ctx)
	require.NoError(t, err)
	require.NoError(t, s.Purge(ctx, jetstream.WithPurgeSequence(info.State.LastSeq)))
	st, _ = h.startPlansSeatWith(dir, po)
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if st.Rebuilds() == 0 {
			return fmt.Errorf("no rebuild yet")
		}
		return nil
	})
	h.expectPlans(st, map[string]string{"n1.a": "published@1:a1 | held/missing", "n1.b": "published@1:b1 | -"})
}
