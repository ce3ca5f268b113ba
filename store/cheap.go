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
// flush of the one it replaces begins, so at each flush's start the C heap's free pages are given back
// (cheap.Trim), on a goroutine of the store's own: Pebble calls its listener under its lock. What the
// process holds of Pebble's part then stays within the cache's size, as Pebble counts it.

// heapGiver gives the C heap's free pages back after each flush begins.
type heapGiver struct {
	kick  chan struct{} // a trim is due; holds one
	quit  chan struct{}
	done  chan struct{}
	trims atomic.Int64 // trims done since the open
}

// newHeapGiver makes a heapGiver whose listener may be asked at once; its goroutine starts with start.
func newHeapGiver() *heapGiver {
	return &heapGiver{kick: make(chan struct{}, 1), quit: make(chan struct{}), done: make(chan struct{})}
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
			cheap.Trim()
			g.trims.Add(1)
		}
	}
}

// due asks for a trim; asked again before it ran, it trims once. It never waits, and asked after stop
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
