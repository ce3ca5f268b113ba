package projector

import (
	"context"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	provisioner "github.com/novox/mesh-provisioner"
)

// Starting parked. A seat restarted on a mesh of thousands of nodes finds most composed-<node> buckets
// as it left them. Each used to set a consumer up at start (a STREAM.INFO and a CONSUMER.CREATE), read
// nothing, and park ParkAfter later: at 1,000 buckets 1.4-1.5 s of CPU at every start, and thousands
// of consumer creations on the JetStream API at once for every seat of a fleet restarted together.
// So a composed-<node> bucket the store has read starts parked, with no consumer and no request of
// its own, when the first listing that started after Start (the one discovery waits for) shows its
// stream unchanged since the store last read it:
//
//   - the checkpoint knows the stream's creation time, and the listing shows the same one: not a
//     stream created again (a checkpoint without it, or one of a bucket never read, tails as before);
//   - the stream's last sequence is the checkpoint, or the end past it whose messages the store was
//     told were removed unread (store.DB.RemovedEnd: a bucket parked on a stream whose last sequence is
//     no message): nothing to read, and, the listing having started after Start, nothing written since
//     start either, so the bucket is synced as the contract says;
//   - the checks a tail starts with (verify.go: its first sequence not past the checkpoint + 1, no
//     message the projection rests on below it, purged unread) pass on that info, every sequence of
//     them (a tail checks a million at a time, and its later checks go on; here there are none);
//   - the listing runs (listingRuns), as parking needs: a parked bucket waits on it.
//
// Anything else tails as before: a bucket written, purged, recreated or deleted while the seat was
// down, one the listing did not return (deleted, or created after it started), one whose info is older
// than the start, or a listing that fails, gets no answer or is late. A bucket started parked is then
// what one parked after ParkAfter is: parked on the listed info, read when that info was read, so a
// listing after it that shows the stream changed wakes it, a request (Wake) wakes it, and so does a
// listing that stops. It is registered as Add starts it, before its goroutine runs and before the
// verb answers (startsParked): a Wake from then on (a node engine's min_seq) is kept, and makes the
// bucket tail at once, also while it still waits for that first listing (one of thousands of streams
// takes seconds; one that gets no answer, up to two of its intervals).

// startsParked registers a bucket that may start parked (a composed-<node> bucket whose checkpoint
// knows its stream's creation time, with parking on) so that a Wake from now on is kept; nil for any
// other. Called by Add, under p.mu.
func (p *Projector) startsParked(bucket string) *parkedBucket {
	if !p.opts.Composed || p.opts.ParkAfter <= 0 || !provisioner.IsComposedBucket(bucket) {
		return nil
	}
	if cp := p.db.Checkpoint(bucket); cp.Applied == 0 || cp.StreamCreated == 0 {
		return nil
	}
	// Starting: a listing not come yet is awaited, not a listing stopped (watchParked).
	pk, _ := p.registerParked(bucket, p.started, true)
	return pk
}

// parkAtStart parks a composed-<node> bucket as it starts when the first listing since Start shows its
// stream unchanged since the store last read it (see above), until the stream changes or a request
// wakes it. It reports false when ctx ends, true when the bucket is to tail: it did not park, or was
// woken. created is the bucket's channel from waitCreated; pk its registration from startsParked (nil:
// it tails).
func (p *Projector) parkAtStart(ctx context.Context, bucket string, log *slog.Logger, created <-chan struct{}, pk *parkedBucket) bool {
	if pk == nil {
		return true
	}
	defer p.unpark(bucket, pk)
	select {
	case <-p.firstListed:
	case <-pk.wake:
		return true // a request waits for the bucket: read it now, not once the listing has come
	case <-ctx.Done():
		return false
	}
	select {
	case <-pk.wake:
		return true // a request waits for the bucket: read it
	default:
	}
	info, read, ok := p.unchangedSinceRead(ctx, bucket)
	if !ok {
		return ctx.Err() == nil
	}
	if p.afterParkRead != nil {
		p.afterParkRead(bucket)
	}
	p.streamFound(bucket)
	// As a tail whose consumer is set up: an advisory that came before is of the stream read (forget.go).
	select {
	case <-created:
	default:
	}
	seq := p.db.Checkpoint(bucket).Applied
	p.markSynced(bucket, log.With("stream", "unchanged since the checkpoint: parked"), seq, p.started)
	log.Debug("started parked: no consumer until the stream changes", "applied_seq", seq)
	p.parkMu.Lock()
	pk.starting, pk.at = false, read
	p.parkMu.Unlock()
	return p.waitParked(ctx, pk, info, log)
}

// unchangedSinceRead returns the listed info of a bucket's stream, and when it was read, when it shows
// the stream unchanged since the store last read it, and the listing was read after Start and runs
// (see above).
func (p *Projector) unchangedSinceRead(ctx context.Context, bucket string) (*jetstream.StreamInfo, time.Time, bool) {
	if !p.mayPark(bucket) {
		return nil, time.Time{}, false
	}
	info, read, ok := p.streams.Info(provisioner.StreamName(bucket))
	if !ok || read.Before(p.started) {
		return nil, time.Time{}, false
	}
	cp := p.db.Checkpoint(bucket)
	if cp.StreamCreated == 0 || info.Created.UnixNano() != cp.StreamCreated {
		return nil, time.Time{}, false
	}
	checked := info
	if info.State.LastSeq != cp.Applied {
		// A stream whose last messages were removed before they were read ends past the checkpoint
		// for good: unchanged when it ends where the store was told it did (park, removedUnread). It
		// is checked as read to its end, which it is: what lies past the checkpoint is gone (a copy:
		// the listing's info is shared, and the bucket parks on its real end).
		if end, ok := p.db.RemovedEnd(bucket); !ok || end != info.State.LastSeq {
			return nil, time.Time{}, false
		}
		c := *info
		c.State.LastSeq = cp.Applied
		checked = &c
	}
	// A few store reads: bounded as the tails' setting up is, thousands of buckets start at once.
	select {
	case p.setup <- struct{}{}:
	case <-ctx.Done():
		return nil, time.Time{}, false
	}
	defer func() { <-p.setup }()
	v := &verifier{}
	below := min(info.State.FirstSeq, cp.Applied+1) // check looks for live messages below this
	for v.checkedBelow < below {
		from := v.checkedBelow
		if err := p.check(ctx, checked, bucket, v); err != nil || v.checkedBelow == from {
			return nil, time.Time{}, false // the tail finds what failed, or checks what could not be read
		}
	}
	return info, read, true
}
