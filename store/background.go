package store

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/cockroachdb/pebble/v2"
)

// ErrBackground marks a store whose flushes or compactions keep failing (BackgroundErr). Pebble
// tries them again by itself; while a flush fails, the memtables fill until writes stall.
var ErrBackground = errors.New("store: the state dir's flushes or compactions fail")

// Pebble reports a flush or compaction that failed to EventListener.BackgroundError and tries it
// again (a flush at once, for good; pebble v2.1.7 compaction.go flush and handleCompactFailure).
// The listeners the store tees together had none, so they went unsaid: a flush that could not open
// its output for want of a descriptor spun, silent, until writes stalled. (Pebble's own default,
// an error line each, would have logged thousands a second.) The store counts them, logs the first
// of a run and, once a flush or compaction is done again, that it recovered; a run of
// bgPersist or more makes BackgroundErr say it (the seat's /readyz), with what to do when it is a
// descriptor or the disk's room that is missing.

// bgPersist is how many failures in a row, no flush or compaction done between, make
// BackgroundErr say them: one that Pebble's next try gets past is logged, and does not take the
// seat out of readiness.
const bgPersist = 3

// background is what the store knows of Pebble's failed flushes and compactions.
type background struct {
	log    *slog.Logger
	errors atomic.Int64 // every failure since the open (BackgroundErrors)

	mu    sync.Mutex
	inRow int64 // failures since the last flush or compaction done
	last  error
}

func (b *background) listener() *pebble.EventListener {
	return &pebble.EventListener{
		BackgroundError: b.failed,
		FlushEnd: func(info pebble.FlushInfo) {
			if info.Err == nil {
				b.done()
			}
		},
		CompactionEnd: func(info pebble.CompactionInfo) {
			if info.Err == nil {
				b.done()
			}
		},
	}
}

func (b *background) failed(err error) {
	b.errors.Add(1)
	b.mu.Lock()
	b.inRow++
	b.last = err
	first := b.inRow == 1
	b.mu.Unlock()
	if first && b.log != nil {
		b.log.Error("a flush or compaction of the state dir failed; Pebble tries again", "err", err, "fix", bgFix(err))
	}
}

func (b *background) done() {
	b.mu.Lock()
	n := b.inRow
	b.inRow, b.last = 0, nil
	b.mu.Unlock()
	if n > 0 && b.log != nil {
		b.log.Info("the state dir's flushes and compactions are done again", "failures", n)
	}
}

// err is the ErrBackground of a run of bgPersist failures or more, else nil.
func (b *background) err() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.inRow < bgPersist {
		return nil
	}
	return fmt.Errorf("%w: %d times in a row, the last: %v: %s", ErrBackground, b.inRow, b.last, bgFix(b.last))
}

// bgFix says what to do about a failure of Pebble's background work.
func bgFix(err error) string {
	if a := accessOf(err); a != nil {
		switch a.errno {
		case syscall.EMFILE:
			return "the process is out of file descriptors: " + fixEMFILE + ", and restart the seat; Pebble tries again meanwhile"
		case syscall.ENFILE:
			return "the system is out of file descriptors: " + fixENFILE + "; Pebble tries again meanwhile"
		}
		return a.fix
	}
	return "Pebble tries again; if it goes on, check the disk and restart the seat (it resumes from what it committed)"
}

// BackgroundErrors counts the flushes and compactions that failed since the store opened (Pebble
// tried each again).
func (db *DB) BackgroundErrors() int64 { return db.bg.errors.Load() }

// BackgroundErr says, as an ErrBackground, that the store's flushes or compactions have failed
// bgPersist times or more in a row and what to do; nil once one is done again.
func (db *DB) BackgroundErr() error { return db.bg.err() }
