package store

import "sync"

// A first fill's store without a log (Options.FirstFillNoWAL) answers while it is filled, and a bucket
// caught up at its stream's end answers synced: true, which a kill must not take back: with a log,
// the batch that reaches the stream's end is synced before Apply returns. Without one, what makes a
// commit durable is a flush of the memtables (Pebble flushes them whole, oldest first), some 10 ms.
// Done once a batch, under applyMu, a mesh's thousand composed-<node> buckets catching up one after
// the other made a thousand flushes, each a table in L0: 11-14 s where syncing a log took 1.3 s, and
// the compactions they started (h145b). So the commits waiting share flushes: Apply waits, once its
// batch is committed and applyMu let go, for a flush that began after its commit; one that starts
// covers every commit before it, so those that committed while a flush ran wait for the next one
// together.

// flushGroup hands out the flushes that commits wait for.
type flushGroup struct {
	mu      sync.Mutex
	cond    sync.Cond
	running bool
	started uint64 // flushes begun
	done    uint64 // flushes ended
	err     error  // of the last flush ended
}

// flushGroup returns once a flush of the memtables that began after the call has ended: what was
// committed before the call is durable then.
func (db *DB) flushGroup() error {
	g := &db.flushes
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.cond.L == nil {
		g.cond.L = &g.mu
	}
	// A flush running began before this call, maybe before its commit: the next one.
	want := g.started + 1
	for g.done < want {
		if g.running {
			g.cond.Wait()
			continue
		}
		g.running = true
		g.started++
		g.mu.Unlock()
		err := db.flushMemTables()
		g.mu.Lock()
		g.running = false
		g.done++
		g.err = err
		g.cond.Broadcast()
	}
	return g.err
}

// flushMemTables flushes the memtables to tables, and waits for it. Under applyMu: no commit meanwhile
// (those waiting commit together after it), and no Close.
func (db *DB) flushMemTables() (err error) {
	if flushHook != nil {
		flushHook()
	}
	db.applyMu.Lock()
	defer db.applyMu.Unlock()
	if db.closed.Load() {
		return ErrClosed
	}
	if err := db.writeFailed.failed(); err != nil {
		return err
	}
	defer func() {
		if r := recover(); r != nil {
			err = db.writeFailed.fail(db.dir, r)
		}
	}()
	if !db.syncByFlush {
		return db.pdb.Flush()
	}
	// The state the flush makes durable, taken with no commit in between: once flushed, the synced
	// buckets' answers read it (pin.go, the durable state).
	snap, seqs, rewrites := db.pdb.NewSnapshot(), db.appliedNow(), db.rewrites.Load()
	if err := db.pdb.Flush(); err != nil {
		_ = snap.Close()
		return err
	}
	db.setDurable(snap, seqs, rewrites)
	return nil
}

// flushHook, when set (tests), is called as a flush of flushGroup is about to take applyMu.
var flushHook func()
