package store

import (
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"syscall"

	"github.com/cockroachdb/pebble/v2"
)

// ErrWriteFailed marks a store whose disk failed a write for another reason than a full disk (an
// input/output error): Pebble cannot take another write in this process. The answer is to stop, check
// the disk, and start again: the store opens from what was committed before the failure.
var ErrWriteFailed = errors.New("store: a write to the state dir failed")

// A write that fails for another reason than a full disk (space.go holds those until there is room)
// reaches Pebble, which panics in the commit that finds it (pebble v2.1.7 db.go: Logger.Fatalf on a
// failed log sync, panic in commitWrite on a log write that failed before). The commit pipeline then
// takes no other write: a panic in commitWrite leaves its lock held, so a later commit, a Flush or
// Close's own sync would wait forever. So every commit of the store (Apply's batches, and its trims,
// marks and checkpoints, through commit, set and del) recovers that panic, the store records the
// failure once (Failed, FailedErr), logs it, refuses every later write, and Flush and Close no longer
// call into Pebble; the seat stops on it (serve exits 1). Nothing is lost: the batch that
// failed carries its checkpoint, and Pebble's log keeps a prefix of what was committed. A failure
// that Pebble finds on its own goroutines (a MANIFEST written by a flush) still panics there, and one
// a memtable's rotation finds (rotateWAL closing the failed log) is a fatal error of the runtime:
// Pebble panics with its mutex released, and the unlock deferred above it cannot be recovered.

// failedState records the first write failure.
type failedState struct {
	once sync.Once
	ch   chan struct{}
	err  error
	log  *slog.Logger
}

func newFailedState(log *slog.Logger) *failedState {
	return &failedState{ch: make(chan struct{}), log: log}
}

// fail records a write failure (a panic Pebble raised in a commit) and returns it.
func (f *failedState) fail(dir string, cause any) error {
	f.once.Do(func() {
		fix := "check the disk"
		if outOfRoom(cause) {
			// A sync that found the disk full (NFS, thin volumes), or a second ENOSPC after the probe
			// found room: Pebble cannot go on, but the disk is not failing, it is full.
			fix = "the disk is full: free space on that disk (or give --state a larger one)"
		}
		f.err = fmt.Errorf("%w: %s: %v: %s, then start again (the seat resumes from what it committed)", ErrWriteFailed, dir, cause, fix)
		if f.log != nil {
			f.log.Error("the state dir cannot be written", "state", dir, "err", fmt.Sprint(cause),
				"fix", fix+", then start again: the seat resumes from what it committed")
		}
		close(f.ch)
	})
	return f.err
}

// failed is the recorded failure, or nil.
func (f *failedState) failed() error {
	select {
	case <-f.ch:
		return f.err
	default:
		return nil
	}
}

// Failed returns a channel closed once a write to the state dir has failed for another reason than a
// full disk: the store takes no more batches. FailedErr then says what and what to do.
func (db *DB) Failed() <-chan struct{} { return db.writeFailed.ch }

// FailedErr is the failure Failed reports, an ErrWriteFailed; nil before.
func (db *DB) FailedErr() error { return db.writeFailed.failed() }

// commit commits a batch of Apply, turning Pebble's panic on a failed write into the store's
// ErrWriteFailed.
func (db *DB) commit(b *pebble.Batch, opts *pebble.WriteOptions) (err error) {
	if err := db.writeFailed.failed(); err != nil {
		return err
	}
	defer func() {
		if r := recover(); r != nil {
			err = db.writeFailed.fail(db.dir, r)
		}
	}()
	if db.noWAL {
		opts = pebble.NoSync // there is no log to sync (Options.NoWAL); Pebble refuses the ask
	}
	return b.Commit(opts)
}

// set writes one key through commit: every write of the store goes through it, so that none panics on
// a failed disk or waits for good on Pebble's commit pipeline once a write has failed.
func (db *DB) set(key, value []byte, opts *pebble.WriteOptions) error {
	b := db.pdb.NewBatch()
	defer b.Close()
	if err := b.Set(key, value, nil); err != nil {
		return err
	}
	return db.commit(b, opts)
}

// del deletes one key through commit (set says why).
func (db *DB) del(key []byte, opts *pebble.WriteOptions) error {
	b := db.pdb.NewBatch()
	defer b.Close()
	if err := b.Delete(key, nil); err != nil {
		return err
	}
	return db.commit(b, opts)
}

// outOfRoom reports whether a failure Pebble raised is the disk being full: an ENOSPC or EDQUOT in
// the error it panicked with, or in the text of its fatal log line.
func outOfRoom(cause any) bool {
	if err, ok := cause.(error); ok && (errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT)) {
		return true
	}
	text := fmt.Sprint(cause)
	return strings.Contains(text, syscall.ENOSPC.Error()) || strings.Contains(text, syscall.EDQUOT.Error())
}
