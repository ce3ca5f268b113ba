package projector

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/store"
)

// Parking. A seat with plans tails one composed-<node> bucket per node, and a node's compositions
// change a few times a day. A consumer each, kept open, cost the seat per bucket about 7 goroutines,
// 70 KiB of memory and a heartbeat message a second; at 4,000 nodes: 28,000 goroutines, 4,000 idle
// messages a second, and a third of a core with nothing to read (measured with an in-process server,
// session 5). So a composed-<node> bucket that has read nothing new for Options.ParkAfter, is synced,
// and whose stream the listing reports on, gives its consumer up (deleted at once) and waits, on its
// goroutine alone, until:
//
//   - a listing newer than the parking reports its stream changed: another last or first sequence,
//     another creation time, or the stream gone (watchParked, at every listing: Options.Verify or the
//     seat's metrics poll, 10 or 5 s). The bucket then tails again from its checkpoint, and the usual
//     checks (verify.go, forget.go) see what changed: a purge, a recreation, a deletion;
//   - a plans request waits for the bucket's min_seq (Wake): the client that just published a
//     composition sees it at once, not at the next listing;
//   - the listing stops working (none completed within two of its intervals and two of its
//     durations, listingRuns): every parked bucket tails again, and none parks until a listing
//     completes, so a parked bucket never waits on a listing that does not come.
//
// A bucket the store has read may also start parked, with no consumer ever set up, when the first
// listing since Start shows its stream as the store left it (parkstart.go).
//
// Idle is the stream's idleness, not the consumer's: a tail whose stream, as its info said when the
// tail started, had taken no message for ParkAfter already (the server's clock: the info's time less
// its last message's, or its creation's when it has none) parks once it is synced with nothing read
// past that info's last sequence, without keeping its consumer ParkAfter more (quietSince). A fresh
// state dir on a mesh of thousands of nodes (a first start, a rebuild) read every bucket and then
// kept each consumer idle 30 s: at 4,000 buckets 6.4-6.9 s of the 16 s of CPU, a heartbeat per bucket
// every 5 s and the pulls' expiries. It parks as any parking does (park, below): registered first,
// its stream's info read after, so a message that came after the tail's info, read or not, is seen
// either by the tail (nothing past the info's last sequence may be read, or it waits ParkAfter), by
// that info (it tails again), or by a listing after it (it is woken). A tail after a park that did
// not park waits ParkAfter, so a parking that fails (its STREAM.INFO unanswered under load) is not
// tried again at every Poll with a consumer created each time.
//
// A parked bucket's answers are as fresh as the listing: a composition written to a parked bucket is
// applied within one listing interval plus Options.Poll. Its synced flag stays true: the projection
// caught up with the stream since start, as the contract's synced says.

// errParked ends an idle composed-<node> bucket's tail: runBucket parks it.
var errParked = errors.New("projector: idle, parked")

// parkedBucket is what a parked bucket's stream looked like when it parked.
type parkedBucket struct {
	wake chan struct{} // capacity 1
	at   time.Time     // when the info below was asked for: a listing after it is newer
	// The info, once read (read): until then only a Wake, or a listing that stops, wakes the bucket.
	read        bool
	created     int64
	first, last uint64
	// starting: a bucket that may start parked, waiting for the first listing since Start
	// (parkAtStart); until it has one, no listing has stopped for it.
	starting bool
	// woken: when a request (Wake) or a listing that stopped last woke it. The tail after takes no
	// listed info read before (openStream): the stream may have been created again since the listing.
	woken time.Time
}

// streamEnd is a stream's last sequence, and which stream (its creation time) it is the last of.
type streamEnd struct {
	last    uint64
	created int64
}

// parking is what a bucket's goroutine remembers from one parking to the next (runBucket).
type parking struct {
	behind streamEnd // the stream's end past the checkpoint that park last tailed again for
	// again: the last park tailed again without parking, so the tail after it waits ParkAfter
	// rather than park as soon as its stream is found quiet.
	again bool
	// since: the tail after takes a listed info only when read since this (openStream): when the
	// reason to tail came (see wokenSince), or the tail before failed.
	since time.Time
}

// quietSince returns when, on this process's clock, a stream whose info was just read last took a
// message (or was created, when it holds none since): its info's time less its last message's, both
// the server's, so the skew between the two clocks does not count, taken back from now, when the
// answer came. Zero when the server does not say when it answered (an old server: the tail waits
// ParkAfter), and now when the server's times disagree (another server's clock behind).
func (p *Projector) quietSince(bucket string, info *jetstream.StreamInfo) time.Time {
	if info.TimeStamp.IsZero() {
		return time.Time{}
	}
	last := info.State.LastTime
	if info.Created.After(last) {
		last = info.Created // never written, or a mirror of older messages
	}
	idle := max(info.TimeStamp.Sub(last), 0)
	if p.aged != nil {
		idle += p.aged(bucket)
	}
	return time.Now().Add(-idle)
}

// mayPark reports whether an idle bucket may give its consumer up now: a composed-<node> bucket of a
// Projector with Options.Composed (which runs watchParked), with parking on and a listing that runs.
func (p *Projector) mayPark(bucket string) bool {
	return p.opts.Composed && p.opts.ParkAfter > 0 && provisioner.IsComposedBucket(bucket) && p.listingRuns()
}

// listingRuns reports whether a listing completed within two of its intervals and two of its
// durations (the newest completed one's). A listing of thousands of streams can take longer than its
// interval, and longer than the one before under load; the next one then starts as it ends, and
// completes up to an interval and its own duration after it. Taken for a listing that stopped, a slow
// listing woke every parked bucket at each tick and let none park, whose thousands of new consumers
// slowed the JetStream API, and the listing, further.
func (p *Projector) listingRuns() bool {
	listed, took := p.streams.Listed(), p.streams.Took()
	return !listed.IsZero() && time.Since(listed.Add(took)) < 2*(p.listEvery()+took)
}

// park waits until the parked bucket's stream changes, a request wakes it, or the listing stops
// working; it reports false when ctx ends. The bucket is registered first, so that a Wake from then
// on is kept: a request that waits for a message written after the info below was read still finds
// the bucket reading. Then the stream is asked for its info once: what the bucket waits to change.
// The bucket tails again at once when the info fails the checks a tail starts with (verify.go): a
// purge or a recreation after the bucket's last check changes no listing once the bucket has parked
// on it. It tails again too when the stream ends past the checkpoint, since a message may have come
// after its consumer had nothing pending; but not twice for the same end (behind, runBucket's): the
// tail in between, idle for ParkAfter on a consumer created after that end was read, found nothing up
// to it, so what lies between was removed before it was read (a TTL, and the marker it left, expired
// while the bucket was parked).
//
// A park that tails again without parking says why (debug) and sets st.again: the tail after it waits
// ParkAfter before it parks, whatever its stream's quiet, so a parking that keeps failing costs a
// consumer per ParkAfter, never one per Poll.
func (p *Projector) park(ctx context.Context, bucket string, log *slog.Logger, st *parking) bool {
	pk, unpark := p.registerParked(bucket, time.Now(), false)
	defer unpark()
	if p.askedRecently(bucket) {
		// A request came after the tail found it idle and before it was registered here, when a Wake
		// reaches it: it tails again as soon as it has parked, and waits ParkAfter (Wake).
		notify(pk.wake)
	}
	if p.beforeParkRead != nil {
		p.beforeParkRead(bucket)
	}
	info, err := p.readStream(ctx, bucket)
	if p.afterParkRead != nil {
		p.afterParkRead(bucket)
	}
	st.again = true  // until it parks
	st.since = pk.at // the info just read is kept in the listing's Poller, read after this
	if err != nil {
		st.since = time.Now()
		// Tail again: it finds out what failed. A consumer is created again for the bucket: said.
		if ctx.Err() == nil {
			log.Debug("not parked: its stream's info could not be read; tailing on", "err", err)
		}
		return ctx.Err() == nil
	}
	if err := p.check(ctx, info, bucket, &verifier{}); err != nil {
		// Tail again: the tail finds what check found, and forgets the bucket to read it again (a
		// stream emptied by a purge has nothing to read past the checkpoint, and check finds the purge).
		log.Debug("not parked: its stream fails the checks; tailing again", "err", err)
		return ctx.Err() == nil
	}
	end := streamEnd{last: info.State.LastSeq, created: info.Created.UnixNano()}
	if applied := p.db.Checkpoint(bucket).Applied; info.State.Msgs > 0 && end.last > applied {
		if end != st.behind {
			st.behind = end
			log.Debug("not parked: its stream ends past the checkpoint; tailing again", "applied_seq", applied, "last_seq", end.last)
			return ctx.Err() == nil
		}
		reread, err := p.removedUnread(ctx, bucket, info, applied, log)
		// A state dir out of room is said once by the store (store/space.go), not at each parking.
		if err != nil && ctx.Err() == nil && !errors.Is(err, store.ErrNoSpace) {
			log.Warn("the stream ends past what is left to read, and the projection could not follow it", "err", err)
		}
		if err != nil || reread {
			return ctx.Err() == nil // read again: from the stream's first message, or park again
		}
	}
	st.again = false
	log.Debug("idle: consumer given up until the stream changes", "applied_seq", info.State.LastSeq)
	if !p.waitParked(ctx, pk, info, log) {
		return false
	}
	st.since = p.wokenSince(pk)
	return true
}

// wokenSince is when the reason a parked bucket was woken came, for the tail after it (openStream): a
// listing that shows its stream changed read it after the bucket parked (pk.at), but a request or a
// listing that stopped may come after a recreation that no listing has shown yet (pk.woken).
func (p *Projector) wokenSince(pk *parkedBucket) time.Time {
	p.parkMu.Lock()
	defer p.parkMu.Unlock()
	if pk.woken.After(pk.at) {
		return pk.woken
	}
	return pk.at
}

// registerParked makes a bucket parked (not yet Parked: its info is not read) so that a Wake from now
// on is kept; at is when the info it will park on was, or will be, asked for, and starting says it
// waits to start parked (parkAtStart). unpark ends it.
func (p *Projector) registerParked(bucket string, at time.Time, starting bool) (pk *parkedBucket, unpark func()) {
	pk = &parkedBucket{wake: make(chan struct{}, 1), at: at, starting: starting}
	p.parkMu.Lock()
	p.parked[bucket] = pk
	p.parkMu.Unlock()
	return pk, func() { p.unpark(bucket, pk) }
}

// unpark ends a bucket's registration as parked, unless another has replaced it.
func (p *Projector) unpark(bucket string, pk *parkedBucket) {
	p.parkMu.Lock()
	if p.parked[bucket] == pk {
		delete(p.parked, bucket)
	}
	p.parkMu.Unlock()
}

// waitParked parks a registered bucket on its stream's info until a listing reports it changed, a
// request wakes it, or the listing stops working; it reports false when ctx ends.
func (p *Projector) waitParked(ctx context.Context, pk *parkedBucket, info *jetstream.StreamInfo, log *slog.Logger) bool {
	p.parkMu.Lock()
	pk.created, pk.first, pk.last, pk.read = info.Created.UnixNano(), info.State.FirstSeq, info.State.LastSeq, true
	p.parkMu.Unlock()
	select {
	case <-ctx.Done():
		return false
	case <-pk.wake:
		log.Debug("tailing again")
		return true
	}
}

// removedUnread is told that nothing is left to read past applied up to the stream's last sequence
// (park: a tail since that end was read found nothing): those messages were removed before they were
// read, a TTL'd composition and the marker it left both expired while the bucket was parked. The
// store's log is told so (store.DB.TailRemoved: no point among them can be rebuilt), and the check a
// tail makes once it has applied the stream's last sequence is made here, since it never will: when
// the stream's first sequence is past a message the projection still rests on, the key went from
// the bucket unseen, and the bucket is forgotten and read again (forget.go).
// It reports whether the bucket was forgotten to be read again.
func (p *Projector) removedUnread(ctx context.Context, bucket string, info *jetstream.StreamInfo, applied uint64, log *slog.Logger) (bool, error) {
	if err := p.db.TailRemoved(bucket, info.State.LastSeq, info.Created.UnixNano()); err != nil {
		return false, fmt.Errorf("record the removed end: %w", err)
	}
	seq, live, err := p.db.LiveBelow(ctx, bucket, 0, min(info.State.FirstSeq, applied+1))
	if err != nil || !live {
		return false, err
	}
	reason := fmt.Errorf("%w: stream %s starts at sequence %d and has nothing left to read up to its last %d, but the projection still rests on message %d: it was removed unread",
		ErrCannotResume, info.Config.Name, info.State.FirstSeq, info.State.LastSeq, seq)
	if err := p.reread(ctx, bucket, reason, log); err != nil {
		return false, err
	}
	return true, nil
}

// Wake makes a parked bucket tail again now (a request waits for its min_seq), and keeps a
// composed-<node> bucket from parking for ParkAfter from now, parked or not: the write the request
// waits for may come later, within its wait_ms, and a bucket that parked again on its stream's quiet
// as soon as it had read what there was left that write to the next listing (answered 504 when that
// came after the wait). A bucket woken by a request tailed ParkAfter before it parked again anyway
// before quiet streams parked once read; a bucket reading when the request came parked without
// reading the write the same way.
//
// A tailed bucket's tail is also told (any bucket): it looks whether its stream removed messages past
// the checkpoint before they were read, which the request may wait for (skipRemoved).
func (p *Projector) Wake(bucket string) {
	p.mu.Lock() // before parkMu, never under it (Add takes parkMu under mu)
	if ch := p.asks[bucket]; ch != nil {
		p.askedAt[bucket] = time.Now()
		notify(ch)
	}
	p.mu.Unlock()
	p.parkMu.Lock()
	defer p.parkMu.Unlock()
	if p.opts.Composed && p.opts.ParkAfter > 0 && provisioner.IsComposedBucket(bucket) {
		now := time.Now()
		if p.asked == nil {
			p.asked = map[string]time.Time{}
		}
		if len(p.asked) >= p.pruneAt {
			// Requests may name any node: keep only those of the last ParkAfter.
			for b, at := range p.asked {
				if now.Sub(at) >= p.opts.ParkAfter {
					delete(p.asked, b)
				}
			}
			p.pruneAt = max(64, 2*len(p.asked))
		}
		p.asked[bucket] = now
	}
	if pk := p.parked[bucket]; pk != nil {
		pk.woken = time.Now()
		notify(pk.wake)
	}
}

// TakeAsked has p take over the requests that waited on other's buckets within the last askedFor
// (Wake): a rebuild's projector, started while they wait, then skips over messages removed unread
// for them (skipRemoved) as the projector it replaces would have. Before, a request that had woken the
// replaced projector only was answered from the rebuilt store, once swapped in, after its whole
// wait_ms: 504, though the stream held nothing up to its min_seq. A bucket p does not tail yet keeps
// the time for when it does.
func (p *Projector) TakeAsked(other *Projector) {
	other.mu.Lock()
	asked := maps.Clone(other.askedAt)
	other.mu.Unlock()
	p.mu.Lock()
	defer p.mu.Unlock()
	for b, at := range asked {
		if time.Since(at) < askedFor && at.After(p.askedAt[b]) {
			p.askedAt[b] = at
			if ch := p.asks[b]; ch != nil {
				notify(ch)
			}
		}
	}
}

// askedAtTime is when a request last waited on a tailed bucket (Wake), zero when none did.
func (p *Projector) askedAtTime(bucket string) time.Time {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.askedAt[bucket]
}

// askedRecently reports whether a request waited on a bucket (Wake) within ParkAfter: it does not
// park yet.
func (p *Projector) askedRecently(bucket string) bool {
	p.parkMu.Lock()
	defer p.parkMu.Unlock()
	at, ok := p.asked[bucket]
	return ok && time.Since(at) < p.opts.ParkAfter
}

// notify wakes the waiter on a channel of capacity 1, or leaves the wake-up already waiting there.
func notify(ch chan<- struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// Parked reports whether a bucket is parked: tailed, without a consumer, waiting for its stream to
// change (not while it is still asking for its stream's info as it parks).
func (p *Projector) Parked(bucket string) bool {
	p.parkMu.Lock()
	defer p.parkMu.Unlock()
	pk := p.parked[bucket]
	return pk != nil && pk.read
}

// ParkedCount is how many buckets are parked.
func (p *Projector) ParkedCount() int {
	p.parkMu.Lock()
	defer p.parkMu.Unlock()
	n := 0
	for _, pk := range p.parked {
		if pk.read {
			n++
		}
	}
	return n
}

// watchParked wakes parked buckets whose streams a new listing reports changed, and every parked bucket
// once the listing stops working, until ctx ends.
func (p *Projector) watchParked(ctx context.Context) {
	t := time.NewTicker(p.opts.Poll)
	defer t.Stop()
	var seen time.Time // the newest listing looked at
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		listed := p.streams.Listed()
		runs := p.listingRuns()
		if runs && !listed.After(seen) {
			continue
		}
		seen = listed
		p.parkMu.Lock()
		for bucket, pk := range p.parked {
			switch {
			case !runs && !pk.starting:
				pk.woken = time.Now() // the infos the listing kept are as old as its last listing
				notify(pk.wake)
			case pk.read && p.streamChanged(bucket, pk, listed):
				notify(pk.wake)
			}
		}
		p.parkMu.Unlock()
	}
}

// streamChanged reports whether the newest info of a parked bucket's stream, read after it parked,
// differs from what the bucket parked on, or a listing after it no longer returned the stream.
func (p *Projector) streamChanged(bucket string, pk *parkedBucket, listed time.Time) bool {
	info, read, ok := p.streams.Info(provisioner.StreamName(bucket))
	if !ok {
		return listed.After(pk.at)
	}
	if !read.After(pk.at) {
		return false
	}
	return info.Created.UnixNano() != pk.created || info.State.FirstSeq != pk.first || info.State.LastSeq != pk.last
}
