package seat_test

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/registry"
	"github.com/novox/mesh-provisioner/seat"
	"github.com/novox/mesh-provisioner/store"
)

// startReadOnlySeat starts a seat that does not write the registry (serve --no-registry), so the test
// writes the registry bucket by hand.
func (h *harness) startReadOnlySeat(dir string) (*seat.Seat, func()) {
	h.t.Helper()
	nc, js := natstest.Connect(h.t, h.url)
	db, err := store.OpenState(dir, store.Options{})
	require.NoError(h.t, err)
	st, err := seat.Start(context.Background(), nc, js, db, seat.Config{Projector: projector.Options{Poll: 50 * time.Millisecond}})
	require.NoError(h.t, err)
	require.Nil(h.t, st.Registry)
	done := false
	stop := func() {
		if done {
			return
		}
		done = true
		require.NoError(h.t, st.Stop())
		require.NoError(h.t, db.Close())
		nc.Close()
	}
	h.t.Cleanup(stop)
	return st, stop
}

// unanswered asks the verb for the needs whose kind no registry entry answers, and also checks the
// whole needs answer against the buckets as the KV API reads them.
func (h *harness) unanswered() []string {
	h.t.Helper()
	h.checkAnswer(map[string]any{"what": "needs"})
	a, _, err := natstest.Ask(h.nc, query.Subject, []byte(`{"what":"needs"}`), false)
	require.NoError(h.t, err)
	var keys []string
	for _, an := range a.Anomalies {
		if reason, _ := an["reason"].(string); strings.HasPrefix(reason, string(provisioner.ReasonUnansweredKind)) {
			require.Contains(h.t, reason, "kind", "the reason names the kind")
			keys = append(keys, fmt.Sprint(an["key"]))
		}
	}
	sort.Strings(keys)
	return keys
}

func TestSeat_UnansweredKindFollowsRegistry(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	require.NoError(t, fixtures.CreateBuckets(ctx, h.js, provisioner.BucketRegistry, provisioner.BucketNeeds,
		provisioner.BucketApplied, provisioner.BucketCollect))
	registry, err := h.js.KeyValue(ctx, provisioner.BucketRegistry)
	require.NoError(t, err)
	needs, err := h.js.KeyValue(ctx, provisioner.BucketNeeds)
	require.NoError(t, err)
	put := func(kv jetstream.KeyValue, key string, value []byte) {
		t.Helper()
		_, err := kv.Put(ctx, key, value)
		require.NoError(t, err)
	}
	entry := func(kind string) []byte {
		e, ok := provisioner.Registry.Lookup(kind)
		require.True(t, ok, kind)
		return e.Value()
	}

	// The table without port, written by hand.
	for _, e := range provisioner.Registry.Entries {
		if e.Kind != "port" {
			put(registry, e.Kind, e.Value())
		}
	}
	need := []byte{0x81, 0xa1, 'v', 0x01}
	put(needs, "n1.mod-a.port.http", need)
	put(needs, "n1.mod-a.config.listen", need)
	put(needs, "n1.mod-a.secret.token", need)
	put(needs, "n2.mod-b.gadget.x", need)
	put(needs, "n2.mod-b.port.admin", need)

	dir := t.TempDir()
	st, stop := h.startReadOnlySeat(dir)
	h.waitCaughtUp(st)
	require.Equal(t, []string{"n1.mod-a.port.http", "n2.mod-b.gadget.x", "n2.mod-b.port.admin"}, h.unanswered())

	// A kind added later clears its needs.
	put(registry, "port", entry("port"))
	h.waitCaughtUp(st)
	require.Equal(t, []string{"n2.mod-b.gadget.x"}, h.unanswered())

	// A kind deleted, or purged, raises them.
	require.NoError(t, registry.Delete(ctx, "secret"))
	require.NoError(t, registry.Purge(ctx, "config"))
	h.waitCaughtUp(st)
	require.Equal(t, []string{"n1.mod-a.config.listen", "n1.mod-a.secret.token", "n2.mod-b.gadget.x"}, h.unanswered())

	// Needs that come later are judged by the registry as it is; a need deleted takes its anomaly.
	put(needs, "n3.mod-c.port.x", need)
	put(needs, "n3.mod-c.secret.y", need)
	require.NoError(t, needs.Delete(ctx, "n2.mod-b.gadget.x"))
	h.waitCaughtUp(st)
	require.Equal(t, []string{"n1.mod-a.config.listen", "n1.mod-a.secret.token", "n3.mod-c.secret.y"}, h.unanswered())

	// A stray kind by hand answers its needs while nothing keeps the registry.
	put(registry, "gadget", entry("secret"))
	put(needs, "n2.mod-b.gadget.x", need)
	h.waitCaughtUp(st)
	require.Equal(t, []string{"n1.mod-a.config.listen", "n1.mod-a.secret.token", "n3.mod-c.secret.y"}, h.unanswered())
	stop()

	// The seat restarts with the writer: it puts back secret and config and deletes gadget, and the
	// projection re-evaluates the needs of each.
	st, _ = h.startSeat(dir)
	h.waitCaughtUp(st)
	require.Equal(t, []string{"n2.mod-b.gadget.x"}, h.unanswered())
}

// TestSeat_VerbAnswersWhileRegistryFails checks that a registry writer that cannot write leaves the
// verb answering: here the registry's stream exists but is no KV bucket, so every pass fails.
func TestSeat_VerbAnswersWhileRegistryFails(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	_, err := h.js.CreateStream(ctx, jetstream.StreamConfig{Name: provisioner.StreamName(provisioner.BucketRegistry),
		Subjects: []string{provisioner.SubjectPrefix(provisioner.BucketRegistry) + ">"}})
	require.NoError(t, err)
	h.load(testMesh.Ops())

	nc, js := natstest.Connect(t, h.url)
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	st, err := seat.Start(ctx, nc, js, db, seat.Config{WriteRegistry: true, Projector: projector.Options{Poll: 50 * time.Millisecond}})
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, st.Stop())
		require.NoError(t, db.Close())
	})
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		if n := st.Registry.Failures(); n < 2 {
			return fmt.Errorf("%d failed passes", n)
		}
		return nil
	})
	h.waitCaughtUp(st)
	for _, b := range []string{provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect} {
		shape, _ := provisioner.ShapeOf(b)
		rows, _, err := natstest.AskAll(h.nc, query.Subject, map[string]any{"what": string(shape.What)}, false)
		require.NoError(t, err, b)
		want := 0
		for k := range h.bucket(b) {
			if _, bad := shapeOK(b, k); bad == "" {
				want++
			}
		}
		require.Positive(t, want)
		require.Len(t, rows, want, "%s: a row per key in shape", b)
	}
	passes, _ := st.Registry.Stats()
	require.Zero(t, passes)
}

// TestSeat_RollingUpgradeKeepsTheNewerTablesKinds: a seat of the old binary runs beside the writer of a
// newer table (one that adds gadget and drops port). The needs of gadget stay answered across the old
// seat's passes and repairs, and the registry gets no revision from it: the old seat deleted gadget
// and put port back every interval, so gadget's needs flickered unanswered-kind.
func TestSeat_RollingUpgradeKeepsTheNewerTablesKinds(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	require.NoError(t, fixtures.CreateBuckets(ctx, h.js, provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect))
	needs, err := h.js.KeyValue(ctx, provisioner.BucketNeeds)
	require.NoError(t, err)
	need := []byte{0x81, 0xa1, 'v', 0x01}
	for _, k := range []string{"n1.mod-a.gadget.x", "n1.mod-a.port.http", "n1.mod-a.secret.token"} {
		_, err := needs.Put(ctx, k, need)
		require.NoError(t, err)
	}
	st, _ := h.startSeat(t.TempDir())
	h.waitCaughtUp(st)
	require.Equal(t, []string{"n1.mod-a.gadget.x"}, h.unanswered())

	var entries []provisioner.RegistryEntry
	for _, e := range provisioner.Registry.Entries {
		if e.Kind != "port" {
			entries = append(entries, e)
		}
	}
	entries = append(entries, provisioner.RegistryEntry{Kind: "gadget", Module: "mesh-gadget", Verb: "mesh-gadget.get"})
	_, js := natstest.Connect(t, h.url)
	newer := registry.New(js, provisioner.NewRegistryTable(provisioner.Registry.Version+1, entries...), time.Hour, nil)
	n, err := newer.Pass(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, n, "gadget written, port deleted")
	// The seat's projection lost port: it wakes its writer, whose repair leaves the newer table's delete.
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		if st.Registry.Repairs() == 0 {
			return fmt.Errorf("no repair yet")
		}
		return nil
	})
	h.waitCaughtUp(st)
	require.Equal(t, []string{"n1.mod-a.port.http"}, h.unanswered())
	_, written := st.Registry.Stats()
	last := h.lastMsg(provisioner.BucketRegistry).Sequence
	for i := 0; i < 3; i++ { // the old seat's passes, as its interval would run them
		n, err := st.Registry.Pass(ctx)
		require.NoError(t, err)
		require.Zero(t, n, "pass %d wrote over the newer table", i)
		h.waitCaughtUp(st)
		require.Equal(t, []string{"n1.mod-a.port.http"}, h.unanswered(), "pass %d", i)
	}
	_, after := st.Registry.Stats()
	require.Equal(t, written, after)
	require.Equal(t, last, h.lastMsg(provisioner.BucketRegistry).Sequence, "no revision from the old seat")
}
