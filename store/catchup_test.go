package store

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
)

// fill applies n needs with values of about 1 KiB, from seq on, and flushes: one L0 sublevel each call
// (every call writes the whole key range again).
func fill(t *testing.T, db *DB, seq *uint64, n int) {
	t.Helper()
	val := append([]byte{0xc5, 0x04, 0x00}, make([]byte, 1024)...) // bin 16 of 1024 bytes
	msgs := make([]provisioner.Message, 0, n)
	for i := 0; i < n; i++ {
		*seq++
		msgs = append(msgs, provisioner.Message{Seq: *seq, Time: int64(*seq), Key: fmt.Sprintf("n%04d.m.config.x", i), Op: provisioner.OpPut, Value: val})
	}
	require.NoError(t, db.Apply(provisioner.BucketNeeds, msgs, 0, false))
	require.NoError(t, db.pdb.Flush())
}

func compactions(db *DB) int64 { return db.pdb.Metrics().Compact.Count }

// TestCatchingUp_HoldsCompactionsUntilTheEnd: while a bucket is far behind its stream, flushes pile up
// in L0 with no compaction; when it reaches its stream's end, the compactions that waited run.
func TestCatchingUp_HoldsCompactionsUntilTheEnd(t *testing.T) {
	db, err := Open(t.TempDir(), Options{MemTableSize: 4 << 20})
	require.NoError(t, err)
	defer db.Close()
	var seq uint64
	db.CatchingUp(provisioner.BucketNeeds, CatchUpBehind)
	for i := 0; i < 10; i++ { // past L0CompactionThreshold (8), short of maxHeldFlushes
		fill(t, db, &seq, 500)
	}
	time.Sleep(300 * time.Millisecond) // the grant loop runs every 100 ms: it had its chances
	require.Zero(t, compactions(db), "no compaction while catching up")
	require.True(t, db.CompactionsHeld())
	require.GreaterOrEqual(t, db.pdb.Metrics().Levels[0].Sublevels, int32(10))

	db.CatchingUp(provisioner.BucketNeeds, 1) // nearer than CatchUpBehind, but not at the end yet
	time.Sleep(300 * time.Millisecond)
	require.Zero(t, compactions(db), "a catch-up holds compactions until its stream's end")

	db.CatchingUp(provisioner.BucketNeeds, 0)
	require.False(t, db.CompactionsHeld())
	require.Eventually(t, func() bool { return compactions(db) > 0 }, 30*time.Second, 10*time.Millisecond)
}

// TestCatchingUp_Bounded: a catch-up that never says it ended (or one larger than the gate is meant
// for) holds compactions for maxHeldFlushes flushes at most; CompactAll does not wait for it either.
func TestCatchingUp_Bounded(t *testing.T) {
	db, err := Open(t.TempDir(), Options{MemTableSize: 4 << 20})
	require.NoError(t, err)
	defer db.Close()
	var seq uint64
	db.CatchingUp(provisioner.BucketNeeds, CatchUpBehind)
	fill(t, db, &seq, 500)
	fill(t, db, &seq, 500)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, db.CompactAll(ctx))
	require.Positive(t, compactions(db))
	require.Zero(t, db.pdb.Metrics().Levels[0].Sublevels)

	n := compactions(db)
	for i := 0; i < maxHeldFlushes; i++ {
		fill(t, db, &seq, 500)
	}
	require.Eventually(t, func() bool { return compactions(db) > n }, 30*time.Second, 10*time.Millisecond,
		"compactions run again after maxHeldFlushes flushes, catching up or not")
}

// TestBulkLoad_HoldsUntilClose: a bulk load holds compactions after its buckets caught up, and the store
// it leaves is compacted by the next open.
func TestBulkLoad_HoldsUntilClose(t *testing.T) {
	dir := t.TempDir()
	db, err := Open(dir, Options{MemTableSize: 4 << 20})
	require.NoError(t, err)
	db.BulkLoad()
	var seq uint64
	db.CatchingUp(provisioner.BucketNeeds, CatchUpBehind)
	for i := 0; i < 10; i++ {
		fill(t, db, &seq, 500)
	}
	db.CatchingUp(provisioner.BucketNeeds, 0)
	time.Sleep(300 * time.Millisecond)
	require.Zero(t, compactions(db), "a bulk load holds compactions until Close")
	require.NoError(t, db.Close())

	db, err = Open(dir, Options{MemTableSize: 4 << 20})
	require.NoError(t, err)
	defer db.Close()
	require.Eventually(t, func() bool { return compactions(db) > 0 }, 30*time.Second, 10*time.Millisecond,
		"the next open compacts what the bulk load left in L0")
}

// TestCompact_ACancelledManualCompactionIsNotCancelledInPebble: a manual compaction asked for while a
// catch-up holds compactions back (the event log's, after a trim by size) is picked by Pebble and held
// for the scheduler's next grant. Pebble cancelled it when the asker's context ended (a seat
// stopping), dropping it from its queue but not from what it held, and the grant after the catch-up
// panicked ("did not find manual compaction with id 1"), taking the process down. The asker now
// returns at once and Pebble carries on: the compaction runs when the wait ends, or ends with Close.
func TestCompact_ACancelledManualCompactionIsNotCancelledInPebble(t *testing.T) {
	start := func(t *testing.T) (*DB, context.CancelFunc, chan error) {
		db, err := Open(t.TempDir(), Options{MemTableSize: 4 << 20})
		require.NoError(t, err)
		var seq uint64
		db.CatchingUp(provisioner.BucketNeeds, CatchUpBehind)
		for i := 0; i < 3; i++ {
			fill(t, db, &seq, 500)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- db.compact(ctx, []byte{prefixHistory}, []byte{prefixEvent + 1}, false) }()
		// Picked and held: the catch-up grants nothing.
		require.Never(t, func() bool { return len(done) > 0 }, 300*time.Millisecond, 10*time.Millisecond)
		require.Zero(t, compactions(db))
		cancel()
		require.ErrorIs(t, <-done, context.Canceled, "the asker returns at once")
		return db, cancel, done
	}
	t.Run("the wait ends", func(t *testing.T) {
		db, _, _ := start(t)
		defer db.Close()
		db.CatchingUp(provisioner.BucketNeeds, 0)
		require.Eventually(t, func() bool { return compactions(db) > 0 }, 30*time.Second, 10*time.Millisecond, "it runs")
	})
	t.Run("the store closes first", func(t *testing.T) {
		db, _, _ := start(t)
		require.NoError(t, db.Close(), "Close does not wait for a compaction that never started")
	})
}

// TestFirstFill_HoldsCompactionsLonger: a first fill's store without a log (FirstFillNoWAL), whose tables
// the seat checkpoints into the store it compacts, holds its compactions past maxHeldFlushes flushes,
// and past the 32 sublevels at which other stores stall their writes (at 3.3M messages its fill
// flushed 41-43 times, and compacted its tables for nothing after 24), and still only for
// maxHeldFlushesFirstFill.
func TestFirstFill_HoldsCompactionsLonger(t *testing.T) {
	db, err := OpenState(t.TempDir(), Options{FirstFillNoWAL: true, MemTableSize: 4 << 20, MinFreeBytes: -1})
	require.NoError(t, err)
	defer db.Close()
	require.True(t, db.NoWAL())
	var seq uint64
	const deep = 40 // past L0StopWritesThreshold of a store with a log (32)
	for i := 0; i < deep; i++ {
		fill(t, db, &seq, 500) // a flush that stalled would not return
	}
	time.Sleep(300 * time.Millisecond) // the grant loop runs every 100 ms: it had its chances
	require.Zero(t, compactions(db), "no compaction past maxHeldFlushes, nor past 32 sublevels")
	require.True(t, db.CompactionsHeld())
	require.GreaterOrEqual(t, db.pdb.Metrics().Levels[0].Sublevels, int32(deep))
	for i := deep; i < maxHeldFlushesFirstFill; i++ {
		fill(t, db, &seq, 500)
	}
	require.Eventually(t, func() bool { return compactions(db) > 0 }, 30*time.Second, 10*time.Millisecond,
		"compactions run again after maxHeldFlushesFirstFill flushes")
}

// deepFirstFill is a first fill's store (FirstFillNoWAL) in a state dir, filled with n flushes held in
// L0 (n sublevels).
func deepFirstFill(t *testing.T, dir string, n int) (*DB, uint64) {
	t.Helper()
	db, err := OpenState(dir, Options{FirstFillNoWAL: true, MemTableSize: 4 << 20, MinFreeBytes: -1})
	require.NoError(t, err)
	var seq uint64
	for i := 0; i < n; i++ {
		fill(t, db, &seq, 500)
	}
	require.Zero(t, compactions(db))
	require.GreaterOrEqual(t, db.pdb.Metrics().Levels[0].Sublevels, int32(n))
	return db, seq
}

// fillWithin is fill, failed if it has not returned within a minute: a flush that waits at
// L0StopWritesThreshold for compactions that wait for flushes never returns.
func fillWithin(t *testing.T, db *DB, seq *uint64, n int) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		val := append([]byte{0xc5, 0x04, 0x00}, make([]byte, 1024)...)
		msgs := make([]provisioner.Message, 0, n)
		for i := 0; i < n; i++ {
			*seq++
			msgs = append(msgs, provisioner.Message{Seq: *seq, Time: int64(*seq), Key: fmt.Sprintf("n%04d.m.config.x", i), Op: provisioner.OpPut, Value: val})
		}
		if err := db.Apply(provisioner.BucketNeeds, msgs, 0, false); err == nil {
			_ = db.pdb.Flush()
		}
	}()
	select {
	case <-done:
	case <-time.After(time.Minute):
		t.Fatalf("a flush on a store with %d L0 sublevels did not return: it waits for compactions held for flushes", db.pdb.Metrics().Levels[0].Sublevels)
	}
}

// TestFirstFill_CheckpointHoldsItsDeepL0: the store a first fill is checkpointed into (seat/relog.go)
// opens held (Options.BulkLoad) with the first store's L0, deeper than the 32 sublevels at which a
// store with a log stalls its writes: it compacts nothing before the seat's compaction, and its
// flushes meanwhile do not stall.
func TestFirstFill_CheckpointHoldsItsDeepL0(t *testing.T) {
	first, seq := deepFirstFill(t, t.TempDir(), 40)
	defer first.Close()
	gen, err := first.CheckpointGeneration()
	require.NoError(t, err)
	db, err := Open(gen, Options{MemTableSize: 4 << 20, MinFreeBytes: -1, BulkLoad: true})
	require.NoError(t, err)
	defer db.Close()
	require.False(t, db.NoWAL())
	for i := 0; i < 3; i++ {
		fillWithin(t, db, &seq, 500)
	}
	time.Sleep(300 * time.Millisecond)
	require.Zero(t, compactions(db), "held from its open, with L0 as deep as the first store's")
	require.True(t, db.CompactionsHeld())
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	require.NoError(t, db.CompactAll(ctx), "the seat's compaction after catch-up")
	require.Zero(t, db.pdb.Metrics().Levels[0].Sublevels)
}

// TestCatchingUp_CountsTheL0ItBeginsWith: a first fill's store killed before the switch reopens with
// its log and no BulkLoad (32 sublevels stall its writes, maxHeldFlushes), its L0 up to
// maxHeldFlushesFirstFill sublevels deep. Pebble compacts it as it opens, but the catch-up that
// follows may begin first: its wait counts the sublevels it found, so it holds nothing here. Counted
// from none, the catch-up's first flush would wait at the stall for compactions that wait for 16
// flushes, and the seat would hang. (The catch-up's state alone: a reopened store compacts before a
// test can begin one.)
func TestCatchingUp_CountsTheL0ItBeginsWith(t *testing.T) {
	c := newCatchUp(maxHeldFlushes) // its scheduler not registered: wake only pokes
	sublevels := int32(40)
	c.opened(func() int32 { return sublevels })
	c.set(provisioner.BucketNeeds, CatchUpBehind)
	require.False(t, c.holding(), "L0 is past maxHeldFlushes sublevels already")
	c.set(provisioner.BucketNeeds, 0)
	sublevels = 3
	c.set(provisioner.BucketNeeds, CatchUpBehind)
	require.True(t, c.holding(), "a shallow L0 is held as before")
	require.Equal(t, int32(3), c.flushes.Load())
}

// TestEndBulkLoad_CompactionsRunAgain: the store the seat checkpoints a first fill into holds its
// compactions from its open (Options.BulkLoad) until the seat's compaction after catch-up ends it
// (EndBulkLoad): then Pebble's own run again.
func TestEndBulkLoad_CompactionsRunAgain(t *testing.T) {
	db, err := Open(t.TempDir(), Options{MemTableSize: 4 << 20, BulkLoad: true})
	require.NoError(t, err)
	defer db.Close()
	var seq uint64
	for i := 0; i < 10; i++ { // past L0CompactionThreshold (8), short of maxHeldFlushes
		fill(t, db, &seq, 500)
	}
	time.Sleep(300 * time.Millisecond)
	require.Zero(t, compactions(db), "held from the open")
	db.EndBulkLoad()
	require.False(t, db.CompactionsHeld())
	require.Eventually(t, func() bool { return compactions(db) > 0 }, 30*time.Second, 10*time.Millisecond)
}

// TestCompactAll_DeepL0InOnePass: the store a first fill is checkpointed into opens with every table in
// L0 (its fill held its compactions to the end), and the seat's compaction after catch-up writes them
// into the last level once. When CompactAll opened the gate before its flush, Pebble's own compaction
// of L0 took the grant first and sent a piece of L0 to L6; L0 then counted in the size that sets the
// base level, and the manual compaction wrote the rest to L5, and L5 to L6 again (at 523 MB of a
// first fill, 960-1,111 MB written in 3 of 5 runs; docs/performance.md, Session 20).
func TestCompactAll_DeepL0InOnePass(t *testing.T) {
	opts := Options{MemTableSize: 8 << 20, MinFreeBytes: -1, TableSize: 256 << 10}
	first, err := OpenState(t.TempDir(), Options{FirstFillNoWAL: true, MemTableSize: opts.MemTableSize, MinFreeBytes: -1, TableSize: opts.TableSize})
	require.NoError(t, err)
	defer first.Close()
	r := rand.New(rand.NewPCG(1, 2))
	var seq uint64
	for f := 0; f < 24; f++ { // about 100 MB of values that do not compress, past LBaseMaxBytes (64 MiB)
		msgs := make([]provisioner.Message, 0, 4000)
		for i := 0; i < 4000; i++ {
			seq++
			val := make([]byte, 1024+3)
			val[0], val[1], val[2] = 0xc5, 0x04, 0x00 // bin 16 of 1024 bytes
			for j := 3; j < len(val); j++ {
				val[j] = byte(r.Uint32())
			}
			msgs = append(msgs, provisioner.Message{Seq: seq, Time: int64(seq), Key: fmt.Sprintf("n%06d.m%02d.config.x", r.IntN(100000), r.IntN(25)), Op: provisioner.OpPut, Value: val})
		}
		require.NoError(t, first.Apply(provisioner.BucketNeeds, msgs, 0, false))
		require.NoError(t, first.pdb.Flush())
	}
	gen, err := first.CheckpointGeneration()
	require.NoError(t, err)
	opts.BulkLoad = true
	db, err := Open(gen, opts)
	require.NoError(t, err)
	defer db.Close()
	for i := 1; i < 7; i++ {
		require.Zero(t, db.pdb.Metrics().Levels[i].TablesCount)
	}
	fill(t, db, &seq, 10) // the switch's projector's few messages, in L0 too
	require.NoError(t, db.Apply(provisioner.BucketNeeds, []provisioner.Message{{Seq: seq + 1, Time: int64(seq + 1), Key: "n000000.m00.config.y", Op: provisioner.OpPut, Value: []byte{0xc0}}}, 0, false))
	require.NoError(t, db.CompactAll(context.Background()))
	m := db.pdb.Metrics()
	for i, l := range m.Levels {
		t.Logf("L%d: %d tables, %d MB, %d MB compacted into it", i, l.TablesCount, l.TablesSize>>20, l.TableBytesCompacted>>20)
	}
	require.Zero(t, m.Levels[5].TableBytesCompacted, "nothing through L5: L0 went to L6 in one pass")
}
