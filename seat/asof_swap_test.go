package seat_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nats.go/micro"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/seat"
	"github.com/novox/mesh-provisioner/store"
)

// startParkingPlansSeat starts a seat with plans whose idle composed-<node> buckets park at once and
// whose streams are listed once an hour: a parked bucket then reads a new message only when it is
// woken. The seat logs into log.
func (h *harness) startParkingPlansSeat(log *natstest.LogBuffer) *seat.Seat {
	h.t.Helper()
	nc, js := natstest.Connect(h.t, h.url)
	db, err := store.OpenState(h.t.TempDir(), store.Options{})
	require.NoError(h.t, err)
	st, err := seat.Start(context.Background(), nc, js, db, seat.Config{Plans: true,
		Logger: slog.New(slog.NewTextHandler(log, &slog.HandlerOptions{Level: slog.LevelInfo})),
		Projector: projector.Options{Poll: 20 * time.Millisecond, DiscoverEvery: time.Hour,
			Verify: time.Hour, ParkAfter: 100 * time.Millisecond}})
	require.NoError(h.t, err)
	h.t.Cleanup(func() {
		require.NoError(h.t, st.Stop())
		require.NoError(h.t, db.Close())
		nc.Close()
	})
	return st
}

// composedAsOf is the as_of of a node's composed-<node> bucket in the verb's plans answer for the node.
// It returns its failures rather than failing the test: the rebuild's hook asks it on its goroutine.
func (h *harness) composedAsOf(node string) (uint64, error) {
	msg, err := h.nc.Request(query.Subject, []byte(fmt.Sprintf(`{"what":"plans","node":%q}`, node)), 10*time.Second)
	if err != nil {
		return 0, err
	}
	if code := msg.Header.Get(micro.ErrorCodeHeader); code != "" {
		return 0, fmt.Errorf("verb error %s: %s", code, msg.Header.Get(micro.ErrorHeader))
	}
	var a struct {
		AsOf map[string]uint64 `json:"as_of"`
	}
	if err := json.Unmarshal(msg.Data, &a); err != nil {
		return 0, fmt.Errorf("a JSON answer: %w", err)
	}
	seq, ok := a.AsOf[provisioner.ComposedPrefix+node]
	if !ok {
		return 0, fmt.Errorf("no as_of of %s in %s", node, msg.Data)
	}
	return seq, nil
}

// atCatchUp is what the rebuild's hook saw, between its catch-up and the swap.
type atCatchUp struct {
	seq   uint64 // the message the replaced projector applied after the rebuild caught up
	asOf  uint64 // the verb's as_of of the bucket then, from the replaced store
	newer uint64 // what the rebuild's store had applied of the bucket then
	err   error
}

// writeBehindTheRebuild has the rebuild, once caught up, wait until the node's composed bucket is
// parked in both projectors, then writes a composition to it and wakes the replaced projector alone:
// the replaced store applies a message the rebuild's store has not read when the swap comes. then,
// when set, runs once the replaced store has it. The hook reports on the returned channel.
func (h *harness) writeBehindTheRebuild(st *seat.Seat, node string, then func() error) <-chan atCatchUp {
	bucket := provisioner.ComposedPrefix + node
	ctx := context.Background()
	kv, err := h.js.KeyValue(ctx, bucket)
	require.NoError(h.t, err)
	val, err := msgpack.Marshal(map[string]any{"status": "published", "plan": "db 3005"})
	require.NoError(h.t, err)
	out := make(chan atCatchUp, 1)
	var once sync.Once
	seat.SetAtCaughtUp(st, func(next *projector.Projector, ndb *store.DB) {
		once.Do(func() {
			var w atCatchUp
			defer func() { out <- w }()
			parked := func() bool { return next.Parked(bucket) && st.Current().Parked(bucket) }
			for deadline := time.Now().Add(20 * time.Second); !parked(); time.Sleep(10 * time.Millisecond) {
				if time.Now().After(deadline) {
					w.err = fmt.Errorf("%s did not park in both projectors", bucket)
					return
				}
			}
			if w.seq, w.err = kv.Put(ctx, "db.3005", val); w.err != nil {
				return
			}
			st.Current().Wake(bucket) // the replaced projector's alone
			for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(10 * time.Millisecond) {
				if have, _ := st.Store().Applied(bucket); have >= w.seq {
					break
				}
				if time.Now().After(deadline) {
					w.err = fmt.Errorf("the replaced store did not apply %d", w.seq)
					return
				}
			}
			if w.asOf, w.err = h.composedAsOf(node); w.err != nil {
				return
			}
			w.newer, _ = ndb.Applied(bucket)
			if then != nil {
				w.err = then()
			}
		})
	})
	return out
}

func awaitCatchUp(t *testing.T, at <-chan atCatchUp) atCatchUp {
	t.Helper()
	select {
	case w := <-at:
		require.NoError(t, w.err)
		return w
	case <-time.After(60 * time.Second):
		t.Fatal("the rebuild did not catch up")
		return atCatchUp{}
	}
}

// startVerifyingSeat starts a seat over the harness's server, its projector checking the streams
// every 200 ms (a purge or a recreated stream is found, and rebuilt for, at once), its log kept; it
// stops when the test ends, and the log is printed if the test failed.
func (h *harness) startVerifyingSeat() (*seat.Seat, *natstest.LogBuffer) {
	t := h.t
	log := &natstest.LogBuffer{}
	nc, js := natstest.Connect(t, h.url)
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	st, err := seat.Start(context.Background(), nc, js, db, seat.Config{WriteRegistry: true,
		Logger:    slog.New(slog.NewTextHandler(log, nil)),
		Projector: projector.Options{Poll: 50 * time.Millisecond, Verify: 200 * time.Millisecond}})
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, st.Stop())
		require.NoError(t, db.Close())
		if t.Failed() {
			t.Log(log.String())
		}
	})
	return st, log
}

func awaitRebuilt(t *testing.T, st *seat.Seat) {
	t.Helper()
	natstest.CheckFor(t, 20*time.Second, time.Millisecond, func() error {
		if st.Rebuilds() == 0 {
			return errors.New("not swapped in yet")
		}
		return nil
	})
}

// TestSeat_AsOfNeverGoesBackAcrossARebuildSwap: CONTRACT section 3, as_of is the sequence the
// projection had applied when it answered. A rebuild's projection caught up; then a composition is
// written to a node's bucket that the replaced projector applies and the rebuild's, parked on that
// bucket, has not read when the swap comes. An answer right after the swap, without min_seq, used to
// come from the rebuild's store at once: as_of below the one given just before the swap, the
// projection gone back in time. The swap now waits until the new store has applied, bucket by bucket,
// what the replaced one had (waking a parked bucket to read it).
func TestSeat_AsOfNeverGoesBackAcrossARebuildSwap(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	sc := fixtures.Plans()
	h.load(sc.Before)
	st := h.startParkingPlansSeat(&natstest.LogBuffer{})
	h.waitPlansCaughtUp(st)
	const node = "edge-1"
	at := h.writeBehindTheRebuild(st, node, nil)
	recreateHostModules(t, h, sc)
	w := awaitCatchUp(t, at)
	require.Equal(t, w.seq, w.asOf, "before the swap the replaced store answers, and has the message")
	require.Less(t, w.newer, w.seq, "the rebuild's store has not read it: the swap comes with it behind")

	awaitRebuilt(t, st)
	asOf, err := h.composedAsOf(node)
	require.NoError(t, err)
	require.GreaterOrEqual(t, asOf, w.asOf, "as_of went back across the swap")
	have, _ := st.Store().Applied(provisioner.ComposedPrefix + node)
	require.GreaterOrEqual(t, have, w.seq, "the store swapped in is behind the one it replaced")
}

// TestSeat_RebuildSwapWaitIsBounded: a bucket the rebuild's store cannot reach (its stream deleted
// after the replaced projector read its last message, before the rebuild's read it, and not yet
// confirmed deleted) does not hold the swap: the seat swaps in after its bound, and says once which
// buckets were behind.
func TestSeat_RebuildSwapWaitIsBounded(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	sc := fixtures.Plans()
	h.load(sc.Before)
	log := &natstest.LogBuffer{}
	st := h.startParkingPlansSeat(log)
	seat.SetSwapWait(st, 200*time.Millisecond)
	h.waitPlansCaughtUp(st)
	const node = "edge-1"
	at := h.writeBehindTheRebuild(st, node, func() error {
		return h.js.DeleteKeyValue(context.Background(), provisioner.ComposedPrefix+node)
	})
	recreateHostModules(t, h, sc)
	w := awaitCatchUp(t, at)
	require.Less(t, w.newer, w.seq)

	awaitRebuilt(t, st)
	const line = "rebuild swapped in behind the replaced projection"
	require.Equal(t, 1, strings.Count(log.String(), line), log.String())
	for _, l := range strings.Split(log.String(), "\n") {
		if strings.Contains(l, line) {
			require.Contains(t, l, provisioner.ComposedPrefix+node)
			require.Contains(t, l, "buckets=1")
		}
	}
}

// TestSeat_RebuildSwapDoesNotWaitWhereGoingBackIsRight: the swap waits for nothing the new store
// cannot reach. The needs stream is purged whole (the rebuild's cause: the new store applies nothing
// of it, and its as_of stays 0 until the next write) and the applied stream created again (its
// sequences start over, below what the replaced store applied): with a swap wait of an hour, the
// rebuild still swaps in, and answers as the buckets are. (Waiting for either, it swapped in only
// after the hour.)
func TestSeat_RebuildSwapDoesNotWaitWhereGoingBackIsRight(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.load(testMesh.Ops())
	st, _ := h.startVerifyingSeat()
	seat.SetSwapWait(st, time.Hour)
	h.waitCaughtUp(st)
	before, _ := st.Store().Applied(provisioner.BucketApplied)
	require.Greater(t, before, uint64(3))

	ctx := context.Background()
	stream, err := h.js.Stream(ctx, provisioner.StreamName(provisioner.BucketNeeds))
	require.NoError(t, err)
	require.NoError(t, stream.Purge(ctx))
	require.NoError(t, h.js.DeleteKeyValue(ctx, provisioner.BucketApplied))
	_, err = h.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.BucketApplied, History: 8})
	require.NoError(t, err)
	h.load([]fixtures.Op{{Bucket: provisioner.BucketApplied, Key: "n-again.mod", Op: provisioner.OpPut, Value: []byte{0x01}}})

	awaitRebuilt(t, st)
	// A purged bucket's as_of stays 0 until its next write.
	h.load([]fixtures.Op{{Bucket: provisioner.BucketNeeds, Key: "n-again.mod.config.k", Op: provisioner.OpPut, Value: []byte{0x01}}})
	h.waitCaughtUp(st)
	h.checkAll()
}

// TestSeat_RebuildSwapDoesNotWaitForARemovedTail: a bucket whose stream's last messages were removed
// after the replaced projector applied them (a per-message TTL and its marker expired, or an operator
// removed them) holds nothing the new store can read up to the replaced one's position: the rebuild's
// store stops at the newest message left. With a swap wait of an hour the rebuild still swaps in, and
// the bucket answers as it is. (The swap used to wait for that removed tail: every rebuild of such a
// mesh stalled for the whole bound.)
func TestSeat_RebuildSwapDoesNotWaitForARemovedTail(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.load(testMesh.Ops())
	st, _ := h.startVerifyingSeat()
	seat.SetSwapWait(st, time.Hour)
	h.waitCaughtUp(st)

	ctx := context.Background()
	stream, err := h.js.Stream(ctx, provisioner.StreamName(provisioner.BucketNeeds))
	require.NoError(t, err)
	cfg := stream.CachedInfo().Config
	cfg.AllowMsgTTL, cfg.SubjectDeleteMarkerTTL = true, time.Second
	_, err = h.js.UpdateStream(ctx, cfg)
	require.NoError(t, err)
	var lastPut uint64
	for _, k := range []string{"n-tail.mod.config.a", "n-tail.mod.config.b"} {
		msg := nats.NewMsg(provisioner.SubjectPrefix(provisioner.BucketNeeds) + k)
		msg.Data = []byte{0x01}
		msg.Header.Set("Nats-TTL", "1s")
		ack, err := h.js.PublishMsg(ctx, msg)
		require.NoError(t, err)
		lastPut = ack.Sequence
	}
	// Each expires, its marker comes, and the markers expire too: the stream's last messages are gone.
	// Both markers must have come: the puts may expire before their markers are written, and the
	// stream's last message then is the second put, already gone.
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		info, err := stream.Info(ctx)
		if err != nil {
			return err
		}
		if info.State.LastSeq < lastPut+2 {
			return fmt.Errorf("the markers have not both come: last sequence %d, puts up to %d", info.State.LastSeq, lastPut)
		}
		if _, err := stream.GetMsg(ctx, info.State.LastSeq); !errors.Is(err, jetstream.ErrMsgNotFound) {
			return fmt.Errorf("the stream still holds its last message %d (%v)", info.State.LastSeq, err)
		}
		if info.State.Msgs == 0 {
			return errors.New("the stream holds nothing: not the case here")
		}
		if have, _ := st.Store().Applied(provisioner.BucketNeeds); have < info.State.LastSeq {
			return fmt.Errorf("the replaced store applied %d of %d", have, info.State.LastSeq)
		}
		return nil
	})
	before, _ := st.Store().Applied(provisioner.BucketNeeds)

	// The rebuild's cause: the applied bucket created again.
	require.NoError(t, h.js.DeleteKeyValue(ctx, provisioner.BucketApplied))
	_, err = h.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.BucketApplied, History: 8})
	require.NoError(t, err)
	h.load([]fixtures.Op{{Bucket: provisioner.BucketApplied, Key: "n-again.mod", Op: provisioner.OpPut, Value: []byte{0x01}}})

	awaitRebuilt(t, st)
	have, _ := st.Store().Applied(provisioner.BucketNeeds)
	require.Less(t, have, before, "the rebuilt store stops at the newest message left")
}

// TestSeat_ResetDuringTheSwapWaitIsNotLost: a stream created again after the rebuild caught up and
// before its swap (during the swap's wait, up to 5 s) is reported by the rebuild's projector, whose
// consumer of that bucket then stops. The report used to be dropped: the rebuilt store was swapped in
// with the bucket marked synced, at the old stream's position, and answered the deleted stream's rows
// for good. Now the swap carries it over: the bucket answers unsynced, and another rebuild reads the
// new stream.
func TestSeat_ResetDuringTheSwapWaitIsNotLost(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.load(testMesh.Ops())
	st, _ := h.startVerifyingSeat()
	h.waitCaughtUp(st)

	ctx := context.Background()
	held := make(chan string, 8)
	seat.SetHeldReset(st, func(bucket string) { held <- bucket })
	hookErr := make(chan error, 1)
	var once sync.Once
	seat.SetBeforeSwap(st, func(*projector.Projector) {
		once.Do(func() {
			hookErr <- func() error {
				if err := h.js.DeleteKeyValue(ctx, provisioner.BucketNeeds); err != nil {
					return err
				}
				if _, err := h.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.BucketNeeds, History: 8}); err != nil {
					return err
				}
				h.load([]fixtures.Op{{Bucket: provisioner.BucketNeeds, Key: "n-again.mod.config.k", Op: provisioner.OpPut, Value: []byte{0x01}}})
				select {
				case b := <-held:
					if b != provisioner.BucketNeeds {
						return fmt.Errorf("reset of %s, not of the needs", b)
					}
					return nil
				case <-time.After(20 * time.Second):
					return errors.New("the rebuild's projector did not report the needs stream created again")
				}
			}()
		})
	})

	// The rebuild's cause: the applied bucket created again.
	require.NoError(t, h.js.DeleteKeyValue(ctx, provisioner.BucketApplied))
	_, err := h.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.BucketApplied, History: 8})
	require.NoError(t, err)
	h.load([]fixtures.Op{{Bucket: provisioner.BucketApplied, Key: "n-again.mod", Op: provisioner.OpPut, Value: []byte{0x01}}})

	select {
	case err := <-hookErr:
		require.NoError(t, err)
	case <-time.After(60 * time.Second):
		t.Fatal("the rebuild did not come to its swap")
	}
	// Another rebuild reads the needs stream as it is now.
	natstest.CheckFor(t, 30*time.Second, 20*time.Millisecond, func() error {
		if n := st.Rebuilds(); n < 2 {
			return fmt.Errorf("%d rebuilds swapped in", n)
		}
		return nil
	})
	h.waitCaughtUp(st)
	h.checkAll()
}
