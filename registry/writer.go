// Package registry keeps mesh-provisioner_registry equal to the compiled table (provisioner.Registry):
// at start and every interval it puts each kind whose stored value differs, and deletes each key the
// table does not hold.
//
// Every write names the revision it read: a kind is written only at the revision its last message was
// read at (0 where the key has none), and a stray is deleted only at the revision it was read at. A
// key's last message is judged as the projection judges it (provisioner.OpOfHeaders): a marker of any
// reason is a removed key, which the writer puts back, whatever bytes the marker carries. So
// several writers with the same table converge on it and never flap: a writer that loses a race reads
// the key again, finds the other's value equal to its own, and writes nothing. A value is compared as
// a reader decodes it (provisioner.RegistryEntry.Matches), so another encoding of the same entry is
// left alone.
//
// Every write carries the table's version (provisioner.HeaderRegistryVersion), and a key whose last
// message names a higher version is left alone: during a rolling upgrade the old seats neither
// downgrade nor delete what the new table wrote.
//
// Keys are listed from the stream's per-subject state (one STREAM.INFO request with a subject filter),
// not with a watcher, so the writer needs no consumer of its own: the least a NATS account can grant it
// is STREAM.INFO, DIRECT.GET (or STREAM.MSG.GET) and publish on $KV.mesh-provisioner_registry.>, plus
// STREAM.CREATE of the registry's stream and INFO when it creates the bucket (docs/accounts.md).
package registry

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/denied"
	"github.com/novox/mesh-provisioner/internal/mpk"
)

// passTimeout bounds one pass, so that a request NATS never answers makes the pass fail and retry
// instead of hanging the writer. A request to a subject the user may not publish to is dropped by the
// server, not refused: the pass sees the connection's permissions violation and fails at once, naming
// the subject (denied.Context), rather than at this deadline.
const passTimeout = 30 * time.Second

// raceAttempts is how often one kind is read again after losing a race to another writer in one pass.
const raceAttempts = 5

// Writer keeps the registry bucket.
type Writer struct {
	js       jetstream.JetStream
	table    provisioner.RegistryTable
	interval time.Duration
	log      *slog.Logger
	// Replicas is the registry bucket's replicas when the Writer creates it (0 means 1); set it
	// before Start. A bucket that exists is used as it is.
	Replicas int

	// retryMin and retryMax bound the backoff after a failed pass.
	retryMin, retryMax time.Duration

	cancel context.CancelFunc
	wg     sync.WaitGroup
	wakeCh chan struct{} // Wake: a pass soon, not at the next interval

	// wakeGap is the least time from one pass's start to a pass a Wake asks for.
	wakeGap time.Duration

	mu       sync.Mutex
	passes   int
	writes   int
	failures int
	repairs  int
}

// New returns a Writer of table that runs a pass every interval (0 means one hour).
func New(js jetstream.JetStream, table provisioner.RegistryTable, interval time.Duration, log *slog.Logger) *Writer {
	if interval <= 0 {
		interval = time.Hour
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Writer{js: js, table: table, interval: interval, log: log.With("component", "registry"),
		retryMin: 250 * time.Millisecond, retryMax: 30 * time.Second, wakeCh: make(chan struct{}, 1), wakeGap: time.Second}
}

// Wake asks for a pass soon rather than at the next interval: a seat calls it when its projection of
// the bucket lost a kind of the table (deleted, purged or expired by someone else), so the kind is
// written again within a second or so, not within the hour. A pass starts at most once a wakeGap for
// wakes; a writer whose last pass failed keeps to its backoff. It never blocks.
func (w *Writer) Wake() {
	select {
	case w.wakeCh <- struct{}{}:
	default: // a pass is asked for already
	}
}

// Start runs a pass now and every interval until Stop. A failed pass is retried with a backoff that
// doubles up to a cap; the first failure is logged, and "recovered" once a pass works again. It never
// stops the verb: the writer runs beside it.
func (w *Writer) Start(ctx context.Context) {
	ctx, w.cancel = context.WithCancel(ctx)
	w.wg.Add(1)
	go func() {
		defer w.wg.Done()
		w.loop(ctx)
	}()
}

// Stop stops the writer and waits for it.
func (w *Writer) Stop() {
	if w.cancel != nil {
		w.cancel()
	}
	w.wg.Wait()
}

// Table is the table the Writer keeps the bucket equal to.
func (w *Writer) Table() provisioner.RegistryTable { return w.table }

// Stats says how many passes completed and how many writes (puts and deletes) they made.
func (w *Writer) Stats() (passes, writes int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.passes, w.writes
}

// Repairs says how many repairs (the passes a Wake asks for, lost kinds only) ran since New.
func (w *Writer) Repairs() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.repairs
}

// Failures says how many passes failed since New.
func (w *Writer) Failures() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.failures
}

func (w *Writer) loop(ctx context.Context) {
	next := time.Now()     // the next pass: at once, then every interval, or after a backoff
	var repairAt time.Time // a repair a Wake asked for; zero for none
	var started time.Time  // the last pass's or repair's start
	failing := false
	backoff := time.Duration(0)
	for {
		due, repair := next, false
		if !repairAt.IsZero() && repairAt.Before(next) {
			due, repair = repairAt, true
		}
		t := time.NewTimer(time.Until(due))
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-w.wakeCh:
			t.Stop()
			if !failing && repairAt.IsZero() { // a failing writer keeps to its backoff
				repairAt = started.Add(w.wakeGap)
			}
			continue
		case <-t.C:
		}
		started, repairAt = time.Now(), time.Time{}
		if repair {
			// Lost kinds only: an edit or a stray waits for the pass. A repair that fails is not
			// retried; the next pass is as due.
			_, err := w.pass(ctx, true) // pass logs what it wrote
			if ctx.Err() != nil {
				return
			}
			w.mu.Lock()
			w.repairs++
			w.mu.Unlock()
			if err != nil {
				w.log.Debug("registry repair failed; the next pass puts it right", "err", err)
			}
			continue
		}
		_, err := w.Pass(ctx) // Pass logs what it wrote
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			w.mu.Lock()
			w.failures++
			w.mu.Unlock()
			if !failing {
				w.log.Warn("registry pass failed; retrying with backoff", "err", err)
				failing = true
			} else {
				w.log.Debug("registry pass failed again", "err", err)
			}
			if backoff == 0 {
				backoff = w.retryMin
			} else {
				backoff = min(backoff*2, w.retryMax)
			}
			next = time.Now().Add(backoff)
			continue
		}
		if failing {
			w.log.Info("registry pass recovered")
			failing = false
		}
		backoff = 0
		next = time.Now().Add(w.interval)
	}
}

// Pass makes the bucket equal to the table once, creating the bucket when there is none, and returns
// how many writes it made. It is what Start runs; two passes may run at once, in this process or in
// others, and converge.
func (w *Writer) Pass(ctx context.Context) (int, error) { return w.pass(ctx, false) }

// pass is Pass, or with lostOnly a repair: it writes only the kinds whose key has no value (never
// written, deleted, purged, expired), or whose value an older table's writer put there (the seat of an
// older binary that repaired the same loss first), and leaves edited values and strays to the next
// Pass. A repair is not counted as a pass.
func (w *Writer) pass(ctx context.Context, lostOnly bool) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, passTimeout)
	defer cancel()
	ctx, unwatch := denied.Context(ctx, w.js.Conn(), registrySubject)
	defer unwatch()
	ctx, stop := untilDisconnected(ctx, w.js.Conn())
	defer stop()
	n, err := w.passOnce(ctx, lostOnly)
	if de := denied.Cause(ctx, err); de != err {
		err = fmt.Errorf("%w (the pass was cut short: %v)", de, err)
	} else if err != nil && errors.Is(context.Cause(ctx), errDisconnected) {
		err = fmt.Errorf("%w (the pass was cut short: %v)", errDisconnected, err)
	}
	return n, err
}

// errDisconnected ends a pass whose connection dropped (untilDisconnected).
var errDisconnected = errors.New("registry pass: the NATS connection dropped; the pass is tried again once it is back")

// untilDisconnected returns a context below ctx that ends, with errDisconnected as its cause, when the
// connection drops. A request in flight then is never answered (the server that took it is gone), and
// nats.go keeps waiting for its answer across the reconnect: a pass cut by a server's restart waited
// out passTimeout, 30 s, before the loop's backoff (250 ms at first) tried again. stop releases the
// listener and its goroutine.
func untilDisconnected(ctx context.Context, nc *nats.Conn) (context.Context, func()) {
	ctx, cancel := context.WithCancelCause(ctx)
	if nc == nil {
		return ctx, func() { cancel(nil) }
	}
	ch := nc.StatusChanged(nats.DISCONNECTED, nats.RECONNECTING, nats.CLOSED)
	done := make(chan struct{})
	go func() {
		defer close(done)
		if _, ok := <-ch; ok { // closed by stop: the pass is over
			cancel(errDisconnected)
		}
	}()
	return ctx, func() {
		nc.RemoveStatusListener(ch)
		<-done
		cancel(nil)
	}
}

// registrySubject matches the subjects a pass publishes to: the registry's keys, its stream's JetStream
// API requests, and the account's info, which the bucket's creation asks first.
func registrySubject(subject string) bool {
	return ofRegistry(subject) || strings.HasSuffix(subject, ".API.INFO")
}

var ofRegistry = denied.OfStream(provisioner.StreamName(provisioner.BucketRegistry))

func (w *Writer) passOnce(ctx context.Context, lostOnly bool) (int, error) {
	if _, err := w.bucket(ctx); err != nil {
		return 0, err
	}
	writes := 0
	var changed []string // the kinds written, and the strays deleted, for the log
	var left []string    // the keys a newer table wrote, left alone, for the log
	defer func() {
		w.mu.Lock()
		w.writes += writes
		w.mu.Unlock()
		if ctx.Err() != nil {
			return
		}
		if len(left) > 0 && !lostOnly {
			// One line a pass (an hour), not a repair: during a rolling upgrade the old seats say
			// why they leave the table as it is; after a rollback, what to remove.
			w.log.Info("registry keys of a newer table left alone", "version", w.table.Version,
				"keys", strings.Join(left, " "))
		}
		if writes == 0 {
			return
		}
		// One info line a pass that changed something, naming what it changed.
		msg := "registry written"
		if lostOnly {
			msg = "registry kinds lost by someone else written again"
		}
		w.log.Info(msg, "writes", writes, "kinds", len(w.table.Entries), "changed", strings.Join(changed, " "))
	}()
	stream, err := w.js.Stream(ctx, provisioner.StreamName(provisioner.BucketRegistry))
	if err != nil {
		return 0, fmt.Errorf("registry stream: %w", err)
	}
	for _, e := range w.table.Entries {
		n, err := w.putKind(ctx, stream, e, lostOnly)
		writes += n
		if n > 0 {
			changed = append(changed, e.Kind)
		}
		if errors.Is(err, errNewer) {
			left = append(left, e.Kind)
			continue
		}
		if err != nil {
			return writes, err
		}
	}
	if lostOnly {
		return writes, nil
	}
	stray, err := w.strays(ctx, stream)
	if err != nil {
		return writes, err
	}
	for _, subj := range stray {
		n, err := w.deleteStray(ctx, stream, subj)
		writes += n
		if n > 0 {
			changed = append(changed, "-"+strings.TrimPrefix(subj, provisioner.SubjectPrefix(provisioner.BucketRegistry)))
		}
		if errors.Is(err, errNewer) {
			left = append(left, strings.TrimPrefix(subj, provisioner.SubjectPrefix(provisioner.BucketRegistry)))
			continue
		}
		if err != nil {
			return writes, err
		}
	}
	w.mu.Lock()
	w.passes++
	w.mu.Unlock()
	return writes, nil
}

// bucket opens the registry bucket, creating it when there is none (another writer may create it at the
// same moment).
func (w *Writer) bucket(ctx context.Context) (jetstream.KeyValue, error) {
	kv, err := w.js.KeyValue(ctx, provisioner.BucketRegistry)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		kv, err = w.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.BucketRegistry, History: 8, Replicas: w.Replicas,
			Description: "mesh-provisioner: which domain answers which kind of placeholder"})
		if errors.Is(err, jetstream.ErrBucketExists) {
			kv, err = w.js.KeyValue(ctx, provisioner.BucketRegistry)
		}
		if err == nil {
			w.log.Info("registry bucket created", "bucket", provisioner.BucketRegistry, "replicas", max(w.Replicas, 1))
		}
	}
	if err != nil {
		return nil, fmt.Errorf("registry bucket: %w", err)
	}
	return kv, nil
}

// putKind writes one kind unless its stored value already matches the entry (with lostOnly, unless it
// has a value at all). The key's last message is read from the stream and judged as the projection
// judges it (deleted), so a key removed by a marker the KV API does not take for one (a
// Nats-Marker-Reason of any other value) is written again. A lost race is read again, a few times at
// most.
func (w *Writer) putKind(ctx context.Context, stream jetstream.Stream, e provisioner.RegistryEntry, lostOnly bool) (int, error) {
	subj := provisioner.SubjectPrefix(provisioner.BucketRegistry) + e.Kind
	for attempt := 0; attempt < raceAttempts; attempt++ {
		// Written only at the revision read: 0 where the key has no message at all.
		var rev uint64
		was := "absent"
		last, err := stream.GetLastMsgForSubject(ctx, subj)
		switch {
		case errors.Is(err, jetstream.ErrMsgNotFound):
		case err != nil:
			return 0, fmt.Errorf("read kind %q: %w", e.Kind, err)
		case w.newer(last, e.Kind):
			return 0, errNewer // a newer table's put or delete: never downgraded
		case deleted(last.Header):
			rev, was = last.Sequence, "deleted"
		case e.Matches(last.Data):
			return 0, nil
		case lostOnly && !w.older(last.Header):
			return 0, nil // an edit waits for the pass
		case lostOnly:
			// An older table's seat put a lost kind back before this repair (a rolling upgrade: the
			// loss woke both): the newer table's value wins now, not at the next pass.
			rev, was = last.Sequence, "older"
		default:
			rev, was = last.Sequence, "different"
		}
		put := nats.NewMsg(subj)
		put.Data = e.Value()
		put.Header.Set(provisioner.HeaderRegistryVersion, strconv.FormatUint(w.table.Version, 10))
		if _, err := w.js.PublishMsg(ctx, put, jetstream.WithExpectLastSequencePerSubject(rev)); err != nil {
			if lostRace(err) {
				continue
			}
			return 0, fmt.Errorf("write kind %q: %w", e.Kind, err)
		}
		w.log.Debug("registry kind written", "kind", e.Kind, "was", was, "revision", rev)
		return 1, nil
	}
	return 0, fmt.Errorf("kind %q: lost the race to another writer %d times", e.Kind, raceAttempts)
}

// strays lists the subjects of the bucket's stream whose key the table does not hold, in byte order. A
// key once deleted is still a subject of the stream (its delete marker); deleteStray finds it gone.
func (w *Writer) strays(ctx context.Context, stream jetstream.Stream) ([]string, error) {
	prefix := provisioner.SubjectPrefix(provisioner.BucketRegistry)
	info, err := stream.Info(ctx, jetstream.WithSubjectFilter(prefix+">"))
	if err != nil {
		return nil, fmt.Errorf("list registry keys: %w", err)
	}
	var stray []string
	for subj := range info.State.Subjects {
		if _, ok := w.table.Lookup(strings.TrimPrefix(subj, prefix)); !ok {
			stray = append(stray, subj)
		}
	}
	sort.Strings(stray)
	return stray, nil
}

// deleteStray deletes the key of a subject the table does not hold, at the revision it was read at.
// It writes the delete marker kv.Delete writes, on the subject itself, so that a key the KV API cannot
// name (one published on the raw subject, such as `a:b`) is deleted too.
func (w *Writer) deleteStray(ctx context.Context, stream jetstream.Stream, subj string) (int, error) {
	key := strings.TrimPrefix(subj, provisioner.SubjectPrefix(provisioner.BucketRegistry))
	var (
		last   *jetstream.RawStreamMsg
		expect jetstream.PublishOpt
		err    error
	)
	if wildcard(subj) {
		var end uint64
		last, end, err = literalLast(ctx, stream, subj)
		// The server would check a per-subject expectation against the subject as a filter: the
		// delete is written only while the stream's last sequence is the one read.
		expect = jetstream.WithExpectLastSequence(end)
	} else {
		last, err = stream.GetLastMsgForSubject(ctx, subj)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			last, err = nil, nil
		}
		if last != nil {
			expect = jetstream.WithExpectLastSequencePerSubject(last.Sequence)
		}
	}
	if err != nil {
		return 0, fmt.Errorf("read stray kind %q: %w", key, err)
	}
	if last == nil {
		return 0, nil
	}
	if w.newer(last, key) {
		return 0, errNewer // a kind of a newer table, or one it deleted
	}
	if deleted(last.Header) {
		return 0, nil
	}
	marker := nats.NewMsg(subj)
	marker.Header.Set(provisioner.HeaderKVOperation, "DEL")
	marker.Header.Set(provisioner.HeaderRegistryVersion, strconv.FormatUint(w.table.Version, 10))
	if _, err := w.js.PublishMsg(ctx, marker, expect); err != nil {
		if lostRace(err) {
			return 0, nil // changed since it was read; the next pass looks again
		}
		return 0, fmt.Errorf("delete stray kind %q: %w", key, err)
	}
	w.log.Debug("registry stray deleted", "kind", key, "revision", last.Sequence)
	return 1, nil
}

// wildcard reports whether a subject read back from the stream holds a wildcard token (`*`, `>`): a key
// published on the raw subject may. Such a subject is never a filter here: as a filter it matches
// other keys, so a read of its last message would get another key's, and a write expecting its
// last sequence would be checked against another key's.
func wildcard(subj string) bool {
	for _, tok := range strings.Split(subj, ".") {
		if tok == "*" || tok == ">" {
			return true
		}
	}
	return false
}

// literalLast is the last message on subj itself (nil for none), even when subj holds wildcard
// tokens, and the stream's last sequence when it was read. It walks the messages subj matches as a
// filter and keeps those on subj: a registry stream holds a few hundred messages at most.
func literalLast(ctx context.Context, stream jetstream.Stream, subj string) (*jetstream.RawStreamMsg, uint64, error) {
	info, err := stream.Info(ctx)
	if err != nil {
		return nil, 0, err
	}
	end := info.State.LastSeq
	var last *jetstream.RawStreamMsg
	for seq := info.State.FirstSeq; seq <= end; {
		if err := ctx.Err(); err != nil {
			return nil, 0, err
		}
		m, err := stream.GetMsg(ctx, seq, jetstream.WithGetMsgSubject(subj))
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			break
		}
		if err != nil {
			return nil, 0, err
		}
		if m.Sequence > end {
			break
		}
		if m.Subject == subj {
			last = m
		}
		seq = m.Sequence + 1
	}
	return last, end, nil
}

// errNewer says a key was left alone because its last message is of a newer table than the writer's.
var errNewer = errors.New("registry: written by a newer table")

// newer reports whether a key's last message was written by a newer table than the writer's
// (provisioner.HeaderRegistryVersion): a seat of an older binary during a rolling upgrade, which must
// neither put back what the newer table changed or deleted nor delete the kinds it added. The header
// is believed only on what a table's writer writes: a delete marker, or a MessagePack map whose kind
// is the key. A value that is not (not MessagePack, another kind, not a map) is no table's, whatever
// its header says, and is put right (or deleted, for a stray) like a hand edit; else an older seat
// would leave it for ever.
func (w *Writer) newer(last *jetstream.RawStreamMsg, key string) bool {
	if provisioner.RegistryVersionOfHeaders(last.Header) <= w.table.Version {
		return false
	}
	return deleted(last.Header) || (mpk.Valid(last.Data) && provisioner.RegistryFields(last.Data).Kind == key)
}

// older reports whether a key's last message was written by the writer of an older table (a header
// below the writer's version; a message without one is a hand edit's, version 0, and not older here).
func (w *Writer) older(h nats.Header) bool {
	v := provisioner.RegistryVersionOfHeaders(h)
	return v > 0 && v < w.table.Version
}

// deleted reports whether a key's last message removes it: a delete, a purge, or a TTL marker, read
// as the projection reads them (provisioner.OpOfHeaders), so a key the seat answers is never taken for
// deleted.
func deleted(h nats.Header) bool {
	return provisioner.OpOfHeaders(h) != provisioner.OpPut
}

// lostRace reports whether a write was refused because the key's revision is no longer the one read:
// another writer got there first. A single-replica stream says so with code 10071, a replicated one
// with 10164; nats.go wraps most, not all, of these as ErrKeyExists or ErrKeyRevisionMismatch (Create
// over a delete marker returns the bare API error).
func lostRace(err error) bool {
	if errors.Is(err, jetstream.ErrKeyExists) || errors.Is(err, jetstream.ErrKeyRevisionMismatch) {
		return true
	}
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && (apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence ||
		apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequenceConstant)
}
