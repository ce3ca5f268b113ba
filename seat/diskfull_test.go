package seat_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/faultfs"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/internal/verbcheck"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/seat"
	"github.com/novox/mesh-provisioner/store"
)

// TestSeat_DiskFillsMidIngest: the state dir's disk fills while the seat ingests, past the reserve
// Apply checks (the disk under Pebble refuses every write with ENOSPC while statfs still shows room:
// another process filling it between the check and the commit). Pebble used to panic in its commit
// pipeline and take the seat down. Now the seat goes on answering (the bucket held says synced:
// false), logs once that it is out of room, naming the state dir, and once there is room again
// catches up by itself: the verb equals the buckets, and every message was applied exactly once.
func TestSeat_DiskFillsMidIngest(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.load(testMesh.Ops())

	var full atomic.Bool
	var refused atomic.Int64
	fs := faultfs.Writes(func() bool {
		if !full.Load() {
			return false
		}
		refused.Add(1)
		return true
	}, syscall.ENOSPC)
	var logs natstest.LogBuffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	dir := t.TempDir()
	db, err := store.OpenState(dir, store.Options{FS: fs, MinFreeBytes: 1 << 20, Logger: log})
	require.NoError(t, err)
	nc, js := natstest.Connect(t, h.url)
	st, err := seat.Start(context.Background(), nc, js, db, seat.Config{Logger: log, WriteRegistry: true,
		Projector: projector.Options{Poll: 50 * time.Millisecond, Verify: 200 * time.Millisecond}})
	require.NoError(t, err)
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			full.Store(false) // a stop waits for room, as a write does
			require.NoError(t, st.Stop())
			require.NoError(t, db.Close())
		}
	}
	t.Cleanup(stop)
	h.waitCaughtUp(st)

	// The disk fills; updates keep coming.
	full.Store(true)
	more := fixtures.Mesh{Seed: 8, Nodes: 24, Modules: 4, NeedsPerModule: 3, Collections: 4}.Ops()
	loaded := make(chan error, 1)
	go func() { loaded <- fixtures.Load(context.Background(), h.js, more, 256, nil) }()
	natstest.CheckFor(t, 20*time.Second, 10*time.Millisecond, func() error {
		if !db.OutOfRoom() || refused.Load() == 0 {
			return fmt.Errorf("the store has not found the disk full (%d writes refused)", refused.Load())
		}
		return nil
	})
	// It answers meanwhile, and a bucket it could not write says it is behind.
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		for _, s := range provisioner.ProvisionerShapes {
			a, _, err := natstest.Ask(h.nc, query.Subject, []byte(fmt.Sprintf(`{"what":%q,"limit":1}`, whatOf(s.Bucket))), false)
			if err != nil {
				return err
			}
			if !a.Synced {
				return nil
			}
		}
		return fmt.Errorf("every bucket answers synced on a full disk")
	})
	require.NoError(t, <-loaded)
	require.True(t, db.OutOfRoom(), "still out of room")

	// Room again: it carries on by itself.
	full.Store(false)
	h.waitCaughtUp(st)
	truth, err := verbcheck.ReadTruth(context.Background(), h.js)
	require.NoError(t, err)
	for _, req := range requests() {
		require.NoError(t, truth.Check(h.nc, req, false, 0))
	}
	// Exactly once: the seat started on an empty state dir, so it applied each stream's every message.
	var total int64
	for _, s := range provisioner.ProvisionerShapes {
		stream, err := h.js.Stream(context.Background(), provisioner.StreamName(s.Bucket))
		require.NoError(t, err)
		info, err := stream.Info(context.Background())
		require.NoError(t, err)
		total += int64(info.State.LastSeq)
	}
	require.Equal(t, total, st.Projector.Applied(), "messages applied, against the streams' messages")

	out := logs.String()
	require.Equal(t, 1, strings.Count(out, "the state dir is out of room"), out)
	require.Contains(t, out, dir)
	require.Equal(t, 1, strings.Count(out, "the state dir has room again"), out)
	require.NotContains(t, out, "applying a batch failed", "the store said it once, not each bucket")
	require.NotContains(t, out, "panic")

	// And what it committed is on disk: a restart resumes from it, applying nothing again.
	stop()
	st, _ = h.startSeat(dir)
	h.waitCaughtUp(st)
	require.Zero(t, st.Projector.Applied(), "messages applied again after the restart")
}

// whatOf is the verb's what for a provisioner bucket.
func whatOf(bucket string) string {
	return strings.TrimPrefix(bucket, "mesh-provisioner_")
}

// TestSeat_StatsWhileAWriteWaitsForRoom: the micro STATS answer (Seat.Stats) read each bucket's
// anomaly rows through Checkpoint, which waits for the Apply in progress; a batch whose write waits
// for room in the state dir holds it for as long as the disk is full, so `nats micro stats` hung on
// a full disk, just when an operator asks where the seat stands. Stats reads what is committed
// without waiting: it answers, saying the held bucket is not synced.
func TestSeat_StatsWhileAWriteWaitsForRoom(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.load(testMesh.Ops())

	var full atomic.Bool
	fs := faultfs.Writes(full.Load, syscall.ENOSPC)
	db, err := store.OpenState(t.TempDir(), store.Options{FS: fs, MinFreeBytes: 1 << 20})
	require.NoError(t, err)
	nc, js := natstest.Connect(t, h.url)
	st, err := seat.Start(context.Background(), nc, js, db, seat.Config{WriteRegistry: true,
		Projector: projector.Options{Poll: 50 * time.Millisecond, Verify: 200 * time.Millisecond}})
	require.NoError(t, err)
	t.Cleanup(func() {
		full.Store(false) // a stop waits for room, as a write does
		require.NoError(t, st.Stop())
		require.NoError(t, db.Close())
	})
	h.waitCaughtUp(st)
	anomalyRows := st.Stats().Buckets[provisioner.BucketNeeds].AnomalyRows

	// One message at the stream's end: its batch is synced, and waits for room in its commit.
	full.Store(true)
	kv, err := h.js.KeyValue(context.Background(), provisioner.BucketNeeds)
	require.NoError(t, err)
	_, err = kv.Put(context.Background(), "held.m.config.a", []byte{0x01})
	require.NoError(t, err)
	natstest.CheckFor(t, 20*time.Second, 10*time.Millisecond, func() error {
		if !db.WritesHeld() {
			return fmt.Errorf("no write held for room yet")
		}
		return nil
	})

	stats := make(chan seat.Stats, 1)
	go func() { stats <- st.Stats() }()
	got := natstest.Receive(t, stats, 10*time.Second, "the stats wait for the write held for room")
	require.False(t, got.Synced, "a bucket's batch waits for room")
	require.False(t, got.Buckets[provisioner.BucketNeeds].Synced)
	require.Equal(t, anomalyRows, got.Buckets[provisioner.BucketNeeds].AnomalyRows, "what is committed")
}

// TestSeat_RebuildWaitsForRoom: a rebuild fills its new generation through a store of its own, whose
// writes a full disk holds like the current store's. WritesHeld said only whether the current store's
// were, so serve, which stops without draining on a held write, went into a stop that waited for the
// rebuild's. It covers the new generation too, naming it; the operator is told that generation is out
// of room (the seat's logger, though Config.Store set none); and once there is room the rebuild goes
// on and swaps in, answering as the buckets.
func TestSeat_RebuildWaitsForRoom(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.load(testMesh.Ops())

	var logs natstest.LogBuffer
	// The disk fills once the rebuild's new generation is open, for its store alone.
	fs, room := faultfs.FullOnceLogged(t, &logs, "rebuild started")
	st, db, _ := h.rebuildOnFullDiskSeat(fs, room, &logs)
	_, held := st.WritesHeld()
	require.False(t, held)

	var fresh []fixtures.Op
	for i := range 30 {
		fresh = append(fresh, fixtures.Op{Bucket: provisioner.BucketApplied, Key: fmt.Sprintf("%s.mod-new%d", fixtures.NodeName(i%5), i), Op: provisioner.OpPut, Value: []byte{0x01}})
	}
	h.recreateApplied(fresh...)
	var dir string
	natstest.CheckFor(t, 20*time.Second, 10*time.Millisecond, func() error {
		if dir, held = st.WritesHeld(); !held {
			return fmt.Errorf("no write of the rebuild held for room yet")
		}
		return nil
	})
	require.NotEqual(t, db.Dir(), dir, "the held write is the new generation's")
	require.False(t, db.WritesHeld())
	out := logs.String()
	require.Equal(t, 1, strings.Count(out, "the state dir is out of room"), out)
	require.Contains(t, out[strings.Index(out, "the state dir is out of room"):], "state="+dir)

	// Room again: the rebuild goes on and swaps in.
	room.Store(true)
	awaitRebuilt(t, st)
	require.Equal(t, dir, st.Store().Dir())
	h.waitCaughtUp(st)
	h.checkAll()
	_, held = st.WritesHeld()
	require.False(t, held)
	require.Contains(t, logs.String(), "the state dir has room again")
}

// TestSeat_RebuildOpensOnAFullDisk: the disk is full when a rebuild opens its new generation (statfs
// shows room, writes fail: another process fills it). Pebble's open wrote through the store's
// disk-full wrapper and waited for room inside store.Open, before the seat knew of the new store:
// WritesHeld said nothing was held, so serve's SIGTERM went into a clean stop that waited for the
// open, for as long as the disk stayed full, and nothing said why the rebuild stood still. The open
// now finds the disk full with a test write before Pebble writes anything and fails: the rebuild says
// so (the generation, no room, what to do), leaves no half generation, the current generation keeps
// answering, and once there is room a retry swaps in.
func TestSeat_RebuildOpensOnAFullDisk(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.load(testMesh.Ops())

	var logs natstest.LogBuffer
	// The disk fills for the rebuild's new generation as soon as a rebuild is asked for.
	fs, room := faultfs.FullOnceLogged(t, &logs, "bucket cannot be resumed")
	st, db, state := h.rebuildOnFullDiskSeat(fs, room, &logs)
	h.recreateApplied()

	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		out := logs.String()
		if !strings.Contains(out, "rebuild failed") {
			return fmt.Errorf("the rebuild has not said it failed")
		}
		if _, held := st.WritesHeld(); held {
			return fmt.Errorf("a write is held")
		}
		return nil
	})
	out := logs.String()
	line := out[strings.Index(out, "rebuild failed"):]
	line, _, _ = strings.Cut(line, "\n")
	require.Contains(t, line, "no room to write in the state dir", line)
	require.Contains(t, line, "free space on that disk", line)
	require.Contains(t, line, "the current generation answers meanwhile", line)
	require.Contains(t, line, state, "names the generation")
	// No half generation is left between the tries, and the current one answers.
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		gens, err := filepath.Glob(filepath.Join(state, "gen-*"))
		if err != nil {
			return err
		}
		if len(gens) != 1 || gens[0] != db.Dir() {
			return fmt.Errorf("generations %v, want only %s", gens, db.Dir())
		}
		return nil
	})
	a, _, err := natstest.Ask(h.nc, query.Subject, []byte(`{"what":"needs","limit":1}`), false)
	require.NoError(t, err)
	require.Len(t, a.Rows, 1)
	require.NotContains(t, logs.String(), "panic")

	// Room again: a retry opens the new generation, fills it and swaps it in.
	room.Store(true)
	natstest.CheckFor(t, 40*time.Second, 20*time.Millisecond, func() error {
		if st.Rebuilds() == 0 {
			return fmt.Errorf("not rebuilt yet")
		}
		return nil
	})
	h.waitCaughtUp(st)
	h.checkAll()
}

// TestSeat_StopContextWhileAWriteWaitsForRoom: a library's Stop while a batch's write waits for room in
// the state dir waited for room, for as long as the disk stayed full, with no way out (serve has its
// own: it exits without draining). StopContext gives up when its context ends, saying the state dir
// is out of room and that the last batch was not committed. Nothing is lost: what is on disk then (a
// copy of the state dir, as a kill would leave it) holds the held bucket's checkpoint before the held
// message, and a seat started on it reads that message again and answers as the buckets. Once there is
// room, the stop that went on by itself ends, and a later Stop returns its result.
func TestSeat_StopContextWhileAWriteWaitsForRoom(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.load(testMesh.Ops())

	var full atomic.Bool
	fs := faultfs.Writes(full.Load, syscall.ENOSPC)
	state := t.TempDir()
	db, err := store.OpenState(state, store.Options{FS: fs, MinFreeBytes: 1 << 20})
	require.NoError(t, err)
	nc, js := natstest.Connect(t, h.url)
	st, err := seat.Start(context.Background(), nc, js, db, seat.Config{WriteRegistry: true,
		Projector: projector.Options{Poll: 50 * time.Millisecond, Verify: 200 * time.Millisecond}})
	require.NoError(t, err)
	t.Cleanup(func() {
		full.Store(false)
		require.NoError(t, st.Stop())
		require.NoError(t, db.Close())
	})
	h.waitCaughtUp(st)
	before, _ := db.Applied(provisioner.BucketNeeds)

	// One message at the stream's end: its batch is synced, and waits for room in its commit.
	full.Store(true)
	kv, err := h.js.KeyValue(context.Background(), provisioner.BucketNeeds)
	require.NoError(t, err)
	heldSeq, err := kv.Put(context.Background(), "held.m.config.a", []byte{0x01})
	require.NoError(t, err)
	natstest.CheckFor(t, 20*time.Second, 10*time.Millisecond, func() error {
		if !db.WritesHeld() {
			return fmt.Errorf("no write held for room yet")
		}
		return nil
	})

	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	stopped := make(chan error, 1)
	go func() { stopped <- st.StopContext(ctx) }()
	stopErr := natstest.Receive(t, stopped, 10*time.Second, "StopContext waits for room past its context")
	require.ErrorIs(t, stopErr, seat.ErrNotDrained)
	require.ErrorIs(t, stopErr, context.DeadlineExceeded)
	require.Contains(t, stopErr.Error(), "out of room")
	require.Contains(t, stopErr.Error(), db.Dir())
	require.True(t, db.WritesHeld(), "the write still waits: nothing was let through")

	// What is on disk now, as a kill would leave it: the held batch is not in it, and its checkpoint
	// did not move.
	crashed := filepath.Join(t.TempDir(), "state")
	require.NoError(t, os.CopyFS(crashed, os.DirFS(state)))
	cdb, err := store.OpenState(crashed, store.Options{})
	require.NoError(t, err)
	seq, _ := cdb.Applied(provisioner.BucketNeeds)
	require.Equal(t, before, seq, "the checkpoint on disk is the last committed batch's")
	require.Less(t, seq, heldSeq)
	require.NoError(t, cdb.Close())
	// A seat started on it reads the held message again and answers as the buckets.
	st2, stop2 := h.startSeat(crashed)
	h.waitCaughtUp(st2)
	seq, _ = st2.Store().Applied(provisioner.BucketNeeds)
	require.GreaterOrEqual(t, seq, heldSeq)
	h.checkAll()
	stop2()

	// Room again: the stop that went on ends, and Stop says how.
	full.Store(false)
	require.NoError(t, st.Stop())
	require.False(t, db.WritesHeld())
}

// TestSeat_RebuildOpenWaitsForRoom: the disk fills after the open of a rebuild's new generation found
// room (its test write went through) and before Pebble's first write, which waits for room inside
// store.Open, before the seat holds the new store. WritesHeld said nothing was held, so serve's
// SIGTERM went into a clean stop that waited for the open. It names the generation being opened; once
// there is room the open goes on and the rebuild swaps in.
func TestSeat_RebuildOpenWaitsForRoom(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.load(testMesh.Ops())

	var logs natstest.LogBuffer
	fs, room := faultfs.FullOnceLoggedButProbe(t, &logs, "bucket cannot be resumed")
	st, db, state := h.rebuildOnFullDiskSeat(fs, room, &logs)
	h.recreateApplied()

	var dir string
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		var held bool
		if dir, held = st.WritesHeld(); !held {
			return fmt.Errorf("no write held for room (rebuild started: %v)", strings.Contains(logs.String(), "rebuild started"))
		}
		return nil
	})
	require.NotEqual(t, db.Dir(), dir)
	require.Equal(t, state, filepath.Dir(dir), "a generation of the state dir")
	require.NotContains(t, logs.String(), "rebuild started", "held in the open")
	require.ErrorIs(t, st.OutOfRoom(), store.ErrNoSpace, "readyz and the stats say so")
	require.Contains(t, st.OutOfRoom().Error(), dir)

	room.Store(true)
	awaitRebuilt(t, st)
	require.Equal(t, dir, st.Store().Dir())
	h.waitCaughtUp(st)
	h.checkAll()
}

// rebuildOnFullDiskSeat starts a seat on a state dir of its own whose rebuilds open their new
// generations on fs (a disk that fills: faultfs), logging to logs, caught up with the harness's mesh;
// room is set before it stops, since a stop waits for room as a write does.
func (h *harness) rebuildOnFullDiskSeat(fs vfs.FS, room *atomic.Bool, logs *natstest.LogBuffer) (st *seat.Seat, db *store.DB, state string) {
	t := h.t
	t.Helper()
	state = t.TempDir()
	db, err := store.OpenState(state, store.Options{})
	require.NoError(t, err)
	nc, js := natstest.Connect(t, h.url)
	st, err = seat.Start(context.Background(), nc, js, db, seat.Config{Logger: slog.New(slog.NewTextHandler(logs, nil)), WriteRegistry: true,
		Projector: projector.Options{Poll: 50 * time.Millisecond, Verify: 200 * time.Millisecond},
		Store:     store.Options{FS: fs, MinFreeBytes: 1 << 20}})
	require.NoError(t, err)
	t.Cleanup(func() {
		room.Store(true)
		require.NoError(t, st.Stop())
		require.NoError(t, db.Close())
	})
	h.waitCaughtUp(st)
	return st, db, state
}

// recreateApplied deletes the applied bucket and creates it again holding ops (one key when none),
// which a seat rebuilds on.
func (h *harness) recreateApplied(ops ...fixtures.Op) {
	h.t.Helper()
	require.NoError(h.t, h.js.DeleteKeyValue(context.Background(), provisioner.BucketApplied))
	_, err := h.js.CreateKeyValue(context.Background(), jetstream.KeyValueConfig{Bucket: provisioner.BucketApplied, History: 8})
	require.NoError(h.t, err)
	if len(ops) == 0 {
		ops = []fixtures.Op{{Bucket: provisioner.BucketApplied, Key: "n1.mod-new", Op: provisioner.OpPut, Value: []byte{0x01}}}
	}
	h.load(ops)
}
