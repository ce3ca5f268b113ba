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
func (db *DB) unpinViews() {
	db.pinMu.Lock()
	p := db.pin
	db.pin = nil
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
