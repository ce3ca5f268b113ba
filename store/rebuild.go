package store

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// A rebuild fills a new generation beside the current one and swaps it in only once it has caught up.
// Until the swap, CURRENT names the old generation, which opens; the new one is a leftover that the
// next OpenState removes, or that the next rebuild resumes (Pending). After the swap, CURRENT names the
// new one. A crash at any point leaves a state dir that opens.

// Pending returns the newest generation newer than the current one (a rebuild that did not finish),
// or "" when there is none. With no CURRENT, that is the newest generation: a first rebuild killed
// before its swap, or a CURRENT lost; the rebuild resumes it from its checkpoints either way.
func (s *StateDir) Pending() (string, error) {
	cur, err := s.Current()
	if err != nil {
		return "", err
	}
	curN := -1
	if cur != "" {
		curN, _ = strconv.Atoi(strings.TrimPrefix(filepath.Base(cur), genPrefix))
	}
	gens, err := s.generations()
	if err != nil {
		return "", err
	}
	if len(gens) == 0 || gens[len(gens)-1] <= curN {
		return "", nil
	}
	return filepath.Join(s.path, fmt.Sprintf("%s%06d", genPrefix, gens[len(gens)-1])), nil
}

// ResetState starts a state dir over: it takes the lock, makes a new empty generation current and
// removes every other one. It is the answer to a state dir that cannot be opened (NeedsRebuild): the
// projection refills from the streams as on a first start.
func ResetState(path string, opts Options) (*DB, error) {
	s, err := LockState(path)
	if err != nil {
		return nil, err
	}
	s.SetLogger(opts.Logger)
	gen, err := s.NewGeneration()
	if err != nil {
		s.Close()
		return nil, err
	}
	db, err := Open(gen, opts.firstFill())
	if err != nil {
		_ = s.RemoveGeneration(gen, "the start over of the state dir could not open it: "+err.Error())
		s.Close()
		return nil, err
	}
	if err := s.Swap(gen); err != nil {
		db.Close()
		s.Close()
		return nil, err
	}
	db.state = s
	return db, nil
}

// SwapIn makes a rebuilt store the state dir's current generation in place of old, which it closes:
// the state dir (and its lock) passes from old to rebuilt, CURRENT is renamed to rebuilt's directory,
// and old's directory is removed. old must have been opened with OpenState, rebuilt with Open on a
// generation of the same state dir, and nothing may read or write old any more.
func SwapIn(old, rebuilt *DB) error {
	s := old.state
	if s == nil {
		return fmt.Errorf("store: %s was not opened from a state dir", old.dir)
	}
	old.state = nil // old's Close must not release the lock
	closeErr := old.Close()
	rebuilt.state = s
	if err := s.Swap(rebuilt.dir); err != nil {
		return fmt.Errorf("swap in %s: %w", rebuilt.dir, err)
	}
	if closeErr != nil {
		return fmt.Errorf("close the replaced generation: %w", closeErr)
	}
	return nil
}

// CheckpointGeneration makes a new generation of db's state dir holding what db has committed, and
// returns it, for Open with a log: a store opened without one (FirstFillNoWAL) cannot turn it on. db's
// memtables are flushed, then Pebble's checkpoint of it is taken in the new generation (its tables
// hard-linked, its manifest and OPTIONS copied: cheap, whatever the size). Commits go on meanwhile: the
// generation holds every one committed before the call, and maybe some after, up to one of the batches,
// each with its checkpoint, as a kill would leave them; a projector on it reads on from there. CURRENT
// still names db's generation (SwapIn makes the new one current), so a crash before the swap leaves the
// new one a leftover, removed at the next open.
func (db *DB) CheckpointGeneration() (string, error) {
	s := db.state
	if s == nil {
		return "", fmt.Errorf("store: %s was not opened from a state dir", db.dir)
	}
	if err := db.writeFailed.failed(); err != nil {
		return "", err
	}
	gen, err := s.NewGeneration()
	if err != nil {
		return "", err
	}
	// Pebble makes the directory itself, and refuses one that exists; its number is taken meanwhile by
	// nothing (the seat makes one generation at a time).
	if err := os.Remove(gen); err != nil {
		return "", fmt.Errorf("checkpoint %s: %w", gen, err)
	}
	err = db.inBackground(context.Background(), func() error {
		// Its flush is not counted towards the compactions' wait (catchUp.uncounted, as Close's): at
		// the wait's last flush, it would start a compaction of the tables just checkpointed, in the
		// store the checkpoint replaces, which the swap's Close would wait for. Only while it runs:
		// flushes of what this store is written after it count, as they add to its L0.
		db.catchUp.uncounted.Add(1)
		defer db.catchUp.uncounted.Add(-1)
		if err := db.pdb.Flush(); err != nil {
			return err
		}
		return db.pdb.Checkpoint(gen)
	})
	if err != nil {
		// Pebble removes what it made of a checkpoint that failed; a flush that failed made nothing.
		_ = os.RemoveAll(gen)
		return "", fmt.Errorf("checkpoint %s into %s: %w", db.dir, gen, err)
	}
	return gen, nil
}
