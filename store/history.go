package store

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"

	"github.com/cockroachdb/pebble/v2"

	provisioner "github.com/novox/mesh-provisioner"
)

// Event is one message of a bucket as the event log keeps it. Value aliases the store's memory and is
// valid only during the callback that received it.
type Event struct {
	Seq   uint64
	Time  int64 // Unix ns
	Op    provisioner.Op
	Value []byte
	// Rollup is kept only for a message whose rollup removed other keys (each of those has an event
	// of its own at the same sequence, a purge, under its key alone), and for a composed-<node> put
	// or delete that rolled its own key up (it forgets its build's last plan kept); RollupNone
	// otherwise.
	Rollup provisioner.Rollup
}

// HistoryMarks say which points a bucket's event log rebuilds exactly: every sequence n >= Floor that no
// gap holds. doc.go explains where the marks come from.
type HistoryMarks struct {
	// Floor is the lowest point the log rebuilds: events at or below it were compacted to the newest
	// event of each key (deletes dropped), and of a composed-<node> key to its newest published
	// composition too, with a newest delete after it (trim.go). 0 when nothing was ever trimmed.
	Floor uint64
	// FloorTime is the time of the message at Floor (Unix ns); 0 when nothing was trimmed.
	FloorTime int64
	// Trimmed is how far the compaction to Floor has got; below Floor only while a trim is under way or
	// was interrupted (it resumes).
	Trimmed uint64
	// Gaps are the ranges of messages the stream had removed before the projector read them.
	Gaps []Gap
}

// Gap is a range of sequences [From, To) the log cannot rebuild: messages at From and after were
// removed from the stream before the projector read them, and a point becomes exact again only once
// the projector has read to the stream's end since (To). To is 0 while the gap is open.
type Gap struct {
	From     uint64
	To       uint64 // 0: open, the projector has not reached the stream's end since
	OpenedAt uint64 // the first sequence read after the newest jump the gap covers
}

// Open reports whether the projector has not yet caught up since the gap.
func (g Gap) Open() bool { return g.To == 0 }

// Holds reports whether the gap makes point n inexact.
func (g Gap) Holds(n uint64) bool { return n >= g.From && (g.To == 0 || n < g.To) }

// ErrTrimmed and ErrGap say why the log cannot rebuild a point; callers test them with errors.Is.
var (
	ErrTrimmed = errors.New("store: the event log was trimmed past that point")
	ErrGap     = errors.New("store: the stream had removed messages around that point before they were read")
)

// Check returns nil when the log rebuilds the state as of n exactly, and an error wrapping ErrTrimmed or
// ErrGap, with the nearest points it can rebuild, when not.
func (m HistoryMarks) Check(n uint64) error {
	if n < m.Floor {
		return fmt.Errorf("%w: the log rebuilds sequence %d and later, not %d", ErrTrimmed, m.Floor, n)
	}
	for _, g := range m.Gaps {
		if !g.Holds(n) {
			continue
		}
		if g.Open() {
			return fmt.Errorf("%w: messages from sequence %d were removed before they were read, and the projector has not caught up since; ask as of seq:%d or earlier", ErrGap, g.From, g.From-1)
		}
		return fmt.Errorf("%w: messages from sequence %d were removed before they were read; ask as of seq:%d or earlier, or seq:%d or later", ErrGap, g.From, g.From-1, g.To)
	}
	return nil
}

// Keys of the history marks (doc.go):
//
//	0x09 <bucket> 00 01 'f'              -> uvarint floor, varint floor time, uvarint trimmed
//	0x09 <bucket> 00 01 'g' <from BE8>   -> uvarint to (0: open), uvarint opened-at
func floorKey(dst []byte, bucket string) []byte {
	return append(bucketPrefix(dst, prefixMarks, bucket), 'f')
}

func gapPrefix(dst []byte, bucket string) []byte {
	return append(bucketPrefix(dst, prefixMarks, bucket), 'g')
}

func gapKey(dst []byte, bucket string, from uint64) []byte {
	return binary.BigEndian.AppendUint64(gapPrefix(dst, bucket), from)
}

func encodeFloor(m HistoryMarks) []byte {
	b := binary.AppendUvarint(nil, m.Floor)
	b = binary.AppendVarint(b, m.FloorTime)
	return binary.AppendUvarint(b, m.Trimmed)
}

func decodeFloor(b []byte) (HistoryMarks, error) {
	var m HistoryMarks
	var n int
	if m.Floor, n = binary.Uvarint(b); n <= 0 {
		return m, ErrCorrupt
	}
	b = b[n:]
	if m.FloorTime, n = binary.Varint(b); n <= 0 {
		return m, ErrCorrupt
	}
	if m.Trimmed, n = binary.Uvarint(b[n:]); n <= 0 {
		return m, ErrCorrupt
	}
	return m, nil
}

func encodeGap(g Gap) []byte {
	return binary.AppendUvarint(binary.AppendUvarint(nil, g.To), g.OpenedAt)
}

// readMarks reads a bucket's marks from any Pebble reader (the DB, a snapshot, a batch).
func readMarks(r pebble.Reader, bucket string) (HistoryMarks, error) {
	var m HistoryMarks
	v, closer, err := r.Get(floorKey(nil, bucket))
	switch {
	case errors.Is(err, pebble.ErrNotFound):
	case err != nil:
		return m, err
	default:
		m, err = decodeFloor(v)
		closer.Close()
		if err != nil {
			return m, fmt.Errorf("%w: history floor of %s", err, bucket)
		}
	}
	p := gapPrefix(nil, bucket)
	it, err := r.NewIter(&pebble.IterOptions{LowerBound: p, UpperBound: prefixEnd(p)})
	if err != nil {
		return m, err
	}
	for it.First(); it.Valid(); it.Next() {
		k := it.Key()
		if len(k) != len(p)+8 {
			it.Close()
			return m, fmt.Errorf("%w: gap key of %s", ErrCorrupt, bucket)
		}
		g := Gap{From: binary.BigEndian.Uint64(k[len(p):])}
		var n int
		if g.To, n = binary.Uvarint(it.Value()); n <= 0 {
			it.Close()
			return m, fmt.Errorf("%w: gap of %s", ErrCorrupt, bucket)
		}
		if g.OpenedAt, n = binary.Uvarint(it.Value()[n:]); n <= 0 {
			it.Close()
			return m, fmt.Errorf("%w: gap of %s", ErrCorrupt, bucket)
		}
		m.Gaps = append(m.Gaps, g)
	}
	return m, it.Close()
}

// loadGaps reads every bucket's open gap into memory at open: Apply extends it, CaughtUp closes it.
func (db *DB) loadGaps() error {
	it, err := db.pdb.NewIter(&pebble.IterOptions{LowerBound: []byte{prefixMarks}, UpperBound: []byte{prefixMarks + 1}})
	if err != nil {
		return readErr(err)
	}
	defer it.Close()
	for it.First(); it.Valid(); it.Next() {
		rest := it.Key()[1:]
		i := termIndex(rest)
		if i < 0 || len(rest) < i+3 {
			return fmt.Errorf("%w: history mark key %q", ErrCorrupt, it.Key())
		}
		if rest[i+2] != 'g' {
			continue
		}
		bucket := string(unesc(nil, rest[:i]))
		to, n := binary.Uvarint(it.Value())
		if n <= 0 || len(rest) != i+3+8 {
			return fmt.Errorf("%w: gap of %s", ErrCorrupt, bucket)
		}
		if to != 0 {
			continue
		}
		opened, m := binary.Uvarint(it.Value()[n:])
		if m <= 0 {
			return fmt.Errorf("%w: gap of %s", ErrCorrupt, bucket)
		}
		g := Gap{From: binary.BigEndian.Uint64(rest[i+3:]), OpenedAt: opened}
		db.openGaps[bucket] = g
		// What the gap holds back from min_seq requests (Reach) is not kept: from its start when a
		// message was read past its newest extension (a jump, or read since a skip: more than it
		// held, never less), nothing when none was (a skip or a removed end, each of a stream
		// that held nothing past the checkpoint).
		if b := db.lookup(bucket); b != nil && g.OpenedAt <= b.cp.Applied {
			b.held.Store(g.From)
		}
	}
	return nil
}

// gap records, in the applier's batch, that messages from..openedAt-1 of a bucket were removed before
// they were read. An open gap is extended instead: it keeps its From and becomes exact only after the
// newest jump.
func (a *applier) gap(bucket string, from, openedAt uint64) {
	g, ok := a.gaps[bucket]
	if !ok {
		g, ok = a.db.openGaps[bucket]
	}
	held, known := a.held[bucket]
	if !known {
		b := a.db.known(bucket)
		held = b.held.Load()
		if held != 0 && b.heldUntil != 0 && from > b.heldUntil {
			// The first jump of the batch starts past where the stream ended when asked after the
			// held one (HoldUntil), no jump between: whatever removed the held messages is at or below
			// that end, read before this jump, and the hold ends there. Kept instead, a bucket whose
			// every batch jumped held every min_seq from its first jump on until the stream's end was
			// read, which a bucket written on and on rarely gives.
			held = 0
		}
	}
	if !ok || !g.Open() {
		// None open, or one this batch closed at a rollup of the whole stream: a new gap.
		g = Gap{From: from}
		held = 0
	}
	if held == 0 {
		// What removed the messages from here on may not be read yet: min_seq requests from here on
		// wait for it (DB.Reach).
		held = from
	}
	g.OpenedAt = openedAt
	if a.gaps == nil {
		a.gaps = map[string]Gap{}
		a.held = map[string]uint64{}
	}
	a.gaps[bucket] = g
	a.held[bucket] = held
	a.buf = gapKey(a.buf[:0], bucket, g.From)
	a.set(a.buf, encodeGap(g))
}

// closeGap closes, in the applier's batch, an open gap of a bucket at seq: the message at seq is a
// rollup of the whole stream, which removed every message before it, so every point from seq on is
// exact whatever the gap lacks. A gap the batch closed stays in a.gaps, closed, so that finish drops
// it from the open ones.
func (a *applier) closeGap(bucket string, seq uint64) {
	g, ok := a.gaps[bucket]
	if !ok {
		g, ok = a.db.openGaps[bucket]
	}
	if !ok || !g.Open() {
		return
	}
	g.To = seq
	if a.gaps == nil {
		a.gaps = map[string]Gap{}
		a.held = map[string]uint64{}
	}
	a.gaps[bucket] = g
	a.held[bucket] = 0
	a.buf = gapKey(a.buf[:0], bucket, g.From)
	a.set(a.buf, encodeGap(g))
}

// CaughtUp tells the store that the message at seq was the last of its bucket's stream when it was
// read (its NumPending was 0). An open gap whose newest jump is at or below seq, and below what is
// applied, is closed there: every message the stream removed before it was read was superseded by one
// at or below seq, so points from seq on are exact again.
func (db *DB) CaughtUp(bucket string, seq uint64) error {
	if db.closed.Load() {
		return ErrClosed
	}
	db.applyMu.Lock()
	defer db.applyMu.Unlock()
	g, ok := db.openGaps[bucket]
	b := db.bucket(bucket)
	if !ok || seq < g.OpenedAt || seq > b.cp.Applied || seq < b.closeAt || db.closed.Load() {
		return nil
	}
	b.closeAt = 0
	g.To = seq
	if err := db.set(gapKey(nil, bucket, g.From), encodeGap(g), pebble.NoSync); err != nil {
		return fmt.Errorf("close history gap of %s: %w", bucket, err)
	}
	delete(db.openGaps, bucket)
	db.unhold(bucket)
	return nil
}

// unhold clears what a bucket's open gap held min_seq requests back from (Reach), and wakes whoever
// waits on the bucket when that changes it; under applyMu.
func (db *DB) unhold(bucket string) {
	b := db.lookup(bucket)
	if b == nil {
		return
	}
	b.heldUntil = 0
	if b.held.Swap(0) == 0 {
		return
	}
	db.mu.Lock()
	defer db.mu.Unlock()
	if !db.closed.Load() {
		b.wake()
	}
}

// Held returns the first sequence a bucket's open gap holds min_seq requests back from (Reach), 0
// when none, and the stream's last sequence HoldUntil was told (0: none since the last jump).
func (db *DB) Held(bucket string) (held, until uint64) {
	b := db.lookup(bucket)
	if b == nil {
		return 0, 0
	}
	if held = b.held.Load(); held == 0 {
		return 0, 0
	}
	db.applyMu.Lock()
	defer db.applyMu.Unlock()
	return b.held.Load(), b.heldUntil
}

// HoldUntil tells the store that its bucket's stream held messages up to last when the projector had
// read a message its consumer said was the last: the count of messages pending after a message can be
// short by a message the stream holds (nats-server counts one the history limit removed while the
// consumer was paused twice, now and then), and what removed the messages the open gap holds may be
// among them. held is what Held returned before the stream was asked: a jump since asks again. A
// request inside the gap waits until the checkpoint reaches last (Reach).
func (db *DB) HoldUntil(bucket string, held, last uint64) {
	db.applyMu.Lock()
	defer db.applyMu.Unlock()
	b := db.lookup(bucket)
	if b == nil || db.closed.Load() || b.held.Load() != held || held == 0 || b.heldUntil != 0 {
		return
	}
	// The gap's messages were removed by messages up to last: points before it are not exact.
	b.closeAt = max(b.closeAt, last)
	if b.cp.Applied >= last {
		db.unhold(bucket)
		return
	}
	b.heldUntil = last
}

// StreamEndsAt tells the store that its bucket's stream has no message past seq, at or below the
// applied sequence: whatever removed the messages its open gap holds (Reach) is at or below it, read,
// or was no message, so a request no longer waits for it. The gap itself stays open for the event
// log: no message read said so.
func (db *DB) StreamEndsAt(bucket string, seq uint64) {
	if db.closed.Load() {
		return
	}
	db.applyMu.Lock()
	defer db.applyMu.Unlock()
	if b := db.lookup(bucket); b != nil && seq <= b.cp.Applied && !db.closed.Load() {
		db.unhold(bucket)
	}
}

// TailRemoved tells the store that its bucket's stream ends at lastSeq and that every message past the
// one applied was removed before it was read: a stream emptied by a purge, or by an age limit without
// markers. No message will say so (Apply records a gap at the jump to the next message read), so the
// log cannot rebuild a point past the applied sequence: it holds an open gap from there, as a jump
// does, which the next message read past lastSeq extends and the stream's end closes. streamCreated
// (Unix ns, 0 when not known) is kept with the checkpoint when it has none, so that a time before
// the stream was created still answers empty.
func (db *DB) TailRemoved(bucket string, lastSeq uint64, streamCreated int64) error {
	if db.closed.Load() {
		return ErrClosed
	}
	db.applyMu.Lock()
	defer db.applyMu.Unlock()
	if db.closed.Load() {
		return ErrClosed
	}
	b := db.known(bucket)
	cp := b.cp
	if lastSeq <= cp.Applied {
		return nil
	}
	if err := db.checkRoom(); err != nil {
		return err
	}
	g, ok := db.openGaps[bucket]
	if !ok {
		g = Gap{From: cp.Applied + 1}
	}
	g.OpenedAt = max(g.OpenedAt, lastSeq+1)
	batch := db.pdb.NewBatch()
	defer batch.Close()
	if err := batch.Set(gapKey(nil, bucket, g.From), encodeGap(g), nil); err != nil {
		return err
	}
	if cp.StreamCreated == 0 && streamCreated != 0 {
		cp.StreamCreated = streamCreated
		if err := batch.Set(checkpointKey(bucket), cp.encode(nil), nil); err != nil {
			return err
		}
	}
	if err := db.commit(batch, pebble.NoSync); err != nil {
		return fmt.Errorf("record the removed end of %s: %w", bucket, err)
	}
	db.openGaps[bucket] = g
	b.setCheckpoint(cp)
	db.durableSoonIfSynced(bucket)
	// Nothing is held past the checkpoint: what removed the gap's messages is read or gone (Reach).
	db.unhold(bucket)
	return nil
}

// SkipRemoved tells the store that nothing is left in its bucket's stream past the applied sequence up
// to seq: the stream removed those messages before they were read (the subject purged, a TTL without
// a marker), and its consumer, having looked past seq, delivered every message left there, all
// applied. The checkpoint moves to seq, as a message at seq would move it, and the log holds an open
// gap from the old applied + 1, as TailRemoved records: a request for min_seq seq is answered, the
// projection being as current as the stream up to it, while no point among the removed messages is
// rebuilt as if they had never been. It reports whether the checkpoint moved.
func (db *DB) SkipRemoved(bucket string, seq uint64, streamCreated int64) (bool, error) {
	if db.closed.Load() {
		return false, ErrClosed
	}
	db.applyMu.Lock()
	defer db.applyMu.Unlock()
	if db.closed.Load() {
		return false, ErrClosed
	}
	b := db.known(bucket)
	cp := b.cp
	if seq <= cp.Applied || cp.StreamCreated != 0 && streamCreated != 0 && cp.StreamCreated != streamCreated {
		return false, nil
	}
	if err := db.checkRoom(); err != nil {
		return false, err
	}
	g, ok := db.openGaps[bucket]
	if !ok {
		g = Gap{From: cp.Applied + 1}
	}
	g.OpenedAt = max(g.OpenedAt, seq+1)
	if cp.StreamCreated == 0 {
		cp.StreamCreated = streamCreated
	}
	cp.Applied = seq
	batch := db.pdb.NewBatch()
	defer batch.Close()
	if err := batch.Set(gapKey(nil, bucket, g.From), encodeGap(g), nil); err != nil {
		return false, err
	}
	if err := batch.Set(checkpointKey(bucket), cp.encode(nil), nil); err != nil {
		return false, err
	}
	if err := db.commit(batch, pebble.NoSync); err != nil {
		return false, fmt.Errorf("record the removed messages of %s up to %d: %w", bucket, seq, err)
	}
	db.openGaps[bucket] = g
	b.setCheckpoint(cp)
	db.durableSoonIfSynced(bucket)
	// The stream holds nothing past the old checkpoint: what removed the gap's messages is read or
	// gone, and nothing holds a request up to seq back (Reach). After the sequence: a reader of Reach
	// loads the sequence first.
	b.held.Store(0)
	b.wake()
	return true, nil
}

// RemovedEnd returns the stream's last sequence that TailRemoved was told of past the checkpoint, when
// nothing has been read since: the stream ends there, every message past the applied one removed
// before it was read. ok is false when none is recorded. The open gap holding it may start below the
// checkpoint + 1: a SkipRemoved moved the checkpoint over a first removal, and TailRemoved extended its
// gap with a second (a message read past it would have moved the checkpoint to its jump or past it).
func (db *DB) RemovedEnd(bucket string) (last uint64, ok bool) {
	db.applyMu.Lock()
	defer db.applyMu.Unlock()
	g, open := db.openGaps[bucket]
	b := db.lookup(bucket)
	if !open || b == nil || g.OpenedAt <= b.cp.Applied+1 {
		return 0, false
	}
	return g.OpenedAt - 1, true
}

// SetHistoryMarks replaces a bucket's marks: an archive loaded into a temporary store carries the marks
// of the log it was written from.
func (db *DB) SetHistoryMarks(bucket string, m HistoryMarks) error {
	if db.closed.Load() {
		return ErrClosed
	}
	db.applyMu.Lock()
	defer db.applyMu.Unlock()
	b := db.pdb.NewBatch()
	defer b.Close()
	p := gapPrefix(nil, bucket)
	if err := b.DeleteRange(p, prefixEnd(p), nil); err != nil {
		return err
	}
	if err := b.Set(floorKey(nil, bucket), encodeFloor(m), nil); err != nil {
		return err
	}
	delete(db.openGaps, bucket)
	for _, g := range m.Gaps {
		if err := b.Set(gapKey(nil, bucket, g.From), encodeGap(g), nil); err != nil {
			return err
		}
		if g.Open() {
			db.openGaps[bucket] = g
		}
	}
	return db.commit(b, pebble.Sync)
}

// HistoryMarks returns a bucket's marks as this view sees them.
func (v *View) HistoryMarks(bucket string) (HistoryMarks, error) { return readMarks(v.snap, bucket) }

// historyKeyStart is the start of every event of one key: <bucket comp> <esc key> 00 01.
func historyKeyStart(dst []byte, bucket, key string) []byte {
	return appendComp(bucketPrefix(dst, prefixHistory, bucket), key)
}

func seqAfter(keyStart []byte, n uint64) []byte {
	if n == math.MaxUint64 {
		return prefixEnd(keyStart)
	}
	return binary.BigEndian.AppendUint64(append([]byte(nil), keyStart...), n+1)
}

func decodeEvent(k, v []byte, ev *Event) error {
	if len(k) < 8 {
		return fmt.Errorf("%w: event key", ErrCorrupt)
	}
	ev.Seq = binary.BigEndian.Uint64(k[len(k)-8:])
	var err error
	ev.Op, ev.Rollup, ev.Time, ev.Value, err = decodeEventValue(v)
	return err
}

// StateAt calls fn, in byte order of raw keys, for every key of a bucket that starts with prefix and
// sorts after after (when set) whose newest event at or below n is a put: the key's state as of n. Each
// key's events are stepped through while they are few and sought past when they are many, so the cost
// is about one step per event for short histories and a few seeks per key for long ones. The key and
// event are valid only during the call; fn returns false to stop.
func (v *View) StateAt(bucket, prefix, after string, n uint64, fn func(key []byte, ev *Event) bool) error {
	base := bucketPrefix(nil, prefixHistory, bucket)
	lo := appendEsc(append([]byte(nil), base...), prefix)
	hi := prefixEnd(lo)
	if after != "" {
		a := prefixEnd(appendComp(append([]byte(nil), base...), after))
		if bytes.Compare(a, lo) > 0 {
			lo = a
		}
	}
	if hi != nil && bytes.Compare(lo, hi) >= 0 {
		return nil
	}
	it, err := v.snap.NewIter(&pebble.IterOptions{LowerBound: lo, UpperBound: hi})
	if err != nil {
		return err
	}
	const steps = 8 // events stepped through before seeking instead
	var ev Event
	var keyStart, kbuf, val []byte
	// take copies the event under the iterator: it is emitted after the iterator has moved on.
	take := func() error {
		if err := decodeEvent(it.Key(), it.Value(), &ev); err != nil {
			return err
		}
		val = append(val[:0], ev.Value...)
		ev.Value = val
		return nil
	}
	seqOf := func(k []byte) uint64 { return binary.BigEndian.Uint64(k[len(k)-8:]) }
	for valid := it.First(); valid; {
		k := it.Key()
		if len(k) < len(base)+10 {
			it.Close()
			return fmt.Errorf("%w: event key", ErrCorrupt)
		}
		keyStart = append(keyStart[:0], k[:len(k)-8]...)
		found := false
		for i := 0; valid && bytes.HasPrefix(it.Key(), keyStart) && seqOf(it.Key()) <= n; i++ {
			if i == steps {
				// A long history: seek to the newest event at or below n.
				if it.SeekLT(seqAfter(keyStart, n)) {
					if err := take(); err != nil {
						it.Close()
						return err
					}
				}
				valid = it.SeekGE(prefixEnd(keyStart))
				break
			}
			if err := take(); err != nil {
				it.Close()
				return err
			}
			found = true
			valid = it.Next()
		}
		// Past n: skip the key's later events, stepping a few, then seeking.
		for i := 0; valid && bytes.HasPrefix(it.Key(), keyStart); i++ {
			if i == steps {
				valid = it.SeekGE(prefixEnd(keyStart))
				break
			}
			valid = it.Next()
		}
		if found && ev.Op == provisioner.OpPut {
			raw := keyStart[len(base) : len(keyStart)-2]
			if hasZero(raw) {
				kbuf = unesc(kbuf[:0], raw)
				raw = kbuf
			}
			if !fn(raw, &ev) {
				break
			}
		}
	}
	return it.Close()
}

// KeyAt returns one key's newest event at or below n, and whether it has one that is a put.
func (v *View) KeyAt(bucket, key string, n uint64) (Event, bool, error) {
	start := historyKeyStart(nil, bucket, key)
	it, err := v.snap.NewIter(&pebble.IterOptions{LowerBound: start, UpperBound: prefixEnd(start)})
	if err != nil {
		return Event{}, false, err
	}
	defer it.Close()
	var ev Event
	if !it.SeekLT(seqAfter(start, n)) {
		return Event{}, false, it.Error()
	}
	if err := decodeEvent(it.Key(), it.Value(), &ev); err != nil {
		return Event{}, false, err
	}
	ev.Value = append([]byte(nil), ev.Value...)
	return ev, ev.Op == provisioner.OpPut, nil
}

// KeyHistory calls fn for every event of one key that the log keeps, oldest first.
func (v *View) KeyHistory(bucket, key string, fn func(ev *Event) bool) error {
	start := historyKeyStart(nil, bucket, key)
	it, err := v.snap.NewIter(&pebble.IterOptions{LowerBound: start, UpperBound: prefixEnd(start)})
	if err != nil {
		return err
	}
	var ev Event
	for it.First(); it.Valid(); it.Next() {
		if err := decodeEvent(it.Key(), it.Value(), &ev); err != nil {
			it.Close()
			return err
		}
		if !fn(&ev) {
			break
		}
	}
	return it.Close()
}

// Events calls fn for every event of a bucket with a sequence at or above from, in sequence order.
func (v *View) Events(bucket string, from uint64, fn func(key []byte, ev *Event) bool) error {
	return events(v.snap, bucket, from, fn)
}

func events(r pebble.Reader, bucket string, from uint64, fn func(key []byte, ev *Event) bool) error {
	p := bucketPrefix(nil, prefixEvent, bucket)
	it, err := r.NewIter(&pebble.IterOptions{LowerBound: eventKey(nil, bucket, from), UpperBound: prefixEnd(p)})
	if err != nil {
		return err
	}
	defer it.Close()
	var ev Event
	var hk []byte
	for it.First(); it.Valid(); it.Next() {
		key := it.Value()
		seq := binary.BigEndian.Uint64(it.Key()[len(p):])
		hk = historyKey(hk[:0], bucket, string(key), seq)
		val, closer, err := r.Get(hk)
		if err != nil {
			return fmt.Errorf("%w: event %d of %s has no history entry: %v", ErrCorrupt, seq, bucket, err)
		}
		err = decodeEvent(hk, val, &ev)
		if err == nil && !fn(key, &ev) {
			closer.Close()
			return nil
		}
		closer.Close()
		if err != nil {
			return err
		}
	}
	return it.Error()
}

// eventAtOrAfter returns the first event the log keeps at or after seq: its sequence and time.
func eventAtOrAfter(r pebble.Reader, bucket string, seq uint64) (uint64, int64, bool, error) {
	p := bucketPrefix(nil, prefixEvent, bucket)
	it, err := r.NewIter(&pebble.IterOptions{LowerBound: eventKey(nil, bucket, seq), UpperBound: prefixEnd(p)})
	if err != nil {
		return 0, 0, false, err
	}
	defer it.Close()
	if !it.First() {
		return 0, 0, false, it.Error()
	}
	s := binary.BigEndian.Uint64(it.Key()[len(p):])
	t, err := eventTime(r, bucket, string(it.Value()), s)
	return s, t, err == nil, err
}

// eventBefore returns the sequence of the last event the log keeps below seq, or 0.
func eventBefore(r pebble.Reader, bucket string, seq uint64) (uint64, error) {
	p := bucketPrefix(nil, prefixEvent, bucket)
	it, err := r.NewIter(&pebble.IterOptions{LowerBound: p, UpperBound: eventKey(nil, bucket, seq)})
	if err != nil {
		return 0, err
	}
	defer it.Close()
	if !it.Last() {
		return 0, it.Error()
	}
	return binary.BigEndian.Uint64(it.Key()[len(p):]), nil
}

func eventTime(r pebble.Reader, bucket, key string, seq uint64) (int64, error) {
	val, closer, err := r.Get(historyKey(nil, bucket, key, seq))
	if err != nil {
		return 0, fmt.Errorf("%w: event %d of %s has no history entry: %v", ErrCorrupt, seq, bucket, err)
	}
	defer closer.Close()
	_, _, t, _, err := decodeEventValue(val)
	return t, err
}

// seqAtTime is the last sequence whose message is stamped at or before t: the largest sequence the log
// keeps with a time at or below t, or the floor when the floor's message is (it may have been compacted
// away). JetStream stamps a stream's messages in sequence order, so a binary search over sequences finds
// it in O(log n) seeks.
func seqAtTime(r pebble.Reader, bucket string, t int64) (uint64, error) {
	marks, err := readMarks(r, bucket)
	if err != nil {
		return 0, err
	}
	last, err := eventBefore(r, bucket, math.MaxUint64)
	if err != nil {
		return 0, err
	}
	// The smallest m such that the first event at or after m is stamped after t (or there is none).
	lo, err := SearchTime(last+1, t, func(seq uint64) (int64, bool, error) {
		_, ts, ok, err := eventAtOrAfter(r, bucket, seq)
		return ts, ok, err
	})
	if err != nil {
		return 0, err
	}
	n, err := eventBefore(r, bucket, lo)
	if err != nil {
		return 0, err
	}
	if marks.Floor > n && marks.FloorTime <= t && marks.FloorTime != 0 {
		n = marks.Floor
	}
	return n, nil
}

// SearchTime is seqAtTime's binary search, over the sequences below hi: the smallest m such that the
// first message at or after m (atOrAfter: its time, false when there is none) is stamped after t. A
// reader of the stream itself (replay's node read) searches with it, so that it looks at the same
// sequences and finds the same point as the log, even where the stream's times are out of order.
func SearchTime(hi uint64, t int64, atOrAfter func(seq uint64) (ts int64, ok bool, err error)) (uint64, error) {
	lo := uint64(0)
	for lo < hi {
		mid := lo + (hi-lo)/2
		ts, ok, err := atOrAfter(mid)
		if err != nil {
			return 0, err
		}
		if !ok || ts > t {
			hi = mid
		} else {
			lo = mid + 1
		}
	}
	return lo, nil
}

// SeqAtTime is the last sequence of a bucket whose message is stamped at or before t (Unix ns), as far
// as the log knows: 0 when it knows none.
func (v *View) SeqAtTime(bucket string, t int64) (uint64, error) { return seqAtTime(v.snap, bucket, t) }

// LiveBelow reports the lowest sequence in [from, to) whose event is still the newest of its key and a
// put: a message the bucket's current state rests on. When a stream's first sequence moves past such a
// message, the message was removed while its key still held it (a purge, or an age limit without
// markers), and the projection no longer equals the bucket. It scans the events in [from, to) by
// sequence, one seek per event.
//
// What it found free of live events from 0 on is kept (liveCheckedKey) and not scanned again, by this
// open or any later one: an event that is not live never becomes live again, since Apply only logs
// messages past the applied sequence and a trim keeps each key's newest event. Forget and ForgetFrom
// delete the mark with the bucket's other marks. So the check a tail makes as it starts scans only
// what the stream's first sequence moved past since the last check, not the whole log below it at
// every start of the seat. LiveBelow and Forget of one bucket are called from its projector's one
// goroutine, so a forgetting never comes between a scan and its mark.
//
// A scan stops when ctx ends, with ctx's error, keeping what it found free so far.
func (db *DB) LiveBelow(ctx context.Context, bucket string, from, to uint64) (uint64, bool, error) {
	if db.closed.Load() {
		return 0, false, ErrClosed
	}
	checked, err := db.liveChecked(bucket)
	if err != nil {
		return 0, false, err
	}
	// Only a scan that starts where the mark ends moves it: the mark says nothing of [checked, from).
	contiguous := from <= checked
	from = max(from, checked)
	if to <= from {
		return 0, false, nil
	}
	seq, live, free, err := db.liveBelow(ctx, bucket, from, to)
	if live || !contiguous || free <= checked {
		return seq, live, err
	}
	// Under applyMu, as Close takes it: Pebble panics on a write to a closed DB.
	db.applyMu.Lock()
	defer db.applyMu.Unlock()
	if db.closed.Load() {
		return 0, false, ErrClosed
	}
	if serr := db.set(liveCheckedKey(nil, bucket), binary.AppendUvarint(nil, free), pebble.NoSync); serr != nil && err == nil {
		err = fmt.Errorf("record the live check of %s: %w", bucket, serr)
	}
	return 0, false, err
}

// liveBelowRead, when set (tests), is told how many events each scan of LiveBelow read.
var liveBelowRead func(events int)

// liveBelowStep, when set (tests), is called for each event a scan of LiveBelow reads.
var liveBelowStep func()

// liveCheckedTag is the history mark below which no event of the bucket is live (LiveBelow).
const liveCheckedTag = 'l'

func liveCheckedKey(dst []byte, bucket string) []byte {
	return append(bucketPrefix(dst, prefixMarks, bucket), liveCheckedTag)
}

// liveChecked is the sequence below which LiveBelow found no live event of the bucket; 0 when none.
func (db *DB) liveChecked(bucket string) (uint64, error) {
	v, closer, err := db.pdb.Get(liveCheckedKey(nil, bucket))
	if errors.Is(err, pebble.ErrNotFound) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	defer closer.Close()
	n, w := binary.Uvarint(v)
	if w <= 0 {
		return 0, fmt.Errorf("%w: live check mark of %s", ErrCorrupt, bucket)
	}
	return n, nil
}

// liveBelow is LiveBelow's scan of the events in [from, to). free is how far it found no live event:
// to, or where it stopped when ctx ended, or the live event it found.
func (db *DB) liveBelow(ctx context.Context, bucket string, from, to uint64) (seq uint64, live bool, free uint64, err error) {
	p := bucketPrefix(nil, prefixEvent, bucket)
	walk, err := db.pdb.NewIter(&pebble.IterOptions{LowerBound: eventKey(nil, bucket, from), UpperBound: eventKey(nil, bucket, to)})
	if err != nil {
		return 0, false, from, err
	}
	defer walk.Close()
	hist, err := db.pdb.NewIter(&pebble.IterOptions{LowerBound: []byte{prefixHistory}, UpperBound: []byte{prefixHistory + 1}})
	if err != nil {
		return 0, false, from, err
	}
	defer hist.Close()
	events := 0
	if liveBelowRead != nil {
		defer func() { liveBelowRead(events) }()
	}
	for walk.First(); walk.Valid(); walk.Next() {
		seq := binary.BigEndian.Uint64(walk.Key()[len(p):])
		if events%1024 == 0 && ctx.Err() != nil {
			return 0, false, seq, ctx.Err()
		}
		events++
		if liveBelowStep != nil {
			liveBelowStep()
		}
		start := historyKeyStart(nil, bucket, string(walk.Value()))
		cur := binary.BigEndian.AppendUint64(append([]byte(nil), start...), seq)
		if !hist.SeekGE(cur) || !bytes.Equal(hist.Key(), cur) {
			continue // compacted away meanwhile
		}
		if len(hist.Value()) == 0 || eventOp(hist.Value()[0]) != provisioner.OpPut {
			continue
		}
		if hist.Next() && bytes.HasPrefix(hist.Key(), start) {
			continue // superseded
		}
		return seq, true, seq, nil
	}
	if err := walk.Error(); err != nil {
		return 0, false, from, err
	}
	return 0, false, to, nil
}
