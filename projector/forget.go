package projector

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/store"
)

// A bucket's stream that the JetStream API says is not found, after the projection read it, was
// deleted, or the server answering has not recovered it yet (a server restarting, a cluster whose
// meta leader is still catching up): one answer cannot tell them apart. So a "not found" is only
// believed once the stream has been found missing on checks at least Options.Verify apart (10 s by
// default) with no successful read of it in between (streamMissing, streamFound). Then:
//
//   - a composed-<node> bucket is forgotten in place (store.DB.Forget): its rows, anomalies, event log
//     and the node's build records go, and the node's plan rows become what a seat that never read
//     the bucket computes. Its consumer ends and it is no longer tailed; a stream of that name
//     created later is found by discovery and read from its first message, and one created again
//     while it was being forgotten is read so at once (leave). A mesh decommissions
//     nodes all the time, and a rebuild would re-read every bucket and start every bucket's event
//     log afresh for each of them;
//   - any other bucket is ErrCannotResume, and its owner rebuilds, as for a recreated stream: those
//     are deleted by an operator, rarely, and every answer rests on them.
//
// Every other reason a composed-<node> bucket's stream cannot be resumed (ErrCannotResume, verify.go:
// recreated, ending before the checkpoint, starting past it, a live key's message removed) is handled
// the same way, but the stream is there: the bucket is forgotten and read again at once, by the same
// goroutine (reread). In a large mesh these are routine (a node reinstalled deletes its bucket and
// creates it again within seconds; a node engine purges its own compositions), and each made the
// whole seat rebuild. The store's checkpoint is set, in Forget's batch, to the stream's first
// sequence - 1 as the stream was read just before (store.DB.ForgetFrom): the messages it removed
// before are part of what was forgotten, not a gap of the new log, so plans as of the forgotten mark
// or later are folded from the new log exactly; before the mark they are 410 for that node, as after
// a deletion. Messages removed after that read are found by the next check, as any purge.

// errForget says a composed-<node> bucket's stream was found deleted and stayed so: forget it.
var errForget = errors.New("projector: stream deleted")

// streamFound records a successful read of a bucket's stream: an earlier "not found" was transient.
func (p *Projector) streamFound(bucket string) { p.missing.Delete(bucket) }

// streamMissing records that the JetStream API said a bucket's stream, which the projection has read,
// is not found. It returns nil until that is confirmed: the stream was first found missing at least
// Options.Verify ago, and not found since. Confirmed, it is errForget for a composed-<node> bucket
// and ErrCannotResume for any other.
func (p *Projector) streamMissing(bucket string) error {
	now := time.Now()
	v, seen := p.missing.LoadOrStore(bucket, now)
	first := v.(time.Time)
	if !seen || now.Sub(first) < p.opts.Verify {
		return nil
	}
	if provisioner.IsComposedBucket(bucket) {
		return fmt.Errorf("%w: stream %s not found since %s", errForget, provisioner.StreamName(bucket), first.UTC().Format(time.RFC3339))
	}
	return deleted(bucket)
}

// forget gives up a composed-<node> bucket whose stream was deleted: the store forgets it, and the
// bucket is no longer tailed, so that discovery starts it afresh when it is created again; unless it
// was created again already (leave). The bucket's consumer has stopped: nothing else applies to it.
// created is the bucket's channel from waitCreated.
func (p *Projector) forget(ctx context.Context, bucket string, reason error, created <-chan struct{}, log *slog.Logger) error {
	if err := p.db.Forget(bucket, time.Now().UnixNano()); err != nil {
		return fmt.Errorf("forget the deleted bucket: %w", err)
	}
	p.missing.Delete(bucket)
	log.Info("bucket deleted: its projection and event log are forgotten", "reason", reason)
	if p.afterForget != nil {
		p.afterForget(bucket)
	}
	p.leave(ctx, bucket, created, log)
	return nil
}

// leave takes a forgotten bucket out of the tailed ones, and tails it again at once, by a new
// runBucket from its stream's first message (the store no longer knows it), when its stream was
// created again meanwhile. The stream can come back in the instant between the check that confirmed
// it deleted and the forgetting's commit: its stream-created advisory then found the bucket still
// tailed (discover's Add did nothing), and nothing tailed it until discover's next listing
// (Options.DiscoverEvery, 30 s). So the bucket leaves first, then looks:
//
//   - it leaves p.tailed and p.waiting in one hold of p.mu, where an advisory's handler reads
//     p.waiting and discover's Add reads p.tailed. An advisory handled after that finds it gone, and
//     discover's Add tails it;
//   - one handled before is in its channel, looked at under that same hold: the bucket is tailed
//     again without asking (nats-server sends the advisory before the stream can be found, so a
//     STREAM.INFO now could still miss it; the new runBucket waits for it as for any bucket not
//     created yet). runBucket empties the channel each time it has set its consumer up on the
//     stream, so an advisory there came after the stream it read was last found: not the one of a
//     creation it was read again after, which would keep a deleted bucket tailed for good;
//   - with none, it asks for its stream once: found, it is tailed again. A creation after this ask
//     comes after the leaving, so its advisory or discover's next listing tails it as any new bucket.
//     An ask that fails otherwise (not "not found") leaves it to discover, within DiscoverEvery.
//
// Add does nothing when discover tailed the bucket first.
func (p *Projector) leave(ctx context.Context, bucket string, created <-chan struct{}, log *slog.Logger) {
	announced := false
	p.mu.Lock()
	delete(p.tailed, bucket)
	delete(p.asks, bucket)
	delete(p.askedAt, bucket)
	delete(p.ends, bucket) // a new tail sets it again; RemovedEnds must not name a forgotten bucket
	if p.waiting[bucket] == created {
		delete(p.waiting, bucket)
	}
	select {
	case <-created:
		announced = true
	default:
	}
	p.mu.Unlock()
	p.parkMu.Lock()
	delete(p.asked, bucket) // a request that waits on it again sets it again (Wake)
	p.parkMu.Unlock()
	p.failing.Delete(bucket)
	p.expiredUnmarked.Delete(bucket)
	if !announced {
		_, err := p.readStream(ctx, bucket)
		switch {
		case errors.Is(err, jetstream.ErrStreamNotFound) || ctx.Err() != nil:
			return
		case err != nil:
			log.Warn("cannot ask whether the deleted bucket's stream was created again; discovery will find it if it was", "err", err)
			return
		}
	}
	log.Info("bucket created again as it was forgotten: read again from its first message")
	p.Add(ctx, bucket)
}

// reread forgets a composed-<node> bucket whose stream cannot be resumed (reason, ErrCannotResume) and
// sets it to be read again from that stream's first message; the bucket's consumer has stopped. A
// stream that cannot be read now (deleted meanwhile, say) is an error: the caller retries, and a
// deletion is then confirmed and forgotten as such.
func (p *Projector) reread(ctx context.Context, bucket string, reason error, log *slog.Logger) error {
	info, err := p.readStream(ctx, bucket)
	if err != nil {
		return fmt.Errorf("read the stream again: %w", err)
	}
	// Read before the mark is taken: every message below its first sequence was removed before it.
	resume := store.Checkpoint{Applied: max(info.State.FirstSeq, 1) - 1, StreamCreated: info.Created.UnixNano()}
	if err := p.db.ForgetFrom(bucket, time.Now().UnixNano(), resume); err != nil {
		return fmt.Errorf("forget the bucket to read it again: %w", err)
	}
	p.missing.Delete(bucket)
	log.Warn("bucket cannot be resumed: its projection and event log are forgotten, and its stream read again",
		"reason", reason, "from_seq", resume.Applied+1)
	return nil
}
