package seat

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/progress"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// A bucket whose stream can no longer be resumed from the checkpoint (it was deleted and created again,
// or purged past the checkpoint) makes the seat rebuild the whole projection (a composed-<node> bucket
// never does: the projector forgets it in place and reads it again, projector/forget.go): a new generation beside
// the current one is filled from the streams by a second projector while the verb keeps answering from
// the current one; once its projector has listed the streams for composed-<node> buckets and every
// bucket of the new one has caught up (but a composed-<node> bucket that cannot be read:
// rebuildCaughtUp), the old projector stops, the new store reaches what the old
// one had applied (swapwait.go), the verb switches to the new store (waiting for the answers in flight on the old one), CURRENT is renamed to
// the new generation and the old one is removed. The new projector keeps running: nothing is read
// twice. A crash at any point leaves CURRENT naming a generation that opens (store/rebuild.go).

// projectorOptions are the seat's projector options for a store, with OnReset wired to a rebuild;
// onReset, when set, takes the resets instead (a rebuild's own projector, until it is swapped in).
func (s *Seat) projectorOptions(db *store.DB, onReset func(string, error)) projector.Options {
	po := s.cfg.Projector
	if po.Logger == nil {
		po.Logger = s.log
	}
	po.Streams = s.streams // one listing for the seat, however many projectors it runs
	if s.cfg.Plans {
		var buckets []string
		if po.Buckets == nil {
			for _, sh := range provisioner.ProvisionerShapes {
				buckets = append(buckets, sh.Bucket)
			}
		} else {
			buckets = append(buckets, po.Buckets...)
		}
		po.Buckets = append(buckets, provisioner.BucketHostModules, provisioner.BucketIndexerBuilds)
		po.Composed = true
	}
	if po.OnReset != nil {
		return po
	}
	po.OnReset = func(bucket string, reason error) {
		if onReset != nil {
			onReset(bucket, reason)
			return
		}
		// The bucket no longer follows its stream: say so in its answers until the rebuild is in.
		db.SetSynced(bucket, false)
		s.requestRebuild(bucket, reason)
	}
	return po
}

func (s *Seat) startRetention(db *store.DB) *store.Retention {
	if s.cfg.Retention == nil {
		return nil
	}
	ro := *s.cfg.Retention
	if ro.Logger == nil {
		ro.Logger = s.log
	}
	r := store.NewRetention(db, ro)
	r.Start(s.ctx)
	return r
}

func (s *Seat) requestRebuild(bucket string, reason error) {
	s.log.Warn("bucket cannot be resumed: rebuilding the projection in a new generation, answering from the current one meanwhile",
		"bucket", bucket, "reason", reason)
	select {
	case s.rebuildCh <- struct{}{}:
	default: // one is asked for already
	}
}

// Rebuilds is how many rebuilds the seat has swapped in.
func (s *Seat) Rebuilds() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.rebuilds
}

func (s *Seat) rebuildLoop(ctx context.Context) {
	s.relogLoop(ctx)
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.rebuildCh:
		}
		retry := newRetrying(s.log)
		for {
			err := s.rebuild(ctx)
			if err == nil {
				retry.succeeded()
				break
			}
			if ctx.Err() != nil {
				break
			}
			if !retry.failed(ctx, func() { s.log.Error("rebuild failed; retrying with backoff", "err", err) }) {
				return
			}
		}
	}
}

// rebuild fills a new generation and swaps it in, and tells the metrics (Config.OnRebuild) how it ended.
func (s *Seat) rebuild(ctx context.Context) error {
	if s.cfg.OnRebuild == nil {
		return s.rebuildOnce(ctx, false)
	}
	done := s.cfg.OnRebuild()
	err := s.rebuildOnce(ctx, false)
	if err == nil || ctx.Err() == nil {
		done(err)
	}
	return err
}

// rebuildOnce fills a new generation from the streams and swaps it in; with relog, the new generation
// is instead a checkpoint of the current store, which has no log, opened with one, and its projector
// reads on from the checkpoint (relog.go).
func (s *Seat) rebuildOnce(ctx context.Context, relog bool) error {
	old := s.Store()
	st := old.State()
	if st == nil {
		return fmt.Errorf("the store was not opened from a state dir: run `mesh-provisioner rebuild`")
	}
	what, doing := "rebuild", "filling"
	newGen := st.NewGeneration
	if relog {
		what, doing = "switch to a log", "reading on in"
		newGen = old.CheckpointGeneration
	}
	gen, err := newGen()
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.opening = gen // a disk that fills during the open holds it: WritesHeld says so
	s.mu.Unlock()
	opts := s.cfg.Store
	if relog {
		// Its L0 is the first fill's flushes: left to Pebble it compacts them into the levels as it
		// opens, and the compaction after catch-up rewrites them all again (h145b: 168 MB, then about
		// as much). Held until that compaction, which ends the hold (Seat.compactAfterCatchUp).
		opts.BulkLoad = true
	}
	ndb, err := store.Open(gen, opts)
	s.mu.Lock()
	s.opening = ""
	s.mu.Unlock()
	if err != nil {
		_ = st.RemoveGeneration(gen, "the "+what+" could not open it (it tries again in a new one): "+err.Error())
		return fmt.Errorf("open the new generation %s (the %s tries again by itself; the current generation answers meanwhile): %w", gen, what, err)
	}
	abandon := func(why string) {
		ndb.Close()
		_ = st.RemoveGeneration(gen, "the "+what+" "+doing+" it was given up: "+why)
	}

	// Until the swap, a reset of the new projector restarts the rebuild; after it, it is the seat's. One
	// reported once the rebuild has caught up (during the swap's wait) is held, and carried over at the
	// swap: the bucket's consumer is gone, and dropped it would be answered synced and stale for good.
	var (
		resetMu sync.Mutex
		swapped bool
		held    []heldReset
	)
	resets := make(chan error, 1)
	s.mu.Lock()
	heldHook := s.heldReset
	s.mu.Unlock()
	p := projector.New(s.js, ndb, s.projectorOptions(ndb, func(bucket string, reason error) {
		resetMu.Lock()
		if swapped {
			resetMu.Unlock()
			ndb.SetSynced(bucket, false)
			s.requestRebuild(bucket, reason)
			return
		}
		held = append(held, heldReset{bucket, reason})
		resetMu.Unlock()
		if heldHook != nil {
			heldHook(bucket)
		}
		select {
		case resets <- fmt.Errorf("%s: %w", bucket, reason):
		default:
		}
	}))
	// The new projector lists no bucket before it starts: count those the current one tails.
	var total int64
	if !relog { // a relog's projector reads the few messages applied since its checkpoint
		total = s.messages(ctx, s.Current().Buckets())
	}
	start := time.Now()
	if relog {
		s.log.Info("the first catch-up is done: checkpointed its store into a generation with a log, which reads on from there", "generation", gen, "from", old.Dir())
	} else {
		s.log.Info("rebuild started", "generation", gen, "messages", total)
	}
	p.Start(s.ctx)
	s.mu.Lock()
	s.next, s.nextDB = p, ndb
	cur := s.proj
	s.mu.Unlock()
	// The requests waiting now woke the current projector alone; those after this wake both (wake).
	p.TakeAsked(cur)
	defer func() {
		s.mu.Lock()
		s.next, s.nextDB = nil, nil
		s.mu.Unlock()
	}()
	barLog := s.log
	if relog {
		barLog = nil // a few messages: its own lines say how long it took
	}
	bar := progress.New(io.Discard, barLog, "rebuild", "messages", total)
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for caughtUp := false; !caughtUp; {
		select {
		case <-ctx.Done():
			p.Stop()
			abandon("the seat stopped")
			return ctx.Err()
		case err := <-resets:
			p.Stop()
			abandon("a stream changed again during the " + what + ": " + err.Error())
			return fmt.Errorf("a stream changed again during the %s: %w", what, err)
		case <-tick.C:
		}
		bar.Set(p.Applied())
		caughtUp = rebuildCaughtUp(ndb, p)
	}
	bar.Done()

	// Swap: the old projector stops, the new store reaches what it had applied (swapwait.go), the verb
	// moves over, then CURRENT.
	s.mu.Lock()
	oldProj, oldRet, atCaughtUp, beforeSwap, wait := s.proj, s.retention, s.atCaughtUp, s.beforeSwap, s.swapWait
	s.mu.Unlock()
	if atCaughtUp != nil {
		atCaughtUp(p, ndb)
	}
	oldProj.Stop()
	if oldRet != nil {
		oldRet.Stop()
	}
	// Resets the old projector reported while a rebuild ran are covered by it; it reports no more. A
	// relog's projector read on from a checkpoint: they are left to the rebuild they asked for.
	if !relog {
		select {
		case <-s.rebuildCh:
		default:
		}
	}
	if wait <= 0 {
		wait = DefaultSwapWait
	}
	waitStart := time.Now()
	if behind := s.awaitSwap(ctx, old, ndb, p, wait); len(behind) > 0 {
		// waited is how long it did wait: the bound, or less when the seat stopped meanwhile.
		behindMsg := "rebuild swapped in behind the replaced projection: answers of these buckets may carry an older as_of until the new projector reads on"
		if relog {
			behindMsg = "switched to the store with a log behind the one without: answers of these buckets may carry an older as_of until its projector reads on"
		}
		s.log.Warn(behindMsg,
			"buckets", len(behind), "first", behind[:min(len(behind), 10)], "waited", time.Since(waitStart).Round(time.Millisecond))
	}
	if beforeSwap != nil {
		beforeSwap(p)
	}
	resetMu.Lock()
	swapped = true
	late := held
	resetMu.Unlock()
	for _, r := range late {
		ndb.SetSynced(r.bucket, false)
	}
	s.reader.swap(ndb)
	for _, r := range late {
		s.requestRebuild(r.bucket, r.reason)
	}
	swapErr := store.SwapIn(old, ndb)
	s.mu.Lock()
	s.appliedBefore += oldProj.Applied()
	s.cur, s.proj, s.owned = ndb, p, ndb
	s.retention = s.startRetention(ndb)
	if !relog {
		s.rebuilds++
	}
	s.mu.Unlock()
	if swapErr != nil {
		// The new store answers; CURRENT still names the old generation, which the next start opens
		// and finds out of date again (a relog's: as a kill during the first catch-up leaves it).
		if relog {
			s.log.Error("the projection with a log answers, but the state dir could not be switched to it", "err", swapErr)
			return nil
		}
		s.log.Error("the rebuilt projection answers, but the state dir could not be switched to it", "err", swapErr)
		return nil
	}
	if relog {
		s.log.Info("answering from the store with a log", "generation", gen, "messages_since_checkpoint", p.Applied(), "took", time.Since(start).Round(time.Millisecond))
		return nil
	}
	s.log.Info("rebuild swapped in", "generation", gen, "messages", p.Applied(), "took", time.Since(start).Round(time.Millisecond))
	return nil
}

// heldReset is a reset a rebuild's projector reported after its catch-up, carried over at the swap.
type heldReset struct {
	bucket string
	reason error
}

// projectionCaughtUp reports whether a projector's store has caught up with every stream: the streams
// were listed for composed-<node> buckets, and every bucket found has caught up. It is Synced of the
// seat, and, but for the Failing composed buckets (rebuildCaughtUp), whether a rebuild's projection
// can be swapped in: the new store holds no composed-<node>
// bucket to start from, so until that listing Buckets lists only the fixed ones, and swapped in then,
// plans answered unsynced, without the nodes' compositions. Discovered is read first, since a listing
// tails the buckets it finds before it says so.
func projectionCaughtUp(db *store.DB, p *projector.Projector) bool {
	return caughtUpBut(db, p, func(string) bool { return false })
}

// rebuildCaughtUp is projectionCaughtUp without the composed-<node> buckets whose tail is Failing
// (one node's stream the seat cannot read: a permission missing, its one consumer taken, no leader),
// which readiness does not wait for either: the rebuild waited for them, and for as long as one node's
// bucket could not be read it never swapped in, the reset bucket answered stale by the replaced
// projection and /readyz at 503. Swapped in, such a bucket is read once it can be, its node's plans
// answering synced: false meanwhile.
func rebuildCaughtUp(db *store.DB, p *projector.Projector) bool {
	return caughtUpBut(db, p, func(b string) bool { return provisioner.IsComposedBucket(b) && p.Failing(b) })
}

// caughtUpBut reports whether the streams were listed for composed-<node> buckets and every bucket
// found has caught up, but those letGo says not to wait for.
func caughtUpBut(db *store.DB, p *projector.Projector, letGo func(bucket string) bool) bool {
	if !p.Discovered() {
		return false
	}
	for _, b := range p.Buckets() {
		if _, synced := db.Applied(b); !synced && !letGo(b) {
			return false
		}
	}
	return true
}

// messages is how many messages the buckets' streams hold, for the progress line.
func (s *Seat) messages(ctx context.Context, buckets []string) int64 {
	var n int64
	for _, b := range buckets {
		st, err := s.js.Stream(ctx, provisioner.StreamName(b))
		if errors.Is(err, jetstream.ErrStreamNotFound) || err != nil {
			continue
		}
		n += int64(st.CachedInfo().State.Msgs)
	}
	return n
}
