package store

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/maphash"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/vfs"

	provisioner "github.com/novox/mesh-provisioner"
)

// SchemaVersion is the version of the key layout in doc.go that this binary reads and writes. A state
// dir of another version is refused with ErrSchema; the answer is a rebuild.
//
// Version 2 is version 1 with a rollup in the top bits of an event's op byte (doc.go), which a binary
// of version 1 misreads (a rollup's put as no value, its export as an empty put). So a state dir stays
// version 1, and older binaries keep reading it, until the batch that logs its first such event writes
// 2 (schemaRollup); from then on an older binary refuses it and starts over rather than misanswer. A
// state dir of version 1 opens as it is.
const SchemaVersion = 2

const (
	schemaBase   = 1 // what a new state dir is written as
	schemaRollup = 2 // the first version whose event log may hold a rollup
)

var (
	// ErrCorrupt marks a state dir that cannot be read as written: the answer is a rebuild.
	ErrCorrupt = errors.New("store: state dir is broken")
	// ErrSchema marks a state dir of another schema version: the answer is a rebuild.
	ErrSchema = errors.New("store: state dir has another schema version")
	// ErrClosed is returned by a DB that was closed.
	ErrClosed = errors.New("store: closed")
)

// NeedsRebuild reports whether err says the state dir cannot be used as it is and a rebuild from the
// streams is the way out.
// An access error (ErrAccess, or an errno of its) never does: the state dir is as it was.
func NeedsRebuild(err error) bool {
	if isAccess(err) {
		return false
	}
	return errors.Is(err, ErrCorrupt) || errors.Is(err, ErrSchema) || isPebbleCorruption(err)
}

// Options tune the Pebble store. The zero value is usable.
type Options struct {
	// CacheSize is Pebble's block cache in bytes; 0 means 128 MiB. Pebble reserves its memtables from
	// the same cache, so the cache is made that much larger: CacheSize is what blocks get at least, and
	// while the memtables are small (after an open, with few writes) blocks take their share too
	// (docs/decisions.md, Session 17).
	CacheSize int64
	// MemTableSize is the size of one memtable in bytes; 0 means 64 MiB.
	MemTableSize uint64
	// Logger receives Pebble's own messages at debug level; nil discards them.
	Logger *slog.Logger
	// MinFreeBytes is the room Apply keeps free on the state dir's file system (space.go); 0 means
	// two memtables and 32 MiB, a negative value turns the check off.
	MinFreeBytes int64
	// FS is the file system Pebble writes through; nil is the disk (vfs.Default). Tests wrap the disk
	// to make writes fail (pebble's vfs/errorfs) while Pebble and the files stay real.
	FS vfs.FS
	// BulkLoad holds compactions from the open on, as DB.BulkLoad does after it: for a store that is
	// filled once or only read (a reader's copy of a state dir, which would otherwise compact the L0 a
	// catching-up seat held back, writing it all again on the live disk).
	BulkLoad bool
	// MaxOpenFiles is Pebble's Options.MaxOpenFiles, which bounds its table cache; 0 means
	// MaxOpenFiles(), from the process's RLIMIT_NOFILE (fds.go).
	MaxOpenFiles int
	// TableSize is the size of the sstables a flush writes (Pebble's TargetFileSizes[0]; each level
	// below doubles it); 0 means Pebble's 2 MiB. Tests make stores of many small tables with it.
	TableSize int64
	// OnFatal is called, in place of Pebble's panic, when Pebble cannot go on for want of a file
	// descriptor (fds.go): an ErrNoFDs that says what ran out and what to do. It should not return
	// (serve logs it and exits); when it does, or when it is nil, Pebble panics as it would.
	OnFatal func(error)
	// NoWAL writes no write-ahead log (Pebble's DisableWAL): a commit lives in the memtable until the
	// memtable is flushed to a table, when it fills and at Close; Flush does nothing, and a commit asked
	// to sync does not. Pebble flushes whole memtables oldest first, so a crash leaves the store as it
	// was after some earlier batch, each checkpoint with the rows it covers, and the next open reads on
	// from there. For a store filled from the streams that nothing answers from until it is closed: a
	// rebuild's generation, which writes each byte once to its tables instead of also to a log.
	NoWAL bool
	// FirstFillNoWAL opens a generation that OpenState or ResetState creates (a state dir with none
	// yet, or one started over) without a log, as NoWAL does, and with its compactions held as BulkLoad
	// does (for maxHeldFlushesFirstFill flushes, not maxHeldFlushes), and makes what a commit asked to
	// sync durable by flushing its memtables (it answers, and synced: true must survive a kill); a
	// generation that exists opens as NoWAL and BulkLoad say. DB.NoWAL reports which it was. The seat
	// fills such a store once from the streams, then answers from a checkpoint of it opened with its
	// log (CheckpointGeneration, seat/relog.go), and compacts that one: a compaction of the first one,
	// once its catch-up no longer held it, would rewrite tables the switch removes, and the swap's
	// Close of it would wait for it.
	FirstFillNoWAL bool

	// syncByFlush: set by firstFill (FirstFillNoWAL on a generation the open creates).
	syncByFlush bool
}

// Checkpoint is a bucket's position, committed in the same batch as the rows it produced.
type Checkpoint struct {
	Applied       uint64 // the last stream sequence applied
	StreamCreated int64  // the stream's creation time (Unix ns) when it was read: a new one means it was recreated
	AnomalyRows   int64  // how many anomaly rows the bucket has
}

func (c Checkpoint) encode(dst []byte) []byte {
	dst = binary.AppendUvarint(dst, c.Applied)
	dst = binary.AppendVarint(dst, c.StreamCreated)
	return binary.AppendVarint(dst, c.AnomalyRows)
}

func decodeCheckpoint(b []byte) (Checkpoint, error) {
	var c Checkpoint
	var n int
	if c.Applied, n = binary.Uvarint(b); n <= 0 {
		return c, fmt.Errorf("%w: checkpoint", ErrCorrupt)
	}
	b = b[n:]
	if c.StreamCreated, n = binary.Varint(b); n <= 0 {
		return c, fmt.Errorf("%w: checkpoint", ErrCorrupt)
	}
	b = b[n:]
	if c.AnomalyRows, n = binary.Varint(b); n <= 0 {
		return c, fmt.Errorf("%w: checkpoint", ErrCorrupt)
	}
	return c, nil
}

// DB is the projection: one Pebble database holding every bucket's rows, secondary indexes, anomaly
// rows, event log and checkpoint. Apply is serialised; reads run beside it on snapshots.
type DB struct {
	pdb   *pebble.DB
	cache interface{ Unref() }
	dir   string
	id    uint64      // this open's, unique in the process (ID)
	fds   *fdWatch    // Pebble's opens that found no descriptor (fds.go)
	bg    *background // Pebble's failed flushes and compactions (background.go)
	giver *heapGiver  // gives the C heap's free pages back after each flush begins (cheap.go)
	state *StateDir   // set by OpenState: released on Close
	// maxOpenFiles is the Options.MaxOpenFiles Pebble was given (MaxOpenFiles).
	maxOpenFiles int
	// noWAL: Options.NoWAL. Only Close makes the commits durable, by flushing the memtables.
	noWAL bool
	// syncByFlush: a first fill's store without a log (Options.FirstFillNoWAL), which the seat answers
	// from: what a commit asked to sync (Apply's sync, Flush) is made durable by flushing the memtables,
	// as a bucket caught up at its stream's end answers synced: true, which a kill must not take back.
	syncByFlush bool
	flushes     flushGroup // syncByFlush's flushes, shared by the commits waiting for one (flushgroup.go)

	applyMu sync.Mutex // one Apply at a time: anomaly sets and kinds are read and written under it
	// applying is the bucket whose batch Apply is committing, nil between batches (holdApplying).
	applying atomic.Pointer[string]
	writes   writesCache // the sorted writes of Apply, reused under applyMu
	batches  batchCache  // the Pebble batch of Apply, reused under applyMu
	catchUp  *catchUp    // holds compactions back while a bucket catches up (catchup.go)

	mu      sync.Mutex // guards buckets and created
	buckets map[string]*bucketState
	created chan struct{} // closed when a bucket state is created: Changed of a bucket the store has none of

	kinds map[string]struct{} // registry kinds present; under applyMu
	// anomSeed seeds the hashes of the anomaly sets (anomset.go), this open's own.
	anomSeed maphash.Seed
	// composedAnom is the anomaly rows of every composed-<node> bucket together, as committed under
	// composedAnomKey (nodeanom.go); under applyMu.
	composedAnom int64
	// schema is the state dir's schema version as written (schemaBase or schemaRollup): written under
	// applyMu, read without it (Schema must not wait for a batch to commit).
	schema atomic.Int32

	planRows atomic.Int64   // plan rows recomputed since open (PlanStats)
	openGaps map[string]Gap // each bucket's open history gap (history.go); under applyMu
	space    *space         // the room on the state dir (space.go)
	broken   *brokenState   // the first corruption Pebble found (broken.go)
	// writeFailed is the first write Pebble failed, other than for a full disk (failed.go).
	writeFailed *failedState
	// histLocks holds a mutex per bucket for trims and Forget while one is held or waited for
	// (lockHistory, forget.go); under histMu.
	histMu    sync.Mutex
	histLocks map[string]*historyLock

	// closing ends when the store has closed: the manual compactions it asked Pebble for (compact)
	// end with it; compactions is those under way.
	closing        context.Context
	endCompactions context.CancelFunc
	compactions    sync.WaitGroup
	// compactMu orders a compaction's start against Close: none starts once Close has begun.
	compactMu sync.Mutex

	// pinMu guards pin: while a rollup's removals are committed in parts (removeInParts), views read
	// the store as it was before the first part, so no answer holds part of a rollup's removals.
	pinMu sync.Mutex
	pin   *pinnedState
	// durable is, on a first fill's store (syncByFlush), the state as of the last flush that ended,
	// which the synced buckets' answers read (pin.go); nil on any other store, and once closed. Under
	// pinMu. durableMoves counts its changes; kicked says a durableSoon flush is about to start.
	durable      *pinnedState
	durableMoves atomic.Uint64
	kicked       atomic.Bool

	// exp are the pending expiries of TTL'd puts still newest of their key (expiry.go); rewrites
	// counts the commits of Expire, which change answers without moving an applied sequence.
	exp      expiries
	rewrites atomic.Uint64

	closed atomic.Bool
}

type bucketState struct {
	name string
	cp   Checkpoint // under DB.applyMu
	anom anomSet    // hashes of the raw keys holding anomaly rows (anomset.go); under DB.applyMu
	// nodeAnom is how many anomaly rows each node has (the raw keys' first token), as committed under
	// prefixNodeAnom; under DB.applyMu.
	nodeAnom map[string]int64
	seq      atomic.Uint64 // cp.Applied, readable without the lock
	// durable is the applied sequence as of DB.durable, on a first fill's store: what the bucket's
	// answers say once it is synced (DB.Answered).
	durable atomic.Uint64
	// held is the first sequence of the bucket's open history gap whose remover may not be read yet,
	// 0 when none (Reach); stored before seq when both move, so that a reader loading seq first never
	// pairs a new sequence with an older held.
	held atomic.Uint64
	// heldUntil is the stream's last sequence when the projector found it past the message the
	// consumer said was the last (HoldUntil): held clears once the checkpoint reaches it, unless a
	// jump since set it to 0 again; under DB.applyMu.
	heldUntil uint64
	// closeAt is the same sequence, kept until the open gap closes: the consumer said a message below
	// it was the stream's last, and was wrong, so CaughtUp closes the gap only at or past it (history.go);
	// under DB.applyMu.
	closeAt  uint64
	anomRows atomic.Int64 // cp.AnomalyRows, readable without the lock (AnomalyRows)
	synced   atomic.Bool
	notify   atomic.Pointer[chan struct{}] // closed and replaced after each commit that moves seq (wake)
	// known: the store holds something of the bucket (a checkpoint, anomalies) or its projector said
	// where it stands (SetSynced); under DB.mu. Reads make no state (lookup); a state an Apply made
	// before its commit failed is not known, so Buckets, and the metrics and stats that list it, do not
	// list a bucket nobody has.
	known bool
}

// OpenState takes the state dir's lock and opens its current generation, creating the first one in an
// empty dir. The DB releases the lock on Close.
func OpenState(path string, opts Options) (*DB, error) {
	return OpenStateContext(context.Background(), path, opts)
}

// OpenStateContext is OpenState, given up when ctx ends (OpenContext says where).
func OpenStateContext(ctx context.Context, path string, opts Options) (*DB, error) {
	s, err := LockState(path)
	if err != nil {
		return nil, err
	}
	s.SetLogger(opts.Logger)
	cur, lost, err := s.Resolve()
	if err != nil {
		s.Close()
		return nil, err
	}
	// named makes cur the generation CURRENT names (Swap removes what else is there, each logged)
	// and gives db the state dir.
	named := func(db *DB) (*DB, error) {
		if err := s.Swap(cur); err != nil {
			db.Close()
			s.Close()
			return nil, err
		}
		db.state = s
		return db, nil
	}
	if cur == "" {
		if cur, err = s.NewGeneration(); err != nil {
			s.Close()
			return nil, err
		}
		db, err := OpenContext(ctx, cur, opts.firstFill())
		if err != nil {
			// CURRENT does not name it: a start that tries again makes its own.
			_ = s.RemoveGeneration(cur, "the first open of the state dir failed: "+err.Error())
			s.Close()
			return nil, err
		}
		return named(db)
	}
	db, err := OpenContext(ctx, cur, opts)
	if err != nil {
		s.Close()
		return nil, err
	}
	if lost != "" {
		log := s.logger()
		log.Warn("the state dir's CURRENT is lost: opened its only generation, writing CURRENT anew", "state", path, "why", lost, "generation", cur)
		// The only complete generation, opened: CURRENT names it again (what else is there holds no
		// store).
		return named(db)
	}
	// Leftovers of a rebuild that was killed before its swap are removed.
	if err := s.RemoveOthers(cur, "not named by CURRENT ("+filepath.Base(cur)+"): left by a rebuild that did not finish, or by a removal cut short"); err != nil {
		db.Close()
		s.Close()
		return nil, err
	}
	db.state = s
	return db, nil
}

// firstFill is the options of a generation OpenState or ResetState creates.
func (o Options) firstFill() Options {
	if o.FirstFillNoWAL {
		o.NoWAL, o.BulkLoad, o.syncByFlush = true, true, true
	}
	return o
}

// NoWAL reports whether the store writes no log (Options.NoWAL, or FirstFillNoWAL on a generation
// its open created): a crash loses the memtables not yet flushed.
func (db *DB) NoWAL() bool { return db.noWAL }

// openCount numbers the DBs opened in this process.
var openCount atomic.Uint64

// ID tells this DB from every other one opened in the process, before or since: what a reader keeps of
// one store's answers (replay's anomaly cache) is never taken for another's, such as the one a rebuild
// swaps in.
func (db *DB) ID() uint64 { return db.id }

// State is the state dir this DB was opened from with OpenState, or nil.
func (db *DB) State() *StateDir { return db.state }

// blockSize is the tables' data (and index) block size on every level, uncompressed: 32 KiB, not
// Pebble's 4 KiB. A block the cache misses costs mostly per block, not per byte: allocating its buffer
// (a page fault for each new page on a VM), a pread, the cache's insert; its Snappy decoding is the
// smaller part. At 1,000,000 keys a module walk whose index entries are cold read 2,326 blocks for
// five modules, and 288 with 32 KiB blocks; the warm-up after a compaction 21,272 blocks, and 2,609.
// A walk or lookup served from the cache costs the same either way; a single key read from a block not
// cached costs more (eight times the bytes: 40 against 151 µs a one-row lookup), which the warm-up
// keeps off node lookups (docs/performance.md, Session 16).
const blockSize = 32 << 10

// Open opens (or creates) a projection in a Pebble directory.
func Open(dir string, opts Options) (*DB, error) { return OpenContext(context.Background(), dir, opts) }

// OpenContext is Open, given up with ctx's error when ctx ends: before Pebble opens, once it has, and
// while the store reads what it keeps in memory (every anomaly row: the long part of an open of
// millions of them). Pebble's own open (the replay of its log, up to two memtables) cannot be
// stopped, nor can its Close wait less than the compactions it runs. A store given up is as it was
// (a new one may have its schema version written), and is read again at the next open.
func OpenContext(ctx context.Context, dir string, opts Options) (*DB, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("open %s: %w", dir, err)
	}
	if opts.CacheSize == 0 {
		opts.CacheSize = 128 << 20
	}
	if opts.MemTableSize == 0 {
		opts.MemTableSize = 64 << 20
	}
	if opts.MaxOpenFiles == 0 {
		opts.MaxOpenFiles = MaxOpenFiles()
	}
	fds := &fdWatch{fatal: opts.OnFatal}
	const memTables = 2 // MemTableStopWritesThreshold
	// Memtables are reserved from the block cache: without room for them on top, a store under
	// write load has a block cache of size zero and every read goes to disk.
	capacity := opts.CacheSize + memTables*int64(opts.MemTableSize)
	cache := pebble.NewCache(capacity)
	defer cache.Unref() // the DB holds its own reference
	po := &pebble.Options{
		Cache:        cache,
		MemTableSize: opts.MemTableSize,
		// Two memtables at most (one filling, one flushing): memory stays bounded during a catch-up.
		MemTableStopWritesThreshold: memTables,
		// A catch-up writes a burst: let L0 take a few flushes before compacting them together, so
		// fewer compactions rewrite the same data, without letting reads fan out over many files.
		L0CompactionThreshold: 8,
		L0StopWritesThreshold: 32,
		FormatMajorVersion:    pebble.FormatNewest,
		Logger:                pebbleLogger{opts.Logger, fds},
		// The table cache evicts rather than run the process out of descriptors (fds.go).
		MaxOpenFiles: opts.MaxOpenFiles,
		DisableWAL:   opts.NoWAL,
	}
	if opts.BulkLoad {
		po.L0StopWritesThreshold = l0StopWritesBulk // its wait may outlast 32 sublevels (catchup.go)
	}
	po.TargetFileSizes[0] = opts.TableSize
	for i := range po.Levels {
		po.Levels[i].BlockSize = blockSize
	}
	broken := newBrokenState(opts.Logger)
	limit := int32(maxHeldFlushes)
	if opts.BulkLoad {
		// A first fill's store, or the checkpoint of one: its tables go to the store the seat
		// compacts once (catchup.go).
		limit = maxHeldFlushesFirstFill
	}
	catchUp := newCatchUp(limit)
	if opts.BulkLoad {
		catchUp.bulk = true
		catchUp.update()
	}
	bg := &background{log: opts.Logger}
	giver := newHeapGiver(capacity)
	listener := pebble.TeeEventListener(pebble.TeeEventListener(*broken.listener(), *catchUp.listener()),
		pebble.TeeEventListener(*bg.listener(), *giver.listener()))
	po.EventListener = &listener
	po.Experimental.CompactionScheduler = catchUp.sched

	minFree := opts.Reserve()
	fs := opts.FS
	if fs == nil {
		fs = vfs.Default
	}
	if err := roomToOpen(dir, fs, minFree); err != nil {
		return nil, err
	}
	if err := fdsToOpen(dir); err != nil {
		return nil, err
	}
	// A write that finds the disk full waits for room instead of failing inside Pebble (space.go).
	space := newSpace(dir, fs, minFree, opts.Logger)
	po.FS = vfs.OnDiskFull(fdFS{fs, fds}, space.waitForRoom)
	fresh := isEmptyDir(dir)
	pdb, err := pebble.Open(dir, po)
	if err != nil {
		if isLockErr(err) {
			return nil, fmt.Errorf("%w: %s: %v", ErrLocked, dir, err)
		}
		return nil, openErr(dir, err)
	}
	fds.armed.Store(true)
	db := &DB{pdb: pdb, dir: dir, fds: fds, maxOpenFiles: opts.MaxOpenFiles, noWAL: opts.NoWAL, syncByFlush: opts.NoWAL && opts.syncByFlush, bg: bg, id: openCount.Add(1), buckets: map[string]*bucketState{}, kinds: map[string]struct{}{}, openGaps: map[string]Gap{},
		anomSeed: maphash.MakeSeed(), space: space, writeFailed: newFailedState(opts.Logger), exp: newExpiries()}
	if err := db.load(ctx, fresh); err != nil {
		pdb.Close()
		return nil, orAccess(dir, err)
	}
	if db.syncByFlush {
		// What load found is durable (a new generation, its schema flushed): the synced buckets'
		// answers read it until the first flush.
		db.setDurable(pdb.NewSnapshot(), db.appliedNow(), db.rewrites.Load())
	}
	db.broken = broken
	db.catchUp = catchUp
	catchUp.opened(func() int32 { return pdb.Metrics().Levels[0].Sublevels })
	db.giver = giver
	giver.start()
	onHold := db.holdApplying
	space.onHold.Store(&onHold)
	db.closing, db.endCompactions = context.WithCancel(context.Background())
	return db, nil
}

func isEmptyDir(dir string) bool {
	f, err := os.Open(dir)
	if err != nil {
		return true
	}
	defer f.Close()
	_, err = f.Readdirnames(1)
	return err == io.EOF
}

func isLockErr(err error) bool {
	return errors.Is(err, os.ErrExist) || errors.Is(err, errWouldBlock)
}

// load checks the schema and reads every bucket's checkpoint, anomaly set and the registry's kinds.
func (db *DB) load(ctx context.Context, fresh bool) error {
	stopped := func() error {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("open %s: %w", db.dir, err)
		}
		return nil
	}
	if err := stopped(); err != nil {
		return err
	}
	v, closer, err := db.pdb.Get(metaKey("schema"))
	switch {
	case errors.Is(err, pebble.ErrNotFound) && fresh:
		if err := db.set(metaKey("schema"), []byte(fmt.Sprint(schemaBase)), pebble.Sync); err != nil {
			return fmt.Errorf("write schema version: %w", err)
		}
		if db.noWAL {
			// Without a log the version is durable once flushed: a crash before the first full
			// memtable leaves a store that opens empty (and is resumed), not one without a version.
			if err := db.pdb.Flush(); err != nil {
				return fmt.Errorf("write schema version: %w", err)
			}
		}
		db.schema.Store(schemaBase)
	case errors.Is(err, pebble.ErrNotFound):
		return fmt.Errorf("%w: %s has no schema version (run `mesh-provisioner rebuild`)", ErrSchema, db.dir)
	case err != nil:
		return fmt.Errorf("read schema version: %w (run `mesh-provisioner rebuild`)", readErr(err))
	default:
		have := string(v)
		closer.Close()
		n, err := strconv.Atoi(have)
		if err != nil || n < schemaBase || n > SchemaVersion {
			return fmt.Errorf("%w: %s is schema v%s, this binary uses v%d (run `mesh-provisioner rebuild`)", ErrSchema, db.dir, have, SchemaVersion)
		}
		db.schema.Store(int32(n))
	}

	it, err := db.pdb.NewIter(&pebble.IterOptions{LowerBound: []byte{prefixCheckpoint}, UpperBound: []byte{prefixCheckpoint + 1}})
	if err != nil {
		return readErr(err)
	}
	for it.First(); it.Valid(); it.Next() {
		name := string(unesc(nil, it.Key()[1:]))
		cp, err := decodeCheckpoint(it.Value())
		if err != nil {
			it.Close()
			return err
		}
		b := db.known(name)
		b.setCheckpoint(cp)
	}
	if err := it.Close(); err != nil {
		return readErr(err)
	}

	it, err = db.pdb.NewIter(&pebble.IterOptions{LowerBound: []byte{prefixAnomaly}, UpperBound: []byte{prefixAnomaly + 1}})
	if err != nil {
		return readErr(err)
	}
	// Every anomaly row is read at every open, into its bucket's set of hashes (anomset.go) and
	// per-node counts, with no allocation a row: a key's rows (one a class) are adjacent, so a key is
	// hashed once with all its classes, and a node's keys mostly are, so a node's count is added once
	// a run of them.
	var (
		b        *bucketState
		bucketAt []byte // the escaped bucket of b's rows
		key      []byte // the raw key of the row
		prev     []byte // the raw key of the rows before, in b, whose classes are classes
		classes  byte
		node     []byte // the node whose run of rows run counts, in b
		run      int64
	)
	flush := func() { // what was counted for b
		if classes != 0 {
			b.anom.add(db.anomHashBytes(prev), classes)
			classes = 0
		}
		if run > 0 {
			b.nodeAnom[string(node)] += run
			run = 0
		}
	}
	n := 0
	for it.First(); it.Valid(); it.Next() {
		if n++; n%4096 == 0 {
			if err := stopped(); err != nil {
				it.Close()
				return err
			}
		}
		comp, esc, class, ok := cutAnomalyKey(it.Key())
		if !ok {
			it.Close()
			return fmt.Errorf("%w: anomaly key %q", ErrCorrupt, it.Key())
		}
		if b == nil || !bytes.Equal(comp, bucketAt) {
			if b != nil {
				flush()
			}
			b = db.known(string(unesc(nil, comp)))
			bucketAt = append(bucketAt[:0], comp...)
			if b.anom.n == 0 {
				// Sized for its rows (a checkpoint's count, at most one a class of each key).
				b.anom = newAnomSet(int(min(max(b.cp.AnomalyRows, 0), 1<<22)))
			}
		}
		key = unesc(key[:0], esc)
		if classes != 0 && !bytes.Equal(key, prev) {
			b.anom.add(db.anomHashBytes(prev), classes)
			classes = 0
		}
		if classes == 0 {
			prev = append(prev[:0], key...)
		}
		classes |= class
		nd := key
		if i := bytes.IndexByte(key, '.'); i >= 0 {
			nd = key[:i]
		}
		if run == 0 || !bytes.Equal(nd, node) {
			if run > 0 {
				b.nodeAnom[string(node)] += run
				run = 0
			}
			node = append(node[:0], nd...)
		}
		run++
	}
	if b != nil {
		flush()
	}
	if err := it.Close(); err != nil {
		return readErr(err)
	}
	// The reconciles below may write (counts a binary before them did not keep): the last look at ctx.
	if err := stopped(); err != nil {
		return err
	}
	if err := db.reconcileNodeAnomalies(); err != nil {
		return err
	}
	if err := db.reconcileComposedAnomalies(); err != nil {
		return err
	}

	p := bucketPrefix([]byte{}, prefixRow, provisioner.BucketRegistry)
	it, err = db.pdb.NewIter(&pebble.IterOptions{LowerBound: p, UpperBound: prefixEnd(p)})
	if err != nil {
		return readErr(err)
	}
	for it.First(); it.Valid(); it.Next() {
		db.kinds[string(unesc(nil, it.Key()[len(p):]))] = struct{}{}
	}
	if err := it.Close(); err != nil {
		return readErr(err)
	}
	if err := db.loadGaps(); err != nil {
		return err
	}
	if err := db.loadExpiries(); err != nil {
		return err
	}
	return db.finishRollups()
}

// splitAnomalyKey reads bucket, raw key and class back from an anomaly key.
func splitAnomalyKey(k []byte) (bucket, key string, class byte, ok bool) {
	comp, esc, class, ok := cutAnomalyKey(k)
	if !ok {
		return "", "", 0, false
	}
	return string(unesc(nil, comp)), string(unesc(nil, esc)), class, true
}

// cutAnomalyKey cuts an anomaly key into its bucket and raw key, both still escaped, and its class.
func cutAnomalyKey(k []byte) (bucket, key []byte, class byte, ok bool) {
	rest := k[1:]
	i := termIndex(rest)
	if i < 0 {
		return nil, nil, 0, false
	}
	bucket = rest[:i]
	rest = rest[i+2:]
	if len(rest) < 3 {
		return nil, nil, 0, false
	}
	class = rest[len(rest)-1]
	rest = rest[:len(rest)-1]
	if rest[len(rest)-2] != 0 || rest[len(rest)-1] != 1 {
		return nil, nil, 0, false
	}
	return bucket, rest[:len(rest)-2], class, true
}

// termIndex finds the first component terminator 0x00 0x01 in b.
func termIndex(b []byte) int {
	for i := 0; i+1 < len(b); i++ {
		if b[i] == 0 {
			if b[i+1] == 1 {
				return i
			}
			i++ // 0x00 0xff: an escaped zero
		}
	}
	return -1
}

// bucket returns the state of a bucket, creating it on first use.
func (db *DB) bucket(name string) *bucketState {
	db.mu.Lock()
	defer db.mu.Unlock()
	b, ok := db.buckets[name]
	if !ok {
		b = &bucketState{name: name, anom: newAnomSet(0), nodeAnom: map[string]int64{}}
		ch := make(chan struct{})
		b.notify.Store(&ch)
		db.buckets[name] = b
		if db.created != nil && !db.closed.Load() {
			close(db.created)
			db.created = nil
		}
	}
	return b
}

// lookup returns a bucket's state, or nil when the store holds none: reads never create one, so the
// names a client makes up (a plans min_seq for any node) cost the seat no memory. Open loads every
// bucket the store holds something of.
func (db *DB) lookup(name string) *bucketState {
	db.mu.Lock()
	defer db.mu.Unlock()
	return db.buckets[name]
}

// known returns the state of a bucket, as bucket does, and records that the store now holds
// something of it, so that Buckets lists it.
func (db *DB) known(name string) *bucketState {
	b := db.bucket(name)
	db.mu.Lock()
	b.known = true
	db.mu.Unlock()
	return b
}

// Buckets lists the buckets the store holds a checkpoint or anomalies for, or whose projector has
// said whether they are synced; not those only read or waited on.
func (db *DB) Buckets() []string {
	db.mu.Lock()
	defer db.mu.Unlock()
	out := make([]string, 0, len(db.buckets))
	for name, b := range db.buckets {
		if b.known {
			out = append(out, name)
		}
	}
	return out
}

// Checkpoint returns a bucket's committed position.
func (db *DB) Checkpoint(bucket string) Checkpoint {
	db.applyMu.Lock()
	defer db.applyMu.Unlock()
	if b := db.lookup(bucket); b != nil {
		return b.cp
	}
	return Checkpoint{}
}

// AnomalyRows returns how many anomaly rows a bucket holds as committed, without waiting for an Apply:
// the stats read it while a batch may wait for room in the state dir for as long as the disk is full
// (space.go), and Checkpoint waits for that batch.
func (db *DB) AnomalyRows(bucket string) int64 {
	if b := db.lookup(bucket); b != nil {
		return b.anomRows.Load()
	}
	return 0
}

// setCheckpoint sets a bucket's committed position and what is read of it without the lock; under
// DB.applyMu.
func (b *bucketState) setCheckpoint(cp Checkpoint) {
	b.cp = cp
	b.seq.Store(cp.Applied)
	b.anomRows.Store(cp.AnomalyRows)
}

// Applied returns the last stream sequence applied for a bucket, and whether it has caught up with the
// stream since start.
func (db *DB) Applied(bucket string) (seq uint64, synced bool) {
	b := db.lookup(bucket)
	if b == nil {
		return 0, false
	}
	return b.seq.Load(), b.synced.Load()
}

// Reach is the highest min_seq a request on a bucket is answered for now: the applied sequence, or,
// while the bucket's open history gap holds messages removed before they were read whose remover may
// not be read yet (held), the sequence before the first of them. A message removed by a later one of
// its key (its purge, a rollup, the history limit) that the projector has not read is in no state
// past it the projection has applied: a request for it answered there would claim a write it lacks (a
// lost write). The gap stops holding once the projector has read to the stream's end since (CaughtUp),
// or the stream was found to hold nothing past the checkpoint (SkipRemoved, TailRemoved, StreamEndsAt).
// On a first fill's store a synced bucket's applied sequence is its durable one, which its answers
// read (Answered, pin.go).
func (db *DB) Reach(bucket string) uint64 {
	b := db.lookup(bucket)
	if b == nil {
		return 0
	}
	seq := b.seq.Load()
	if db.readsDurable(b) {
		// Its answers read the durable state (pin.go), at this sequence.
		seq = b.durable.Load()
	}
	if h := b.held.Load(); h != 0 && h <= seq {
		return h - 1
	}
	return seq
}

// SetSynced records that a bucket's projection has caught up with its stream since start, and wakes
// whoever waits on Changed when that changes: a bucket whose stream does not exist yet becomes synced
// without a commit, and what waits for it (the needs wait for the registry) must not wait for a poll.
func (db *DB) SetSynced(bucket string, synced bool) {
	b := db.known(bucket)
	if synced && db.syncByFlush && !b.synced.Load() && b.seq.Load() > b.durable.Load() {
		// Once synced its answers read the durable state (pin.go): what the answers not synced showed
		// is made durable first, so that its as_of does not go back (a checkpoint moved without a
		// flush: TailRemoved, SkipRemoved). A flush that fails fails the store (failed.go).
		_ = db.flushGroup()
	}
	if b.synced.Swap(synced) == synced {
		return
	}
	db.mu.Lock()
	defer db.mu.Unlock()
	if !db.closed.Load() { // else Close has closed the channel for good, under mu
		b.wake()
	}
}

// wake closes the bucket's Changed channel and gives it a new one. Each channel is swapped out, and
// so closed, exactly once, whoever wakes at the same moment; not after Close, which closes the last.
func (b *bucketState) wake() {
	ch := make(chan struct{})
	close(*b.notify.Swap(&ch))
}

// Changed returns a channel closed at the next commit that moves a bucket's applied sequence, or when
// its synced flag changes; for a bucket the store holds nothing of, one closed when any bucket's state
// is created (the waiter looks again, without a state of its own).
func (db *DB) Changed(bucket string) <-chan struct{} {
	db.mu.Lock()
	defer db.mu.Unlock()
	if b, ok := db.buckets[bucket]; ok {
		return *b.notify.Load()
	}
	if db.created == nil {
		db.created = make(chan struct{})
		if db.closed.Load() {
			close(db.created) // Close has run: wake at once, to find the store closed
		}
	}
	return db.created
}

// Flush syncs everything committed so far to disk; without a log (Options.NoWAL) it does nothing:
// Close writes the memtables out; but a first fill's store without a log (Options.FirstFillNoWAL),
// which answers, flushes its memtables to tables.
func (db *DB) Flush() error {
	if db.closed.Load() {
		return ErrClosed
	}
	if err := db.writeFailed.failed(); err != nil {
		return err // Pebble takes no write any more (failed.go)
	}
	if db.noWAL {
		if db.syncByFlush {
			return db.flushGroup()
		}
		return nil
	}
	return db.pdb.LogData(nil, pebble.Sync)
}

// Close syncs and closes the store (without a log, flushes its memtables to tables), and releases the
// state dir's lock when it holds it.
func (db *DB) Close() error {
	if !db.closed.CompareAndSwap(false, true) {
		return nil
	}
	// Every compaction that saw the store open is counted in compactions by now (compact).
	db.compactMu.Lock()
	db.compactMu.Unlock() //nolint:staticcheck // an empty critical section: a barrier
	db.applyMu.Lock()
	defer db.applyMu.Unlock()
	db.giver.stop()
	var err error
	if db.writeFailed.failed() == nil {
		if db.noWAL {
			// Pebble's Close drops the memtables, which no log holds. Flushed here they leave
			// compactions held as they were (catchUp.closing): at a rebuild's end they were the 16th
			// flush, and Close waited for a compaction of much of what was written, which the serve
			// that opens the generation compacts again.
			db.catchUp.closing.Store(true)
			err = db.pdb.Flush()
			db.dropDurable()
		} else {
			err = db.pdb.LogData(nil, pebble.Sync)
		}
		if cerr := db.pdb.Close(); err == nil {
			err = cerr
		}
	}
	// Else Pebble's commit pipeline may hold its lock for good (failed.go): neither synced nor
	// closed, as a process killed would leave it (the failure was said by Failed). Its goroutines end
	// with the process.
	// Only now, with no compaction left to schedule, are the manual ones still queued let go (compact).
	db.endCompactions()
	db.compactions.Wait()
	// Apply's buffers go with the store (under applyMu, held): a closed store something still refers
	// to (Seat.DB is the store a seat started with, which a first fill's switch or a rebuild replaces)
	// kept a catch-up batch's Pebble batch and sorted writes, some MB each, for its life.
	db.batches.b, db.writes.w = nil, nil
	if db.state != nil {
		if serr := db.state.Close(); err == nil {
			err = serr
		}
	}
	// Whoever waits on Changed wakes, and finds the store closed (or, behind a reader that swaps
	// stores after a rebuild, the new one).
	db.mu.Lock()
	for _, b := range db.buckets {
		close(*b.notify.Load())
	}
	if db.created != nil {
		close(db.created)
	}
	db.mu.Unlock()
	return err
}

// Pebble exposes the underlying database for metrics and tools in this module.
func (db *DB) Pebble() *pebble.DB { return db.pdb }

// Dir is the Pebble directory.
func (db *DB) Dir() string { return db.dir }

type pebbleLogger struct {
	l   *slog.Logger
	fds *fdWatch // a Fatalf for want of a descriptor goes to its OnFatal (fds.go)
}

func (p pebbleLogger) Infof(format string, args ...any) {
	if p.l != nil {
		p.l.Debug(fmt.Sprintf(format, args...), "component", "pebble")
	}
}

func (p pebbleLogger) Errorf(format string, args ...any) {
	if p.l != nil {
		p.l.Error(fmt.Sprintf(format, args...), "component", "pebble")
	}
}

func (p pebbleLogger) Fatalf(format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	if errno, ok := fdsText(msg); ok && p.fds != nil {
		p.fds.die(fdsErr(errno, "stopped", errors.New(msg)))
	}
	if p.l != nil {
		p.l.Error(fmt.Sprintf(format, args...), "component", "pebble")
	}
	panic(fmt.Sprintf(format, args...))
}

// CompactAll compacts the whole store down to its last level: after a large catch-up, every read then
// merges one sorted run instead of the memtable, many L0 files and the levels below. It is work the
// background compactions would do over time, done at once; reads and writes go on meanwhile.
func (db *DB) CompactAll(ctx context.Context) error {
	if db.closed.Load() {
		return ErrClosed
	}
	return db.inBackground(ctx, func() error {
		if err := db.pdb.Flush(); err != nil {
			return err
		}
		// Compactions that wait for a catch-up would keep this one waiting too: the gate opens once
		// the flush is done, and Pebble's Compact asks for its grant itself (no wake). Opened before
		// the flush, Pebble's own compaction of a deep L0 took the grant first: it sent a piece of
		// L0 to L6, and then the size of L0 set the base level to L5, so the manual compaction wrote
		// the rest of L0 into L5 and all of L5 into L6 again (docs/performance.md, Session 20). A
		// flush does not wait for the gate: a hold ends short of L0StopWritesThreshold (catchup.go).
		db.catchUp.manual.Add(1)
		defer db.catchUp.manual.Add(-1)
		return db.pdb.Compact(db.closing, []byte{0x00}, []byte{0xff}, true)
	})
}

// compact asks Pebble for a manual compaction of [start, end], and returns when it is done or ctx
// ends, whichever comes first; in the second case Pebble carries on with it, and it ends when the
// store closes at the latest. Pebble is never asked to cancel it: Pebble (v2.1.7) drops a cancelled
// manual compaction from its queue but not from the compaction it may have picked already and holds
// for the scheduler's next grant (which a catch-up holds back, catchup.go), and that grant then
// panics ("did not find manual compaction with id"), taking the seat down.
func (db *DB) compact(ctx context.Context, start, end []byte, parallelize bool) error {
	return db.inBackground(ctx, func() error { return db.pdb.Compact(db.closing, start, end, parallelize) })
}

// inBackground runs a compaction (fn) on a goroutine Close waits for, and returns when it is done or
// ctx ends. A store closed first runs none (ErrClosed). Close can still close Pebble between this
// start and fn's first call into Pebble, which panics with pebble.ErrClosed on a closed DB (a
// rebuild's SwapIn closing the old store as the seat's compaction after a catch-up starts on it):
// that panic, and only it, is returned as ErrClosed.
func (db *DB) inBackground(ctx context.Context, fn func() error) error {
	db.compactMu.Lock()
	if db.closed.Load() {
		db.compactMu.Unlock()
		return ErrClosed
	}
	db.compactions.Add(1)
	db.compactMu.Unlock()
	done := make(chan error, 1)
	go func() {
		defer db.compactions.Done()
		done <- closedPanic(fn)
	}()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// closedPanic calls fn, turning Pebble's panic on a closed DB into ErrClosed.
func closedPanic(fn func() error) (err error) {
	defer func() {
		if r := recover(); r != nil {
			if e, ok := r.(error); ok && errors.Is(e, pebble.ErrClosed) {
				err = ErrClosed
				return
			}
			panic(r)
		}
	}()
	return fn()
}

// Schema is the state dir's schema version as written now: schemaBase (1), which older binaries read
// too, until the event log holds a rollup, then SchemaVersion. An operator reads it (metrics,
// $SRV.STATS) to know whether a downgrade keeps the state dir.
func (db *DB) Schema() int { return int(db.schema.Load()) }
