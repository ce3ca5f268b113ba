// Package seat wires the mechanisms into the running seat: the registry writer, the projector and the
// verb over one store. The command's serve and the end-to-end tests start it the same way. Stop takes
// it down in the order that loses nothing: the verb drains, the projector commits its last batch, the
// store syncs.
//
// The seat also keeps the event log's retention, answers the verb's at from the event log (package
// replay), and rebuilds the projection in a new generation when a bucket cannot be resumed, answering
// from the old one until the new one has caught up (rebuild.go).
package seat

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/streaminfo"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/registry"
	"github.com/novox/mesh-provisioner/replay"
	"github.com/novox/mesh-provisioner/store"
)

// Config of a seat.
type Config struct {
	Version string
	Logger  *slog.Logger
	// WriteRegistry runs the registry writer every RegistryInterval (0 means one hour).
	WriteRegistry    bool
	RegistryInterval time.Duration
	// RegistryReplicas is the registry bucket's replicas when the writer creates it (0 means 1).
	RegistryReplicas int
	// Projector tunes the consumers; its Logger defaults to the seat's. With OnReset unset, a bucket
	// that cannot be resumed makes the seat rebuild the projection (rebuild.go).
	Projector projector.Options
	// Plans tails the plans' inputs (mesh-host_modules, mesh-indexer_builds and every composed-<node>
	// bucket, those created later too) and answers what: plans.
	Plans bool
	// Observe, when set, is told of every answered request (query.Options.Observe): the metrics.
	Observe func(what string, code int, d time.Duration)
	// Retention, when set, trims the event log in the background.
	Retention *store.RetentionOptions
	// Store tunes a store the seat opens itself: the new generation of a rebuild. Its Logger defaults
	// to the seat's, so that a new generation out of room says so (store/space.go).
	Store store.Options
	// Streams, when set, is the listing of every stream's info that the seat runs for its projectors'
	// stream checks and shares with another reader, the lag metric (metrics.Options.Streams); nil: the
	// seat makes its own. Either way the seat runs exactly one listing, whatever the number of its
	// projectors (two during a rebuild), and stops it at Stop.
	Streams *streaminfo.Poller
	// ListEvery, when shorter than the projector's Verify (projector.DefaultVerify when 0), is how often
	// the seat lists the streams: the poll interval of the metrics that share the listing.
	ListEvery time.Duration
	// OnRebuild, when set, is called as a rebuild of the projection starts, and the func it returns
	// once that rebuild ends, with its error (nil once swapped in): the metrics' StartRebuild. A rebuild
	// given up because the seat stops is not reported as ended.
	OnRebuild func() (done func(err error))
}

// Seat is a running seat.
type Seat struct {
	// DB and Projector are those the seat started with; after a rebuild, Store and Current return the
	// ones in use.
	DB        *store.DB
	Projector *projector.Projector
	Server    *query.Server
	Registry  *registry.Writer // nil when the seat does not write the registry

	log *slog.Logger
	nc  *nats.Conn // the verb's connection: Stop drains it
	// stopOnce starts the stop once, on its own goroutine (StopContext); stopDone closes when it has
	// returned stopErr.
	stopOnce sync.Once
	stopDone chan struct{}
	stopErr  error

	cfg     Config
	js      jetstream.JetStream
	streams *streaminfo.Poller // the seat's one listing of every stream's info, run on wg
	reader  *swapReader
	at      *replay.Handler // the verb's at: keeps temporary stores of plans, removed at Stop
	ctx     context.Context // the seat's own, for what outlives a rebuild round
	cancel  context.CancelFunc
	wg      sync.WaitGroup

	mu        sync.Mutex
	cur       *store.DB
	proj      *projector.Projector
	retention *store.Retention
	next      *projector.Projector // a rebuild's, until it is swapped in or given up
	nextDB    *store.DB            // next's store, the new generation: its writes can be held for room too
	opening   string               // the new generation a rebuild is opening, until Open returns
	owned     *store.DB            // a store a rebuild swapped in: the seat closes it at Stop
	rebuildCh chan struct{}
	rebuilds  int
	// appliedBefore is what the projectors a rebuild replaced had applied: MessagesApplied goes on
	// from it, so the counter never runs backwards.
	appliedBefore int64

	beforeSwap  func(next *projector.Projector)               // tests: called as a rebuild has stopped the old projector
	atCaughtUp  func(next *projector.Projector, db *store.DB) // tests: called as a rebuild has caught up, before the old projector stops
	heldReset   func(bucket string)                           // tests: called as a rebuild's projector reports a reset that its swap must carry over
	swapWait    time.Duration                                 // tests: the swap's wait for the new store (swapwait.go); 0: DefaultSwapWait
	beforeRelog func()                                        // tests: called as a first fill without a log has caught up, before its checkpoint (relog.go)
}

// CompactAfter is how many messages a catch-up must have applied for the seat to compact the store
// once it is synced.
var CompactAfter int64 = 50_000

// Start starts a seat on a store, and answers the verb on nc. A store without a log that its state dir
// made for a first fill (store.Options.FirstFillNoWAL) is answered from until every bucket has caught up,
// then replaced by a checkpoint of it with a log (relog.go).
func Start(ctx context.Context, nc *nats.Conn, js jetstream.JetStream, db *store.DB, cfg Config) (*Seat, error) {
	return start(ctx, nc, js, db, cfg, nil)
}

// start is Start; hooks, when set, is called before anything starts (tests).
func start(ctx context.Context, nc *nats.Conn, js jetstream.JetStream, db *store.DB, cfg Config, hooks func(*Seat)) (*Seat, error) {
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if cfg.Store.Logger == nil {
		cfg.Store.Logger = log
	}
	s := &Seat{DB: db, log: log, nc: nc, cfg: cfg, js: js, cur: db, reader: newSwapReader(db), rebuildCh: make(chan struct{}, 1)}
	if hooks != nil {
		hooks(s)
	}
	s.ctx, s.cancel = context.WithCancel(ctx)
	s.streams = cfg.Streams
	if s.streams == nil {
		s.streams = streaminfo.New(js)
	}
	// Running before the projector looks (streaminfo.Poller.Go), so its buckets may start parked.
	s.streams.Go(s.ctx, &s.wg, s.listEvery(), log.With("component", "stream-infos"))
	if cfg.WriteRegistry {
		s.Registry = registry.New(js, provisioner.Registry, cfg.RegistryInterval, log)
		s.Registry.Replicas = cfg.RegistryReplicas
		s.Registry.Start(ctx)
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.wakeRegistryOnLoss(s.ctx)
		}()
	}
	s.Projector = projector.New(js, db, s.projectorOptions(db, nil))
	s.Projector.Start(s.ctx)
	s.proj = s.Projector
	s.retention = s.startRetention(db)
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.rebuildLoop(s.ctx)
	}()

	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.compactAfterCatchUp(s.ctx)
	}()

	s.at = replay.NewHandler(s.reader.open, func(bucket string) bool {
		_, synced := s.reader.Applied(bucket)
		return synced
	})
	// A request waiting for a sequence wakes its bucket: a parked composed-<node> bucket tails again,
	// and any bucket's tail looks for messages removed before they were read (projector.Wake).
	qo := query.Options{Version: cfg.Version, Logger: log, Metadata: s.metadata(), Observe: cfg.Observe, At: s.at.Answer, Wake: s.wake}
	if cfg.Plans {
		qo.Plans = query.Plans(s.reader, s.PlansSynced, s.wake)
	}
	s.Server = query.NewServer(s.reader, qo)
	// $SRV.STATS carries where each bucket stands (see ops.go).
	if err := s.Server.Start(nc, func() any { return s.Stats() }); err != nil {
		s.Stop()
		return nil, err
	}
	return s, nil
}

// listEvery is how often the seat lists every stream's info: every Verify of its projectors, or
// sooner when the metrics that share the listing poll more often.
func (s *Seat) listEvery() time.Duration {
	every := s.cfg.Projector.Verify
	if every <= 0 {
		every = projector.DefaultVerify
	}
	if s.cfg.ListEvery > 0 && s.cfg.ListEvery < every {
		every = s.cfg.ListEvery
	}
	return every
}

// compactAfterCatchUp compacts the store once a burst of CompactAfter messages or more has been applied
// and the seat has gone quiet (synced, nothing applied for a second): a catch-up leaves its rows spread
// over memtables and many L0 files, and every answer would merge them until background compactions
// caught up. A steady trickle never goes quiet and is left to Pebble's own compactions.
func (s *Seat) compactAfterCatchUp(ctx context.Context) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	// Counted over every projector (MessagesApplied): a rebuild's counts all it read again, and the
	// projector that takes over a first catch-up without a log (relog.go) goes on from it.
	var compacted int64
	last := int64(-1)
	seen := s.DB
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		n := s.MessagesApplied()
		quiet := n == last && s.Synced()
		last = n
		db := s.Store()
		// A store without a log is checkpointed into one with it once caught up (relog.go): that one
		// is compacted, not this one, whose tables the swap removes; at once, as it was swapped in
		// caught up.
		switched := seen != db && seen.NoWAL()
		seen = db
		if switched && n-compacted < CompactAfter {
			// It held its compactions for this one (rebuild.go), which a fill this small does not
			// need: Pebble's own run.
			db.EndBulkLoad()
		}
		if !(quiet || switched) || n-compacted < CompactAfter || db.NoWAL() {
			continue
		}
		compacted = n
		start := time.Now()
		err := db.CompactAll(ctx)
		if switched {
			db.EndBulkLoad() // held for this compaction (rebuild.go)
		}
		if err != nil {
			// ErrClosed: a rebuild swapped this store out meanwhile; nothing failed.
			if ctx.Err() == nil && !errors.Is(err, store.ErrClosed) {
				s.log.Warn("compaction after catch-up failed; background compactions go on", "err", err)
			}
			continue
		}
		took := time.Since(start)
		start = time.Now()
		warmed, err := s.warmRows(ctx)
		if err != nil && ctx.Err() == nil && !errors.Is(err, store.ErrClosed) {
			s.log.Warn("reading the rows into the block cache after a compaction failed", "err", err)
		}
		s.log.Info("compacted after catch-up", "messages", n, "took", took.Round(time.Millisecond),
			"warmed_keys", warmed, "warm_took", time.Since(start).Round(time.Millisecond))
	}
}

// warmChunk is how many keys warmRows reads through one view: a few milliseconds, so a rebuild's swap,
// which waits for the views of the old store to close, waits no longer than a request.
const warmChunk = 8192

// warmRows reads the current store's checkpoints, rows and per-node anomaly counts once, after the
// compaction after a catch-up: that compaction rewrote every table, so Pebble's block cache held none
// of their blocks, and each node lookup read and decompressed its own (store.RowsView.WarmRows). It
// stops with ctx, and returns how many keys it read.
func (s *Seat) warmRows(ctx context.Context) (int, error) {
	var from []byte
	read := 0
	for {
		if err := ctx.Err(); err != nil {
			return read, err
		}
		h := s.reader.acquire()
		v, err := h.db.RowsView()
		if err != nil {
			h.mu.RUnlock()
			return read, err
		}
		n, next, err := v.WarmRows(from, warmChunk)
		v.Close()
		h.mu.RUnlock()
		read += n
		if err != nil || next == nil {
			return read, err
		}
		from = next
	}
}

// ErrNotDrained is what StopContext returns when its context ended while a write of the seat's waits
// for room in the state dir (the error names it): the seat's last batch waits with it.
var ErrNotDrained = errors.New("seat: stopped without committing the last batch")

// Stop drains the verb, stops the registry writer and the projector (its last batch committed), and
// syncs the store. It does not close the store given to Start (after a rebuild that one is closed
// already); it closes a store a rebuild swapped in. It leaves the connection given to Start drained
// and closed (drain.go). A write held until the state dir has room holds Stop as long (store/space.go):
// StopContext bounds the wait.
func (s *Seat) Stop() error { return s.StopContext(context.Background()) }

// StopContext is Stop, given up when ctx ends first: it then returns an error wrapping ctx's error,
// and ErrNotDrained with the state dir when a write waits for room there. The stop goes on
// by itself (the seat's goroutines end once there is room: a write held cannot be let through without
// Pebble panicking); a later Stop or StopContext waits for it again and returns its result. Until it
// has returned, Close of the store given to Start waits for room too: a process that gives up now
// should exit without it, which loses nothing. The batch held carries its checkpoint and was not
// committed, so the next start reads it again from the stream.
func (s *Seat) StopContext(ctx context.Context) error {
	s.stopOnce.Do(func() {
		s.stopDone = make(chan struct{})
		go func() {
			defer close(s.stopDone)
			s.stopErr = s.stop()
		}()
	})
	select {
	case <-s.stopDone:
		return s.stopErr
	case <-ctx.Done():
	}
	if dir, held := s.WritesHeld(); held {
		return fmt.Errorf("stop: state dir %s out of room: %w: %w", dir, ErrNotDrained, ctx.Err())
	}
	return fmt.Errorf("stop not finished: %w", ctx.Err())
}

// stop is Stop's work, run once.
func (s *Seat) stop() error {
	if s.Server != nil {
		s.Server.Stop()
	}
	// The verb has answered its last request: the temporary stores of plans it kept go.
	s.at.Close()
	s.cancel() // a rebuild under way stops, and leaves its generation to be removed at the next open
	s.wg.Wait()
	if s.Registry != nil {
		s.Registry.Stop()
	}
	s.mu.Lock()
	db, proj, ret, owned := s.cur, s.proj, s.retention, s.owned
	s.mu.Unlock()
	if proj != nil {
		proj.Stop()
	}
	if ret != nil {
		ret.Stop()
	}
	s.drainVerb()
	if err := db.Flush(); err != nil {
		return fmt.Errorf("sync state: %w", err)
	}
	if owned != nil {
		if err := owned.Close(); err != nil {
			return fmt.Errorf("close state: %w", err)
		}
	}
	return nil
}

// Store is the store the seat answers from: the one it started with, or the one a rebuild swapped in.
func (s *Seat) Store() *store.DB {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cur
}

// WritesHeld reports whether a write of one of the seat's stores is held until the state dir has room
// (store.DB.WritesHeld), and that store's directory: the store it answers from, or the new generation
// a rebuild fills, which has its own, while it opens too (store.WritesHeldIn). Stop waits for the held
// write, and so for room.
func (s *Seat) WritesHeld() (dir string, held bool) {
	s.mu.Lock()
	cur, next, opening := s.cur, s.nextDB, s.opening
	s.mu.Unlock()
	if cur.WritesHeld() {
		return cur.Dir(), true
	}
	if next != nil && next.WritesHeld() {
		return next.Dir(), true
	}
	if opening != "" && store.WritesHeldIn(opening) {
		return opening, true // the open's own writes
	}
	return "", false
}

// OutOfRoom says why the seat's projection cannot be written for want of room (store.DB.RoomErr): the
// store it answers from, or a rebuild's new generation, named as such; nil when both have room. It
// answers meanwhile, from what it committed; /readyz and the micro stats say this.
func (s *Seat) OutOfRoom() error {
	s.mu.Lock()
	cur, next, opening := s.cur, s.nextDB, s.opening
	s.mu.Unlock()
	if err := cur.RoomErr(); err != nil {
		return err
	}
	if next != nil {
		if err := next.RoomErr(); err != nil {
			return fmt.Errorf("the rebuild's new generation: %w", err)
		}
	}
	if opening != "" && store.WritesHeldIn(opening) {
		return fmt.Errorf("the rebuild's new generation: %w: writes held: opening %s found the disk full: free space on that disk (or give --state a larger one); the rebuild goes on by itself",
			store.ErrNoSpace, opening)
	}
	return nil
}

// Current is the projector in use.
func (s *Seat) Current() *projector.Projector {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.proj
}

// wake makes a parked composed-<node> bucket that a request waits on read now (projector.Wake): in the
// projector in use, and in a rebuild's, whose store the request may be answered from once it is
// swapped in (the old projector stops before the verb moves over, and a wake it took is lost).
func (s *Seat) wake(bucket string) {
	s.mu.Lock()
	cur, next := s.proj, s.next
	s.mu.Unlock()
	cur.Wake(bucket)
	if next != nil {
		next.Wake(bucket)
	}
}

// Retention is the event log's retention in use, or nil.
func (s *Seat) Retention() *store.Retention {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.retention
}

// Synced reports whether every bucket the projector tails has caught up with its stream since start.
func (s *Seat) Synced() bool { return projectionCaughtUp(s.Store(), s.Current()) }

// PlansSynced reports whether the inputs of a plans answer have caught up with their streams since
// start: the streams were listed once for composed-<node> buckets, mesh-host_modules and
// mesh-indexer_builds are synced, and so is composed-<node> of the node (of every node when node is
// empty). A node with no composed-<node> bucket has nothing to catch up with.
func (s *Seat) PlansSynced(node string) bool {
	db, p := s.Store(), s.Current()
	synced := func(b string) bool {
		_, ok := db.Applied(b)
		return ok
	}
	if !p.Discovered() || !synced(provisioner.BucketHostModules) || !synced(provisioner.BucketIndexerBuilds) {
		return false
	}
	if node != "" {
		b := provisioner.ComposedPrefix + node
		return !p.Tails(b) || synced(b)
	}
	return p.EachBucket(func(b string) bool {
		return !strings.HasPrefix(b, provisioner.ComposedPrefix) || synced(b)
	})
}
