// Package streamread reads a JetStream stream in order through a consumer its caller creates, under
// the caller's context: what nats.go's ordered consumer does, without the requests it makes where no
// context reaches them.
//
// nats.go's ordered consumer recreates a lost consumer inside Next (and before every Fetch), with a
// 10 s request on a context of its own, retried without end, under the lock its Stop takes: a create
// that goes unanswered (a cluster without quorum, a JetStream API denied or slow) holds a Stop, or a
// cancelled read, for 10 s and more. Here the caller creates the consumer (Create) under its context,
// reads it with Reader.Next under its context, and when the consumer is lost (no heartbeat, deleted)
// or delivers out of order, Next says so and the caller creates a new one from the last sequence it
// read. Every request is the caller's, so a cancelled context ends the read at once.
//
// Consume reads the same way with a callback, which nats.go calls in the goroutine that delivers the
// messages: the projector tails the buckets so (it costs less a message than Next); replay's export
// reads a stream once with Next.
package streamread

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Config is the consumer a stream is read with, from its first message when after is 0, else from
// the message after sequence after. It is what nats.go's ordered consumer creates: no acks, one
// replica in memory, removed by the server after five minutes without a pull (so one its reader left
// behind, its server gone, goes by itself).
func Config(after uint64) jetstream.ConsumerConfig {
	cfg := jetstream.ConsumerConfig{
		DeliverPolicy:     jetstream.DeliverAllPolicy,
		AckPolicy:         jetstream.AckNonePolicy,
		InactiveThreshold: 5 * time.Minute,
		Replicas:          1,
		MemoryStorage:     true,
	}
	if after > 0 {
		cfg.DeliverPolicy = jetstream.DeliverByStartSequencePolicy
		cfg.OptStartSeq = after + 1
	}
	return cfg
}

// Stream is what Create creates a consumer on: a jetstream.Stream, or a stream known by its name alone
// (the projector's, when the stream listing holds a fresh enough info of it: no STREAM.INFO asked).
type Stream interface {
	CreateConsumer(ctx context.Context, cfg jetstream.ConsumerConfig) (jetstream.Consumer, error)
}

// Create creates the consumer (Config) on s under ctx, named name (empty: a name nats.go makes up).
// A caller that names it can delete it when the creation's answer does not come (Answered): the server
// may have created it all the same.
func Create(ctx context.Context, s Stream, name string, after uint64) (jetstream.Consumer, error) {
	cfg := Config(after)
	cfg.Name = name
	cons, err := s.CreateConsumer(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("create consumer: %w", err)
	}
	return cons, nil
}

// Answered reports whether a failed request got the JetStream API's answer (an API error: it did
// nothing), rather than none (its context ended, a timeout, the connection lost), when what it asked
// may have been done.
func Answered(err error) bool {
	var jsErr jetstream.JetStreamError
	return errors.As(err, &jsErr) && jsErr.APIError() != nil
}

// Heartbeat is how often the server says a pull is still alive when no message flows. A consumer
// whose server died (a cluster node lost, the connection moved, a restart) is found out after two
// missed heartbeats and an unanswered CONSUMER.INFO (Next); nats.go's default is half the pull's 30 s
// expiry, which left a reader reading nothing for up to 30 s after a failover. One small message a
// second per consumer while idle is the price.
const Heartbeat = time.Second

// ConfirmTimeout bounds the CONSUMER.INFO that Next asks when two heartbeats were missed, to tell a
// consumer lost from heartbeats merely late. It is generous: late heartbeats come from a loaded
// process or server, where a short bound would take a slow answer for a lost consumer and bring the
// CONSUMER.CREATE (and the load) that confirming saves.
const ConfirmTimeout = 5 * time.Second

// MaxBytes is the most bytes of messages a read holds pulled and not yet read, when the server's max
// payload is small enough (PullBytes): 32 MiB, a few dozen values of NATS's default max payload (1 MB)
// and four of the largest it advises (8 MB), where a pull of 4096 messages held 4 and 32 GiB. Reads of
// small values lose nothing by it: a pull of 32 MiB holds some hundred thousand of them, and the
// iterator pulls again when half is read (docs/performance.md, session 16).
const MaxBytes = 32 << 20

// Overhead is what a delivered message counts against a pull's max bytes beyond its payload (headers
// and data), which the server's max payload bounds: its subject and its reply subject (the
// consumer's ack subject), each bounded by the server's max control line (4 KiB by default), with
// room to spare.
const Overhead = 64 << 10

// PullBytes returns the byte bound of the reads of nc (Read, and the max bytes of a Fetch's pull):
// bytes (MaxBytes when 0), or the largest message nc's server takes (its max payload and Overhead)
// when that is larger, so that a pull is never bounded below one message, which it would never
// deliver.
func PullBytes(nc *nats.Conn, bytes int) int {
	if bytes <= 0 {
		bytes = MaxBytes
	}
	return max(bytes, int(nc.MaxPayload())+Overhead)
}

// ErrOutOfOrder says the consumer delivered a message other than the next one: one was lost on the
// way (the client dropped it as a slow consumer). The reader creates a new consumer from the last
// message it read.
var ErrOutOfOrder = errors.New("streamread: consumer delivered out of order")

// Reader reads one consumer's messages in the order the consumer delivered them, and checks that
// order: a message missed on the way is ErrOutOfOrder, never a silent hole.
type Reader struct {
	cons      jetstream.Consumer
	it        jetstream.MessagesContext
	delivered atomic.Uint64 // the consumer's sequence of the last message read (Consume: written in nats.go's goroutine)
	inFlight  uint64        // delivered+1 when a miss found messages delivered and not read (stillThere)
	// next is the option Next reads under, for the context nextCtx: made again only when the context
	// changes (a context of a type that cannot be compared, none of package context's, every time),
	// where each message allocated its closure and the slice holding it: 40-45 heap bytes of the
	// ingest child's 810 a message (docs/performance.md, session 19).
	next    []jetstream.NextOpt
	nextCtx context.Context

	// Refused, when set, says why heartbeats are missed when NATS refused the pulls (a user not
	// granted CONSUMER.MSG.NEXT): the server drops each one, so no heartbeat or message ever comes,
	// while the consumer is there to confirm. Next asks it at each miss, before the confirmation.
	Refused func() error
}

// Read starts pulling cons with Heartbeat: at most bytes of messages pulled and not yet read when
// bytes > 0 (PullBytes says how large), else at most pull messages (0: nats.go's default); with both,
// at most pull messages held and each pull at most bytes (below).
func Read(cons jetstream.Consumer, pull, bytes int) (*Reader, error) {
	return ReadIdle(cons, pull, bytes, Heartbeat)
}

// ReadIdle is Read with the pulls' idle heartbeat every heartbeat (at most 15 s, half the pulls'
// expiry): longer for consumers that are many and mostly idle, whose loss may be found later.
//
// A bound in bytes is nats.go's PullMaxBytes: the iterator counts the bytes it asked for and has not
// handed out (its buffer, and what the server still owes it), and pulls again, for what was read,
// once that falls below half the bound. It is the one option of nats.go that bounds the client's
// buffer by bytes: PullMaxMessagesWithBytesLimit bounds each pull's bytes but not the buffer, since
// after a pull cut short by its max bytes (a 409 from the server) the iterator pulls again at once
// until it holds its message count; with values near NATS's max payload 4096 messages were
// gigabytes. PullMaxBytes cannot be given a message count beside it (nats.go asks for a million
// messages a pull): small values are pulled by the bound's worth, more of them per pull than the
// count (docs/performance.md, session 16). A bound below the size of the next message never
// delivers it (the server answers each pull with a 409 and the iterator pulls again without end):
// bytes must be at least the largest message the stream can deliver, which PullBytes makes sure of.
//
// That buffer costs memory of its own: nats.go makes the iterator's channel for a million messages,
// 8 MB of pointers, allocated and zeroed whole and scanned by every garbage collection. A seat's few
// long-lived tails measured 60-80 MiB more peak RSS at 1,000,000 keys with it (docs/performance.md,
// session 16), so they pass both: PullMaxMessagesWithBytesLimit holds at most pull messages (a
// channel of that many) and bounds each pull by bytes; what it does not bound is a run of pulls each
// cut short by max bytes while the reader falls behind, up to pull messages of the largest size.
func ReadIdle(cons jetstream.Consumer, pull, bytes int, heartbeat time.Duration) (*Reader, error) {
	var opts []jetstream.PullMessagesOpt
	for _, o := range pulls(pull, bytes, heartbeat) {
		opts = append(opts, o)
	}
	it, err := cons.Messages(opts...)
	if err != nil {
		return nil, fmt.Errorf("consume: %w", err)
	}
	return &Reader{cons: cons, it: it}, nil
}

// pullOpt is an option of both nats.go's Messages and its Consume.
type pullOpt interface {
	jetstream.PullMessagesOpt
	jetstream.PullConsumeOpt
}

// pulls returns the options of ReadIdle's pulls (and Consume's).
func pulls(pull, bytes int, heartbeat time.Duration) []pullOpt {
	opts := []pullOpt{jetstream.PullHeartbeat(heartbeat)}
	switch {
	case bytes > 0 && pull > 0:
		opts = append(opts, jetstream.PullMaxMessagesWithBytesLimit(pull, bytes))
	case bytes > 0:
		opts = append(opts, jetstream.PullMaxBytes(bytes))
	case pull > 0:
		opts = append(opts, jetstream.PullMaxMessages(pull))
	}
	return opts
}

// Next returns the next message and its metadata, waiting until one comes or ctx ends (ctx.Err()). A
// consumer that was lost (deleted, or two heartbeats missed and not confirmed there) is an error, as
// is a message out of order (ErrOutOfOrder); either way the Reader is done with, and a new consumer is
// read from the last message read. After ctx ends the Reader still reads.
//
// Two missed heartbeats are confirmed before they count as a loss: Next asks the consumer's info
// (CONSUMER.INFO, at most ConfirmTimeout), and reads on from the same consumer (nats.go pulls again
// after the miss) when the server still has it and has delivered nothing the Reader did not read, or
// has, but no miss before found so with nothing read since: a client late on its heartbeats is late on
// its messages too, which come behind them. On a loaded process or server, heartbeats a second apart
// come late now and then; with thousands of idle consumers (a seat's composed-<node> buckets) each
// late one cost a CONSUMER.DELETE, a STREAM.INFO and a CONSUMER.CREATE: more load on the JetStream
// API, and more late heartbeats. A consumer whose server is gone, or that was deleted, does not answer
// so, and is lost as before.
func (r *Reader) Next(ctx context.Context) (jetstream.Msg, *jetstream.MsgMetadata, error) {
	if r.next == nil || !reflect.TypeOf(ctx).Comparable() || r.nextCtx != ctx {
		r.next, r.nextCtx = []jetstream.NextOpt{jetstream.NextContext(ctx)}, ctx
	}
	msg, err := r.it.Next(r.next...)
	for errors.Is(err, jetstream.ErrNoHeartbeat) && ctx.Err() == nil {
		if r.Refused != nil {
			if rerr := r.Refused(); rerr != nil {
				return nil, nil, fmt.Errorf("read: %w", rerr)
			}
		}
		if !r.stillThere(ctx) {
			break
		}
		msg, err = r.it.Next(r.next...)
	}
	if err != nil {
		if ctx.Err() != nil {
			return nil, nil, ctx.Err()
		}
		return nil, nil, fmt.Errorf("read: %w", err)
	}
	md := new(jetstream.MsgMetadata)
	if err := r.inOrder(msg, md); err != nil {
		return nil, nil, err
	}
	return msg, md, nil
}

// inOrder reads msg's metadata into md (parseMetadata) and counts msg read when it is the consumer's
// next message.
func (r *Reader) inOrder(msg jetstream.Msg, md *jetstream.MsgMetadata) error {
	if err := parseMetadata(msg.Reply(), md); err != nil {
		return fmt.Errorf("message metadata: %w", err)
	}
	delivered := r.delivered.Load()
	if md.Sequence.Consumer != delivered+1 {
		return fmt.Errorf("%w: message %d of the consumer after %d (stream sequence %d)", ErrOutOfOrder, md.Sequence.Consumer, delivered, md.Sequence.Stream)
	}
	r.delivered.Store(md.Sequence.Consumer)
	return nil
}

// stillThere reports whether the consumer, its heartbeats missed, is still on the server, with
// nothing delivered that the Reader has not read, or with messages delivered and not read that may
// still be on their way: the first miss at that point.
func (r *Reader) stillThere(ctx context.Context) bool {
	ictx, cancel := context.WithTimeout(ctx, ConfirmTimeout)
	defer cancel()
	ci, err := r.cons.Info(ictx)
	delivered := r.delivered.Load() // after the answer: Consume may read meanwhile
	switch {
	case err != nil:
		return false
	case ci.Delivered.Consumer <= delivered:
		return true
	case r.inFlight == delivered+1:
		return false // still not come since the last miss: lost on the way
	default:
		// Delivered, not yet read: on its way behind the late heartbeats, or lost. Read on once; a
		// message after a lost one is out of order (ErrOutOfOrder), and another miss with nothing
		// read meanwhile is a loss.
		r.inFlight = delivered + 1
		return true
	}
}

// Delivered is the consumer's sequence of the last message Next returned (or Consume handed on): how
// many it returned.
func (r *Reader) Delivered() uint64 { return r.delivered.Load() }

// Stop ends the pulls at once; it takes no lock, so a Next waiting on another goroutine does not hold
// it up.
func (r *Reader) Stop() { r.it.Stop() }

// Consume reads cons as ReadIdle and Next do, the other way round: nats.go's Consume hands each
// message, in the consumer's order, to handle on the goroutine that delivers them, until ctx ends
// (ctx.Err()), handle fails (its error), or the consumer is lost or delivers out of order (Next's
// errors). refused, when not nil, is Reader.Refused. Consume returns once no handle runs, nor will:
// handle must return once ctx ends. The metadata handle is given is the message's until handle
// returns, then the next one's: one is read into for every message, where Next allocates each.
//
// It is what Next costs less of. nats.go's Next arms a heartbeat timer of its own in every call and
// stops it on the way out (an allocation and three timer operations a message, 5% of the projector's
// CPU while it catches up, docs/performance.md, session 20), and hands the message over a channel
// read under a select; Consume keeps one timer for the whole read, stopped and reset around each
// handle, and calls handle in the goroutine that takes the messages off the connection's.
//
// What Next says, Consume says too: a message missed on the way is ErrOutOfOrder; two heartbeats
// missed (nats.go says so to the error handler, and pulls again) are confirmed with CONSUMER.INFO as
// Next confirms them, on Consume's own goroutine while nats.go reads on; a status that ends the pulls
// (the consumer deleted) or the connection closed ends the read with nats.go's error.
//
// One difference, and where Consume reads with Next instead: nats.go keeps the messages a Consume
// was delivered and has not handed over in a list its subscriptions bound (nats.go's
// DefaultSubPendingBytesLimit, 64 MiB, with no option to raise it), past which it drops a message,
// where Messages keeps them in a channel of pull messages, however large. A read bounded by bytes
// holds at most two pulls' worth (nats.go pulls again when half its count is read, and a pull cut
// short by its bytes only once read), so at most ConsumeBytes of bytes stays below that bound; a
// larger bound (a server's max payload past 32 MiB, the projector's PullBytes set so) or a read
// counted in messages alone, whose bytes the largest message sets, is read with Next and handed to
// handle from there.
func Consume(ctx context.Context, cons jetstream.Consumer, pull, bytes int, heartbeat time.Duration, refused func() error,
	handle func(jetstream.Msg, *jetstream.MsgMetadata) error) error {
	if bytes <= 0 || bytes > ConsumeBytes {
		return consumeNext(ctx, cons, pull, bytes, heartbeat, refused, handle)
	}
	r := &Reader{cons: cons, Refused: refused}
	var (
		mu   sync.Mutex // held while handle runs
		done bool       // set under mu: handle is called no more
	)
	failed := make(chan error, 1)
	missed := make(chan struct{}, 1)
	var lastErr atomic.Pointer[error] // the last error nats.go said, for a read it ended
	var md jetstream.MsgMetadata      // each message's in turn, under mu
	deliver := func(msg jetstream.Msg) {
		mu.Lock()
		defer mu.Unlock()
		if done {
			return
		}
		err := r.inOrder(msg, &md)
		if err == nil {
			err = handle(msg, &md)
		}
		if err != nil {
			done = true
			failed <- err
		}
	}
	opts := []jetstream.PullConsumeOpt{jetstream.ConsumeErrHandler(func(_ jetstream.ConsumeContext, err error) {
		if errors.Is(err, jetstream.ErrNoHeartbeat) {
			select {
			case missed <- struct{}{}:
			default:
			}
			return
		}
		lastErr.Store(&err)
	})}
	for _, o := range pulls(pull, bytes, heartbeat) {
		opts = append(opts, o)
	}
	cc, err := cons.Consume(deliver, opts...)
	if err != nil {
		return fmt.Errorf("consume: %w", err)
	}
	defer func() {
		cc.Stop()
		mu.Lock()
		done = true
		mu.Unlock()
	}()
	closed := cc.Closed()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case err := <-failed:
			return err
		case <-missed:
			if r.Refused != nil {
				if rerr := r.Refused(); rerr != nil {
					return fmt.Errorf("read: %w", rerr)
				}
			}
			if !r.stillThere(ctx) {
				if ctx.Err() != nil {
					return ctx.Err()
				}
				return fmt.Errorf("read: %w", jetstream.ErrNoHeartbeat)
			}
		case <-closed:
			if ctx.Err() != nil {
				return ctx.Err()
			}
			select {
			case err := <-failed: // handle's, as nats.go stopped
				return err
			default:
			}
			if err := lastErr.Load(); err != nil {
				return fmt.Errorf("read: %w", *err)
			}
			return fmt.Errorf("read: %w", jetstream.ErrMsgIteratorClosed)
		}
	}
}

// ConsumeBytes is the largest byte bound of its pulls that Consume reads with nats.go's Consume: two
// pulls of it are nats.go's subscriptions' bound on what they keep, 64 MiB (Consume).
const ConsumeBytes = 32 << 20

// consumeNext is Consume with Next: a read whose pulls may hold more than nats.go's Consume keeps.
func consumeNext(ctx context.Context, cons jetstream.Consumer, pull, bytes int, heartbeat time.Duration, refused func() error,
	handle func(jetstream.Msg, *jetstream.MsgMetadata) error) error {
	r, err := ReadIdle(cons, pull, bytes, heartbeat)
	if err != nil {
		return err
	}
	defer r.Stop()
	r.Refused = refused
	for {
		msg, md, err := r.Next(ctx)
		if err != nil {
			return err
		}
		if err := handle(msg, md); err != nil {
			return err
		}
	}
}
