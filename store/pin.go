package store

import "github.com/cockroachdb/pebble/v2"

// pinnedState is the store as it was before a rollup's removals began: what views read until the
// batch of the rollup message itself commits.
//
// A rollup that removes other keys (a wildcard or whole-bucket Nats-Rollup) has them removed in parts
// of rollupPart keys, each committed on its own so that a rollup of a million keys does not build one
// batch of a million purges (removeInParts). Only the message's own batch moves the checkpoint. Read
// from the committed state, an answer in between would hold some of the removed keys and not others,
// under an as_of that says the rollup has not happened yet: a state the stream never had. Pinned, the
// answers in between are exactly the state as of the message before, as their as_of says, and the next
// answer after the message's batch is the state after it. Other buckets' applies wait on applyMu
// meanwhile, so their state in the pin is their committed state too.
type pinnedState struct {
	snap *pebble.Snapshot
	refs int // one for the pin, one for each View reading it; under DB.pinMu
	// rewrites is DB.Rewrites as of the durable state (setDurable): a View of it says that.
	rewrites uint64
}

// pinViews pins the committed state for views until unpinViews. Called under applyMu.
func (db *DB) pinViews() {
	p := &pinnedState{snap: db.pdb.NewSnapshot(), refs: 1}
	db.pinMu.Lock()
	db.pin = p
	db.pinMu.Unlock()
}

// unpinViews lets views read the committed state again; the pinned snapshot is closed once the last
// view reading it is closed. Called under applyMu.
func (db *DB) unpinViews() { db.letGo(&db.pin) }

// letGo empties slot (db.pin or db.durable) and drops its reference to the state it held: its snapshot
// is closed once the last view reading it is.
func (db *DB) letGo(slot **pinnedState) {
	db.pinMu.Lock()
	p := *slot
	*slot = nil
	db.pinMu.Unlock()
	if p != nil {
		db.release(p)
	}
}

// viewSnapshot returns the snapshot a View reads: the pinned state's, with a reference for the caller
// to release, or a new snapshot of the committed state when none is pinned. The new snapshot is taken
// under pinMu: taken after the check but outside it, a rollup could pin and commit parts in between,
// and the view would read some of the removed keys gone under the as_of before the rollup.
func (db *DB) viewSnapshot() (*pebble.Snapshot, *pinnedState) {
	db.pinMu.Lock()
	defer db.pinMu.Unlock()
	if db.pin != nil {
		db.pin.refs++
		return db.pin.snap, db.pin
	}
	if viewSnapshotHook != nil {
		viewSnapshotHook()
	}
	return db.pdb.NewSnapshot(), nil
}

// viewSnapshotHook, when set (tests), is called just before a View snapshots the committed state.
var viewSnapshotHook func()

// release drops a reference to p, closing its snapshot with the last one.
func (db *DB) release(p *pinnedState) {
	db.pinMu.Lock()
	p.refs--
	last := p.refs == 0
	db.pinMu.Unlock()
	if last {
		// A snapshot's Close can fail only on a closed store, where nothing is left to release.
		_ = p.snap.Close()
	}
}

// newRowsIter opens an iterator over the committed state, or over the pinned one while a rollup's
// removals are committed in parts. An iterator reads the point in time it was opened at whatever
// happens to the snapshot after, so it needs no reference of its own: it is opened under pinMu, before
// unpinViews can close the snapshot.
func (db *DB) newRowsIter() (*pebble.Iterator, error) {
	db.pinMu.Lock()
	defer db.pinMu.Unlock()
	if db.pin != nil {
		return db.pin.snap.NewIter(nil)
	}
	return db.pdb.NewIter(nil)
}

// The durable state. A first fill's store without a log (Options.FirstFillNoWAL, syncByFlush) makes
// its commits durable by flushing its memtables (flushgroup.go), 10-60 ms after they are committed and
// seen by views. A bucket caught up at its stream's end answers synced: true, which a kill must not
// take back: so its answers read the state as of the last flush that ended, as a store with a log
// shows a batch asked to sync only once synced. flushMemTables snapshots the state under applyMu just
// before its flush (no commit in between) and, once the flush has ended, makes it the durable state,
// with each bucket's applied sequence in it (bucketState.durable). Answers of a bucket not synced yet
// read the committed state, which a kill may take back as it may a batch not synced on a store with a
// log. Every other store has no durable state: what it shows is durable once asked to sync.

// setDurable makes snap, the state flushed with the applied sequences seqs, the durable state, and
// wakes the synced buckets whose durable sequence moved. Called under applyMu.
func (db *DB) setDurable(snap *pebble.Snapshot, seqs []bucketSeq, rewrites uint64) {
	db.pinMu.Lock()
	old := db.durable
	db.durable = &pinnedState{snap: snap, refs: 1, rewrites: rewrites}
	db.pinMu.Unlock()
	// After the state: a reader of Reach or Answered that opens a view next reads one at or past it.
	for _, s := range seqs {
		if s.b.durable.Swap(s.seq) != s.seq && s.b.synced.Load() {
			s.b.wake()
		}
	}
	db.durableMoves.Add(1)
	if old != nil {
		db.release(old)
	}
}

type bucketSeq struct {
	b   *bucketState
	seq uint64
}

// appliedNow is every bucket's applied sequence. Called under applyMu, which holds them still.
func (db *DB) appliedNow() []bucketSeq {
	db.mu.Lock()
	defer db.mu.Unlock()
	seqs := make([]bucketSeq, 0, len(db.buckets))
	for _, b := range db.buckets {
		seqs = append(seqs, bucketSeq{b, b.seq.Load()})
	}
	return seqs
}

// dropDurable lets the durable state go (Close); its snapshot is closed once the last view reading it
// is. Called under applyMu.
func (db *DB) dropDurable() { db.letGo(&db.durable) }

// readsDurable reports whether answers of b read the durable state: b is synced, on a first fill's
// store without a log.
func (db *DB) readsDurable(b *bucketState) bool { return db.syncByFlush && b != nil && b.synced.Load() }

// durableSoon starts a flush that makes what is committed durable, shared with any other asked for
// meanwhile: on a first fill's store, a commit not asked to sync that changed a synced bucket (an
// expiry, a batch with more of its stream to read) is answered only once flushed. Not waited for.
func (db *DB) durableSoon() {
	if !db.syncByFlush || !db.kicked.CompareAndSwap(false, true) {
		return
	}
	go func() {
		db.kicked.Store(false)
		_ = db.flushGroup() // a flush that fails fails the store (failed.go); ErrClosed: nothing to do
	}()
}

// durableSoonIfSynced is durableSoon for a commit that changed bucket.
func (db *DB) durableSoonIfSynced(bucket string) {
	if db.syncByFlush && db.readsDurable(db.lookup(bucket)) {
		db.durableSoon()
	}
}

// Answered is Applied as the answers see it: on a first fill's store, a synced bucket's sequence is
// its durable one (the state its answers read).
func (db *DB) Answered(bucket string) (seq uint64, synced bool) {
	b := db.lookup(bucket)
	if b == nil {
		return 0, false
	}
	if !b.synced.Load() {
		return b.seq.Load(), false
	}
	if db.readsDurable(b) {
		return b.durable.Load(), true
	}
	return b.seq.Load(), true
}

// AnswerRowsView opens the RowsView an answer of bucket reads, and says whether that answer is synced:
// on a first fill's store, a synced bucket's reads the durable state.
func (db *DB) AnswerRowsView(bucket string) (*RowsView, bool, error) {
	if db.closed.Load() {
		return nil, false, ErrClosed
	}
	b := db.lookup(bucket)
	synced := b != nil && b.synced.Load()
	if !synced || !db.readsDurable(b) {
		v, err := db.RowsView()
		return v, synced, err
	}
	db.pinMu.Lock()
	defer db.pinMu.Unlock()
	if db.durable == nil {
		return nil, false, ErrClosed
	}
	// As newRowsIter: the iterator keeps the point in time it was opened at.
	it, err := db.durable.snap.NewIter(nil)
	if err != nil {
		return nil, false, err
	}
	return &RowsView{rows: rows{db: db, it: it}}, true, nil
}

// AnswerView is View for an answer that says synced (a plans answer whose inputs are synced, an
// answer with at): on a first fill's store, the durable state.
func (db *DB) AnswerView(synced bool) (*View, error) {
	if !synced || !db.syncByFlush {
		return db.View()
	}
	if db.closed.Load() {
		return nil, ErrClosed
	}
	db.pinMu.Lock()
	p := db.durable
	if p == nil {
		db.pinMu.Unlock()
		return nil, ErrClosed
	}
	p.refs++
	db.pinMu.Unlock()
	return &View{rows: rows{db: db, src: p.snap}, snap: p.snap, pinned: p, rewrites: p.rewrites}, nil
}

// AnswerRewrites is Rewrites as the answers see it: it moves too when the durable state does, which
// may change a synced bucket's answers without moving their sequences (an expiry's rewrite committed
// before, shown only now).
func (db *DB) AnswerRewrites() uint64 { return db.rewrites.Load() + db.durableMoves.Load() }
