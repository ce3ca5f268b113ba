package seat

import (
	"context"
	"errors"
	"sort"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// A rebuild swaps its store in once every bucket of it has caught up with its stream once; the
// replaced projector reads on until it stops, so at the swap it may have applied messages, written
// after that catch-up, that the new one has not read yet. Swapped in then, an answer without min_seq
// right after the swap carried an as_of below one given just before it: a client paging, or comparing
// answers, saw the projection go back. So after the old projector stopped (its positions are final)
// and before the verb moves over, the swap waits until the new store has applied, bucket by bucket,
// at least what the replaced one had applied of the same stream, for at most DefaultSwapWait.

// DefaultSwapWait bounds how long a rebuild's swap waits for the new store to reach what the replaced
// one applied; past it the swap goes on, and says which buckets were behind.
const DefaultSwapWait = 5 * time.Second

// swapTarget is a bucket the new store must reach before the swap: the replaced store's position.
type swapTarget struct {
	bucket string
	cp     store.Checkpoint
	stream jetstream.Stream // looked up at the first probe (leftToRead)
	probed uint64           // the new store's position at the last probe, +1 (0: never probed)
}

// swapTargets lists the buckets whose new store is behind what the replaced store applied, and that
// it can be waited for: the replaced store followed the bucket's stream (synced: a bucket reset,
// whose stream was recreated or purged, follows nothing, and a bucket forgotten is not listed), and
// the new projector tails it. A bucket the new projector does not tail (a composed-<node> bucket
// deleted, or created after the new projector listed the streams and before it heard of it) is not
// waited for: it reads it once it finds it. Nor is a composed-<node> bucket whose tail is Failing in the
// new projector (rebuildCaughtUp): it is read once it can be.
func swapTargets(old *store.DB, ndb *store.DB, next *projector.Projector) []swapTarget {
	var out []swapTarget
	for _, b := range old.Buckets() {
		seq, synced := old.Applied(b)
		if seq == 0 || !synced {
			continue
		}
		if have, _ := ndb.Applied(b); have >= seq || !next.Tails(b) || (provisioner.IsComposedBucket(b) && next.Failing(b)) {
			continue
		}
		out = append(out, swapTarget{bucket: b, cp: old.Checkpoint(b)})
	}
	return out
}

// reached reports whether the new store's position of a bucket needs no more waiting for the replaced
// one's, old: it has applied as much, or it reads another stream (one created again: its sequences
// started over, and going back is right), or the stream, as listed, no longer holds anything up to
// old's position (info, nil when not listed: a purge removed what is left to read, and the new store
// stays below it until the next write, as a purged bucket's as_of does). A stream's first sequence
// only grows, so a listing older than the stop still says so rightly when its creation time is old's.
func reached(old, cur store.Checkpoint, info *jetstream.StreamInfo) bool {
	if cur.Applied >= old.Applied {
		return true
	}
	if cur.StreamCreated != 0 && old.StreamCreated != 0 && cur.StreamCreated != old.StreamCreated {
		return true
	}
	return info != nil && old.StreamCreated != 0 && info.Created.UnixNano() == old.StreamCreated &&
		info.State.FirstSeq > old.Applied
}

// awaitSwap waits, after the old projector stopped, until the new store has applied what the replaced
// store had of every bucket (swapTargets, reached), for at most wait and while ctx lives; a bucket of
// the new projector that is parked is woken, since nothing else would make it read before the next
// listing. It returns the buckets still behind.
func (s *Seat) awaitSwap(ctx context.Context, old, ndb *store.DB, next *projector.Projector, wait time.Duration) []string {
	targets := swapTargets(old, ndb, next)
	behind := func() []swapTarget {
		kept := targets[:0]
		for _, t := range targets {
			var info *jetstream.StreamInfo
			if i, _, ok := s.streams.Info(provisioner.StreamName(t.bucket)); ok {
				info = i
			}
			cur := ndb.Checkpoint(t.bucket)
			if reached(t.cp, cur, info) || !s.leftToRead(ctx, &t, cur.Applied) {
				continue
			}
			kept = append(kept, t)
		}
		return kept
	}
	targets = behind()
	if len(targets) > 0 {
		deadline := time.NewTimer(wait)
		defer deadline.Stop()
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
	wait:
		for len(targets) > 0 {
			for _, t := range targets {
				next.Wake(t.bucket)
			}
			select {
			case <-ctx.Done():
				break wait
			case <-deadline.C:
				break wait
			case <-tick.C:
			}
			targets = behind()
		}
	}
	names := make([]string, len(targets))
	for i, t := range targets {
		names[i] = t.bucket
	}
	sort.Strings(names)
	return names
}

// leftToRead reports whether the bucket's stream still holds a message after the new store's position
// cur and up to the replaced store's: messages at a stream's end may have been removed since the
// replaced projector applied them (a per-message TTL and its delete marker expired; a message deleted),
// and the new projector, synced at the newest one left, will never read past it: waiting for the
// removed ones stalled every such rebuild for the whole bound. Sequences up to the old position are
// all written already, so once nothing is left there, nothing comes; the stream is asked again only
// when the new store has moved. The stream asked is the one the new projector reads, whichever it is
// (one created again, or a checkpoint of an old store without its creation time): what it holds past
// the new position is what the new store would still read. A probe that fails says there may be
// something left.
func (s *Seat) leftToRead(ctx context.Context, t *swapTarget, cur uint64) bool {
	if t.probed == cur+1 {
		return true
	}
	pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if t.stream == nil {
		st, err := s.js.Stream(pctx, provisioner.StreamName(t.bucket))
		if err != nil {
			return true
		}
		t.stream = st
	}
	msg, err := t.stream.GetMsg(pctx, cur+1, jetstream.WithGetMsgSubject(">"))
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
		return false
	case err != nil:
		return true
	}
	t.probed = cur + 1
	return msg.Sequence <= t.cp.Applied
}
