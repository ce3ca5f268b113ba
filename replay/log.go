package replay

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/store"
)

// Log is an event log to ask forensics questions of: a private copy of a state dir, or a temporary
// store filled from the streams or from an archive. Close removes whatever it made.
type Log struct {
	DB     *store.DB
	Source string // what it was read from, for messages
	dir    string // removed on Close
	// anomalies keeps the anomalies of the states Ask answered for the pages after the first, as the
	// seat keeps them (anomcache.go): a command walks a whole bucket's state a page at a time.
	anomalies anomalyCache
	// plans keeps the plans' inputs as of the last point Ask answered plans at (plans.go).
	plans keptPlans
	// asking is held for reading by each Ask and for writing by Close: Close waits for the Asks
	// under way, which would otherwise read a closed store (pebble panics), and Asks after it
	// return store.ErrClosed.
	asking sync.RWMutex
	closed bool
	// points, when set, is what a point is resolved against instead of the store's view: a log of one
	// node's keys resolves against its whole stream (node.go).
	points func(v *store.View) pointIndex
	// node, when set, is the only node whose keys the log holds, of nodeBucket (NodeFromNATS): a
	// request must ask that bucket, narrowed by it.
	node, nodeBucket string
	// Unread lists the composed-<node> buckets a read of every bucket (FromNATS, FromArchive) could
	// not read, in byte order: the streams' tails that kept failing (Fill), or what an archive says
	// its export could not read. A plans answer of their nodes lacks their compositions.
	Unread []string
}

// checkNode refuses a request the log cannot answer: one not narrowed by the node whose keys alone it
// holds.
func (l *Log) checkNode(r *query.Request) error {
	if l.node != "" && (r.Node != l.node || bucketOfWhat(r.What) != l.nodeBucket) {
		return fmt.Errorf("replay: this log holds the keys of node %s of %s alone, and the request asks %s of node %q", l.node, l.nodeBucket, r.What, r.Node)
	}
	return nil
}

// pointsOf is what the log resolves points against, read through v.
func (l *Log) pointsOf(v *store.View) pointIndex {
	if l.points != nil {
		return l.points(v)
	}
	return viewPoints{v}
}

// Close closes the store and removes the copy or temporary store.
func (l *Log) Close() error {
	l.asking.Lock()
	defer l.asking.Unlock()
	if l.closed {
		return nil
	}
	l.closed = true
	l.plans.close()
	err := l.DB.Close()
	if l.dir != "" {
		if rerr := store.RemoveCopy(l.dir); err == nil {
			err = rerr
		}
	}
	return err
}

// onFatal is the Options.OnFatal of every store the package opens (SetOnFatal).
var onFatal atomic.Pointer[func(error)]

// SetOnFatal makes fn the Options.OnFatal of every store the package opens from now on: the copy of a
// state dir or the temporary store a Log reads, and the temporary stores of plans answered at a point
// (a command's Log's, and a seat's Handler's). Pebble cannot go on when it meets no file descriptor to
// create its log or MANIFEST with (store/fds.go); without fn it panics. It is one for the process, as
// the descriptors are; a command sets it before it opens a Log.
func SetOnFatal(fn func(error)) { onFatal.Store(&fn) }

// withOnFatal is opts with the OnFatal SetOnFatal gave, if any.
func withOnFatal(opts store.Options) store.Options {
	if fn := onFatal.Load(); fn != nil {
		opts.OnFatal = *fn
	}
	return opts
}

// offlineOptions are the store options of a log read by a command: a small cache, and the seat's
// memtables, so that filling a temporary store from the streams flushes as seldom as a catch-up does
// (with 16 MiB memtables a million needs took 20-22 s to fill and close, with 64 MiB 15-16 s).
var offlineOptions = store.Options{CacheSize: 32 << 20, MemTableSize: 64 << 20}

// OpenState opens a private copy of a state dir's current generation (store.CopyCurrent): it never
// takes the state dir's lock, so it reads a running seat's log as well as a stopped one's.
func OpenState(stateDir string) (*Log, error) {
	if _, err := os.Stat(stateDir); errors.Is(err, os.ErrNotExist) {
		// Said as such: "holds no projection yet" read as if the directory were there, empty.
		return nil, fmt.Errorf("store: %s does not exist: give the seat's state dir (serve's --state)", stateDir)
	}
	if err := store.CheckStateDir(stateDir); err != nil {
		return nil, err
	}
	dir, err := store.CopyCurrent(stateDir)
	if err != nil {
		return nil, err
	}
	// A reader keeps no reserve: CopyCurrent placed the copy where what it costs fits, leaving the
	// seat's reserve on the state dir's disk; the seat's own reserve on the copy refused every replay
	// on a disk below it, telling the reader to give --state a larger one.
	// Compactions are held too (store.CopyOptions).
	db, err := store.Open(dir, withOnFatal(store.CopyOptions(offlineOptions)))
	if err != nil {
		store.RemoveCopy(dir)
		return nil, fmt.Errorf("open the copy of %s: %w", stateDir, err)
	}
	markSynced(db)
	return &Log{DB: db, Source: "state " + stateDir, dir: dir}, nil
}

// markSynced says every bucket of an offline log holds all it will ever hold: the provisioner's, the
// plans' inputs (a plans answer is synced as mesh-host_modules is), and any other the log holds.
func markSynced(db *store.DB) {
	for _, b := range append(provisionerBuckets(), provisioner.BucketHostModules, provisioner.BucketIndexerBuilds) {
		db.SetSynced(b, true)
	}
	for _, b := range db.Buckets() {
		db.SetSynced(b, true)
	}
}

// smallOptions are the store options of a temporary store that holds few messages (one node's,
// NodeFromNATS): Pebble lays out its log for a memtable's size, 70 MiB of the temporary disk with
// offlineOptions' for a node's few hundred keys.
var smallOptions = store.Options{CacheSize: 8 << 20, MemTableSize: 4 << 20}

// newTemp opens an empty store in a temporary directory.
func newTemp(source string) (*Log, error) { return newTempWith(source, offlineOptions) }

// newTempWith is newTemp with the store's options.
func newTempWith(source string, opts store.Options) (*Log, error) {
	dir, err := store.MakeTempStore()
	if err != nil {
		return nil, err
	}
	db, err := openUnlessHeld(dir, opts)
	if errors.Is(err, store.ErrNoSpace) {
		return nil, tempRoomErr(filepath.Dir(dir), opts)
	}
	if err != nil {
		store.RemoveCopy(dir)
		return nil, err
	}
	// Filled once, read by a few questions, then removed: compacting it would be work for nothing
	// (bounded as for a rebuild, store/catchup.go).
	db.BulkLoad()
	return &Log{DB: db, Source: source, dir: dir}, nil
}

// openUnlessHeld opens a temporary store in dir, or, as soon as a write of the open is held until
// there is room (the disk filled after the store's look at its room, store/space.go), returns
// ErrNoSpace at once, leaving the open to a goroutine that closes and removes the store once there is
// room (closeUnlessHeld). dir is removed when the open fails.
func openUnlessHeld(dir string, opts store.Options) (*store.DB, error) {
	type opened struct {
		db  *store.DB
		err error
	}
	done := make(chan opened, 1)
	go func() {
		db, err := store.Open(dir, withOnFatal(opts))
		done <- opened{db, err}
	}()
	tick := time.NewTicker(heldPoll)
	defer tick.Stop()
	for {
		select {
		case o := <-done:
			if o.err != nil {
				store.RemoveCopy(dir)
			}
			return o.db, o.err
		case <-tick.C:
			if store.WritesHeldIn(dir) {
				go func() {
					if o := <-done; o.err == nil {
						o.db.Close()
					}
					store.RemoveCopy(dir)
				}()
				return nil, fmt.Errorf("%w: a write to %s found the disk full", store.ErrNoSpace, dir)
			}
		}
	}
}

// applyUnlessHeld runs apply, a write of db, or, as soon as a write of db is held until there is room
// (store/space.go), returns ErrNoSpace at once, leaving apply to run on: wait waits for it, which a
// close of db must (closeUnlessHeld).
func applyUnlessHeld(db *store.DB, apply func() error) (wait func(), err error) {
	done := make(chan error, 1)
	go func() { done <- apply() }()
	tick := time.NewTicker(heldPoll)
	defer tick.Stop()
	for {
		select {
		case err := <-done:
			return func() {}, err
		case <-tick.C:
			if db.WritesHeld() {
				return func() { <-done }, fmt.Errorf("%w: a write of the temporary store found the disk full", store.ErrNoSpace)
			}
		}
	}
}

// Progress is told how many messages are done out of how many (0 when not known yet).
type Progress func(done, total int64)

// FromNATS reads the buckets' streams, from their first message to their end, into a temporary store
// with the projector the seat runs, and returns it once every bucket has caught up. It holds what the
// streams still hold: older revisions the buckets' history limits dropped are not there.
func FromNATS(ctx context.Context, js jetstream.JetStream, buckets []string, source string, progress Progress) (*Log, error) {
	l, err := newTemp(source)
	if err != nil {
		return nil, err
	}
	opts := projector.Options{Buckets: buckets}
	if buckets == nil {
		// The seat's buckets: the provisioner's four and the plans' inputs, composed-<node> ones found
		// by listing.
		opts.Buckets = append(provisionerBuckets(), provisioner.BucketHostModules, provisioner.BucketIndexerBuilds)
		opts.Composed = true
	}
	ends := streamEnds(ctx, js, opts.Buckets)
	stop, found, unread, err := fill(ctx, js, l.DB, opts, progress, true)
	l.Unread = unread
	if err != nil {
		if errors.Is(err, store.ErrNoSpace) {
			err = tempRoomErr(filepath.Dir(l.dir), offlineOptions) // what is free with the store still there
		}
		l.closeUnlessHeld(stop)
		return nil, err
	}
	// The projector stopped, then all that was written synced, through applyUnlessHeld: Pebble writes
	// its log behind the batches, so a write that finds the disk full may be held only now, and held in
	// a Close later (the command's, once it has answered) it hung the command.
	wait, err := applyUnlessHeld(l.DB, func() error {
		stop()
		if err := removedEnds(l.DB, ends, unread); err != nil {
			return err
		}
		if err := found(ctx, unread); err != nil {
			return err
		}
		return l.DB.Flush()
	})
	if err != nil {
		if errors.Is(err, store.ErrNoSpace) {
			err = tempRoomErr(filepath.Dir(l.dir), offlineOptions)
		}
		l.closeUnlessHeld(wait)
		return nil, err
	}
	return l, nil
}

// heldPoll is how often closeUnlessHeld looks whether a write of the store waits for room.
const heldPoll = 20 * time.Millisecond

// closeUnlessHeld stops the fill (stop) and closes the temporary store, or returns as soon as a write
// of the store is held until there is room (store/space.go): the stop and the close wait for that
// write, which nothing else ends, and a command that has failed on a full disk has no one to wait for.
// They are then left to a goroutine of their own, which removes the store once there is room; in a
// command the process's exit comes first, and the store is left in the temporary directory, where the
// next read of the streams removes it (newTemp).
func (l *Log) closeUnlessHeld(stop func()) {
	closed := make(chan struct{})
	go func() {
		defer close(closed)
		stop()
		l.Close()
	}()
	tick := time.NewTicker(heldPoll)
	defer tick.Stop()
	for {
		select {
		case <-closed:
			return
		case <-tick.C:
			if l.DB.WritesHeld() {
				return
			}
		}
	}
}

// tempRoomErr says the disk of the system's temporary directory (dir) has too little room for a
// temporary store, and what to do: the store's own words name --state, which is not where it is, and
// giving a command --state changes what it reads.
func tempRoomErr(dir string, opts store.Options) error {
	free := ""
	var st syscall.Statfs_t
	if syscall.Statfs(dir, &st) == nil {
		free = fmt.Sprintf("%d MiB free, ", int64(st.Bavail)*int64(st.Bsize)>>20)
	}
	return noTempRoom(fmt.Sprintf("no room for the temporary store that reads the streams, in %s (%sthe data plus %d MiB kept free needed): free space there, or set TMPDIR to a larger disk",
		dir, free, opts.Reserve()>>20))
}

// noTempRoom is store.ErrNoSpace in its own words, which name no state dir.
type noTempRoom string

func (e noTempRoom) Error() string { return string(e) }
func (e noTempRoom) Unwrap() error { return store.ErrNoSpace }

// fillGiveUp is how long Fill waits while reading a stream keeps failing (a consumer that cannot be
// created or read) and no message is applied, before it gives up with the failure.
var fillGiveUp = time.Minute

// Fill runs a projector over db until every bucket has caught up with its stream, then stops it. A
// bucket that cannot be resumed (its stream was recreated meanwhile) is an error wrapping
// projector.ErrCannotResume; a stream whose reading keeps failing for fillGiveUp with no message
// applied meanwhile is an error with the failure (a user denied consumers, NATS unreachable).
//
// With opts.Composed, a composed-<node> bucket whose tail is Failing (projector.Projector.Failing:
// a permission missing for that stream, no leader, its consumer slot taken) is not waited for, as a
// seat's readiness does not wait for it: the fill ends once every other bucket has caught up, and
// returns those buckets in byte order (unread). What the store holds of them is what was read, their
// checkpoints not synced: a seat on the store reads them on once it can. The fixed buckets are
// waited for, however they fail.
//
// The stream's last messages removed before they were read are recorded as FromNATS records them
// (removedEnds): a rebuilt state dir answered a point among them as if they had never been written
// until serve's tail found them (projector.tailRemoved).
func Fill(ctx context.Context, js jetstream.JetStream, db *store.DB, opts projector.Options, progress Progress) (unread []string, err error) {
	if opts.Buckets == nil {
		opts.Buckets = provisionerBuckets()
	}
	ends := streamEnds(ctx, js, opts.Buckets)
	stop, found, unread, err := fill(ctx, js, db, opts, progress, false)
	stop()
	if err != nil {
		return unread, err
	}
	if err := removedEnds(db, ends, unread); err != nil {
		return unread, err
	}
	return unread, found(ctx, unread)
}

// streamEnds reads each bucket's stream's info before a fill: the fill reads past its last sequence,
// so what it did not read up to there was removed before it was read (removedEnds).
func streamEnds(ctx context.Context, js jetstream.JetStream, buckets []string) map[string]*jetstream.StreamInfo {
	ends := map[string]*jetstream.StreamInfo{}
	for _, b := range buckets {
		s, err := js.Stream(ctx, provisioner.StreamName(b))
		if err == nil {
			ends[b] = s.CachedInfo()
		}
	}
	return ends
}

// removedEnds records, once a fill has stopped, each stream's last messages removed before they were
// read (a subject purged, a TTL without a marker): a gap open from the last one read, as the archive
// of the streams and a key's history from them say (streamGaps). Without it a point among them was
// answered as if they had never been written.
// A bucket the fill left unread (Fill) is not among them: its messages past the checkpoint were not
// read, not removed.
func removedEnds(db *store.DB, ends map[string]*jetstream.StreamInfo, unread []string) error {
	for b, info := range ends {
		if slices.Contains(unread, b) {
			continue
		}
		if applied, _ := db.Applied(b); info.State.Msgs > 0 && info.State.LastSeq > applied {
			if err := db.TailRemoved(b, info.State.LastSeq, info.Created.UnixNano()); err != nil {
				return err
			}
		}
	}
	return nil
}

// fill is Fill, but leaves the projector's stop to the caller (stop): it waits for a batch being
// committed, which a write held for room holds. found records, once stop has returned, the removed
// ends of the composed-<node> buckets the projector found by listing, but those unread
// (projector.Projector.RemovedEnds): streamEnds knows only the buckets opts names. With roomOrFail, a store out of room (a batch
// refused for want of it, or a write held) ends the fill with the store's ErrNoSpace, where a seat's
// or a rebuild's waits for room: a temporary store of a command waited without a word, its progress
// at 0 for as long as the disk stayed full.
func fill(ctx context.Context, js jetstream.JetStream, db *store.DB, opts projector.Options, progress Progress, roomOrFail bool) (stop func(), found func(ctx context.Context, unread []string) error, unread []string, err error) {
	stop = func() {}
	found = func(context.Context, []string) error { return nil }
	if opts.Buckets == nil {
		for _, s := range provisioner.ProvisionerShapes {
			opts.Buckets = append(opts.Buckets, s.Bucket)
		}
	}
	var total int64
	for _, b := range opts.Buckets {
		s, err := js.Stream(ctx, provisioner.StreamName(b))
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			continue
		}
		if err != nil {
			return stop, found, nil, fmt.Errorf("stream of %s: %w", b, err)
		}
		total += int64(s.CachedInfo().State.Msgs)
	}
	var mu sync.Mutex
	var resetErr, tailErr error
	var failingSince time.Time // the first tail failure since a message was last applied
	if opts.Poll == 0 {
		opts.Poll = 100 * time.Millisecond
	}
	opts.OnReset = func(bucket string, err error) {
		mu.Lock()
		defer mu.Unlock()
		resetErr = errors.Join(resetErr, fmt.Errorf("%s: %w", bucket, err))
	}
	opts.OnTailError = func(bucket string, err error) {
		mu.Lock()
		defer mu.Unlock()
		tailErr = fmt.Errorf("%s: %w", bucket, err)
		if failingSince.IsZero() {
			failingSince = time.Now()
		}
	}
	p := projector.New(js, db, opts)
	p.Start(ctx)
	stop = p.Stop
	if opts.Composed {
		named := opts.Buckets
		found = func(ctx context.Context, unread []string) error {
			return p.RemovedEnds(ctx, func(b string) bool {
				return provisioner.IsComposedBucket(b) && !slices.Contains(named, b) && !slices.Contains(unread, b)
			})
		}
	}
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	applied := int64(-1)
	listed := false // the composed buckets' messages are counted in total
	for {
		if n := p.Applied(); n != applied {
			applied = n
			mu.Lock()
			failingSince = time.Time{} // reading moves: a failure since is counted afresh
			mu.Unlock()
		}
		if progress != nil {
			progress(applied, total)
		}
		mu.Lock()
		err := resetErr
		if err == nil && !failingSince.IsZero() && time.Since(failingSince) > fillGiveUp {
			// A command is not left waiting for ever on a stream it cannot read: the projector retries
			// without end, as a seat must.
			err = fmt.Errorf("no message read for %s while reading the streams kept failing: %w", fillGiveUp, tailErr)
		}
		mu.Unlock()
		if err == nil && roomOrFail && db.OutOfRoom() {
			err = db.RoomErr()
		}
		if err != nil {
			return stop, found, nil, err
		}
		// With Composed, the composed-<node> buckets found by listing count too, once listed.
		done := !opts.Composed || p.Discovered()
		if opts.Composed && done && !listed {
			// Their messages count in the total from then on: a rebuild's progress went past it
			// ("12973/12948 messages"), counted before the projector listed them.
			listed = true
			p.EachBucket(func(b string) bool {
				if n, ok := p.Listed(b); ok && provisioner.IsComposedBucket(b) {
					total += int64(n)
				}
				return true
			})
		}
		unread = unread[:0]
		for _, b := range p.Buckets() {
			if _, synced := db.Applied(b); synced {
				continue
			}
			if opts.Composed && provisioner.IsComposedBucket(b) && p.Failing(b) {
				// One node's bucket that cannot be read does not hold up the others (Fill).
				unread = append(unread, b)
				continue
			}
			done = false
			break
		}
		if done {
			if progress != nil {
				progress(p.Applied(), total) // the last word: what the fill read in all
			}
			if len(unread) == 0 {
				unread = nil
			}
			return stop, found, unread, nil
		}
		select {
		case <-ctx.Done():
			return stop, found, nil, ctx.Err()
		case <-tick.C:
		}
	}
}

func provisionerBuckets() []string {
	var out []string
	for _, s := range provisioner.ProvisionerShapes {
		out = append(out, s.Bucket)
	}
	return out
}

// DefaultBuckets are the buckets a seat reads that exist on js: the provisioner's four, and the plans'
// inputs (mesh-host_modules, mesh-indexer_builds and every composed-<node> bucket).
func DefaultBuckets(ctx context.Context, js jetstream.JetStream) ([]string, error) {
	out := append(provisionerBuckets(), provisioner.BucketHostModules, provisioner.BucketIndexerBuilds)
	names := js.StreamNames(ctx)
	for name := range names.Name() {
		// mesh-host_modules and mesh-indexer_builds are plans' inputs too, and already listed.
		if b, ok := strings.CutPrefix(name, "KV_"); ok && provisioner.IsPlanInput(b) && !slices.Contains(out, b) {
			out = append(out, b)
		}
	}
	if err := names.Err(); err != nil {
		return nil, fmt.Errorf("list composed buckets: %w", err)
	}
	return out, nil
}
