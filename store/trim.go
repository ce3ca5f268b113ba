package store

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"sync"
	"time"

	"github.com/cockroachdb/pebble/v2"

	provisioner "github.com/novox/mesh-provisioner"
)

// trimBatch is how many events one trim batch walks before it commits: deletes go to Pebble in
// batches of this size, so a trim never holds much in memory and never stalls ingest.
var trimBatch = 4096

// trimIterDone, when set (by tests), is told the stats of each trim batch's history iterator.
var trimIterDone func(pebble.IteratorStats)

// TrimHistory compacts a bucket's event log up to horizon: of every key, only the newest event at or
// below horizon is kept, and only when it is a put; every older event is deleted. A key of a
// composed-<node> bucket also keeps its newest published composition at or below horizon since its
// last purge or TTL marker, and beside it its newest event even when that is a delete: the plans as
// of a point fold the last plan kept from the log (replay), and a refusal, a pending composition or a
// delete after a published composition still holds the module at that plan. A build written
// differently (m.0042, m.42) is one build record, so a delete or a marker of one spelling is kept too
// while another spelling keeps an event below it (trimmer.event). The state, and the
// plans' build records, as of every point at or after horizon are unchanged, and the floor moves to
// horizon, so as-of questions below it are refused (ErrTrimmed) rather than answered wrong.
// horizonTime is the time of the message at horizon.
//
// The floor is committed before any event is deleted, and the walk commits its progress with each
// batch, so an interrupted trim is resumed by the next one. Trimming runs beside Apply without taking
// its lock: it only touches events at or below horizon, and Apply only writes above the applied
// sequence, which is at or above horizon. It returns how many events it deleted.
func (db *DB) TrimHistory(ctx context.Context, bucket string, horizon uint64, horizonTime int64) (int, error) {
	if db.closed.Load() {
		return 0, ErrClosed
	}
	defer db.lockHistory(bucket)() // not beside a Forget of the bucket (forget.go)
	if applied, _ := db.Applied(bucket); horizon > applied {
		return 0, fmt.Errorf("store: trim %s to %d: only %d is applied", bucket, horizon, applied)
	}
	marks, err := readMarks(db.pdb, bucket)
	if err != nil {
		return 0, err
	}
	if horizon <= marks.Floor {
		if marks.Trimmed >= marks.Floor {
			return 0, nil // nothing new, nothing left over
		}
		horizon, horizonTime = marks.Floor, marks.FloorTime // resume an interrupted trim
	} else {
		// The floor first: from this commit on, no reader asks for a point below it, so deleting
		// events it no longer needs can happen in any number of batches.
		b := db.pdb.NewBatch()
		marks.Floor, marks.FloorTime = horizon, horizonTime
		if err := b.Set(floorKey(nil, bucket), encodeFloor(marks), nil); err == nil {
			for _, g := range marks.Gaps {
				if !g.Open() && g.To <= horizon {
					err = errors.Join(err, b.Delete(gapKey(nil, bucket, g.From), nil))
				}
			}
			if err == nil {
				err = db.commit(b, pebble.NoSync)
			}
		}
		b.Close()
		if err != nil {
			return 0, fmt.Errorf("trim %s: write floor: %w", bucket, err)
		}
	}

	p := bucketPrefix(nil, prefixEvent, bucket)
	walk, err := db.pdb.NewIter(&pebble.IterOptions{LowerBound: eventKey(nil, bucket, marks.Trimmed+1), UpperBound: eventKey(nil, bucket, horizon+1)})
	if err != nil {
		return 0, err
	}
	defer walk.Close()
	deleted := 0
	t := newTrimmer(db, bucket)
	t.marks, t.ctx = &marks, ctx
	if err := t.begin(); err != nil {
		return 0, err
	}
	defer t.close()
	n := 0
	for walk.First(); walk.Valid(); walk.Next() {
		seq := binary.BigEndian.Uint64(walk.Key()[len(p):])
		d, err := t.event(string(walk.Value()), seq, true)
		if err != nil {
			return deleted, fmt.Errorf("trim %s at %d: %w", bucket, seq, err)
		}
		deleted += d
		if n++; n%trimBatch == 0 {
			marks.Trimmed = seq
			if err := t.commit(marks); err != nil {
				return deleted, err
			}
			if ctx.Err() != nil {
				return deleted, ctx.Err()
			}
			if err := t.begin(); err != nil {
				return deleted, err
			}
		}
	}
	if err := walk.Error(); err != nil {
		return deleted, err
	}
	marks.Trimmed = horizon
	return deleted, t.commit(marks)
}

// trimmer is one trim's batch: the deletes, an iterator over the bucket's history as committed when the
// batch began, and what the walk kept of each key it met, in this batch (the iterator does not see the
// batch's own deletes) and in the batches before it (bounded, begin).
type trimmer struct {
	db     *DB
	bucket string
	// composed is the shape of a composed-<node> bucket, whose keys keep their last published
	// composition too; nil for every other bucket.
	composed *provisioner.Shape
	batch    *pebble.Batch
	hist     *pebble.Iterator
	kept     map[string]keptEvents
	keptOld  map[string]keptEvents // the generation before kept (begin)
	pinned   map[uint64]bool       // rollups that removed other keys, never dropped (pin)
	buf      []byte
	marks    *HistoryMarks // the trim's marks, committed with each batch
	ctx      context.Context
}

// pin keeps the event at seq whatever comes after it: a rollup that removed other keys. The log names
// a sequence by the rollup's own key alone, so the purges it wrote under the keys it removed (at its
// sequence, doc.go) are never walked: those keys keep their events from before it, and a fill of the
// log by sequence (Events: plans as of a point) removes them again only through the rollup. Dropped,
// even for a later event of its own key, the keys it removed came back there.
func (t *trimmer) pin(seq uint64) {
	if t.pinned == nil {
		t.pinned = map[uint64]bool{}
	}
	t.pinned[seq] = true
}

// keptEvents is what a trim keeps of one key at or below the horizon: its newest event, and, of a
// composed-<node> key, its newest published composition since its last purge or TTL marker and that
// marker (provisioner.PublishesPlan says why). Each is a sequence, 0 for none; they may be one event.
type keptEvents struct {
	newest, published, purge uint64
	// before is, when purge is one a rollup wrote under the key (it removed the key), the key's
	// event before that purge: a fill of the log by sequence meets the purge only through the rollup,
	// which removes the key only when the fill holds it (a row, or a delete as its newest event:
	// applier.rollup), and a purge that did not remove the key there did not forget its build.
	before uint64
	pin    bool // the key keeps a rollup that removed other keys (trimmer.pin)
}

func newTrimmer(db *DB, bucket string) *trimmer {
	t := &trimmer{db: db, bucket: bucket}
	if _, ok := provisioner.ComposedNode(bucket); ok {
		if shape, ok := provisioner.ShapeOf(bucket); ok {
			t.composed = &shape
		}
	}
	return t
}

func (t *trimmer) begin() error {
	p := bucketPrefix(nil, prefixHistory, t.bucket)
	it, err := t.db.pdb.NewIter(&pebble.IterOptions{LowerBound: p, UpperBound: prefixEnd(p)})
	if err != nil {
		return err
	}
	t.batch, t.hist = t.db.pdb.NewBatch(), it
	if t.kept == nil || len(t.kept) >= keptCap {
		// What the walk kept of the keys it met goes on to the next batch, committed by then: read
		// back, a key's kept events lie beyond the tombstones of every event of it the walk dropped
		// so far, and a key with a long history made each batch step over all of them again (a trim
		// of one key's 80,000 events took 630 ms, 14x that of 10,000). Bounded by two generations of
		// keptCap keys: a key met in either is known, and one met in neither has met no drop since
		// keptCap other keys were met.
		t.keptOld, t.kept = t.kept, make(map[string]keptEvents, min(keptCap, 1024))
	}
	return nil
}

// keptCap is how many keys one generation of trimmer.kept holds.
var keptCap = 1 << 16

// keptOf is what the walk kept of a key it met, in this batch or an earlier one of this trim.
func (t *trimmer) keptOf(key string) (keptEvents, bool) {
	if k, ok := t.kept[key]; ok {
		return k, true
	}
	k, ok := t.keptOld[key]
	return k, ok
}

func (t *trimmer) close() {
	if t.batch != nil {
		t.batch.Close()
		t.batch = nil
	}
	if t.hist != nil {
		if trimIterDone != nil {
			trimIterDone(t.hist.Stats())
		}
		t.hist.Close()
		t.hist = nil
	}
}

func (t *trimmer) commit(m HistoryMarks) error {
	defer t.close()
	if err := t.batch.Set(floorKey(nil, t.bucket), encodeFloor(m), nil); err != nil {
		return err
	}
	if err := t.db.commit(t.batch, pebble.NoSync); err != nil {
		return fmt.Errorf("trim %s: commit: %w", t.bucket, err)
	}
	return nil
}

// event handles the event at seq of key, walked in sequence order below the horizon. It becomes the
// key's newest event and supersedes what the walk kept of the key before it, except, of a
// composed-<node> key, the newest published composition (a refusal, a pending composition, a value
// out of shape or a delete leaves the fold's published revision as it was) and the last purge or TTL
// marker. Of any other key a delete or a purge drops everything: a key absent from the log is absent
// from the state.
//
// A build written differently (m.0042, m.42) is one build record, folded from the messages of every
// spelling, so a composed-<node> key's delete or purge can decide the record whatever the other
// spellings kept below it: the newest message of the build sets its status, and its last purge or
// TTL marker forgets what came before. Such an event is kept when another spelling of the build keeps
// an event below it (othersBelow), and otherwise dropped with the rest of the key as before: with
// nothing of the build below it, a delete that publishes nothing and a marker fold to no record, as
// an empty log does.
//
// own says the event is the message at seq (its entry by sequence names key); otherwise it is the purge
// a rollup that removed other keys wrote under key at its own sequence (removedBy).
func (t *trimmer) event(key string, seq uint64, own bool) (int, error) {
	start := historyKeyStart(nil, t.bucket, key)
	cur := binary.BigEndian.AppendUint64(append([]byte(nil), start...), seq)
	if !t.hist.SeekGE(cur) || !bytes.Equal(t.hist.Key(), cur) {
		return 0, fmt.Errorf("%w: event %d of %s has no history entry", ErrCorrupt, seq, t.bucket)
	}
	m, err := t.message(key)
	if err != nil {
		return 0, err
	}
	var parts provisioner.Parts
	plans := false
	if t.composed != nil {
		var perr error
		parts, perr = provisioner.ParseKey(*t.composed, key)
		plans = perr == nil
	}
	// Read from the value now: it lives in the iterator's memory, which keptBefore moves.
	published := plans && provisioner.PublishesPlan(&m)
	deleted := 0
	k, met := t.keptOf(key)
	if !met {
		if k, deleted, err = t.keptBefore(key, start, plans); err != nil {
			return 0, err
		}
	}
	// A put or a delete of a composed-<node> key that rolled its own key up forgets the build's
	// history as a marker does (provisioner.BuildRecord.Fold).
	rolled := plans && m.Rollup != provisioner.RollupNone && m.Op != provisioner.OpPurge && m.Op != provisioner.OpExpire
	var next keptEvents
	switch {
	case rolled:
		next = keptEvents{newest: seq, purge: seq}
		if published {
			next.published = seq
		}
	case m.Op == provisioner.OpPut:
		next = keptEvents{newest: seq, published: k.published, purge: k.purge, before: k.before}
		if published {
			next.published = seq
		}
	case !plans:
	case m.Op == provisioner.OpDelete:
		next = keptEvents{newest: seq, published: k.published, purge: k.purge, before: k.before}
		if k.published == 0 {
			others, err := t.othersBelow(&parts, key, seq)
			if err != nil {
				return 0, err
			}
			if !others {
				next = keptEvents{}
			}
		}
	default: // a purge or a TTL marker
		others, err := t.othersBelow(&parts, key, seq)
		if err != nil {
			return 0, err
		}
		if others {
			next = keptEvents{newest: seq, purge: seq}
			if !own {
				next.before = k.newest
			}
		}
	}
	// The keys the rollup removed: each has a purge at seq under it that the walk by sequence never
	// meets, handled here as that key's event, so that what they kept from before the rollup goes as
	// a purge's would. The rollup is pinned only when one of them keeps its purge (a composed build
	// written differently, whose other spelling keeps an event below it): a fill of the log by
	// sequence meets that purge only through the rollup. Otherwise nothing of the keys it removed is
	// left from before it, and it is an event of its own key like any other: before, every rollup
	// that removed other keys was kept for ever, with a purge under every key it removed, and a
	// client rolling its bucket up again and again grew the log without bound.
	//
	// A rollup of a whole bucket removed every key of it: they are read and handled trimBatch at a
	// time, each lot committed in a batch of its own as a part of the walk before the rollup (the
	// batch's marks say only what is below it was walked), so that the trim's memory stays that of a
	// batch. A trim stopped between two lots walks the rollup again, and meets only the keys that
	// still hold its purge: each handled again is left as it was.
	for after := ""; own && m.RemovesOthers(); {
		removed, err := t.removedAt(&m, seq, after, trimBatch)
		if err != nil {
			return 0, err
		}
		for _, x := range removed {
			d, err := t.event(x, seq, false)
			if err != nil {
				return 0, err
			}
			deleted += d
			if k, _ := t.keptOf(x); k.newest == seq || k.purge == seq || k.published == seq {
				t.pin(seq)
				next.pin = true
			}
		}
		if len(removed) < trimBatch {
			break
		}
		after = removed[len(removed)-1]
		m.Value = nil // in the iterator's memory, which commit closes
		marks := *t.marks
		marks.Trimmed = max(marks.Trimmed, seq-1)
		if err := t.commit(marks); err != nil {
			return 0, err
		}
		if err := t.ctx.Err(); err != nil {
			return 0, err
		}
		if err := t.begin(); err != nil {
			return 0, err
		}
	}
	if next.pin = next.pin || k.pin; next.pin {
		// The key keeps a rollup that removed other keys (pin), which may be a put of it: its newest
		// event stays beside it, whatever it is, so that the rollup is not its state.
		next.newest = seq
	}
	t.kept[key] = next
	var dropped [5]uint64
	for i, s := range [...]uint64{k.newest, k.published, k.purge, k.before, seq} {
		if s == 0 || s == next.newest || s == next.published || s == next.purge || s == next.before || slices.Contains(dropped[:i], s) || t.pinned[s] {
			continue // nothing, kept, dropped already, or a rollup that removed other keys
		}
		dropped[i] = s
		// The walked event, and the newest this trim kept of a key it met, are named by their
		// entries by sequence; what was read back from the log may be a purge a rollup wrote under
		// the key at its own sequence (drop).
		if err := t.drop(start, key, s, s == seq && own || met && s == k.newest); err != nil {
			return 0, err
		}
		deleted++
	}
	return deleted, nil
}

// removedAt lists, in key order, at most limit keys after after ("": from the first) other than m's
// own that hold an event at seq, the sequence of m, a rollup that removed other keys: the keys it
// removed, each with a purge there (doc.go). It reads the committed log under the rollup's literal
// tokens (every key for a rollup of the whole stream), two seeks a key.
func (t *trimmer) removedAt(m *provisioner.Message, seq uint64, after string, limit int) ([]string, error) {
	base := bucketPrefix(nil, prefixHistory, t.bucket)
	lo := appendEsc(append([]byte(nil), base...), rollupPrefix(m))
	it, err := t.db.pdb.NewIter(&pebble.IterOptions{LowerBound: lo, UpperBound: prefixEnd(lo)})
	if err != nil {
		return nil, err
	}
	var keys []string
	var comp, at []byte
	valid := it.First()
	if after != "" {
		valid = it.SeekGE(prefixEnd(appendComp(append([]byte(nil), base...), after)))
	}
	for ; valid; valid = it.SeekGE(prefixEnd(comp)) {
		k := it.Key()
		if len(k) < len(base)+10 {
			it.Close()
			return nil, fmt.Errorf("%w: history key %q", ErrCorrupt, k)
		}
		comp = append(comp[:0], k[:len(k)-8]...) // base, the escaped key, its terminator
		at = binary.BigEndian.AppendUint64(append(at[:0], comp...), seq)
		if !it.SeekGE(at) {
			break
		}
		if !bytes.Equal(it.Key(), at) {
			continue
		}
		if key := string(unesc(nil, comp[len(base):len(comp)-2])); key != m.Key {
			if keys = append(keys, key); len(keys) >= limit {
				break
			}
		}
	}
	if err := it.Close(); err != nil {
		return nil, err
	}
	return keys, nil
}

// othersBelow reports whether another spelling of the build of a composed-<node> key (the module's
// key with its build written with more or fewer leading zeros) keeps an event below seq: what this
// batch kept of it when the batch met it, else its committed events, which below seq are all what
// earlier batches and trims kept. It seeks each spelling that can exist, stopping at the first number
// of leading zeros no key of the bucket starts with, so a build written one way costs a seek or two.
func (t *trimmer) othersBelow(p *provisioner.Parts, key string, seq uint64) (bool, error) {
	digits := provisioner.FormatBuild(p.Build)
	zeros := p.Module + "."
	for z := 0; ; z++ {
		if z > 0 {
			zeros += "0"
			t.buf = appendEsc(bucketPrefix(t.buf[:0], prefixHistory, t.bucket), zeros)
			if !t.hist.SeekGE(t.buf) || !bytes.HasPrefix(t.hist.Key(), t.buf) {
				return false, t.hist.Error()
			}
		}
		other := zeros + digits
		if other == key {
			continue
		}
		if k, met := t.keptOf(other); met {
			if k != (keptEvents{}) {
				return true, nil
			}
			continue
		}
		t.buf = historyKeyStart(t.buf[:0], t.bucket, other)
		if t.hist.SeekGE(t.buf) && bytes.HasPrefix(t.hist.Key(), t.buf) && len(t.hist.Key()) == len(t.buf)+8 &&
			binary.BigEndian.Uint64(t.hist.Key()[len(t.buf):]) < seq {
			return true, nil
		}
		if err := t.hist.Error(); err != nil {
			return false, err
		}
	}
}

// message decodes the history entry under the iterator, an event of key.
func (t *trimmer) message(key string) (provisioner.Message, error) {
	m := provisioner.Message{Key: key, Seq: binary.BigEndian.Uint64(t.hist.Key()[len(t.hist.Key())-8:])}
	var err error
	m.Op, m.Rollup, m.Time, m.Value, err = decodeEventValue(t.hist.Value())
	return m, err
}

// keptBefore reads what earlier batches and trims kept of a key that this batch has not met yet: its
// committed events before the iterator's position, which are all at or below what was trimmed
// before. There are at most three, the newest, a published composition and a purge or TTL marker
// older than it; any other is dropped, as the rule says.
func (t *trimmer) keptBefore(key string, start []byte, plans bool) (keptEvents, int, error) {
	var k keptEvents
	deleted := 0
	wantBefore := false // k.purge is a purge a rollup wrote under the key: the next event is its before
	// Limited to the key's own events: the keys before it may be tombstones only (a rollup's keys
	// handled in lots, each lot committed), and a plain Prev stepped back over every one of them,
	// once a lot, until compacted.
	for t.hist.PrevWithLimit(start) == pebble.IterValid && bytes.HasPrefix(t.hist.Key(), start) {
		m, err := t.message(key)
		if err != nil {
			return k, deleted, err
		}
		if wantBefore {
			k.before, wantBefore = m.Seq, false
			continue
		}
		marker := plans && (m.Op != provisioner.OpPut && m.Op != provisioner.OpDelete || m.Rollup != provisioner.RollupNone)
		if m.RemovesOthers() && !t.pinned[m.Seq] {
			// A rollup that removed other keys, walked by an earlier trim: pinned while a key it
			// removed still keeps its purge (event); an older binary's trim kept them all.
			still, err := t.removedAt(&m, m.Seq, "", 1)
			if err != nil {
				return k, deleted, err
			}
			if len(still) > 0 {
				t.pin(m.Seq)
			}
		}
		if t.pinned[m.Seq] {
			k.pin = true // never dropped, whichever of the three it is
		}
		switch published := plans && provisioner.PublishesPlan(&m); {
		case k.newest == 0:
			k.newest = m.Seq
			if published {
				k.published = m.Seq
			}
			if marker {
				k.purge = m.Seq
			}
		case k.purge == 0 && k.published == 0 && published:
			k.published = m.Seq
			if marker {
				k.purge = m.Seq
			}
		case k.purge == 0 && marker:
			k.purge = m.Seq
		case t.pinned[m.Seq]:
		default:
			if err := t.drop(start, key, m.Seq, false); err != nil {
				return k, deleted, err
			}
			deleted++
		}
		if k.purge == m.Seq && m.Op == provisioner.OpPurge && m.Rollup == provisioner.RollupNone {
			// A purge a rollup wrote under the key has an entry by sequence naming another key.
			if wantBefore, err = t.removedPurge(key, m.Seq); err != nil {
				return k, deleted, err
			}
		}
	}
	return k, deleted, t.hist.Error()
}

// removedPurge reports whether the purge of key at seq is one a rollup wrote under the key it removed:
// the entry by sequence at seq names another key.
func (t *trimmer) removedPurge(key string, seq uint64) (bool, error) {
	v, closer, err := t.db.pdb.Get(eventKey(nil, t.bucket, seq))
	if errors.Is(err, pebble.ErrNotFound) {
		return true, nil
	}
	if err != nil {
		return false, err
	}
	defer closer.Close()
	return string(v) != key, nil
}

// drop deletes the event of key at seq, and the entry by sequence at seq when it names key. A key that
// a rollup removed has a purge at the rollup's sequence whose entry by sequence names the rollup's own
// key (doc.go): deleting it with the purge took the rollup's own message out of the log's order by
// sequence, and a put that rolled the stream up, still the newest of its key, was then missed by
// LiveBelow (a purge of it went unnoticed), by Events and by every later trim. named says the entry is
// known to name key (an event the walk met); otherwise it is read.
func (t *trimmer) drop(keyStart []byte, key string, seq uint64, named bool) error {
	t.buf = binary.BigEndian.AppendUint64(append(t.buf[:0], keyStart...), seq)
	if err := t.batch.Delete(t.buf, nil); err != nil {
		return err
	}
	t.buf = eventKey(t.buf[:0], t.bucket, seq)
	if !named {
		v, closer, err := t.db.pdb.Get(t.buf)
		if errors.Is(err, pebble.ErrNotFound) {
			return nil
		}
		if err != nil {
			return err
		}
		own := string(v) == key
		closer.Close()
		if !own {
			return nil
		}
	}
	return t.batch.Delete(t.buf, nil)
}

// HistoryBytes estimates the disk space the event log takes, all buckets together (Pebble's estimate
// over the sstables of the log's key ranges; what sits in memtables is not counted).
func (db *DB) HistoryBytes() (uint64, error) {
	if db.closed.Load() {
		return 0, ErrClosed
	}
	return db.pdb.EstimateDiskUsage([]byte{prefixHistory}, []byte{prefixEvent + 1})
}

// RetentionOptions say how long the event log keeps history. The zero value keeps everything.
type RetentionOptions struct {
	// MaxAge trims events stamped longer ago than this (by the messages' own time); 0 keeps them.
	MaxAge time.Duration
	// MaxBytes trims the oldest history when the log's estimated size passes this, down to 80% of it;
	// 0 means no limit. The state at the floor is always kept, so the log never gets smaller than
	// about one copy of the current rows (and of the compositions' last published revisions).
	MaxBytes int64
	// Every is how often the retention is applied; 0 means one minute.
	Every time.Duration
	// Now is the clock; nil means time.Now.
	Now func() time.Time
	// Logger receives a line per trim; nil discards them.
	Logger *slog.Logger
}

// Retention trims a store's event log in the background, without blocking ingest. Start runs it; Stop
// stops it and waits.
type Retention struct {
	db   *DB
	opts RetentionOptions
	log  *slog.Logger

	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu      sync.Mutex
	rounds  int
	deleted int64
}

// NewRetention returns a Retention for db.
func NewRetention(db *DB, opts RetentionOptions) *Retention {
	if opts.Every <= 0 {
		opts.Every = time.Minute
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Retention{db: db, opts: opts, log: log.With("component", "history")}
}

// Start applies the retention now and every Every until Stop.
func (r *Retention) Start(ctx context.Context) {
	ctx, r.cancel = context.WithCancel(ctx)
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		failing := false
		t := time.NewTimer(0)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			_, err := r.Apply(ctx)
			switch {
			case err != nil && ctx.Err() == nil && !errors.Is(err, ErrClosed):
				if !failing {
					r.log.Warn("trimming the event log failed; retrying", "err", err)
					failing = true
				}
			case err == nil && failing:
				r.log.Info("recovered")
				failing = false
			}
			t.Reset(r.opts.Every)
		}
	}()
}

// Stop stops the background trimming and waits for it.
func (r *Retention) Stop() {
	if r.cancel != nil {
		r.cancel()
	}
	r.wg.Wait()
}

// Stats says how many rounds ran and how many events they deleted.
func (r *Retention) Stats() (rounds int, deleted int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.rounds, r.deleted
}

// Apply runs one round: for each bucket the horizon is the newer of what MaxAge and MaxBytes ask for,
// and the log is trimmed to it. It returns how many events it deleted.
func (r *Retention) Apply(ctx context.Context) (int, error) {
	now := r.opts.Now().UnixNano()
	horizon := int64(math.MinInt64) // trim messages stamped at or before this
	if r.opts.MaxAge > 0 {
		horizon = now - int64(r.opts.MaxAge)
	}
	bySize := false
	if r.opts.MaxBytes > 0 {
		t, ok, err := r.sizeHorizon(now)
		if err != nil {
			return 0, err
		}
		if ok && t > horizon {
			horizon, bySize = t, true
		}
	}
	total := 0
	var errs error
	if horizon != math.MinInt64 {
		for _, b := range r.db.Buckets() {
			n, err := r.trimBucket(ctx, b, horizon)
			total += n
			errs = errors.Join(errs, err)
		}
	}
	if bySize && total > 0 {
		// Deleted events free their space only once compacted; without it the next round would find
		// the log still too big and trim again.
		if err := r.db.compact(ctx, []byte{prefixHistory}, []byte{prefixEvent + 1}, false); err != nil && ctx.Err() == nil {
			errs = errors.Join(errs, fmt.Errorf("compact the event log: %w", err))
		}
	}
	r.mu.Lock()
	r.rounds++
	r.deleted += int64(total)
	r.mu.Unlock()
	if total > 0 {
		r.log.Info("event log trimmed", "events_deleted", total, "horizon", time.Unix(0, horizon).UTC().Format(time.RFC3339), "by_size", bySize)
	}
	return total, errs
}

func (r *Retention) trimBucket(ctx context.Context, bucket string, horizon int64) (int, error) {
	seq, err := seqAtTime(r.db.pdb, bucket, horizon)
	if err != nil {
		return 0, err
	}
	if applied, _ := r.db.Applied(bucket); seq > applied {
		seq = applied
	}
	if seq == 0 {
		return 0, nil
	}
	s, ts, ok, err := eventAtOrAfter(r.db.pdb, bucket, seq)
	if err != nil {
		return 0, err
	}
	if !ok || s != seq {
		return 0, nil // at or below the floor already
	}
	return r.db.TrimHistory(ctx, bucket, seq, ts)
}

// sizeHorizon finds, when the log is bigger than MaxBytes, the time before which enough events go to
// bring it down to 80% of MaxBytes. Events are counted by sequence above each bucket's compacted floor,
// so the estimate is proportional: compaction keeps one event per live key (up to three of a
// composition: see TrimHistory), which is why the next round may trim further.
func (r *Retention) sizeHorizon(now int64) (int64, bool, error) {
	used, err := r.db.HistoryBytes()
	if err != nil {
		return 0, false, err
	}
	if used <= uint64(r.opts.MaxBytes) {
		return 0, false, nil
	}
	target := uint64(r.opts.MaxBytes) / 10 * 8
	frac := float64(used-target) / float64(used)
	type span struct {
		bucket      string
		from, to    uint64
		first, last int64
	}
	var spans []span
	var all uint64
	lo, hi := int64(math.MaxInt64), int64(math.MinInt64)
	for _, b := range r.db.Buckets() {
		marks, err := readMarks(r.db.pdb, b)
		if err != nil {
			return 0, false, err
		}
		applied, _ := r.db.Applied(b)
		if applied <= marks.Trimmed {
			continue
		}
		s, first, ok, err := eventAtOrAfter(r.db.pdb, b, marks.Trimmed+1)
		if err != nil || !ok {
			if err != nil {
				return 0, false, err
			}
			continue
		}
		_, last, _, err := eventAtOrAfter(r.db.pdb, b, applied)
		if err != nil {
			return 0, false, err
		}
		spans = append(spans, span{bucket: b, from: s, to: applied, first: first, last: last})
		all += applied - s + 1
		lo, hi = min(lo, first), max(hi, last)
	}
	if len(spans) == 0 {
		return 0, false, nil
	}
	want := uint64(frac * float64(all))
	count := func(t int64) (uint64, error) {
		var n uint64
		for _, sp := range spans {
			seq, err := seqAtTime(r.db.pdb, sp.bucket, t)
			if err != nil {
				return 0, err
			}
			if seq >= sp.from {
				n += min(seq, sp.to) - sp.from + 1
			}
		}
		return n, nil
	}
	// The earliest time whose count reaches want.
	for lo < hi {
		mid := lo + (hi-lo)/2
		n, err := count(mid)
		if err != nil {
			return 0, false, err
		}
		if n >= want {
			hi = mid
		} else {
			lo = mid + 1
		}
	}
	return min(lo, now), true, nil
}
