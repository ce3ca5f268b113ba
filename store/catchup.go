package store

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/cockroachdb/pebble/v2"
)

// Compactions wait while a catch-up writes.
//
// A catch-up (a fresh state dir, a rebuild, a seat that was down while the mesh wrote) is a bulk load:
// hundreds of thousands of messages in a burst, each writing a row, index entries and events spread over
// the whole key space. Left to itself Pebble compacts L0 into the levels below after every few flushes,
// and the next flushes overlap what it just wrote, so the same bytes are rewritten again and again while
// the projector competes with those compactions for the CPU. At a million needs that was 3.7 of the 26
// cpu-µs per message. While any bucket is far behind its stream (CatchingUp), the store lets flushes
// pile up in L0 instead and compacts once when the catch-up ends (the seat's compaction after catch-up,
// or Pebble's own as soon as the wait ends).
//
// The wait is bounded: after maxHeldFlushes flushes compactions run again whatever the catch-up says,
// well before L0StopWritesThreshold would stall writes, so a catch-up of any size, or a projector that
// stopped without saying it was done, never leaves the LSM unbounded. Reads during the catch-up fan out
// over more L0 files; answers then say synced: false anyway.

// CatchUpBehind is how far behind its stream (messages) a bucket must be for its catch-up to hold
// compactions back: the size of a burst after which the seat compacts anyway. A variable for tests.
var CatchUpBehind uint64 = 50_000

// maxHeldFlushes bounds how many flushes pile up in L0 while compactions wait (L0StopWritesThreshold is
// 32 sublevels).
const maxHeldFlushes = 16

// maxHeldFlushesFirstFill is maxHeldFlushes for a first fill's store without a log (FirstFillNoWAL):
// its tables are checkpointed into the store the seat answers from and compacts once (the seat's
// compaction after catch-up rewrites every level), so a compaction of them in the first store is
// written for nothing, and the swap's Close waits for the one in flight. At 1,116,030 messages its fill
// flushed 17-19 times; at 3,348,030 (12,000 nodes), 41-42 times: held for 24 flushes, as it was, the
// first store then compacted 15 times before the switch, about 750 of the 1,230 MB it wrote to synced
// (docs/performance.md, Session 20). Each flush adds an L0 sublevel at most, which every read of the
// fill merges: 64 bounds a lookup during a fill (answered synced: false) to as many tables of L0, and
// holds a fill of about 5M messages of that mesh to the end. Such a store stalls writes only past
// l0StopWritesBulk, which is above it.
const maxHeldFlushesFirstFill = 64

// l0StopWritesBulk is L0StopWritesThreshold (sublevels) for a store opened with its compactions held
// (Options.BulkLoad, FirstFillNoWAL): a first fill's store, and the one it is checkpointed into
// (seat/relog.go), which opens with as many sublevels and counts them towards its wait (catchUp.l0).
// Both wait for maxHeldFlushesFirstFill flushes at most; past the threshold a flush waits for a
// compaction, which must not wait for flushes: 8 sublevels to spare, as L0StopWritesThreshold (32)
// has over maxHeldFlushes for the others.
const l0StopWritesBulk = maxHeldFlushesFirstFill + 8

// catchUp tracks which buckets are catching up, and gates compactions on it.
type catchUp struct {
	mu      sync.Mutex
	buckets map[string]struct{}
	bulk    bool // BulkLoad: held until Close
	// held is set while compactions wait; flushes counts the flushes since they began to wait, from
	// the L0 sublevels there were then (l0).
	held    atomic.Bool
	flushes atomic.Int32
	// manual counts CompactAll calls under way: they open the gate, or they would wait for it.
	manual atomic.Int32
	// closing is set by the Close of a store without a log before it flushes its memtables: those
	// flushes do not count towards maxHeldFlushes, so they do not start compactions that Close would
	// wait for and the next open redo.
	closing atomic.Bool
	// uncounted is set while CheckpointGeneration flushes: not counted either.
	uncounted atomic.Int32
	// limit is how many flushes the wait lasts: maxHeldFlushes, or maxHeldFlushesFirstFill.
	limit int32
	// l0 reports the store's L0 sublevels: a wait that begins with L0 deep already (a first fill's
	// store reopened after a kill, with maxHeldFlushes; the checkpoint of one) ends as many flushes
	// sooner, so a flush never waits at L0StopWritesThreshold for compactions that wait for flushes.
	// Set once the store is open; nil before.
	l0    func() int32
	sched *gateScheduler
}

func newCatchUp(limit int32) *catchUp {
	c := &catchUp{buckets: map[string]struct{}{}, limit: limit}
	c.sched = newGateScheduler(c.holding)
	return c
}

// holding reports whether compactions wait now.
func (c *catchUp) holding() bool {
	return c.held.Load() && c.manual.Load() == 0 && c.flushes.Load() < c.limit
}

func (c *catchUp) listener() *pebble.EventListener {
	return &pebble.EventListener{FlushEnd: func(info pebble.FlushInfo) {
		if info.Err != nil || len(info.Output) == 0 || c.closing.Load() || c.uncounted.Load() > 0 {
			return // nothing reached L0, or Close's own flush
		}
		if c.held.Load() && c.flushes.Add(1) >= c.limit {
			c.sched.wake()
		}
	}}
}

// set records how far behind its stream a bucket is.
func (c *catchUp) set(bucket string, behind uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	// A bucket starts catching up CatchUpBehind messages behind, and ends at its stream's end: the
	// compactions that waited then run on a quiet store rather than beside the catch-up's last batches.
	_, was := c.buckets[bucket]
	now := behind >= CatchUpBehind || was && behind > 0
	if was == now {
		return
	}
	if now {
		c.buckets[bucket] = struct{}{}
	} else {
		delete(c.buckets, bucket)
	}
	c.update()
}

// update holds or releases compactions as the buckets and the bulk load say. c.mu is held.
func (c *catchUp) update() {
	held := len(c.buckets) > 0 || c.bulk
	if held == c.held.Load() {
		return
	}
	if held {
		c.flushes.Store(c.sublevels())
	}
	c.held.Store(held)
	if !held {
		c.sched.wake() // the compactions that waited start now
	}
}

// sublevels is the store's L0 sublevels now, or 0 before it is open. c.mu is held.
func (c *catchUp) sublevels() int32 {
	if c.l0 == nil {
		return 0
	}
	return c.l0()
}

// opened is called once the store is open: a wait held from the open (Options.BulkLoad) counts the
// sublevels it opened with.
func (c *catchUp) opened(l0 func() int32) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.l0 = l0
	if c.held.Load() {
		c.flushes.Store(c.sublevels())
		c.sched.wake()
	}
}

// CatchingUp tells the store how many messages of a bucket's stream are still to come after the batch
// it is about to apply (the consumer's pending count): a bucket CatchUpBehind or more behind holds
// compactions back until it reaches the end of its stream, or says 0 when it stops.
func (db *DB) CatchingUp(bucket string, behind uint64) { db.catchUp.set(bucket, behind) }

// CompactionsHeld reports whether compactions wait for a catch-up or a bulk load now.
func (db *DB) CompactionsHeld() bool { return db.catchUp.holding() }

// BulkLoad holds compactions back until the store closes, whatever CatchingUp says: for a store that is
// filled from scratch and then closed (a rebuild), so Close does not wait for a compaction of everything
// just written. The seat that opens it next compacts it (Pebble does as soon as it opens, as L0 is over
// its threshold), while it answers. Like a catch-up, the wait ends after maxHeldFlushes flushes
// (maxHeldFlushesFirstFill for a store opened with it held, Options.BulkLoad or FirstFillNoWAL).
func (db *DB) BulkLoad() {
	c := db.catchUp
	c.mu.Lock()
	defer c.mu.Unlock()
	c.bulk = true
	c.update()
}

// EndBulkLoad ends what BulkLoad (or Options.BulkLoad) began: compactions wait only for catch-ups
// again, and those that waited run. For the store the seat checkpoints a first fill into, which holds
// them from its open until the seat's compaction after catch-up (seat/relog.go).
func (db *DB) EndBulkLoad() {
	c := db.catchUp
	c.mu.Lock()
	defer c.mu.Unlock()
	c.bulk = false
	c.update()
}

// gateScheduler is Pebble's compaction scheduler with a gate: Pebble's default scheduler (a concurrency
// limit, ConcurrencyLimitScheduler, whose constructor is not exported) granting nothing while held
// says so. It grants when Pebble asks (TrySchedule), when a compaction ends, and from a loop of its own
// (a compaction refused once is not asked for again: the scheduler must offer it), every 100 ms and when
// woken.
type gateScheduler struct {
	held func() bool
	db   pebble.DBForCompaction

	mu           sync.Mutex
	cond         *sync.Cond
	running      int
	granting     bool
	unregistered bool

	poke chan struct{}
	stop chan struct{}
	done chan struct{}
}

var _ pebble.CompactionScheduler = (*gateScheduler)(nil)

func newGateScheduler(held func() bool) *gateScheduler {
	s := &gateScheduler{held: held, poke: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
	s.cond = sync.NewCond(&s.mu)
	return s
}

func (s *gateScheduler) allowed() int {
	if s.held() {
		return 0
	}
	return s.db.GetAllowedWithoutPermission()
}

// Register is called once by Pebble when the DB opens; the grant loop runs until Unregister.
func (s *gateScheduler) Register(_ int, db pebble.DBForCompaction) {
	s.db = db
	go s.loop()
}

// Unregister is called once by Pebble when the DB closes: the loop stops, and no grant follows.
func (s *gateScheduler) Unregister() {
	close(s.stop)
	<-s.done
	s.mu.Lock()
	defer s.mu.Unlock()
	s.unregistered = true
	for s.granting {
		s.cond.Wait()
	}
}

func (s *gateScheduler) TrySchedule() (bool, pebble.CompactionGrantHandle) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.unregistered || s.allowed() <= s.running {
		return false, nil
	}
	s.running++
	return true, s
}

func (s *gateScheduler) UpdateGetAllowedWithoutPermission() { s.wake() }

func (s *gateScheduler) wake() {
	select {
	case s.poke <- struct{}{}:
	default:
	}
}

func (s *gateScheduler) loop() {
	defer close(s.done)
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-t.C:
		case <-s.poke:
		}
		s.grant()
	}
}

// grant offers the compactions the DB waits to run as many grants as are allowed. Pebble's DB methods
// take its own mutex: they are called without s.mu held.
func (s *gateScheduler) grant() {
	s.mu.Lock()
	for s.granting {
		s.cond.Wait()
	}
	n := 0
	if !s.unregistered {
		n = s.allowed() - s.running
	}
	if n <= 0 {
		s.mu.Unlock()
		return
	}
	s.granting = true
	s.mu.Unlock()
	for ; n > 0; n-- {
		if waiting, _ := s.db.GetWaitingCompaction(); !waiting || !s.db.Schedule(s) {
			break
		}
		s.mu.Lock()
		s.running++
		s.mu.Unlock()
	}
	s.mu.Lock()
	s.granting = false
	s.cond.Broadcast()
	s.mu.Unlock()
}

// The scheduler is its own grant handle: it only counts running compactions.

func (s *gateScheduler) Started()                                          {}
func (s *gateScheduler) MeasureCPU(pebble.CompactionGoroutineKind)         {}
func (s *gateScheduler) CumulativeStats(pebble.CompactionGrantHandleStats) {}

func (s *gateScheduler) Done() {
	s.mu.Lock()
	s.running--
	s.mu.Unlock()
	s.wake()
}
