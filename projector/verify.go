package projector

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	provisioner "github.com/novox/mesh-provisioner"
)

// A purge of messages the projection already applied sends no message, and a consumer recreated on a
// stream deleted and created again in between would read on at its old sequence. The projector
// therefore checks each bucket's stream against what the projection rests on when it starts
// tailing and every Options.Verify while it runs (verify), and stops with ErrCannotResume when:
//
//   - the stream was deleted (the JetStream API says it is not found, on checks at least Verify
//     apart: forget.go) after the projection read it; a composed-<node> bucket is forgotten instead;
//   - the stream was created at another time than the one the checkpoint was read from;
//   - it ends before the checkpoint;
//   - it starts past the checkpoint + 1 (messages were removed before they were read) and is empty, or
//     is a composed-<node> bucket: a fixed bucket that still holds messages is read on from its first
//     one, and the next check finds any key the projection holds that the removal took;
//   - it starts past a message that is still the newest of its key in the projection: the message was
//     removed while the bucket still answered with it, so the bucket no longer holds what the
//     projection does. Checked only when the projection has applied the stream's last sequence: a key
//     rewritten since, whose older revision the bucket's history limit removed, is not a purge.

// The streams' infos come from one listing of every stream every Options.Verify or sooner
// (streaminfo.Poller, about 256 infos a request), not from one STREAM.INFO request per bucket: a seat
// with plans tails thousands of composed-<node> buckets. The listing is the Projector's own, or one its
// owner shares (Options.Streams: a seat lists once for its projectors and its lag metric). A bucket
// uses the kept info when it was read after its last check, so the info is newer than anything that
// check saw. It asks its own stream instead (through the Poller, so the other readers see the answer
// too) when there is no such info (the listing fails, or has not returned the stream yet), and also
// when the kept info ends before the checkpoint: messages written after the listing and applied since
// are no sign of a truncated stream, but check cannot tell them from one.
//
// A bucket checks with the listing as soon as one newer than its last check is in and at least half of
// Options.Verify has passed, so its checks follow the listings rather than race them; without one, it
// checks once one and a half Options.Verify have passed, late enough that a listing merely slower than
// the last one does not send each bucket to ask its own. Composed-<node> buckets ask their streams
// at most Options.AskPerSecond times a second in all (mayAsk): without a listing, thousands of them
// would otherwise send hundreds of requests a second, so each is then checked less often, in turn.

// verifier remembers when the bucket was last checked, and how far the live-message check has looked,
// so each check reads only the events the stream's head moved past since the last one.
type verifier struct {
	checkedBelow uint64 // no live message below this
	last         time.Time
	askAt        time.Time // the slot reserved to ask the stream (mayAsk); zero when none is
}

// verify checks a bucket's stream against the projection when a check is due; see above.
func (p *Projector) verify(ctx context.Context, bucket string, v *verifier) error {
	now := time.Now()
	since := now.Sub(v.last)
	if since < p.opts.Verify/2 {
		return nil
	}
	info, read, ok := p.streams.Info(provisioner.StreamName(bucket))
	if ok && read.After(v.last) && info.State.LastSeq >= p.db.Checkpoint(bucket).Applied {
		v.last, v.askAt = now, time.Time{}
		p.streamFound(bucket)
		return p.check(ctx, info, bucket, v)
	}
	if since < p.opts.Verify+p.opts.Verify/2 {
		return nil
	}
	if !p.mayAsk(bucket, v, now) {
		return nil // asked again at the bucket's next tick
	}
	v.last = now
	info, err := p.readStream(ctx, bucket)
	if errors.Is(err, jetstream.ErrStreamNotFound) && p.db.Checkpoint(bucket).Applied > 0 {
		return p.streamMissing(bucket) // nil until confirmed (forget.go)
	}
	if err != nil {
		return nil // a failed check proves nothing; the next one asks again
	}
	p.streamFound(bucket)
	// The Poller keeps this info as read when the request started, after v.last: the next check must
	// not take it for one newer than this check.
	v.last = time.Now()
	return p.check(ctx, info, bucket, v)
}

// readStream asks a bucket's stream for its info (STREAM.INFO, through the Poller so that its other
// readers see the answer), for at most 5 s.
func (p *Projector) readStream(ctx context.Context, bucket string) (*jetstream.StreamInfo, error) {
	ictx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	return p.streams.Read(ictx, provisioner.StreamName(bucket))
}

// mayAsk reports whether a check may ask its bucket's stream now: always for the seat's fixed buckets;
// a composed-<node> bucket first reserves a slot, 1/Options.AskPerSecond after the last one reserved
// (or now), and asks once it has come. Slots go in the order buckets come due, so none waits for
// luck, and a bucket gone never holds the others up.
func (p *Projector) mayAsk(bucket string, v *verifier, now time.Time) bool {
	if _, composed := provisioner.ComposedNode(bucket); !composed {
		return true
	}
	if v.askAt.IsZero() {
		p.askMu.Lock()
		v.askAt = p.lastAsk.Add(time.Second / time.Duration(p.opts.AskPerSecond))
		if v.askAt.Before(now) {
			v.askAt = now
		}
		p.lastAsk = v.askAt
		p.askMu.Unlock()
	}
	if now.Before(v.askAt) {
		return false
	}
	v.askAt = time.Time{}
	return true
}

// deleted is the error of a bucket whose stream was deleted after the projection read it: the
// projection rests on messages no stream holds any more, which a rebuild would not find. Kept, its
// rows would answer what no bucket holds, and differ from those of a seat started since.
func deleted(bucket string) error {
	return fmt.Errorf("%w: stream %s was deleted", ErrCannotResume, provisioner.StreamName(bucket))
}

func (p *Projector) check(ctx context.Context, info *jetstream.StreamInfo, bucket string, v *verifier) error {
	cp := p.db.Checkpoint(bucket)
	if cp.Applied == 0 {
		return nil
	}
	name := info.Config.Name
	created := info.Created.UnixNano()
	if cp.StreamCreated != 0 && cp.StreamCreated != created {
		return fmt.Errorf("%w: stream %s was recreated (created %s, checkpoint from a stream created %s)",
			ErrCannotResume, name, info.Created.UTC().Format(time.RFC3339Nano), time.Unix(0, cp.StreamCreated).UTC().Format(time.RFC3339Nano))
	}
	if info.State.LastSeq < cp.Applied {
		return fmt.Errorf("%w: stream %s ends at sequence %d, before checkpoint %d", ErrCannotResume, name, info.State.LastSeq, cp.Applied)
	}
	if info.State.FirstSeq > cp.Applied+1 && (info.State.Msgs == 0 || provisioner.IsComposedBucket(bucket)) {
		// Of a fixed bucket that still holds messages, those removed unread were superseded (a history
		// of 1 keeps only the newest of each key) or purged: once the bucket is read to its end, the
		// check below finds a key the projection still holds from before them, as it would have
		// without the jump; the log records the gap (store.DB.Apply).
		return fmt.Errorf("%w: stream %s starts at sequence %d, past checkpoint %d + 1: messages were removed before they were read",
			ErrCannotResume, name, info.State.FirstSeq, cp.Applied)
	}
	if cp.Applied < info.State.LastSeq || info.State.FirstSeq <= v.checkedBelow {
		return nil
	}
	// At most a million sequences per check, so a first check on a long log does not hold up ingest.
	to := min(info.State.FirstSeq, cp.Applied+1, v.checkedBelow+1<<20)
	seq, live, err := p.db.LiveBelow(ctx, bucket, v.checkedBelow, to)
	if err != nil {
		return nil
	}
	if live {
		return fmt.Errorf("%w: stream %s starts at sequence %d, but the projection still rests on message %d: it was purged",
			ErrCannotResume, name, info.State.FirstSeq, seq)
	}
	v.checkedBelow = to
	return nil
}
