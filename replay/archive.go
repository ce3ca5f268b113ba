package replay

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/klauspost/compress/zstd"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"
	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/ctxio"
	"github.com/novox/mesh-provisioner/internal/denied"
	"github.com/novox/mesh-provisioner/internal/streamread"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// The archive export writes and replay --archive reads: a zstd stream of MessagePack values, written
// as three zstd frames one after another (which a zstd reader reads as one stream):
//
//  1. the header, a map (ArchiveHeader): format, version, tool, created, source, and per bucket its
//     first and last sequence, message count, stream creation time, and the history marks (floor and
//     gaps) that say which points the archive rebuilds exactly;
//  2. the records, each an array [bucket index, sequence, time (Unix ns), subject, headers, data], in
//     sequence order one bucket after another;
//  3. the end, a record with bucket index -1 whose sequence is the number of records: an archive
//     without it was cut short and is refused.
//
// An archive of a log that forgot composed-<node> buckets (store.DB.Forget) carries when each was
// forgotten (the header's forgotten), so that plans as of a time before it are refused as the log
// refuses them. Such an archive is version 2: a reader of version 1 would drop the field and answer
// those times without the bucket, where a version it does not read is refused, naming the tool that
// wrote it. An archive without any is still written as version 1, which every reader reads.
//
// An export of the streams that could not read some composed-<node> buckets (ExportNATS) says which
// in the header's unread, and is version 3: a reader of version 2 would answer those nodes' plans as
// if they had never composed. What it read of such a bucket before its read failed is kept; a reader
// refuses those nodes' plans, and says the others' answers are incomplete.
const (
	ArchiveFormat  = "mesh-provisioner-history"
	ArchiveVersion = 3
)

// ArchiveHeader says what an archive holds.
type ArchiveHeader struct {
	Format  string          `msgpack:"format"`
	Version int             `msgpack:"version"`
	Tool    string          `msgpack:"tool"`
	Created time.Time       `msgpack:"created"`
	Source  string          `msgpack:"source"` // "state": the seat's event log; "nats": the streams
	Buckets []ArchiveBucket `msgpack:"buckets"`
	// Forgotten lists the composed-<node> buckets the log forgot, with when (version 2; absent
	// before), in byte order of their names.
	Forgotten []ArchiveForgotten `msgpack:"forgotten,omitempty"`
	// Unread lists the composed-<node> buckets an export of the streams could not read, in byte
	// order (version 3; absent before).
	Unread []string `msgpack:"unread,omitempty"`
	// UnreadWhy says, of each bucket in Unread, why it could not be read (not written: for the
	// export's own report).
	UnreadWhy map[string]string `msgpack:"-"`
}

// ArchiveForgotten is a forgotten mark as written: [bucket, when (Unix ns)].
type ArchiveForgotten struct {
	_msgpack struct{} `msgpack:",as_array"`
	Bucket   string
	At       int64
}

// ArchiveBucket is one bucket of an archive.
type ArchiveBucket struct {
	Name          string       `msgpack:"name"`
	FirstSeq      uint64       `msgpack:"first_seq"`
	LastSeq       uint64       `msgpack:"last_seq"`
	Messages      uint64       `msgpack:"messages"`
	StreamCreated time.Time    `msgpack:"stream_created"`
	Floor         uint64       `msgpack:"floor"`
	FloorTime     int64        `msgpack:"floor_time"`
	Gaps          []ArchiveGap `msgpack:"gaps"`
}

// ArchiveGap is a store.Gap as written: [from, to, opened-at].
type ArchiveGap struct {
	_msgpack struct{} `msgpack:",as_array"`
	From     uint64
	To       uint64
	OpenedAt uint64
}

type archiveRecord struct {
	_msgpack struct{} `msgpack:",as_array"`
	Bucket   int
	Seq      uint64
	Time     int64
	Subject  string
	Headers  map[string][]string
	Data     []byte
}

// archiveWriter spools records into a temporary file beside the archive (the header's counts and marks
// are known only once every record is read), then writes header, records and end, and renames the
// result into place, so a half-written archive never has the archive's name.
type archiveWriter struct {
	out    string
	spool  *os.File
	zw     *zstd.Encoder
	bw     *bufio.Writer
	enc    *msgpack.Encoder
	header ArchiveHeader
	count  uint64
}

func newArchiveWriter(out, tool, source string) (*archiveWriter, error) {
	spool, err := os.CreateTemp(filepath.Dir(out), "."+filepath.Base(out)+".spool-")
	if err != nil {
		return nil, fmt.Errorf("archive: %w", err)
	}
	zw, err := zstd.NewWriter(spool)
	if err != nil {
		spool.Close()
		os.Remove(spool.Name())
		return nil, err
	}
	w := &archiveWriter{out: out, spool: spool, zw: zw, bw: bufio.NewWriterSize(zw, 1<<16),
		header: ArchiveHeader{Format: ArchiveFormat, Version: 1, Tool: tool, Source: source, Created: time.Now().UTC()}}
	w.enc = msgpack.NewEncoder(w.bw)
	return w, nil
}

func (w *archiveWriter) abort() {
	w.zw.Close()
	w.spool.Close()
	os.Remove(w.spool.Name())
}

func (w *archiveWriter) bucket(b ArchiveBucket) int {
	w.header.Buckets = append(w.header.Buckets, b)
	return len(w.header.Buckets) - 1
}

func (w *archiveWriter) record(r *archiveRecord) error {
	w.count++
	b := &w.header.Buckets[r.Bucket]
	if b.Messages == 0 {
		b.FirstSeq = r.Seq
	}
	b.Messages++
	b.LastSeq = max(b.LastSeq, r.Seq)
	return w.enc.Encode(r)
}

// finish writes the archive: header, the spooled records, end; synced and renamed into place. It stops
// with ctx's error once ctx is done, asked at each read of the spool: the copy of an archive of
// millions of messages, gigabytes, ran to its end whatever the operator pressed.
func (w *archiveWriter) finish(ctx context.Context) (err error) {
	defer w.abort()
	if err := w.bw.Flush(); err != nil {
		return err
	}
	if err := w.zw.Close(); err != nil {
		return err
	}
	f, err := os.CreateTemp(filepath.Dir(w.out), "."+filepath.Base(w.out)+".tmp-")
	if err != nil {
		return fmt.Errorf("archive: %w", err)
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	frame := func(v any) error {
		zw, err := zstd.NewWriter(f)
		if err != nil {
			return err
		}
		if err := msgpack.NewEncoder(zw).Encode(v); err != nil {
			zw.Close()
			return err
		}
		return zw.Close()
	}
	if err := frame(&w.header); err != nil {
		return fmt.Errorf("archive header: %w", err)
	}
	if _, err := w.spool.Seek(0, io.SeekStart); err != nil {
		return err
	}
	if _, err := io.Copy(f, ctxio.Reader{Ctx: ctx, R: w.spool}); err != nil {
		return fmt.Errorf("archive records: %w", err)
	}
	if err := frame(&archiveRecord{Bucket: -1, Seq: w.count}); err != nil {
		return fmt.Errorf("archive end: %w", err)
	}
	if err := f.Sync(); err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(f.Name(), w.out)
}

func gapsOut(gs []store.Gap) []ArchiveGap {
	out := make([]ArchiveGap, 0, len(gs))
	for _, g := range gs {
		out = append(out, ArchiveGap{From: g.From, To: g.To, OpenedAt: g.OpenedAt})
	}
	return out
}

// ExportLog writes the history of every bucket a seat reads from an event log to an archive: the
// provisioner's four, then the plans' inputs the log holds (in ExportNATS's order): every event it
// keeps, with the subject and the headers of its operation written out again (the log keeps the
// operation, not the headers), and the log's marks, so the archive answers the points the log answers.
func ExportLog(ctx context.Context, db *store.DB, out, tool string, progress Progress) (ArchiveHeader, error) {
	w, err := newArchiveWriter(out, tool, "state")
	if err != nil {
		return ArchiveHeader{}, err
	}
	v, err := db.View()
	if err != nil {
		w.abort()
		return ArchiveHeader{}, err
	}
	defer v.Close()
	buckets := provisionerBuckets()
	var inputs []string
	for _, b := range v.Buckets() {
		// The store names every bucket it was asked about; a plans' input is in the log once applied.
		if !provisioner.IsPlanInput(b) {
			continue
		}
		cp, err := v.Checkpoint(b)
		if err != nil {
			w.abort()
			return ArchiveHeader{}, err
		}
		if cp.Applied > 0 || cp.StreamCreated != 0 {
			inputs = append(inputs, b)
		}
	}
	for _, b := range []string{provisioner.BucketHostModules, provisioner.BucketIndexerBuilds} {
		if i := slices.Index(inputs, b); i >= 0 {
			buckets = append(buckets, b)
			inputs = slices.Delete(inputs, i, i+1)
		}
	}
	slices.Sort(inputs)
	buckets = append(buckets, inputs...)
	if err := v.Forgotten(func(bucket string, at int64) {
		w.header.Forgotten = append(w.header.Forgotten, ArchiveForgotten{Bucket: bucket, At: at})
	}); err != nil {
		w.abort()
		return ArchiveHeader{}, err
	}
	if len(w.header.Forgotten) > 0 {
		w.header.Version = 2
	}
	var done int64
	for _, bucket := range buckets {
		cp, err := v.Checkpoint(bucket)
		if err != nil {
			w.abort()
			return ArchiveHeader{}, err
		}
		marks, err := v.HistoryMarks(bucket)
		if err != nil {
			w.abort()
			return ArchiveHeader{}, err
		}
		i := w.bucket(ArchiveBucket{Name: bucket, Floor: marks.Floor, FloorTime: marks.FloorTime, Gaps: gapsOut(marks.Gaps)})
		if cp.StreamCreated != 0 {
			w.header.Buckets[i].StreamCreated = time.Unix(0, cp.StreamCreated).UTC()
		}
		prefix := provisioner.SubjectPrefix(bucket)
		var rerr error
		err = v.Events(bucket, 0, func(key []byte, ev *store.Event) bool {
			m := ev.Message(key)
			rec := archiveRecord{Bucket: i, Seq: m.Seq, Time: m.Time, Subject: prefix + m.Key, Headers: projector.HeadersOf(m.Op, m.Rollup)}
			if m.Foreign {
				rec.Subject = m.Key // a rollup of the whole stream on a subject added by hand
			}
			if m.Op == provisioner.OpPut || m.Foreign {
				rec.Data = m.Value
			}
			if rerr = w.record(&rec); rerr != nil {
				return false
			}
			if done++; progress != nil && done%4096 == 0 {
				progress(done, 0)
			}
			return ctx.Err() == nil
		})
		if err == nil {
			err = rerr
		}
		if err == nil {
			err = ctx.Err()
		}
		if err != nil {
			w.abort()
			return ArchiveHeader{}, err
		}
		w.header.Buckets[i].LastSeq = max(w.header.Buckets[i].LastSeq, cp.Applied)
	}
	if progress != nil {
		progress(done, done)
	}
	return w.header, w.finish(ctx)
}

// ExportNATS writes the buckets' raw history from their streams to an archive: every message the
// streams hold, with its subject and headers as stored, read until each stream's end. Messages a
// stream no longer holds (superseded revisions past the bucket's history, purged ones) are recorded as
// gaps, as the projector would record them.
//
// A composed-<node> bucket whose stream does not answer, or whose read fails for exportRetryFor, does
// not stop the export, as it does not stop a seat (Fill): the archive is written without it (what was
// read of it kept), and the header lists it (Unread). Any other bucket that
// cannot be read fails the export.
func ExportNATS(ctx context.Context, js jetstream.JetStream, buckets []string, out, tool string, progress Progress) (ArchiveHeader, error) {
	if buckets == nil {
		var err error
		if buckets, err = DefaultBuckets(ctx, js); err != nil {
			return ArchiveHeader{}, err
		}
	}
	w, err := newArchiveWriter(out, tool, "nats")
	if err != nil {
		return ArchiveHeader{}, err
	}
	var total, done int64
	type src struct {
		stream jetstream.Stream
		info   *jetstream.StreamInfo
		index  int
	}
	var srcs []src
	for _, b := range buckets {
		sctx, unwatch := watchComposed(ctx, js, b)
		s, err := js.Stream(sctx, provisioner.StreamName(b))
		unwatch()
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			continue
		}
		if err != nil && provisioner.IsComposedBucket(b) && ctx.Err() == nil {
			w.unread(b, fmt.Errorf("stream of %s: %w", b, refusedBy(sctx, err)))
			continue
		}
		if err != nil {
			w.abort()
			return ArchiveHeader{}, fmt.Errorf("stream of %s: %w", b, err)
		}
		info := s.CachedInfo()
		total += int64(info.State.Msgs)
		srcs = append(srcs, src{stream: s, info: info, index: w.bucket(ArchiveBucket{Name: b, StreamCreated: info.Created.UTC()})})
	}
	pullBytes := exportPullBytes
	if pullBytes == 0 {
		pullBytes = streamread.PullBytes(js.Conn(), 0)
	}
	for _, s := range srcs {
		sctx, unwatch := watchComposed(ctx, js, w.header.Buckets[s.index].Name)
		err := exportStream(sctx, w, s.stream, s.info, s.index, pullBytes, func() {
			if done++; progress != nil && done%4096 == 0 {
				progress(done, total)
			}
		})
		unwatch()
		if err != nil {
			var ue *unreadError
			if errors.As(err, &ue) && provisioner.IsComposedBucket(ue.bucket) && ctx.Err() == nil {
				w.unread(ue.bucket, ue.err)
				continue
			}
			w.abort()
			return ArchiveHeader{}, err
		}
	}
	if progress != nil {
		progress(done, total)
	}
	if len(w.header.Unread) > 0 {
		slices.Sort(w.header.Unread)
		w.header.Version = 3
	}
	if err := ctx.Err(); err != nil {
		// Ended as the last stream was read (its consumer's delete cut short, say): an export
		// stopped leaves no archive, as one stopped earlier does.
		w.abort()
		return ArchiveHeader{}, err
	}
	return w.header, w.finish(ctx)
}

// exportStream reads one stream from its first message until a message read with nothing pending, or
// at or past the stream's last sequence when the export began, or until its consumer has nothing more
// to deliver (the messages after the last one read were removed meanwhile).
//
// The consumer is created and read under ctx (internal/streamread), so a cancelled export ends at
// once whatever the server does. One lost midway (its server restarted, deleted) is created again from
// the message after the last one read: nothing is read twice, and what the stream removed in between
// is a gap, as the projector records it. A stream whose consumer cannot be read again within
// exportRetryFor is an error.
func exportStream(ctx context.Context, w *archiveWriter, s jetstream.Stream, info *jetstream.StreamInfo, index, pullBytes int, tick func()) error {
	name := w.header.Buckets[index].Name
	if info.State.Msgs == 0 {
		// Emptied, by a purge or an age limit: the messages it held are gone, not absent.
		if info.State.LastSeq > 0 {
			w.header.Buckets[index].Gaps = gapsOut([]store.Gap{{From: 1, OpenedAt: info.State.LastSeq + 1}})
			w.header.Buckets[index].LastSeq = info.State.LastSeq
		}
		return nil
	}
	e := &streamExport{w: w, index: index, last: info.State.LastSeq, pullBytes: pullBytes, tick: tick}
	// giveUp keeps what was read: ExportNATS goes on without a composed-<node> bucket, which the
	// header lists as unread, and fails on any other. No gap is opened past it: one would make every
	// plans answer at a later point 410, the other nodes' too, where the list refuses that node alone
	// and says the rest is incomplete (as a read of the streams that let the bucket go does, Fill).
	giveUp := func(err error) error {
		w.header.Buckets[index].Gaps = gapsOut(e.gaps)
		return &unreadError{bucket: name, err: err}
	}
	wait := exportRetryMin
	var failing time.Time // when the consumer was lost with nothing read since
	for {
		from := e.prev
		err := e.read(ctx, s)
		if err == nil {
			break
		}
		if de := (*denied.Error)(nil); ctx.Err() != nil && errors.As(context.Cause(ctx), &de) {
			// NATS refused this stream's read (ExportNATS watches it): no retry mends that.
			return giveUp(fmt.Errorf("read %s: stopped at sequence %d of %d: %w", name, e.prev, e.last, de))
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			return fmt.Errorf("read %s: the stream was deleted while exporting: %w", name, err)
		}
		if errors.Is(err, errArchiveWrite) {
			// The disk of --out (full, say), not the consumer: reading again would not help, and the
			// message the failed write held counted as read.
			return err
		}
		if e.prev > from || failing.IsZero() {
			failing, wait = time.Now(), exportRetryMin
		} else if time.Since(failing) > exportRetryFor {
			return giveUp(fmt.Errorf("read %s: stopped at sequence %d of %d, no consumer read for %s; run export again: %w", name, e.prev, e.last, exportRetryFor, err))
		}
		if err := pause(ctx, wait); err != nil {
			return err
		}
		wait = min(2*wait, exportRetryMax)
	}
	if e.prev < info.State.LastSeq {
		// The read stopped before the stream's end when the export began, and only where the consumer
		// said nothing was left after the last message read (read: a message with nothing pending, or
		// drained): the messages after it are gone (a purge while exporting, the last message's
		// subject purged before). The archive says so with a gap open from there, so that replay
		// refuses the points among them rather than answer them as of the last message read. (A check
		// that the stream held no message at or before the next sequence took the messages before a
		// removed last one for a read cut short, and failed every export of such a stream.)
		g := e.openGap()
		g.OpenedAt = max(g.OpenedAt, info.State.LastSeq+1)
		w.header.Buckets[index].LastSeq = max(w.header.Buckets[index].LastSeq, info.State.LastSeq)
	}
	w.header.Buckets[index].Gaps = gapsOut(e.gaps)
	return nil
}

// watchComposed returns ctx, ended as soon as NATS refuses a request of a composed-<node> bucket's
// stream (internal/denied): a refused request otherwise waits out the JetStream API's timeout, each
// retry of it, before the export goes on without the bucket. Other buckets are not watched here:
// their refusal fails the export, which the command's own watch says.
func watchComposed(ctx context.Context, js jetstream.JetStream, bucket string) (context.Context, context.CancelFunc) {
	if !provisioner.IsComposedBucket(bucket) {
		return ctx, func() {}
	}
	return denied.Context(ctx, js.Conn(), denied.OfStream(provisioner.StreamName(bucket)))
}

// refusedBy is the refusal that ended ctx (watchComposed) in place of err; err when none did.
func refusedBy(ctx context.Context, err error) error {
	if de := (*denied.Error)(nil); errors.As(context.Cause(ctx), &de) {
		return de
	}
	return err
}

// unread records a composed-<node> bucket the export goes on without, and why.
func (w *archiveWriter) unread(bucket string, why error) {
	w.header.Unread = append(w.header.Unread, bucket)
	if w.header.UnreadWhy == nil {
		w.header.UnreadWhy = map[string]string{}
	}
	w.header.UnreadWhy[bucket] = why.Error()
}

// unreadError is a stream export gave up reading (exportStream): what it read is in the archive, the
// rest a gap open from there.
type unreadError struct {
	bucket string
	err    error
}

func (e *unreadError) Error() string { return e.err.Error() }
func (e *unreadError) Unwrap() error { return e.err }

// errArchiveWrite marks a write of the archive's spool that failed: the export ends at once.
var errArchiveWrite = errors.New("write the archive")

// How export retries a stream whose consumer was lost: after 100 ms, doubling up to 5 s, for at most a
// minute without a message read (a server restart, a leader moving), then it fails rather than wait
// for ever in a script.
const (
	exportRetryMin = 100 * time.Millisecond
	exportRetryMax = 5 * time.Second
	exportRetryFor = time.Minute
)

// exportPullBytes, when set (tests), bounds an export's pulls instead of streamread.PullBytes: pulls
// of small messages as few as a pull of 4096 messages held, for the tests that lose a consumer or
// purge the stream while an export reads it.
var exportPullBytes int

// exportIdle is how long a read waits without a message before it asks the consumer whether anything
// is left for it.
const exportIdle = 500 * time.Millisecond

// streamExport is one stream's read into an archive, over the consumers it takes.
type streamExport struct {
	w     *archiveWriter
	index int
	last  uint64 // the stream's last sequence when the export began
	tick  func()

	pullBytes int // the most bytes of messages pulled and not yet read (streamread.PullBytes)

	prev uint64 // the last sequence read
	gaps []store.Gap
	open *store.Gap // the gap not closed yet, in gaps
}

// read reads the stream through one consumer, from the message after the last one read, until the
// end (nil) or until the consumer is lost or ctx ends (an error).
func (e *streamExport) read(ctx context.Context, s jetstream.Stream) (err error) {
	// Deleted when done, and when cancelled too, for at most a second then (a cancelled export barely
	// waits for a server that is gone): left to its inactive threshold, each Ctrl-C kept a consumer on
	// the server for five minutes. Named here, so that one whose creation got no answer (a Ctrl-C
	// during it) is deleted as well: the server may have created it.
	name := nuid.Next()
	drop := func() {
		dctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		if ctx.Err() != nil {
			dctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		}
		defer cancel()
		_ = s.DeleteConsumer(dctx, name)
	}
	cons, err := streamread.Create(ctx, s, name, e.prev)
	if err != nil {
		if !streamread.Answered(err) {
			drop()
		}
		return err
	}
	defer drop()
	rd, err := streamread.Read(cons, 0, e.pullBytes)
	if err != nil {
		return err
	}
	defer rd.Stop()

	// A watcher asks the consumer, when no message came for exportIdle, whether it has delivered
	// everything there is: then the messages after the last one read were removed, and no message
	// with nothing pending will ever come. A consumer it finds gone is lost.
	rctx, rcancel := context.WithCancel(ctx)
	var read atomic.Uint64
	var drained, gone atomic.Bool
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(exportIdle)
		defer t.Stop()
		seen := uint64(0)
		for {
			select {
			case <-rctx.Done():
				return
			case <-t.C:
			}
			if n := read.Load(); n != seen {
				seen = n
				continue
			}
			ci, err := cons.Info(rctx)
			if errors.Is(err, jetstream.ErrConsumerNotFound) {
				// Lost (deleted, or its server restarted): said before two heartbeats are missed.
				gone.Store(true)
				rcancel()
				return
			}
			if err == nil && ci.NumPending == 0 && ci.Delivered.Consumer == read.Load() {
				drained.Store(true)
				rcancel()
				return
			}
		}
	}()
	defer func() {
		rcancel()
		wg.Wait()
	}()

	for {
		msg, md, err := rd.Next(rctx)
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if drained.Load() {
				return nil
			}
			if gone.Load() {
				return fmt.Errorf("read: %w", jetstream.ErrConsumerNotFound)
			}
			return err
		}
		read.Store(rd.Delivered())
		end, err := e.add(msg, md)
		if err != nil || end {
			return err
		}
	}
}

// openGap returns the gap not closed yet, opened after the last sequence read when there is none.
func (e *streamExport) openGap() *store.Gap {
	if e.open == nil {
		e.gaps = append(e.gaps, store.Gap{From: e.prev + 1})
		e.open = &e.gaps[len(e.gaps)-1]
	}
	return e.open
}

// add writes one message to the archive, and says whether it is the last to read: nothing pending
// after it, or at or past the stream's last sequence when the export began.
func (e *streamExport) add(msg jetstream.Msg, md *jetstream.MsgMetadata) (bool, error) {
	seq := md.Sequence.Stream
	if seq > e.prev+1 {
		e.openGap().OpenedAt = seq
	}
	e.prev = seq
	rec := archiveRecord{Bucket: e.index, Seq: seq, Time: md.Timestamp.UnixNano(), Subject: msg.Subject(), Data: msg.Data()}
	if h := msg.Headers(); len(h) > 0 {
		rec.Headers = map[string][]string(h)
		if e.open != nil && provisioner.RollupOfHeaders(rec.Headers) == provisioner.RollupAll {
			// The server removed every earlier message as it stored this one: the points from it on
			// are exact, as the projector records them (store.Apply).
			e.open.To = seq
			e.open = nil
		}
	}
	if err := e.w.record(&rec); err != nil {
		return false, fmt.Errorf("%w beside %s: %w", errArchiveWrite, e.w.out, err)
	}
	e.tick()
	if md.NumPending == 0 {
		if e.open != nil && seq >= e.open.OpenedAt {
			e.open.To = seq
			e.open = nil
		}
		// Nothing after this one in the stream: its last sequence when the export began was
		// removed, or is this one.
		return true, nil
	}
	return seq >= e.last, nil
}

// FromArchive reads an archive into a temporary store, with the marks it carries.
func FromArchive(ctx context.Context, path string, progress Progress) (*Log, error) {
	return FromArchiveBuckets(ctx, path, nil, progress)
}

// FromArchiveBuckets reads the records of the given buckets of an archive (nil: every bucket) into a
// temporary store, with their marks: the records of the others are read past, not applied. The
// forgotten marks are kept whatever the buckets.
func FromArchiveBuckets(ctx context.Context, path string, buckets []string, progress Progress) (*Log, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if fi, err := f.Stat(); err == nil && fi.Mode().IsRegular() && fi.Size() == 0 {
		return nil, fmt.Errorf("archive %s is empty", path)
	}
	zr, err := zstd.NewReader(bufio.NewReaderSize(f, 1<<16))
	if err != nil {
		return nil, fmt.Errorf("archive %s: %w", path, err)
	}
	defer zr.Close()
	dec := msgpack.NewDecoder(zr)
	var h ArchiveHeader
	if err := dec.Decode(&h); err != nil {
		return nil, fmt.Errorf("archive %s: not a mesh-provisioner history archive: %w", path, err)
	}
	if h.Format != ArchiveFormat {
		return nil, fmt.Errorf("archive %s: format %q, want %q", path, h.Format, ArchiveFormat)
	}
	if h.Version > ArchiveVersion {
		return nil, fmt.Errorf("archive %s: version %d is newer than this tool reads (%d): read it with the mesh-provisioner that wrote it (%s) or a newer one", path, h.Version, ArchiveVersion, h.Tool)
	}
	l, err := newTemp("archive " + path)
	if err != nil {
		return nil, err
	}
	wait := func() {} // the Apply a write held for room left running (applyUnlessHeld)
	fail := func(err error) (*Log, error) {
		if errors.Is(err, store.ErrNoSpace) {
			err = tempRoomErr(filepath.Dir(l.dir), offlineOptions)
		}
		l.closeUnlessHeld(wait)
		return nil, err
	}
	var total int64
	for _, b := range h.Buckets {
		total += int64(b.Messages)
		if _, ok := provisioner.ShapeOf(b.Name); !ok {
			return fail(fmt.Errorf("archive %s: bucket %q is not one the seat tails", path, b.Name))
		}
	}
	for _, f := range h.Forgotten {
		if !provisioner.IsComposedBucket(f.Bucket) {
			return fail(fmt.Errorf("archive %s: forgotten bucket %q is not a composed-<node> bucket", path, f.Bucket))
		}
	}
	for _, b := range h.Unread {
		if !provisioner.IsComposedBucket(b) {
			return fail(fmt.Errorf("archive %s: unread bucket %q is not a composed-<node> bucket", path, b))
		}
	}
	keep := make([]bool, len(h.Buckets)) // by the records' bucket index: read into the store, or past
	for i, b := range h.Buckets {
		keep[i] = buckets == nil || slices.Contains(buckets, b.Name)
	}
	batch := make([]provisioner.Message, 0, 4096)
	batchBytes := 0 // of the messages in batch: their keys and values
	cur := -1
	flush := func() error {
		if len(batch) == 0 {
			return nil
		}
		b := h.Buckets[cur]
		var created int64 // 0: not known, as Apply takes it (the zero time.Time is no Unix time)
		if !b.StreamCreated.IsZero() {
			created = b.StreamCreated.UnixNano()
		}
		var err error
		wait, err = applyUnlessHeld(l.DB, func() error { return l.DB.Apply(b.Name, batch, created, false) })
		batch = batch[:0]
		return err
	}
	var n uint64
	// tick counts a record read, applied or read past.
	tick := func() error {
		if n++; n%4096 == 0 {
			// Asked with or without a progress to tell: a library caller's cancel stops the read too.
			if progress != nil {
				progress(int64(n), total)
			}
			return ctx.Err()
		}
		return nil
	}
	for {
		var rec archiveRecord
		if err := dec.Decode(&rec); err != nil {
			if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
				return fail(fmt.Errorf("archive %s is cut short after %d records: it has no end", path, n))
			}
			return fail(fmt.Errorf("archive %s: record %d: %w", path, n+1, err))
		}
		if rec.Bucket == -1 {
			if rec.Seq != n {
				return fail(fmt.Errorf("archive %s: the end says %d records, read %d", path, rec.Seq, n))
			}
			// Nothing may follow the end: two archives in one file, or bytes appended, are not
			// this archive, and reading the first alone would hide the rest.
			var b [1]byte
			if k, err := io.ReadAtLeast(io.MultiReader(dec.Buffered(), zr), b[:], 1); k > 0 || !errors.Is(err, io.EOF) {
				return fail(fmt.Errorf("archive %s has data after its end: it is not one archive as export writes it", path))
			}
			break
		}
		if rec.Bucket < 0 || rec.Bucket >= len(h.Buckets) {
			return fail(fmt.Errorf("archive %s: record %d names bucket %d of %d", path, n+1, rec.Bucket, len(h.Buckets)))
		}
		if !keep[rec.Bucket] {
			if err := tick(); err != nil {
				return fail(err)
			}
			continue
		}
		// A batch is applied at 4096 messages or at streamread.MaxBytes of values, whichever comes
		// first: 4096 values near NATS's max payload were gigabytes in memory, twice (the batch, and
		// Pebble's copy of it).
		if rec.Bucket != cur || len(batch) == cap(batch) || batchBytes >= streamread.MaxBytes {
			batchBytes = 0
			if err := flush(); err != nil {
				return fail(err)
			}
			cur = rec.Bucket
		}
		m, err := projector.MessageOf(h.Buckets[cur].Name, rec.Subject, nats.Header(rec.Headers), rec.Data, rec.Seq, time.Unix(0, rec.Time))
		if err != nil {
			return fail(fmt.Errorf("archive %s: record %d: %w", path, n+1, err))
		}
		batch = append(batch, m)
		batchBytes += len(m.Key) + len(m.Value)
		if err := tick(); err != nil {
			return fail(err)
		}
	}
	if err := flush(); err != nil {
		return fail(err)
	}
	// The marks, then a sync of all that was written, through applyUnlessHeld: Pebble writes its log
	// behind the batches, so a write that finds the disk full may be held only now, and held in a
	// Close later (the command's, once it has answered) it hung the command.
	wait, err = applyUnlessHeld(l.DB, func() error {
		for i, b := range h.Buckets {
			if !keep[i] {
				continue
			}
			if b.Messages == 0 && !b.StreamCreated.IsZero() {
				// No record brought the stream's creation time: a time before it still answers empty.
				if err := l.DB.Apply(b.Name, nil, b.StreamCreated.UnixNano(), false); err != nil {
					return err
				}
			}
			m := store.HistoryMarks{Floor: b.Floor, FloorTime: b.FloorTime, Trimmed: b.Floor}
			for _, g := range b.Gaps {
				m.Gaps = append(m.Gaps, store.Gap{From: g.From, To: g.To, OpenedAt: g.OpenedAt})
			}
			if err := l.DB.SetHistoryMarks(b.Name, m); err != nil {
				return err
			}
		}
		for _, f := range h.Forgotten {
			if err := l.DB.SetForgottenAt(f.Bucket, f.At); err != nil {
				return err
			}
		}
		return l.DB.Flush()
	})
	if err != nil {
		return fail(err)
	}
	markSynced(l.DB)
	for _, b := range h.Unread {
		if buckets == nil || slices.Contains(buckets, b) {
			l.Unread = append(l.Unread, b)
		}
	}
	if progress != nil {
		progress(int64(n), total)
	}
	return l, nil
}

// ReadArchiveHeader reads only an archive's header.
func ReadArchiveHeader(path string) (ArchiveHeader, error) {
	f, err := os.Open(path)
	if err != nil {
		return ArchiveHeader{}, err
	}
	defer f.Close()
	zr, err := zstd.NewReader(f)
	if err != nil {
		return ArchiveHeader{}, err
	}
	defer zr.Close()
	var h ArchiveHeader
	if err := msgpack.NewDecoder(zr).Decode(&h); err != nil {
		return ArchiveHeader{}, fmt.Errorf("archive %s: %w", path, err)
	}
	return h, nil
}

// pause waits d, or until ctx ends (its error), before a read is tried again.
func pause(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
