package projector

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// The ordered consumer recreates itself after the server lost it, at the sequence after the last one
// it delivered, on whatever stream has the name by then: a stream deleted and created again goes
// unnoticed, and so does a purge of messages the projection already applied (no message says so). The
// projector therefore checks each bucket's stream against what the projection rests on when it starts
// tailing and every Options.Verify while it runs (verify), and stops with ErrCannotResume when:
//
//   - the stream was created at another time than the one the checkpoint was read from;
//   - it ends before the checkpoint;
//   - it starts past the checkpoint + 1 (messages were removed before they were read);
//   - it starts past a message that is still the newest of its key in the projection: the message was
//     removed while the bucket still answered with it, so the bucket no longer holds what the
//     projection does. Checked only when the projection has applied the stream's last sequence: a key
//     rewritten since, whose older revision the bucket's history limit removed, is not a purge.

// verifier remembers how far the live-message check has looked, so each check reads only the events
// the stream's head moved past since the last one.
type verifier struct {
	checkedBelow uint64 // no live message below this
	last         time.Time
}

// verify checks a bucket's stream against the projection; see above.
func (p *Projector) verify(ctx context.Context, stream jetstream.Stream, bucket string, v *verifier) error {
	ictx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	info, err := stream.Info(ictx)
	if err != nil {
		return nil // a failed check proves nothing; the next one asks again
	}
	return p.check(info, bucket, v)
}

func (p *Projector) check(info *jetstream.StreamInfo, bucket string, v *verifier) error {
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
	if info.State.FirstSeq > cp.Applied+1 {
		return fmt.Errorf("%w: stream %s starts at sequence %d, past checkpoint %d + 1: messages were removed before they were read",
			ErrCannotResume, name, info.State.FirstSeq, cp.Applied)
	}
	if cp.Applied < info.State.LastSeq || info.State.FirstSeq <= v.checkedBelow {
		return nil
	}
	// At most a million sequences per check, so a first check on a long log does not hold up ingest.
	to := min(info.State.FirstSeq, cp.Applied+1, v.checkedBelow+1<<20)
	seq, live, err := p.db.LiveBelow(bucket, v.checkedBelow, to)
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
