package store

import "github.com/cockroachdb/pebble/v2"

// SetTrimBatch sets how many events a trim batch walks, for tests of the multi-batch path.
func SetTrimBatch(n int) (restore func()) {
	old := trimBatch
	trimBatch = n
	return func() { trimBatch = old }
}

// States is how many bucket states the store keeps in memory.
func (db *DB) States() int {
	db.mu.Lock()
	defer db.mu.Unlock()
	return len(db.buckets)
}

// SetRollupPart sets how many keys a batch of a rollup's removals holds, and what is told each part
// committed (an error stops the rollup there, as a seat stopped between two parts).
func SetRollupPart(n int, done func(n int) error) (restore func()) {
	return SetRollupPartRead(n, done, nil)
}

// SetRollupPartRead is SetRollupPart, with what each part's scan read told to read.
func SetRollupPartRead(n int, done func(n int) error, read func(points uint64)) (restore func()) {
	oldRead := rollupPartRead
	rollupPartRead = read
	old, oldDone := rollupPart, rollupPartDone
	rollupPart, rollupPartDone = n, done
	return func() { rollupPart, rollupPartDone, rollupPartRead = old, oldDone, oldRead }
}

// CountTrimSteps makes every trim add its history iterators' steps (Pebble's own, tombstones
// included) to n.
func CountTrimSteps(n *int) (restore func()) {
	trimIterDone = func(st pebble.IteratorStats) {
		*n += st.ForwardStepCount[pebble.InternalIterCall] + st.ReverseStepCount[pebble.InternalIterCall]
	}
	return func() { trimIterDone = nil }
}

// SetTrimKeptCap sets how many keys one generation of what a trim carries between batches holds, for
// tests of its rotation.
func SetTrimKeptCap(n int) (restore func()) {
	old := keptCap
	keptCap = n
	return func() { keptCap = old }
}

// CountLiveBelow makes every scan of LiveBelow add the events it read to n.
func CountLiveBelow(n *int) (restore func()) {
	liveBelowRead = func(events int) { *n += events }
	return func() { liveBelowRead = nil }
}

// StopLiveBelowAfter calls stop once scans of LiveBelow have read n events.
func StopLiveBelowAfter(n int, stop func()) (restore func()) {
	read := 0
	liveBelowStep = func() {
		if read++; read == n {
			stop()
		}
	}
	return func() { liveBelowStep = nil }
}

// SetViewSnapshotHook sets what a View calls just before it snapshots the committed state.
func SetViewSnapshotHook(f func()) (restore func()) {
	old := viewSnapshotHook
	viewSnapshotHook = f
	return func() { viewSnapshotHook = old }
}

// OnTrimBatch calls fn as each trim batch ends (committed or not).
func OnTrimBatch(fn func()) (restore func()) {
	trimIterDone = func(pebble.IteratorStats) { fn() }
	return func() { trimIterDone = nil }
}

// HistoryLocks is how many buckets' history locks the store keeps (lockHistory).
func (db *DB) HistoryLocks() int {
	db.histMu.Lock()
	defer db.histMu.Unlock()
	return len(db.histLocks)
}

// MaxOpenFilesOf is maxOpenFiles.
var MaxOpenFilesOf = maxOpenFiles

// EmbeddedMaxConnOf is embeddedMaxConn.
var EmbeddedMaxConnOf = embeddedMaxConn

// HoldFlushes makes every flush of a first fill's store (flushgroup.go) call hold before it begins.
func HoldFlushes(hold func()) (restore func()) {
	flushHook = hold
	return func() { flushHook = nil }
}
