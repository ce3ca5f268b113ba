package seat

import (
	"context"
	"time"
)

// A seat started on a state dir with no generation yet, or one started over, fills that generation
// from the streams without Pebble's write-ahead log (store.Options.FirstFillNoWAL, serve): the log was
// an uncompressed second copy of every byte the catch-up wrote. Pebble cannot turn the log on in an
// open store, and the verb answers from that store meanwhile; so once every bucket has caught up
// (rebuildCaughtUp), the seat checkpoints the store into a new generation (its memtables flushed, its
// tables hard-linked: store.DB.CheckpointGeneration), opens that one with its log, starts a projector
// on it, which reads on from its checkpoints the few messages applied since, and swaps it in as a
// rebuild's generation is (rebuild.go, swapwait.go): answers go on throughout, and as_of does not go
// back. A rebuild asked for first (a bucket reset) opens its generation with the log, and then nothing
// more is needed. A kill before the swap leaves CURRENT naming the first generation, which opens (with
// its log) as it was after one of its batches, each with its checkpoint (whole memtables are flushed,
// oldest first): the seat reads on from there. Answers it gave past that point may have shown rows the
// kill lost, with synced: false: a batch that reaches its stream's end, after which its bucket answers
// synced: true, is flushed to tables before the bucket says so (store.Options.FirstFillNoWAL), as a
// store with a log syncs it; and a synced bucket's answers read the state as of the last flush that
// ended, so none shows what a kill takes back (store/pin.go, the durable state; docs/decisions.md,
// Session 20).

// relogLoop turns the log on once the first catch-up into a store without one is done. It returns once
// it has, when a rebuild is asked for (the caller runs it: its generation has a log), or when ctx ends.
func (s *Seat) relogLoop(ctx context.Context) {
	if db := s.Store(); !db.NoWAL() || db.State() == nil {
		return
	}
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	retry := newRetrying(s.log)
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.rebuildCh:
			select { // left for the caller, which rebuilds
			case s.rebuildCh <- struct{}{}:
			default:
			}
			return
		case <-tick.C:
		}
		if !rebuildCaughtUp(s.Store(), s.Current()) {
			continue
		}
		s.mu.Lock()
		hook := s.beforeRelog
		s.mu.Unlock()
		if hook != nil {
			hook()
		}
		err := s.rebuildOnce(ctx, true)
		if err == nil {
			retry.succeeded()
			return
		}
		if ctx.Err() != nil {
			return
		}
		if !retry.failed(ctx, func() {
			s.log.Error("turning the log on after the first catch-up failed; answering from the store without one meanwhile, retrying with backoff", "err", err)
		}) {
			return
		}
	}
}
