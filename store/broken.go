package store

import (
	"fmt"
	"log/slog"
	"sync"

	"github.com/cockroachdb/pebble/v2"
)

// Pebble checks every block it reads against its checksum. When one does not match it reports the
// file to its event listener, whose default calls Logger.Fatalf: the process died with a panic and a
// stack trace (the broken-state test garbling an sstable saw it at open). The store takes the report
// instead: the read that found it fails with Pebble's corruption error (NeedsRebuild says yes to it),
// the store logs what is broken and what to do, and Broken is closed, so that the seat stops (or,
// later, rebuilds) rather than answer and apply around a hole.

// brokenState records the first corruption Pebble reports.
type brokenState struct {
	once sync.Once
	ch   chan struct{}
	err  error
	log  *slog.Logger
}

func newBrokenState(log *slog.Logger) *brokenState {
	return &brokenState{ch: make(chan struct{}), log: log}
}

func (b *brokenState) listener() *pebble.EventListener {
	return &pebble.EventListener{DataCorruption: func(info pebble.DataCorruptionInfo) {
		b.once.Do(func() {
			b.err = fmt.Errorf("%w: %s does not read back as written (%v): run `mesh-provisioner rebuild`", ErrCorrupt, info.Path, info.Details)
			if b.log != nil {
				b.log.Error("state dir is broken", "file", info.Path, "err", info.Details, "fix", "run `mesh-provisioner rebuild`")
			}
			close(b.ch)
		})
	}}
}

// Broken returns a channel closed once Pebble has found part of the state dir that does not read
// back as written. BrokenErr then says what and what to do.
func (db *DB) Broken() <-chan struct{} { return db.broken.ch }

// BrokenErr is the corruption Broken reports, an ErrCorrupt; nil before.
func (db *DB) BrokenErr() error {
	select {
	case <-db.broken.ch:
		return db.broken.err
	default:
		return nil
	}
}

// isPebbleCorruption reports whether err is Pebble's corruption error.
func isPebbleCorruption(err error) bool { return err != nil && pebble.IsCorruptionError(err) }

// damage is err's text for a message: Pebble joins a second error to a corruption it finds, which
// prints as a line "<corruption detail carrier>" of no use to whoever reads it; its details alone are
// said instead.
func damage(err error) string {
	if info := pebble.ExtractDataCorruptionInfo(err); info != nil && info.Details != nil {
		return info.Details.Error()
	}
	return err.Error()
}
