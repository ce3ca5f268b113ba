package seat_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/internal/streaminfo"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/seat"
	"github.com/novox/mesh-provisioner/store"
)

// asker asks the verb the whole time, a few kinds of questions, and keeps every error.
type asker struct {
	stop    chan struct{}
	wg      sync.WaitGroup
	answers atomic.Int64
	mu      sync.Mutex
	errs    []error
}

func (h *harness) startAsker() *asker {
	a := &asker{stop: make(chan struct{})}
	bodies := [][]byte{
		[]byte(`{"what":"needs","node":"` + fixtures.NodeName(3) + `"}`),
		[]byte(`{"what":"applied"}`),
		[]byte(`{}`),
		[]byte(`{"what":"collect","limit":5}`),
	}
	a.wg.Add(1)
	go func() {
		defer a.wg.Done()
		for i := 0; ; i++ {
			select {
			case <-a.stop:
				return
			default:
			}
			if _, _, err := natstest.Ask(h.nc, query.Subject, bodies[i%len(bodies)], false); err != nil {
				a.mu.Lock()
				a.errs = append(a.errs, err)
				a.mu.Unlock()
			}
			a.answers.Add(1)
		}
	}()
	return a
}

func (a *asker) finish(t *testing.T) {
	t.Helper()
	close(a.stop)
	a.wg.Wait()
	require.Empty(t, a.errs, "every question asked during the rebuild was answered")
	require.Positive(t, a.answers.Load())
}

func generations(t *testing.T, dir string) []string {
	t.Helper()
	gens, err := filepath.Glob(filepath.Join(dir, "gen-*"))
	require.NoError(t, err)
	return gens
}

func (h *harness) checkAll() {
	h.t.Helper()
	for _, req := range requests() {
		h.checkAnswer(req)
	}
}

func TestSeat_RebuildsWhenAStreamIsRecreated(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.load(testMesh.Ops())
	dir := t.TempDir()
	st, _ := h.startSeat(dir)
	h.waitCaughtUp(st)
	ask := h.startAsker()

	// The applied bucket is deleted and created again, with other keys.
	ctx := context.Background()
	require.NoError(t, h.js.DeleteKeyValue(ctx, provisioner.BucketApplied))
	_, err := h.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.BucketApplied, History: 8})
	require.NoError(t, err)
	var fresh []fixtures.Op
	for i := 0; i < 30; i++ {
		fresh = append(fresh, fixtures.Op{Bucket: provisioner.BucketApplied, Key: fmt.Sprintf("%s.mod-new%d", fixtures.NodeName(i%5), i), Op: provisioner.OpPut, Value: []byte{0x01}})
	}
	h.load(fresh)

	h.waitRebuilt(st, ask)
	gens := generations(t, dir)
	require.Len(t, gens, 1, "the replaced generation is removed")
	cur, err := os.ReadFile(filepath.Join(dir, "CURRENT"))
	require.NoError(t, err)
	require.Equal(t, filepath.Base(gens[0]), string(cur[:len(cur)-1]))
	require.Equal(t, st.Store().Dir(), gens[0])
}

func TestSeat_RebuildsWhenAStreamIsPurgedBelowTheCheckpoint(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.load(testMesh.Ops())
	dir := t.TempDir()
	st, _ := h.startSeat(dir)
	h.waitCaughtUp(st)
	ask := h.startAsker()

	// Purge the needs stream below the middle of what the seat applied: keys whose only revision was
	// there are gone from the bucket, and no message says so.
	ctx := context.Background()
	stream, err := h.js.Stream(ctx, provisioner.StreamName(provisioner.BucketNeeds))
	require.NoError(t, err)
	applied, _ := st.Store().Applied(provisioner.BucketNeeds)
	require.NoError(t, stream.Purge(ctx, jetstream.WithPurgeSequence(applied/2)))

	h.waitRebuilt(st, ask)
	require.Len(t, generations(t, dir), 1)

	// The rebuilt seat goes on as before: a new write is answered, and a restart resumes.
	kv, err := h.js.KeyValue(ctx, provisioner.BucketNeeds)
	require.NoError(t, err)
	seq, err := kv.Put(ctx, "n09999.mod-x.config.after", []byte{0x01})
	require.NoError(t, err)
	a, _, err := natstest.Ask(h.nc, query.Subject, []byte(fmt.Sprintf(`{"what":"needs","node":"n09999","min_seq":%d,"wait_ms":5000}`, seq)), false)
	require.NoError(t, err)
	require.Len(t, a.Rows, 1)
}

func TestSeat_DeletedStateDirIsRebuiltFromTheStreams(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.load(testMesh.Ops())
	dir := t.TempDir()
	st, stop := h.startSeat(dir)
	h.waitCaughtUp(st)
	stop()
	require.NoError(t, os.RemoveAll(dir))
	st, _ = h.startSeat(dir)
	h.waitCaughtUp(st)
	h.checkAll()
}

func TestSeat_BrokenStateDirStartsOver(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.load(testMesh.Ops())
	dir := t.TempDir()
	st, stop := h.startSeat(dir)
	h.waitCaughtUp(st)
	gen := st.Store().Dir()
	stop()
	m, err := filepath.Glob(filepath.Join(gen, "MANIFEST-*"))
	require.NoError(t, err)
	require.NotEmpty(t, m)
	require.NoError(t, os.WriteFile(m[0], []byte("garbage garbage garbage"), 0o644))

	// What serve does: a state dir this binary cannot read is started over.
	_, err = store.OpenState(dir, store.Options{})
	require.True(t, store.NeedsRebuild(err), "%v", err)
	db, err := store.ResetState(dir, store.Options{})
	require.NoError(t, err)
	require.NoError(t, db.Close())
	require.Len(t, generations(t, dir), 1)
	st, _ = h.startSeat(dir)
	h.waitCaughtUp(st)
	h.checkAll()
}

func TestSeat_RetentionTrimsInTheBackgroundAndAtSays410(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.load(testMesh.Ops())
	nc, js := natstest.Connect(t, h.url)
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	// The clock says it is two hours later: everything loaded is older than the hour kept.
	later := func() time.Time { return time.Now().Add(2 * time.Hour) }
	st, err := seat.Start(context.Background(), nc, js, db, seat.Config{WriteRegistry: true,
		Projector: projector.Options{Poll: 50 * time.Millisecond},
		Retention: &store.RetentionOptions{MaxAge: time.Hour, Every: 50 * time.Millisecond, Now: later}})
	require.NoError(t, err)
	defer st.Stop()
	h.waitCaughtUp(st)
	applied, _ := st.Store().Applied(provisioner.BucketNeeds)
	natstest.CheckFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		v, err := st.Store().View()
		if err != nil {
			return err
		}
		defer v.Close()
		m, err := v.HistoryMarks(provisioner.BucketNeeds)
		if err != nil {
			return err
		}
		if m.Floor != applied || m.Trimmed != applied {
			return fmt.Errorf("floor %d trimmed %d, want %d", m.Floor, m.Trimmed, applied)
		}
		return nil
	})
	rounds, deleted := st.Retention().Stats()
	require.Positive(t, rounds)
	require.Zero(t, deleted, "each key was written once: its one event is the state at the floor, and is kept")

	_, _, err = natstest.Ask(h.nc, query.Subject, []byte(fmt.Sprintf(`{"what":"needs","at":"seq:%d"}`, applied-1)), false)
	var ve *natstest.VerbError
	require.ErrorAs(t, err, &ve)
	require.Equal(t, 410, ve.Code)
	// The newest point still answers, and equals the live answer.
	live, _, err := natstest.Ask(h.nc, query.Subject, []byte(`{"what":"needs","node":"`+fixtures.NodeName(3)+`"}`), false)
	require.NoError(t, err)
	at, _, err := natstest.Ask(h.nc, query.Subject, []byte(fmt.Sprintf(`{"what":"needs","node":%q,"at":"seq:%d"}`, fixtures.NodeName(3), applied)), false)
	require.NoError(t, err)
	require.Equal(t, live.Rows, at.Rows)
	require.Equal(t, live.AsOf, at.AsOf)
}

// waitRebuilt waits until the seat has rebuilt and caught up again, then checks that the asker never
// saw a wrong answer meanwhile and that every answer equals the buckets.
func (h *harness) waitRebuilt(st *seat.Seat, ask *asker) {
	h.t.Helper()
	natstest.CheckFor(h.t, 20*time.Second, 20*time.Millisecond, func() error {
		if st.Rebuilds() == 0 {
			return errors.New("not rebuilt yet")
		}
		return nil
	})
	h.waitCaughtUp(st)
	ask.finish(h.t)
	h.checkAll()
}

// slowListing is a JetStream whose stream listings wait while held: a mesh whose listing of every
// stream takes longer than the fixed buckets' catch-up.
type slowListing struct {
	jetstream.JetStream
	held atomic.Pointer[chan struct{}] // set: listings wait until it is closed
}

func (j *slowListing) ListStreams(ctx context.Context, opts ...jetstream.StreamListOpt) jetstream.StreamInfoLister {
	if held := j.held.Load(); held != nil {
		select {
		case <-*held:
		case <-ctx.Done():
		}
	}
	return j.JetStream.ListStreams(ctx, opts...)
}

// TestPlans_RebuildSwapsInOnceTheComposedBucketsCaughtUp: a rebuild is swapped in only once its
// projector has listed the streams for composed-<node> buckets and caught up with every one that
// existed, as a first start is synced only then: right after the swap, plans answers are synced and
// hold every node's compositions, as before the reset. The stream listing is held back during the
// rebuild, so discovery finds the buckets only once it lists their names itself (two listing
// intervals later), long after the fixed buckets caught up.
func TestPlans_RebuildSwapsInOnceTheComposedBucketsCaughtUp(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	sc := fixtures.Plans()
	h.load(sc.Before)
	h.load(sc.After)
	// More nodes, each with its own bucket and a published composition its host module wants.
	var more []fixtures.Op
	for i := range 20 {
		node := fmt.Sprintf("more-%02d", i)
		more = append(more,
			fixtures.Op{Bucket: provisioner.ComposedPrefix + node, Key: "web.3", Op: provisioner.OpPut, Value: mp(t, map[string]any{"status": "published", "plan": node})},
			fixtures.Op{Bucket: provisioner.BucketHostModules, Key: node + ".web", Op: provisioner.OpPut, Value: mp(t, map[string]any{"want": 3})})
	}
	h.load(more)
	h.load([]fixtures.Op{{Bucket: provisioner.BucketApplied, Key: "edge-1.web", Op: provisioner.OpPut, Value: []byte{0x01}}})

	nc, js := natstest.Connect(t, h.url)
	slow := &slowListing{JetStream: js}
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	st, err := seat.Start(context.Background(), nc, js, db, seat.Config{Plans: true, Streams: streaminfo.New(slow),
		Projector: projector.Options{Poll: 50 * time.Millisecond, DiscoverEvery: time.Hour, Verify: 500 * time.Millisecond}})
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, st.Stop())
		require.NoError(t, db.Close())
	})
	h.waitPlansCaughtUp(st)
	before := h.planAnswers()
	require.Equal(t, true, before["all"].(map[string]any)["synced"])
	require.Contains(t, rowsByKey(before["all"].(map[string]any)["rows"].([]any))["more-19.web"], "plan:more-19")

	// The listing is held, and the applied bucket deleted and created again with the same key: the
	// seat rebuilds, and the plans' inputs are as they were.
	held := make(chan struct{})
	slow.held.Store(&held)
	defer close(held)
	ctx := context.Background()
	require.NoError(t, h.js.DeleteKeyValue(ctx, provisioner.BucketApplied))
	_, err = h.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.BucketApplied, History: 8})
	require.NoError(t, err)
	h.load([]fixtures.Op{{Bucket: provisioner.BucketApplied, Key: "edge-1.web", Op: provisioner.OpPut, Value: []byte{0x01}}})
	natstest.CheckFor(t, 20*time.Second, time.Millisecond, func() error {
		if st.Rebuilds() == 0 {
			return errors.New("not rebuilt yet")
		}
		return nil
	})
	for _, pr := range planRequests {
		a, err := h.askPlans(pr.req, false)
		require.NoError(t, err, pr.name)
		require.Equal(t, true, a["synced"], "%s, right after the swap", pr.name)
		require.Equal(t, before[pr.name], a, "%s, right after the swap", pr.name)
	}
}

// TestPlans_RebuildSwapsInPastAComposedBucketThatCannotBeRead: one node's composed-<node> bucket cannot
// be read (its stream's one consumer is taken), which readiness lets go (Failing). Then a fixed
// bucket's stream is created again: the seat rebuilds, and the rebuild waited for every composed
// bucket to catch up, that one too, so it never swapped in: the old projection answered that bucket
// stale, not synced, and /readyz said 503, for as long as the one node's bucket could not be read. A
// Failing composed bucket is not waited for by the swap, as readiness does not wait for it: it is
// read once it can be.
func TestPlans_RebuildSwapsInPastAComposedBucketThatCannotBeRead(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	sc := fixtures.Plans()
	h.load(sc.Before)
	h.load([]fixtures.Op{{Bucket: provisioner.BucketApplied, Key: "edge-1.web", Op: provisioner.OpPut, Value: []byte{0x01}}})
	ctx := context.Background()
	s2, err := h.js.CreateStream(ctx, jetstream.StreamConfig{Name: "KV_composed-n2", Subjects: []string{"$KV.composed-n2.>"},
		MaxMsgsPerSubject: 1, AllowRollup: true, DenyDelete: true, AllowDirect: true, Storage: jetstream.MemoryStorage, MaxConsumers: 1})
	require.NoError(t, err)
	_, err = h.js.Publish(ctx, "$KV.composed-n2.web.1", mp(t, map[string]any{"status": "published", "plan": "n2"}))
	require.NoError(t, err)
	_, err = s2.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: "other"})
	require.NoError(t, err)

	st, _ := h.startPlansSeatWith(t.TempDir(), projector.Options{Poll: 50 * time.Millisecond, DiscoverEvery: time.Hour, Verify: 200 * time.Millisecond})
	natstest.CheckFor(t, 30*time.Second, 20*time.Millisecond, func() error {
		if !st.Failing("composed-n2") {
			return errors.New("composed-n2 not failing yet")
		}
		return nil
	})
	onlyN2 := func() error {
		if u := st.Unsynced(); !slices.Equal(u, []string{"composed-n2"}) {
			return fmt.Errorf("unsynced: %v", u)
		}
		return nil
	}
	natstest.CheckFor(t, 30*time.Second, 20*time.Millisecond, onlyN2)

	// The applied bucket is deleted and created again, with another key.
	require.NoError(t, h.js.DeleteKeyValue(ctx, provisioner.BucketApplied))
	_, err = h.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.BucketApplied, History: 8})
	require.NoError(t, err)
	h.load([]fixtures.Op{{Bucket: provisioner.BucketApplied, Key: "edge-2.web", Op: provisioner.OpPut, Value: []byte{0x01}}})
	natstest.CheckFor(t, 30*time.Second, 20*time.Millisecond, func() error {
		if st.Rebuilds() == 0 {
			return fmt.Errorf("not rebuilt yet; unsynced: %v", st.Unsynced())
		}
		return nil
	})
	natstest.CheckFor(t, 30*time.Second, 20*time.Millisecond, onlyN2)
	a, _, err := natstest.Ask(h.nc, query.Subject, []byte(`{"what":"applied"}`), false)
	require.NoError(t, err)
	require.True(t, a.Synced)
	require.Len(t, a.Rows, 1)
	require.Equal(t, "edge-2.web", a.Rows[0]["key"])
	require.True(t, st.Failing("composed-n2"), "still cannot be read, and said so")

	// Once it can be read, it is.
	require.NoError(t, s2.DeleteConsumer(ctx, "other"))
	natstest.CheckFor(t, 30*time.Second, 20*time.Millisecond, func() error {
		if seq, synced := st.Store().Applied("composed-n2"); seq != 1 || !synced {
			return fmt.Errorf("composed-n2: applied %d, synced %v", seq, synced)
		}
		return nil
	})
}
