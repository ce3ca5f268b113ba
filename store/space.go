package store

import (
	"errors"
	"fmt"
	"syscall"
)

// ErrNoSpace marks a state dir that has too little room left (or has become read-only) to take the
// next batch: the answer is to free space; applying resumes by itself once there is.
var ErrNoSpace = errors.New("store: no room to write in the state dir")

// A full disk is not an error Pebble can come back from: when its log cannot be written or rotated
// it panics inside its commit pipeline (pebble v2.1.7 db.go rotateWAL), and the process dies with a
// stack trace, leaving a state dir that opens (the commit that failed was never acknowledged). So the
// store stops writing before the disk is full: Apply refuses a batch with ErrNoSpace while less than
// Options.MinFreeBytes is free on the state dir's file system, or while that file system is
// read-only, and the projector retries it with backoff, answering meanwhile from what is committed
// (not synced). Another writer filling the disk between the check and the commit can still beat it;
// the reserve makes that a race instead of a certainty.

// stRdonly is ST_RDONLY (Linux) and MNT_RDONLY (BSDs, macOS) in statfs flags.
const stRdonly = 0x1

// defaultMinFree is the room kept free when Options.MinFreeBytes is 0: two memtables (a flush writes
// one out while the next fills, and the log holds as much) and room for a compaction's output.
func defaultMinFree(memTable uint64) int64 { return 2*int64(memTable) + 32<<20 }

// checkRoom returns ErrNoSpace when the state dir's file system is read-only or has less than the
// reserve free. A file system it cannot ask is let through: Pebble says what is wrong then.
func (db *DB) checkRoom() error { return db.room("applying resumes by itself") }

// room is checkRoom with what follows once there is room again.
func (db *DB) room(then string) error {
	if db.minFree < 0 {
		return nil
	}
	var st syscall.Statfs_t
	if err := syscall.Statfs(db.dir, &st); err != nil {
		return nil
	}
	if int64(st.Flags)&stRdonly != 0 {
		return fmt.Errorf("%w: %s is on a read-only file system: make it writable; %s", ErrNoSpace, db.dir, then)
	}
	free := int64(st.Bavail) * int64(st.Bsize)
	if free < db.minFree {
		return fmt.Errorf("%w: %d MiB free in %s, below the %d MiB kept for Pebble's log, flushes and compactions: free space on that disk (or give --state a larger one); %s",
			ErrNoSpace, free>>20, db.dir, db.minFree>>20, then)
	}
	return nil
}

// roomToOpen refuses to open a Pebble directory on a file system with less than minFree free: opening
// writes (a replayed log is flushed into a table, a new log and manifest are made), and on a full
// disk Pebble retries that flush forever, neither opening nor failing.
func roomToOpen(dir string, minFree int64) error {
	db := &DB{dir: dir, minFree: minFree}
	return db.room("then start again")
}

// openErr says why Pebble could not open a state dir: no room, not writable, or (anything else) a
// broken state that a rebuild replaces.
func openErr(dir string, err error) error {
	switch {
	case errors.Is(err, syscall.ENOSPC):
		return fmt.Errorf("%w: open %s: %v: free space on that disk (or give --state a larger one), then start again", ErrNoSpace, dir, err)
	case errors.Is(err, syscall.EROFS), errors.Is(err, syscall.EACCES), errors.Is(err, syscall.EPERM):
		return fmt.Errorf("open %s: %v: the state dir must be writable by the seat: fix its mount or permissions, or give another --state", dir, err)
	}
	return fmt.Errorf("%w: open %s: %v (run `mesh-provisioner rebuild`)", ErrCorrupt, dir, err)
}
