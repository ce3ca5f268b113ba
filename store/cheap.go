package store

import (
	"sync/atomic"

	"github.com/cockroachdb/pebble/v2"

	"github.com/novox/mesh-provisioner/internal/cheap"
)

// Pebble's cache holds the blocks and reserves the memtables' room: Open sizes it CacheSize plus two
// memtables. The first memtables of an open are small (256 KiB, doubling), so on a seat that writes
// little the blocks take the memtables' share too, up to the whole cache. When writes come, each new
// memtable's reservation evicts blocks for its room, and glibc keeps the evicted blocks' pages: the
// memtables' pages came on top of them, and a restarted seat that had walked every index and then took
// 400,000 writes reached 389 MiB (docs/performance.md, Session 17). A memtable is made just before the
// flush of the one it replaces begins; so at a flush's start, when the C heap holds an eighth of the
// cache's size more free than at its lowest since the last look, its free pages are given back
// (cheap.Trim), on a goroutine of the store's own: Pebble calls its listener under its lock. What the
// process holds of Pebble's part then stays near the cache's size, as Pebble counts it.
//
// Only then: pages given back are faulted in again when blocks are allocated there (about 25 µs a
// page on the machines measured), and a flush that freed little has nothing worth giving back. (A
// trim at every flush looked 60% dearer on the bench's module walks in one pair of runs, not in a later
// pair at a higher load.)

// heapGiver gives the C heap's free pages back after a flush begins, when blocks freed since make
// up an eighth of the cache.
type heapGiver struct {
	kick chan struct{} // a flush began; holds one
	quit chan struct{}
	done chan struct{}
	// room is how much more the C heap may hold free than at its lowest before a trim: an eighth of
	// the cache's size.
	room int64
	// low is the least the C heap held free at a look since the last trim, or at that trim; -1
	// before the first look; under run.
	low    int64
	checks atomic.Int64 // flushes looked at since the open
	trims  atomic.Int64 // trims done since the open
}

// newHeapGiver makes a heapGiver for a cache of capacity bytes, whose listener may be asked at once;
// its goroutine starts with start.
func newHeapGiver(capacity int64) *heapGiver {
	return &heapGiver{room: capacity / 8, low: -1, kick: make(chan struct{}, 1), quit: make(chan struct{}), done: make(chan struct{})}
}

// start starts the goroutine, which stop ends: once the store is open.
func (g *heapGiver) start() { go g.run() }

func (g *heapGiver) run() {
	defer close(g.done)
	for {
		select {
		case <-g.quit:
			return
		case <-g.kick:
			g.look(cheap.Free())
		}
	}
}

// look decides on a flush begun, the C heap holding free bytes free: a trim when that is room more
// than the least it held at a look since the last trim.
func (g *heapGiver) look(free int64) {
	g.checks.Add(1)
	if g.low < 0 || free < g.low {
		g.low = free
		return
	}
	if free-g.low >= g.room {
		cheap.Trim()
		g.trims.Add(1)
		g.low = free // the free chunks stay free, their pages given back
	}
}

// due says a flush began; said again before it was looked at, it is looked at once. It never waits, and asked after stop
// it does nothing.
func (g *heapGiver) due() {
	select {
	case g.kick <- struct{}{}:
	default:
	}
}

// stop ends the goroutine and waits for it.
func (g *heapGiver) stop() {
	close(g.quit)
	<-g.done
}

func (g *heapGiver) listener() *pebble.EventListener {
	return &pebble.EventListener{FlushBegin: func(pebble.FlushInfo) { g.due() }}
}
