package replay

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/streamread"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// EachRevisionInStream is EachRevision read from the bucket's stream itself, with no store: the key's
// revisions through a consumer filtered on its subject, so that the history of one key costs its own
// messages and not the stream's (a temporary store of every message, 500 MB and 16 s at a million
// needs keys). It answers what a store filled from the same stream answers (FromNATS, then
// EachRevision): a rollup of other keys removed the key's earlier messages from the stream with it, so
// the store never holds a revision of the key that such a rollup would end, and the key's own subject
// carries every revision the stream keeps. The gaps are the store's too: when messages were removed
// before the stream's end, its sequences alone are read (no data, headers only) to find them, as the
// projector would; and the stream's last messages removed before they were read are a gap open from
// there, as the archive of the streams has it (ExportNATS; a store filled from the streams records
// that only of a stream emptied, store.DB.TailRemoved). A key that a consumer's filter does not name
// alone (BySubject: a wildcard token, say, which names one subject in the store and a pattern to a
// consumer) is refused (ErrPattern), and read through a store instead.
func EachRevisionInStream(ctx context.Context, js jetstream.JetStream, bucket, key string, progress Progress, fn func(*Revision) error) (KeyHistory, error) {
	h := KeyHistory{Bucket: bucket, Key: key}
	if _, ok := provisioner.ShapeOf(bucket); !ok {
		return h, fmt.Errorf("replay: %q is not a bucket the seat tails", bucket)
	}
	if !BySubject(key) {
		return h, ErrPattern
	}
	s, err := js.Stream(ctx, provisioner.StreamName(bucket))
	if err != nil {
		return h, fmt.Errorf("stream of %s: %w", bucket, err)
	}
	st, created := s.CachedInfo().State, s.CachedInfo().Created
	pullBytes := streamread.PullBytes(js.Conn(), 0)
	if st.Msgs > 0 && !strings.Contains("."+key+".", "..") {
		// (A key with an empty token names no subject the stream can hold: it has no message.)
		// The revisions first, as they come: the gaps are said after them, and may take a read of
		// the whole stream's sequences.
		subject := provisioner.SubjectPrefix(bucket) + key
		var rev Revision
		err = readStream(ctx, s, []string{subject}, false, st.LastSeq, pullBytes, func(msg jetstream.Msg, md *jetstream.MsgMetadata) error {
			m, err := projector.MessageOf(bucket, msg.Subject(), msg.Headers(), msg.Data(), md.Sequence.Stream, md.Timestamp)
			if err != nil {
				return err
			}
			rev = Revision{Seq: m.Seq, Time: time.Unix(0, m.Time).UTC(), Op: m.Op, Value: m.Value}
			return fn(&rev)
		})
		if err != nil {
			return h, err
		}
	}
	if h.Gaps, err = streamGaps(ctx, s, st, pullBytes, progress, nil); err != nil {
		return h, err
	}
	// The reads are of the stream the info was of: one recreated meanwhile (deleted, and made again
	// with the same name) would mix the revisions of one with the gaps of the other. A store filled
	// from the streams refuses it too (Fill, ErrCannotResume).
	now, err := s.Info(ctx)
	if err != nil {
		return h, fmt.Errorf("stream of %s: %w", bucket, err)
	}
	if !now.Created.Equal(created) {
		return h, fmt.Errorf("stream %s was recreated while it was read (created %s, now %s): ask again", provisioner.StreamName(bucket), created.UTC().Format(time.RFC3339Nano), now.Created.UTC().Format(time.RFC3339Nano))
	}
	return h, nil
}

// ErrPattern says a key cannot be read from a stream by its subject (BySubject).
var ErrPattern = errors.New("replay: the key is a subject pattern")

// BySubject reports whether EachRevisionInStream reads a key: whether a consumer's filter on its
// subject matches that one subject. A token `*` or `>` is a wildcard to a filter, though the store
// names one subject with it (the server stores a message on `n1.>.x`, or on `n1.*`); nats.go refuses
// a filter with a `>` anywhere but at its end, or a space, and the server one with white space. Those
// keys are read through a store. A key with an empty token is read (it has no message: the server
// stores none on such a subject).
func BySubject(key string) bool {
	if strings.ContainsAny(key, " \t\n\f\r") || strings.Contains(strings.TrimSuffix(key, ">"), ">") {
		return false
	}
	return !provisioner.HasWildcard(key)
}

// streamGaps are the gaps a store filled from the whole stream would record (store.DB.Apply,
// CaughtUp, TailRemoved), and the removed end an archive of it records: none when no message is
// missing below the stream's last; else a read of every message's sequence and headers, no data, each
// message's sequence and time told to each when set.
func streamGaps(ctx context.Context, s jetstream.Stream, st jetstream.StreamState, pullBytes int, progress Progress, each func(msg jetstream.Msg, seq uint64, t int64)) ([]store.Gap, error) {
	switch {
	case st.LastSeq == 0:
		return nil, nil
	case st.Msgs == 0:
		// Emptied before it was read: an open gap from the start (TailRemoved).
		return []store.Gap{{From: 1, OpenedAt: st.LastSeq + 1}}, nil
	case st.FirstSeq <= 1 && st.NumDeleted == 0:
		return nil, nil
	}
	var gaps []store.Gap
	var open *store.Gap
	prev, done := uint64(0), int64(0)
	err := readStream(ctx, s, nil, true, st.LastSeq, pullBytes, func(msg jetstream.Msg, md *jetstream.MsgMetadata) error {
		seq := md.Sequence.Stream
		if each != nil {
			each(msg, seq, md.Timestamp.UnixNano())
		}
		if seq > prev+1 {
			if open == nil {
				gaps = append(gaps, store.Gap{From: prev + 1})
				open = &gaps[len(gaps)-1]
			}
			open.OpenedAt = seq
		}
		if open != nil && provisioner.RollupOfHeaders(msg.Headers()) == provisioner.RollupAll {
			open.To, open = seq, nil // it removed every message before it (store.applier.closeGap)
		}
		prev = seq
		if done++; progress != nil && done%4096 == 0 {
			progress(done, int64(st.Msgs))
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	if progress != nil {
		progress(done, int64(st.Msgs))
	}
	if open != nil && prev >= open.OpenedAt {
		open.To, open = prev, nil // read to the stream's end: caught up (CaughtUp)
	}
	if prev < st.LastSeq {
		// The read ended where the consumer had nothing after prev: the stream's last messages were
		// removed before they were read (a subject purged, a TTL without a marker). A gap open from
		// there, as the archive of the streams records it (exportStream).
		if open == nil {
			gaps = append(gaps, store.Gap{From: prev + 1})
			open = &gaps[len(gaps)-1]
		}
		open.OpenedAt = max(open.OpenedAt, st.LastSeq+1)
	}
	return gaps, nil
}

// readStream calls fn for each message of the stream (of the subjects alone, when given; headers
// alone, with headersOnly), in order, up to last or until none is left, through a consumer it deletes
// when done, cancelled too.
//
// A pull with no wait is given up by nats.go after a second without a message (its idle timer), with
// no error, and what the server sends it later goes to an inbox nobody listens to: the consumer has
// delivered it, and will not again. So every message's consumer sequence is checked to follow the last
// one read, and an empty pull asks the consumer whether it delivered more than was read: either way the
// read goes on from the message after the last one read, through a new consumer. An empty pull that the
// consumer says was not answered while messages are pending (a server slow to answer; a pull denied)
// is pulled again, for at most readStall without a message.
func readStream(ctx context.Context, s jetstream.Stream, subjects []string, headersOnly bool, last uint64, pullBytes int, fn func(jetstream.Msg, *jetstream.MsgMetadata) error) error {
	var name string // the consumer's, deleted when replaced and when done
	drop := func() {
		if name == "" {
			return
		}
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		defer cancel()
		_ = s.DeleteConsumer(dctx, name)
	}
	defer func() { drop() }()
	var after uint64 // the stream sequence of the last message read
	create := func() (jetstream.Consumer, error) {
		drop()
		cfg := streamread.Config(after)
		cfg.Name = nuid.Next()
		if len(subjects) == 1 {
			cfg.FilterSubject = subjects[0]
		} else {
			cfg.FilterSubjects = subjects
		}
		cfg.HeadersOnly = headersOnly
		name = cfg.Name // before it is asked: the server may create it though its answer is lost
		cons, err := s.CreateConsumer(ctx, cfg)
		if err != nil {
			return nil, fmt.Errorf("create consumer: %w", err)
		}
		return cons, nil
	}
	cons, err := create()
	if err != nil {
		return err
	}
	if cons.CachedInfo().NumPending == 0 {
		return nil // no message of the subject
	}
	var delivered uint64 // the consumer sequence of the last message read
	var stalled time.Time
	wait := readRetryMin
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		// A pull answers what is there, up to readBatch messages and pullBytes: with values near
		// NATS's max payload, a pull of 4096 messages (FetchNoWait, which takes no bound in bytes)
		// held gigabytes in the client, which nats.go takes in as fast as they come whatever the
		// reader does. It waits readWait for more when fewer are there, which a read never sees
		// but at a removal (it returns at the message with nothing pending after it). Its end with
		// nothing, after readWait, is also what a pull nobody answered looks like (a user denied the
		// pull, or the reply's inbox), so an empty one ends the read only when the consumer says
		// nothing is pending.
		batch, err := cons.Fetch(readBatch, jetstream.FetchMaxBytes(pullBytes), jetstream.FetchMaxWait(readWait))
		if err != nil {
			return fmt.Errorf("read: %w", err)
		}
		n, lost := 0, false
		for msg := range batch.Messages() {
			md, err := msg.Metadata()
			if err != nil {
				return fmt.Errorf("message metadata: %w", err)
			}
			if md.Sequence.Consumer != delivered+1 {
				lost = true // the messages before it went to a pull given up on
				break
			}
			n++
			delivered, after = md.Sequence.Consumer, md.Sequence.Stream
			if err := fn(msg, md); err != nil {
				return err
			}
			if md.Sequence.Stream >= last || md.NumPending == 0 {
				return nil
			}
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if !lost {
			if err := batch.Error(); err != nil {
				return fmt.Errorf("read: %w", err)
			}
		}
		if !lost && n == 0 {
			ci, err := cons.Info(ctx)
			if err != nil {
				return fmt.Errorf("read: %w", err)
			}
			if lost = ci.Delivered.Consumer > delivered; !lost && ci.NumPending == 0 {
				return nil // removed since
			}
		}
		if n > 0 {
			stalled, wait = time.Time{}, readRetryMin
		} else {
			// Nothing read: the pull went unanswered, or was answered after it was given up on.
			if stalled.IsZero() {
				stalled = time.Now()
			} else if time.Since(stalled) > readStall {
				return fmt.Errorf("read: no message came for %s, with messages pending", readStall)
			}
			if err := pause(ctx, wait); err != nil {
				return err
			}
			wait = min(2*wait, readRetryMax)
		}
		if lost {
			// Delivered to a pull given up on: read again from the message after the last one read.
			if cons, err = create(); err != nil {
				return err
			}
			delivered = 0
			if cons.CachedInfo().NumPending == 0 {
				return nil // none left after it
			}
		}
	}
}

// A pull of readStream: at most readBatch messages (and its bytes bound, streamread.PullBytes), waiting
// at most readWait for them when fewer are there.
const (
	readBatch = 4096
	readWait  = 500 * time.Millisecond
)

// How readStream pulls again when a pull brought nothing while messages are pending (unanswered, or
// answered too late): after 50 ms, doubling up to a second, for at most as long without a message as
// a fill from the streams waits (fillGiveUp).
const (
	readRetryMin = 50 * time.Millisecond
	readRetryMax = time.Second
)

var readStall = fillGiveUp
