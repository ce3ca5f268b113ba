package replay

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/msgget"
	"github.com/novox/mesh-provisioner/internal/streamread"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// NodeFromNATS reads what a node's state and diffs need of a bucket's stream into a temporary store:
// the node's own messages (subjects <node> and <node>.>, the raw keys whose first token is the node,
// which are all that a request narrowed by the node reads: its rows, and its anomalies), the registry
// whole for needs (unanswered-kind reads it as of the same moment), and of the rest of the stream only
// what resolving a point reads: its last sequence, its gaps (the headers-only read of every sequence
// that EachRevisionInStream makes when messages are missing below the last) and its messages' times,
// got one at a time by sequence while a time is resolved (a binary search, as store.View.SeqAtTime
// makes) or kept from that read. The log answers a request narrowed by this node, at any point,
// byte for byte as FromNATS of the whole bucket does: a node of 250 keys in a bucket of a million cost
// the million's temporary store, 10 s and 500 MB of disk. A request not narrowed by the node is
// refused (the log holds no other key). ctx bounds the read, and the log's later asks of the stream
// too (a time's resolution asks messages' times): it is to outlive the log's use, as js's connection
// is.
func NodeFromNATS(ctx context.Context, js jetstream.JetStream, bucket, node, source string, progress Progress) (*Log, error) {
	shape, ok := provisioner.ShapeOf(bucket)
	if !ok || shape.What == "" || bucket == provisioner.BucketRegistry {
		return nil, fmt.Errorf("replay: %q is not a bucket with nodes", bucket)
	}
	if !provisioner.ValidToken(node) {
		return nil, fmt.Errorf("replay: node %q is not a key token", node)
	}
	l, err := newTempWith(source, smallOptions)
	if err != nil {
		return nil, err
	}
	wait := func() {} // a write held for room left running (applyUnlessHeld)
	fail := func(err error) (*Log, error) {
		if errors.Is(err, store.ErrNoSpace) {
			err = tempRoomErr(filepath.Dir(l.dir), smallOptions)
		}
		l.closeUnlessHeld(wait)
		return nil, err
	}
	if bucket == provisioner.BucketNeeds {
		stop, _, _, err := fill(ctx, js, l.DB, projector.Options{Buckets: []string{provisioner.BucketRegistry}}, nil, true)
		wait = stop
		if err != nil {
			return fail(err)
		}
		if wait, err = applyUnlessHeld(l.DB, func() error { stop(); return nil }); err != nil {
			return fail(err)
		}
	}
	np := &nodePoints{ctx: ctx, bucket: bucket, node: node, times: map[uint64]seqTime{}}
	s, err := js.Stream(ctx, provisioner.StreamName(bucket))
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound):
		// No stream: nothing to read, an empty log, as the whole read's.
	case err != nil:
		return fail(fmt.Errorf("stream of %s: %w", bucket, err))
	default:
		info := s.CachedInfo()
		st := info.State
		created := info.Created.UnixNano()
		np.stream, np.nc, np.api = provisioner.StreamName(bucket), js.Conn(), projector.APIPrefix(js)
		np.prefix = provisioner.SubjectPrefix(bucket)
		if st.LastSeq > 0 {
			np.cp.StreamCreated = created
		}
		prefix := provisioner.SubjectPrefix(bucket)
		batch := make([]provisioner.Message, 0, 1024)
		batchBytes := 0 // of the messages in batch: their keys and values
		flush := func() error {
			if len(batch) == 0 {
				return nil
			}
			var err error
			wait, err = applyUnlessHeld(l.DB, func() error { return l.DB.Apply(bucket, batch, created, false) })
			batch = batch[:0]
			return err
		}
		if st.Msgs > 0 {
			err = readStream(ctx, s, []string{prefix + node, prefix + node + ".>"}, false, st.LastSeq, streamread.PullBytes(js.Conn(), 0), func(msg jetstream.Msg, md *jetstream.MsgMetadata) error {
				m, err := projector.MessageOf(bucket, msg.Subject(), msg.Headers(), msg.Data(), md.Sequence.Stream, md.Timestamp)
				if err != nil {
					return err
				}
				// Applied at 1024 messages or streamread.MaxBytes of values, whichever comes first.
				batchBytes += len(m.Key) + len(m.Value)
				if batch = append(batch, m); len(batch) == cap(batch) || batchBytes >= streamread.MaxBytes {
					batchBytes = 0
					return flush()
				}
				return nil
			})
			if err == nil {
				err = flush()
			}
			if err != nil {
				return fail(err)
			}
		}
		// The stream's sequences: every one from 1 to its last when it misses none (its times asked as
		// a point needs them), else each one it holds, read with the gaps. It misses none when
		// streamGaps does not read them: were its info wrong, a time asked of a missing message fails,
		// never answers.
		// Only the messages the log keeps count (a message on a subject added to the stream by hand,
		// foreign, is logged only when it rolls the whole stream up): a time between a foreign
		// message and the bucket's next resolves to the bucket's message before it, as the whole
		// read's log has it, and the binary search looks at the same sequences.
		np.full = st.Msgs > 0 && st.FirstSeq <= 1 && st.NumDeleted == 0
		if np.full {
			// What the whole read applied: the stream's last message, of any subject.
			np.cp.Applied = st.LastSeq
			if np.last, _, err = np.timeOf(st.LastSeq); err != nil && !errors.Is(err, errNoMessage) {
				return fail(err)
			}
			if errors.Is(err, errNoMessage) {
				// The last of the bucket's subjects is before a foreign message: asked by subject.
				if np.last, _, _, err = np.get(0, "last_by_subj"); err != nil {
					return fail(err)
				}
			}
		} else if st.Msgs > 0 {
			// 16 bytes a message: 18 MB for a million, grown once.
			np.seqs, np.seqTimes = make([]uint64, 0, st.Msgs), make([]int64, 0, st.Msgs)
		}
		np.marks.Gaps, err = streamGaps(ctx, s, st, streamread.PullBytes(js.Conn(), 0), progress, func(msg jetstream.Msg, seq uint64, t int64) {
			// What the whole read applied: the last message it read (none when the stream was emptied).
			np.cp.Applied = seq
			if strings.HasPrefix(msg.Subject(), np.prefix) || provisioner.RollupOfHeaders(msg.Headers()) == provisioner.RollupAll {
				np.seqs = append(np.seqs, seq)
				np.seqTimes = append(np.seqTimes, t)
			}
		})
		if err != nil {
			return fail(err)
		}
		if !np.full && len(np.seqs) > 0 {
			np.last = np.seqs[len(np.seqs)-1]
		}
		// The reads are of the stream the info was of (as EachRevisionInStream checks): one recreated
		// meanwhile would mix the messages of one with the sequences of the other.
		now, err := s.Info(ctx)
		if err != nil {
			return fail(fmt.Errorf("stream of %s: %w", bucket, err))
		}
		if !now.Created.Equal(info.Created) {
			return fail(fmt.Errorf("stream %s was recreated while it was read (created %s, now %s): ask again", np.stream,
				info.Created.UTC().Format(time.RFC3339Nano), now.Created.UTC().Format(time.RFC3339Nano)))
		}
	}
	wait, err = applyUnlessHeld(l.DB, func() error {
		if err := l.DB.SetHistoryMarks(bucket, np.marks); err != nil {
			return err
		}
		return l.DB.Flush()
	})
	if err != nil {
		return fail(err)
	}
	markSynced(l.DB)
	l.points = func(v *store.View) pointIndex { return nodeIndex{viewPoints{v}, np} }
	l.node, l.nodeBucket = node, bucket
	return l, nil
}

// nodePoints is what resolving a point reads of the stream of a node's log (NodeFromNATS): the
// checkpoint and marks a store filled from the whole stream would hold, and its messages' times.
type nodePoints struct {
	bucket, node string
	cp           store.Checkpoint
	marks        store.HistoryMarks
	last         uint64 // the last sequence the whole read's log keeps (of the bucket's subjects); 0: none
	// full says the stream holds every sequence from 1 to its last, whose times are asked of it (a
	// message get, of the stream's leader, of the first message of the bucket's subjects at or after
	// a sequence) and kept in times; else seqs and seqTimes are every message the whole read's log
	// keeps, read with the gaps.
	full     bool
	seqs     []uint64
	seqTimes []int64

	ctx    context.Context
	nc     *nats.Conn
	stream string
	api    string
	prefix string // of the bucket's subjects: $KV.<bucket>.
	mu     sync.Mutex
	times  map[uint64]seqTime // asked of the stream, when full: the first at or after a sequence
}

// nodeIndex resolves points of the node's bucket against its stream (nodePoints), of any other bucket
// (the registry, for needs) against the store.
type nodeIndex struct {
	viewPoints
	np *nodePoints
}

func (x nodeIndex) Checkpoint(bucket string) (store.Checkpoint, error) {
	if bucket != x.np.bucket {
		return x.viewPoints.Checkpoint(bucket)
	}
	return x.np.cp, nil
}

func (x nodeIndex) HistoryMarks(bucket string) (store.HistoryMarks, error) {
	if bucket != x.np.bucket {
		return x.viewPoints.HistoryMarks(bucket)
	}
	return x.np.marks, nil
}

// SeqAtTime is store.View.SeqAtTime's binary search (store.SearchTime) over the stream's messages: the same
// sequences looked at, so the same answer, even where the stream's times are out of order. The floor
// is 0: nothing read from a stream is trimmed.
func (x nodeIndex) SeqAtTime(bucket string, t int64) (uint64, error) {
	if bucket != x.np.bucket {
		return x.viewPoints.SeqAtTime(bucket, t)
	}
	np := x.np
	lo, err := store.SearchTime(np.last+1, t, func(seq uint64) (int64, bool, error) {
		_, ts, ok, err := np.atOrAfter(seq)
		return ts, ok, err
	})
	if err != nil {
		return 0, err
	}
	return np.before(lo), nil
}

func (x nodeIndex) TimeAfter(bucket string, seq uint64) (int64, error) {
	if bucket != x.np.bucket {
		return x.viewPoints.TimeAfter(bucket, seq)
	}
	if seq == ^uint64(0) {
		return 0, nil
	}
	s, t, ok, err := x.np.atOrAfter(seq + 1)
	if err != nil || !ok || s <= seq {
		return 0, err
	}
	return t, nil
}

// atOrAfter is the first message the stream holds at or after seq: its sequence and time.
func (np *nodePoints) atOrAfter(seq uint64) (uint64, int64, bool, error) {
	if np.full {
		seq = max(seq, 1)
		if seq > np.last {
			return 0, 0, false, nil
		}
		s, t, err := np.timeOf(seq)
		return s, t, err == nil, err
	}
	i := sort.Search(len(np.seqs), func(i int) bool { return np.seqs[i] >= seq })
	if i == len(np.seqs) {
		return 0, 0, false, nil
	}
	return np.seqs[i], np.seqTimes[i], true, nil
}

// before is the last sequence the stream holds below seq, or 0.
func (np *nodePoints) before(seq uint64) uint64 {
	if np.full {
		if seq == 0 {
			return 0
		}
		return min(seq-1, np.last)
	}
	i := sort.Search(len(np.seqs), func(i int) bool { return np.seqs[i] >= seq })
	if i == 0 {
		return 0
	}
	return np.seqs[i-1]
}

// seqTime is a message's sequence and time.
type seqTime struct {
	seq  uint64
	time int64
}

// timeOf is the sequence and time of the first message of the bucket's subjects at or after seq (at
// or below last once last is known), asked of the stream's leader (get) and kept: a state walked a
// page at a time resolves its point once a page. The message at seq is asked first, as cheap as
// a get is; only when it is foreign is the next one of the bucket's subjects asked (a filter with a
// wildcard, which the server may match against many subjects). With last not yet known, a foreign
// message at seq is errNoMessage.
func (np *nodePoints) timeOf(seq uint64) (uint64, int64, error) {
	np.mu.Lock()
	defer np.mu.Unlock()
	if st, ok := np.times[seq]; ok {
		return st.seq, st.time, nil
	}
	s, t, ok, err := np.get(seq, "")
	if err == nil && ok && s == 0 {
		if np.last == 0 {
			return 0, 0, errNoMessage
		}
		s, t, ok, err = np.get(seq, "next_by_subj")
	}
	if err == nil && (!ok || np.last != 0 && s > np.last) {
		// Removed since the stream's info was read: the answer would no longer be the whole read's.
		err = fmt.Errorf("time of message %d of %s: removed since the stream was read", seq, np.stream)
	}
	if err != nil {
		return 0, 0, err
	}
	np.times[seq] = seqTime{s, t}
	return s, t, nil
}

// errNoMessage says the message asked is not of the bucket's subjects.
var errNoMessage = errors.New("replay: no message of the bucket there")

// get asks the stream's leader (a message get, the grant the seat's user has: docs/accounts.md) for
// a message: by with "" the one at seq (its sequence is 0 when it is foreign, not of the bucket's
// subjects), "next_by_subj" the first of the bucket's subjects at or after seq, "last_by_subj" the
// last of them. It returns its sequence and time; ok is false when there is none.
func (np *nodePoints) get(seq uint64, by string) (uint64, int64, bool, error) {
	req := msgget.Request{Seq: seq}
	switch by {
	case "last_by_subj":
		req = msgget.Request{Last: np.prefix + ">"}
	case "next_by_subj":
		req.Next = np.prefix + ">"
	}
	ctx, cancel := context.WithTimeout(np.ctx, 10*time.Second)
	defer cancel()
	m, found, err := msgget.Get(ctx, np.nc, np.api, np.stream, req)
	switch {
	case err != nil:
		return 0, 0, false, fmt.Errorf("time of message %d of %s: %w", seq, np.stream, err)
	case !found:
		return 0, 0, false, nil
	case m.Seq < seq:
		return 0, 0, false, fmt.Errorf("time of message %d of %s: message %d in the answer", seq, np.stream, m.Seq)
	}
	if !strings.HasPrefix(m.Subject, np.prefix) && !foreignRollsAll(m.Header) {
		return 0, 0, true, nil // foreign: the log keeps it only when it rolls the whole stream up
	}
	return m.Seq, m.Time.UnixNano(), true, nil
}

// foreignRollsAll reports whether a foreign message's headers (NATS/1.0 wire form) roll the whole
// stream up.
func foreignRollsAll(hdr []byte) bool {
	if len(hdr) == 0 {
		return false
	}
	h, err := nats.DecodeHeadersMsg(hdr)
	return err == nil && provisioner.RollupOfHeaders(h) == provisioner.RollupAll
}
