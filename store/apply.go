package store

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/cockroachdb/pebble/v2"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/mpk"
)

// rowValue is a row as stored, in its primary key and in every secondary index entry (they cover the
// row, so an index scan answers without a second read): flags, uvarint revision, varint created (Unix
// ns), then the value as written.
const flagMsgpack = 1

func appendRowValue(dst []byte, rev uint64, created int64, msgpack bool, value []byte) []byte {
	var f byte
	if msgpack {
		f = flagMsgpack
	}
	dst = append(dst, f)
	dst = binary.AppendUvarint(dst, rev)
	dst = binary.AppendVarint(dst, created)
	return append(dst, value...)
}

func decodeRowValue(b []byte, r *provisioner.Row) error {
	if len(b) < 1 {
		return fmt.Errorf("%w: empty row", ErrCorrupt)
	}
	r.Msgpack = b[0]&flagMsgpack != 0
	b = b[1:]
	var n int
	if r.Revision, n = binary.Uvarint(b); n <= 0 {
		return fmt.Errorf("%w: row revision", ErrCorrupt)
	}
	b = b[n:]
	if r.Created, n = binary.Varint(b); n <= 0 {
		return fmt.Errorf("%w: row time", ErrCorrupt)
	}
	r.Value = b[n:]
	return nil
}

// The event log keeps every applied message: history entries hold op, time and value. The op byte's
// top two bits hold the rollup of a message whose rollup removed other keys (none for every other
// message, so its byte is the op alone, as written before rollups were kept).
const eventRollupShift = 6

func appendEventValue(dst []byte, op provisioner.Op, rollup provisioner.Rollup, t int64, value []byte) []byte {
	dst = append(dst, byte(op)|byte(rollup)<<eventRollupShift)
	dst = binary.AppendVarint(dst, t)
	return append(dst, value...)
}

// eventOp is the op of an event value's first byte, without its rollup bits.
func eventOp(b byte) provisioner.Op { return provisioner.Op(b & (1<<eventRollupShift - 1)) }

func decodeEventValue(b []byte) (op provisioner.Op, rollup provisioner.Rollup, t int64, value []byte, err error) {
	if len(b) < 2 {
		return 0, 0, 0, nil, fmt.Errorf("%w: event", ErrCorrupt)
	}
	op = eventOp(b[0])
	rollup = provisioner.Rollup(b[0] >> eventRollupShift)
	t, n := binary.Varint(b[1:])
	if n <= 0 {
		return 0, 0, 0, nil, fmt.Errorf("%w: event time", ErrCorrupt)
	}
	return op, rollup, t, b[1+n:], nil
}

func appendAnomalyValue(dst []byte, rev uint64, text string) []byte {
	dst = binary.AppendUvarint(dst, rev)
	return append(dst, text...)
}

// applier gathers one Apply's writes: a Pebble batch, and the anomaly sets and checkpoints it changes,
// which reach the DB's memory only once the batch commits.
type applier struct {
	db    *DB
	batch *pebble.Batch
	// w holds the batch's writes until commit, which hands them to batch in key order (sorted.go).
	w   *sortedWrites
	buf []byte
	val []byte
	// anom overlays the committed anomaly sets of the buckets this batch touches: the classes each
	// key it read or changed held as committed, and holds now.
	anom map[string]map[string]anomChange
	// anomIt reads the committed anomaly rows of keys whose hash is in their bucket's set
	// (committedClasses); anomKey is its seek key.
	anomIt  *pebble.Iterator
	anomKey []byte
	// inOrder is set while a step touches many keys in key order (a rollup's removals, the kinds'
	// re-evaluation): a key whose hash is in its bucket's set is then read through anomIt, whose
	// seeks step forward from the one before, not with a Get each (anomset.go).
	inOrder bool
	// err is the first read that failed in a step that returns no error (committedClasses): the
	// batch does not commit.
	err error
	cps map[string]*Checkpoint
	// kindsChanged are registry kinds whose presence this batch changed, with their new presence.
	kindsChanged map[string]bool
	// states caches the buckets' states for the batch: DB.bucket takes a lock.
	states map[string]*bucketState
	// plans is what a batch of a plans' input bucket touches (plans.go); nil for other buckets.
	plans *planBatch
	// gaps are the open history gaps this batch opened or extended (history.go).
	gaps map[string]Gap
	// held is, of each bucket in gaps, the first sequence its open gap holds min_seq requests back
	// from (bucketState.held), as this batch leaves it.
	held map[string]uint64
	// schemaRollup says the batch writes the schema version schemaRollup (store.go).
	schemaRollup bool
	// removing is set while a rollup removes other keys (rollup): their purges share the rollup's
	// sequence, whose entry by sequence names the rollup's own key alone.
	removing bool
	// exp are the pending expiries this batch changed (expiry.go): nil for a key's forgotten.
	exp map[expKey]*Expiry
	// committed says batch committed: close keeps it for the next applier (batchCache).
	committed bool
	// unpins says the batch applies a rollup whose removals were committed before it, in parts, while
	// views read the pinned state before them: its commit lets them read the committed state again.
	unpins bool
}

func (a *applier) set(key, val []byte) { a.w.set(key, val) }
func (a *applier) delete(key []byte)   { a.w.delete(key) }

func (a *applier) state(bucket string) *bucketState {
	if b, ok := a.states[bucket]; ok {
		return b
	}
	b := a.db.bucket(bucket)
	a.states[bucket] = b
	return b
}

func (a *applier) checkpoint(bucket string) *Checkpoint {
	if cp, ok := a.cps[bucket]; ok {
		return cp
	}
	cp := a.state(bucket).cp
	a.cps[bucket] = &cp
	return &cp
}

// anomChange is the anomaly classes of a key as committed (was) and as this batch leaves them (now).
type anomChange struct{ was, now byte }

// classes is the anomaly classes a key holds as this batch leaves it so far: what the batch set, else
// none when its hash is not in the bucket's set, else what its committed anomaly rows say (anomset.go).
func (a *applier) classes(bucket, key string) byte {
	m := a.anom[bucket]
	if c, ok := m[key]; ok {
		return c.now
	}
	set := &a.state(bucket).anom
	if set.n == 0 {
		return 0
	}
	meta, ok := set.lookup(a.db.anomHash(key))
	if !ok {
		return 0
	}
	var (
		c   byte
		err error
	)
	if meta&anomUnknown == 0 && !a.inOrder {
		// One key holds the hash: this one exactly when it holds a row of that key's classes. A Get
		// reads it alone; many keys in order are cheaper read through the iterator, below.
		c = byte(meta & anomClasses)
		var held bool
		if held, err = a.hasAnomalyRow(bucket, key, c&-c); !held {
			c = 0
		}
	} else {
		c, err = a.committedClasses(bucket, key)
	}
	if err != nil {
		if a.err == nil {
			a.err = fmt.Errorf("read anomalies of %s %q: %w", bucket, key, err)
		}
		return 0
	}
	if m == nil {
		m = map[string]anomChange{}
		a.anom[bucket] = m
	}
	m[key] = anomChange{was: c, now: c}
	return c
}

// setClasses records the classes a key holds now; classes was asked first, so a key the overlay does
// not hold held none.
func (a *applier) setClasses(bucket, key string, c byte) {
	m, ok := a.anom[bucket]
	if !ok {
		m = map[string]anomChange{}
		a.anom[bucket] = m
	}
	ch := m[key]
	ch.now = c
	m[key] = ch
}

// setAnomaly writes the anomaly row of one class of a key, replacing any earlier one of that class.
func (a *applier) setAnomaly(bucket, key string, class byte, rev uint64, reason provisioner.Reason, detail string) {
	have := a.classes(bucket, key)
	if have&class == 0 {
		a.checkpoint(bucket).AnomalyRows++
		a.setClasses(bucket, key, have|class)
	}
	text := string(reason)
	if detail != "" {
		text += ": " + detail
	}
	a.buf = anomalyKey(a.buf[:0], bucket, key, class)
	a.val = appendAnomalyValue(a.val[:0], rev, text)
	a.set(a.buf, a.val)
}

// clearAnomaly removes the anomaly rows of the given classes of a key, when it has them.
func (a *applier) clearAnomaly(bucket, key string, classes byte) {
	have := a.classes(bucket, key)
	if have&classes == 0 {
		return
	}
	for _, c := range []byte{classShape, classValue, classKind} {
		if have&classes&c == 0 {
			continue
		}
		a.buf = anomalyKey(a.buf[:0], bucket, key, c)
		a.delete(a.buf)
		a.checkpoint(bucket).AnomalyRows--
	}
	a.setClasses(bucket, key, have&^classes)
}

// Apply applies messages of one bucket's stream in order, with the bucket's new checkpoint, in one
// Pebble batch: rows, index entries, anomaly rows, event log and checkpoint commit together or not at
// all. Messages at or below the applied sequence are skipped, so a repeated delivery changes nothing.
// With sync the batch is synced to disk before Apply returns; without, it may stay in Pebble's WAL
// buffer until the next synced commit, so a crash can lose it (the projector syncs each batch that
// reaches the stream's end) — the checkpoint never runs ahead of the rows either way, because both are
// in the same batch, and what is lost is read again from the stream. A store without a log
// (Options.NoWAL) syncs nothing: its batches are durable once their memtable is flushed, at Close at
// the latest, and a crash keeps the batches of the memtables flushed before it; but a first fill's
// (Options.FirstFillNoWAL), which answers, returns a batch with sync once a flush of its memtables has
// made it durable (flushgroup.go). A message whose rollup removed
// other keys from the stream (provisioner.Message.RemovesOthers) removes them from the projection
// too, and is committed in a batch that starts with it.
func (db *DB) Apply(bucket string, msgs []provisioner.Message, streamCreated int64, sync bool) error {
	if err := db.applyAll(bucket, msgs, streamCreated, sync); err != nil || !sync || !db.syncByFlush {
		return err
	}
	// A first fill's store without a log: the batch is durable once a flush that began after its
	// commit has ended, which the projector waits for before it says the bucket synced (flushgroup.go).
	return db.flushGroup()
}

// applyAll is Apply but for a first fill's flush.
func (db *DB) applyAll(bucket string, msgs []provisioner.Message, streamCreated int64, sync bool) error {
	if db.closed.Load() {
		return ErrClosed
	}
	shape, ok := provisioner.ShapeOf(bucket)
	if !ok {
		return fmt.Errorf("store: no shape for bucket %q", bucket)
	}
	if err := db.writeFailed.failed(); err != nil {
		return err
	}
	// While a write waits for room, the batch committing holds applyMu until there is: refused at
	// once instead, so the bucket's projector says it is behind and backs off (space.go).
	if db.space.held.Load() > 0 {
		return db.checkRoom()
	}
	db.applyMu.Lock()
	defer db.applyMu.Unlock()
	if db.closed.Load() {
		return ErrClosed
	}
	if err := db.checkRoom(); err != nil {
		return err
	}
	db.applying.Store(&bucket)
	defer db.applying.Store(nil)
	// A message whose rollup removed other keys starts a batch of its own: the keys it removes are
	// found in what is committed, so what came before it in msgs is committed first. An empty msgs is
	// one batch too (it commits the checkpoint, with streamCreated).
	for {
		n := len(msgs)
		for i := 1; i < len(msgs); i++ {
			if msgs[i].RemovesOthers() {
				n = i
				break
			}
		}
		if err := db.applyLocked(shape, msgs[:n], streamCreated, sync && n == len(msgs)); err != nil {
			return err
		}
		if msgs = msgs[n:]; len(msgs) == 0 {
			return nil
		}
	}
}

// rollupPart is how many keys a batch removes for a rollup that removes other keys (removeInParts).
var rollupPart = 10000

// rollupPartDone, when set (tests), is told each part removeInParts committed; an error stops it there,
// as a seat stopped between two parts.
var rollupPartDone func(n int) error

// rollupPartRead, when set (tests), is told how many points (keys, and tombstones of keys removed
// already) each part's scan of the rows read.
var rollupPartRead func(points uint64)

// rollupPartOddRead, when set (tests), is told how many points each part's scan of the anomaly rows,
// for the out-of-shape keys, read.
var rollupPartOddRead func(points uint64)

// removeInParts removes the keys a rollup removed from the stream (applier.rollup) in batches of
// rollupPart keys, committed before the batch that applies the rollup message itself: a rollup of a
// whole bucket of a million keys (any node's user can send one, docs/accounts.md) built one batch of
// a million purges, about 1 GiB of memory. The checkpoint moves only with the message's own batch;
// the first part's batch marks the rollup unfinished (rollupmark.go), so a store opened after a stop
// in between finishes it before anything reads it. Meanwhile views read the state before the first
// part (pin.go).
func (db *DB) removeInParts(shape provisioner.Shape, m *provisioner.Message, streamCreated int64) error {
	for from := ""; ; {
		a := db.newApplier()
		last, n, err := a.rollup(shape, m, from, rollupPart)
		if err == nil && n > 0 {
			if from == "" {
				a.set(rollupMarkerKey(shape.Bucket), appendRollupMarker(nil, m, streamCreated))
			}
			err = a.finish(shape.Bucket, nil, false, false)
		}
		a.close()
		if err == nil && n > 0 && rollupPartDone != nil {
			err = rollupPartDone(n)
		}
		if err != nil {
			return fmt.Errorf("apply %s seq %d: rollup: %w", shape.Bucket, m.Seq, err)
		}
		if n < rollupPart {
			return nil
		}
		from = last
	}
}

// newApplier starts a batch: the one the last applier committed, reset (batchCache), else one of
// Pebble's pool; letting them keep buffers of a catch-up batch's size saves growing a new one for
// every batch.
func (db *DB) newApplier() *applier {
	return &applier{db: db, batch: db.batches.take(db.pdb), w: db.writes.take(), anom: map[string]map[string]anomChange{}, cps: map[string]*Checkpoint{}, states: map[string]*bucketState{}}
}

func (a *applier) close() {
	if a.anomIt != nil {
		a.anomIt.Close()
	}
	a.db.batches.give(a.batch, a.committed)
	a.db.writes.give(a.w)
}

// batchCache keeps the Pebble batch of the last applier that committed, reset, for the next one
// (appliers are serialised under applyMu, as writesCache's are). Closed, a batch went back to Pebble's
// pool, a sync.Pool, which keeps it in the slot of the P that closed it: the next applier, on the
// other P as often as not, found none, and its batch started at Pebble's 1 KiB and grew to a
// catch-up batch's 3 MB by doubling, each step allocated afresh and the batch copied into it (the
// ingest child at 1,000,000 keys: Batch.grow 1.7% of its CPU, and most of its garbage;
// docs/performance.md, session 19).
type batchCache struct{ b *pebble.Batch }

func (c *batchCache) take(pdb *pebble.DB) *pebble.Batch {
	if b := c.b; b != nil {
		c.b = nil
		return b
	}
	return pdb.NewBatch(pebble.WithMaxRetainedSizeBytes(16 << 20))
}

// give keeps a committed batch, reset: Reset drops a buffer past the 16 MiB the batch retains, and
// one the commit pipeline may still read, as Close does. A batch that did not commit is closed.
func (c *batchCache) give(b *pebble.Batch, committed bool) {
	if !committed || c.b != nil {
		b.Close()
		return
	}
	b.Reset()
	c.b = b
}

// applyLocked is Apply of msgs in one Pebble batch, under applyMu.
func (db *DB) applyLocked(shape provisioner.Shape, msgs []provisioner.Message, streamCreated int64, sync bool) error {
	bucket := shape.Bucket
	pinned := false
	if len(msgs) > 0 && msgs[0].RemovesOthers() && msgs[0].Seq > db.known(bucket).cp.Applied {
		// Answers read the state before the removals until this batch commits (pin.go).
		db.pinViews()
		defer db.unpinViews() // when the parts or this batch fail: answers read what is committed
		pinned = true
		if err := db.removeInParts(shape, &msgs[0], streamCreated); err != nil {
			return err
		}
	}
	a := db.newApplier()
	defer a.close()
	a.unpins = pinned
	if pinned {
		// The rollup is done with this batch (rollupmark.go).
		a.delete(rollupMarkerKey(bucket))
	}
	cp := a.checkpoint(bucket)
	if streamCreated != 0 {
		cp.StreamCreated = streamCreated
	}
	moved := false
	for i := range msgs {
		m := &msgs[i]
		if m.Seq <= cp.Applied {
			continue
		}
		if m.Seq > cp.Applied+1 {
			// Messages were removed from the stream before they were read: the log has a gap.
			a.gap(bucket, cp.Applied+1, m.Seq)
		}
		if m.Rollup == provisioner.RollupAll {
			// The server removed every earlier message of the stream as it stored this one, so the
			// state as of it is this message's alone, whatever was removed unread before it.
			a.closeGap(bucket, m.Seq)
		}
		if m.Foreign && !m.RemovesOthers() {
			// No key of the bucket: nothing to project or to log, and no gap either. A rollup of the
			// whole stream on it is one of the whole bucket (foreign.go).
			cp.Applied = m.Seq
			moved = true
			continue
		}
		if m.RemovesOthers() && !(i == 0 && pinned) {
			// Apply starts a batch with each such message, so removeInParts removed the others
			// already; a scan again from the first row would step over every key it removed.
			if _, _, err := a.rollup(shape, m, "", 0); err != nil {
				return fmt.Errorf("apply %s seq %d: rollup: %w", bucket, m.Seq, err)
			}
		}
		if err := a.apply(shape, m); err != nil {
			return fmt.Errorf("apply %s seq %d: %w", bucket, m.Seq, err)
		}
		cp.Applied = m.Seq
		moved = true
	}
	return a.finish(bucket, cp, sync, moved)
}

// finish commits the batch and makes memory follow it; with moved, the bucket's applied sequence moves
// to cp's and its waiters are woken.
func (a *applier) finish(bucket string, cp *Checkpoint, sync, moved bool) error {
	db := a.db
	if len(a.kindsChanged) > 0 {
		if err := a.reevaluateKinds(); err != nil {
			return fmt.Errorf("re-evaluate kinds: %w", err)
		}
	}
	if a.plans != nil {
		if err := a.recomputePlans(); err != nil {
			return fmt.Errorf("recompute plans: %w", err)
		}
	}
	if a.err != nil {
		return a.err
	}
	for name, c := range a.cps {
		a.set(checkpointKey(name), c.encode(nil))
	}
	nodeAnom := a.writeNodeAnom(a.nodeAnomDeltas())
	composedAnom := a.writeComposedAnom(a.composedAnomDelta())
	if err := a.w.writeTo(a.batch); err != nil {
		return err
	}
	opt := pebble.NoSync
	if sync {
		opt = pebble.Sync
	}
	if err := db.commit(a.batch, opt); err != nil {
		return fmt.Errorf("commit %s: %w", bucket, err)
	}
	a.committed = true
	if db.syncByFlush && !sync {
		// A synced bucket's answers show this batch only once it is flushed (pin.go, the durable
		// state): one is started, which the batch does not wait for.
		if db.readsDurable(db.lookup(bucket)) {
			db.durableSoon()
		} else {
			for name := range a.cps {
				if db.readsDurable(db.lookup(name)) {
					db.durableSoon()
					break
				}
			}
		}
	}
	if a.unpins {
		// Before the applied sequence moves: whoever it wakes reads the state after the rollup.
		db.unpinViews()
	}

	// The batch is durable in Pebble: now memory follows.
	if a.schemaRollup {
		db.schema.Store(schemaRollup)
	}
	db.composedAnom = composedAnom
	a.commitExpiries()
	for name, c := range a.cps {
		b := db.known(name)
		b.cp = *c
		b.anomRows.Store(c.AnomalyRows)
	}
	for name, nodes := range nodeAnom {
		b := db.known(name)
		for node, n := range nodes {
			if n <= 0 {
				delete(b.nodeAnom, node)
			} else {
				b.nodeAnom[node] = n
			}
		}
	}
	for name, m := range a.anom {
		b := db.known(name)
		for k, c := range m {
			switch {
			case c.was == c.now:
			case c.was == 0:
				b.anom.add(db.anomHash(k), c.now)
			case c.now == 0:
				b.anom.remove(db.anomHash(k))
			default:
				b.anom.update(db.anomHash(k), c.now)
			}
		}
	}
	// Before the applied sequence moves (below): a reader of Reach loads the sequence first.
	for name, g := range a.gaps {
		if g.Open() {
			db.openGaps[name] = g
			db.known(name).held.Store(a.held[name])
		} else {
			delete(db.openGaps, name)
			db.known(name).held.Store(0)
			db.known(name).closeAt = 0
		}
	}
	for k, present := range a.kindsChanged {
		if present {
			db.kinds[k] = struct{}{}
		} else {
			delete(db.kinds, k)
		}
	}
	for name := range a.gaps {
		db.known(name).heldUntil = 0 // a jump since: what removed it may be past that end
	}
	if moved {
		b := db.bucket(bucket)
		b.seq.Store(cp.Applied)
		if b.heldUntil != 0 && cp.Applied >= b.heldUntil {
			// After the sequence: a reader of Reach loads the sequence first.
			b.held.Store(0)
			b.heldUntil = 0
		}
		b.wake()
	}
	return nil
}

// kindAnswered reports whether the registry, as this batch leaves it, answers a kind.
func (a *applier) kindAnswered(kind string) bool {
	if present, ok := a.kindsChanged[kind]; ok {
		return present
	}
	_, ok := a.db.kinds[kind]
	return ok
}

func (a *applier) apply(shape provisioner.Shape, m *provisioner.Message) error {
	bucket := shape.Bucket
	// The event log first: every message, whatever its key (a foreign rollup's under its log form).
	key, op := logForm(m)
	a.buf = historyKey(a.buf[:0], bucket, key, m.Seq)
	var rollup provisioner.Rollup
	if m.RemovesOthers() || m.Rollup != provisioner.RollupNone && m.Op != provisioner.OpPurge && provisioner.IsComposedBucket(bucket) {
		// A composed-<node> put or delete that rolled its own key up forgets its build's last plan
		// kept (BuildRecord.Fold): the log keeps the rollup so that a fold of it does too.
		rollup = m.Rollup
		if a.db.schema.Load() < schemaRollup && !a.schemaRollup {
			// The first rollup the log keeps: the state dir is now one older binaries misread.
			a.schemaRollup = true
			a.set(metaKey("schema"), []byte(strconv.Itoa(schemaRollup)))
		}
	}
	a.val = appendEventValue(a.val[:0], op, rollup, m.Time, m.Value)
	a.set(a.buf, a.val)
	if !a.removing { // the sequence's own entry names the rollup's key, written once, after its removals
		a.buf = eventKey(a.buf[:0], bucket, m.Seq)
		a.set(a.buf, []byte(key))
	}
	if m.Foreign {
		return nil // no key of the bucket: its rollup removed them all (applier.rollup)
	}
	a.noteExpiry(bucket, m)

	parts, perr := provisioner.ParseKey(shape, m.Key)
	if perr != nil {
		var ke *provisioner.KeyError
		if !errors.As(perr, &ke) {
			return perr
		}
		if m.Op == provisioner.OpPut {
			a.setAnomaly(bucket, m.Key, classShape, m.Seq, ke.Reason, ke.Detail)
		} else {
			a.clearAnomaly(bucket, m.Key, classShape)
		}
		return nil
	}

	var idxBuf [2]provisioner.IndexValue
	idx := provisioner.Indexes(idxBuf[:0], bucket, parts)
	if m.Op != provisioner.OpPut {
		a.buf = rowKey(a.buf[:0], bucket, m.Key)
		a.delete(a.buf)
		for _, iv := range idx {
			a.buf = indexKey(a.buf[:0], bucket, iv.Index, iv.Value, m.Key)
			a.delete(a.buf)
		}
		if bucket == provisioner.BucketRegistry {
			a.registryKind(parts.Kind, false)
		}
		a.clearAnomaly(bucket, m.Key, classShape|classValue|classKind)
		if provisioner.IsPlanInput(bucket) {
			return a.planMessage(bucket, &parts, m, false)
		}
		return nil
	}

	valid := mpk.Valid(m.Value)
	a.val = appendRowValue(a.val[:0], m.Seq, m.Time, valid, m.Value)
	a.buf = rowKey(a.buf[:0], bucket, m.Key)
	a.set(a.buf, a.val)
	for _, iv := range idx {
		a.buf = indexKey(a.buf[:0], bucket, iv.Index, iv.Value, m.Key)
		a.set(a.buf, a.val)
	}
	a.clearAnomaly(bucket, m.Key, classShape)
	if valid {
		a.clearAnomaly(bucket, m.Key, classValue)
	} else {
		a.setAnomaly(bucket, m.Key, classValue, m.Seq, provisioner.ReasonValueNotMsgpack, fmt.Sprintf("%d bytes are not one complete MessagePack object", len(m.Value)))
	}
	if provisioner.IsPlanInput(bucket) {
		return a.planMessage(bucket, &parts, m, valid)
	}
	switch bucket {
	case provisioner.BucketRegistry:
		a.registryKind(parts.Kind, true)
	case provisioner.BucketNeeds:
		if a.kindAnswered(parts.Kind) {
			a.clearAnomaly(bucket, m.Key, classKind)
		} else {
			a.setAnomaly(bucket, m.Key, classKind, m.Seq, provisioner.ReasonUnansweredKind, unansweredDetail(parts.Kind))
		}
	}
	return nil
}

// rollup removes the keys other than its own whose earlier messages a message's rollup removed from
// the stream (provisioner.Message.RemovesOthers): each is applied as a purge at the message's
// sequence, so its row, index entries, anomalies and derived state go as a purge's do, and the event
// log holds the purge under the key (the sequence's own entry stays the message's key). The keys it
// can remove are in the committed state (the message starts its batch): rows after from, in key
// order, then out-of-shape keys' anomalies. With limit > 0 it removes at most limit keys
// (removeInParts) and returns the last row key it removed and how many it removed.
func (a *applier) rollup(shape provisioner.Shape, m *provisioner.Message, from string, limit int) (string, int, error) {
	bucket := shape.Bucket
	// Rows: those under the pattern's literal tokens (all of them for a rollup of the stream).
	prefix := rollupPrefix(m)
	match := func(key string) bool {
		// A foreign rollup's subject is no key: a key of the same text is removed too.
		return (m.Foreign || key != m.Key) && (m.Rollup == provisioner.RollupAll || provisioner.RollupMatches(m.Key, key))
	}
	full := func(keys []string) bool { return limit > 0 && len(keys) >= limit }
	// Rows, in key order after from, then out-of-shape keys (no row, only their anomaly rows of class
	// key shape), in key order after from too, and up to the last row taken when the rows filled the
	// part: one after another, each part reads the anomaly rows of its own range of keys once.
	rows, rowsRead, err := a.rollupScan(bucket, prefixRow, prefix, from, "", limit, match, nil)
	if err != nil {
		return "", 0, err
	}
	upTo := ""
	if full(rows) {
		upTo = rows[len(rows)-1]
	}
	shapeOnly := func(k []byte) bool { return k[len(k)-1] == classShape }
	odd, oddRead, err := a.rollupScan(bucket, prefixAnomaly, prefix, from, upTo, limit, match, shapeOnly)
	if err != nil {
		return "", 0, err
	}
	if rollupPartRead != nil {
		rollupPartRead(rowsRead)
	}
	if rollupPartOddRead != nil {
		rollupPartOddRead(oddRead)
	}
	keys := append(rows, odd...)
	if provisioner.IsComposedBucket(bucket) {
		// A composed key whose last message is a delete has no row and no anomaly, and its build
		// record still keeps its last published revision (BuildRecord.Fold); the rollup removed that
		// revision from the stream, so it is forgotten as a purge forgets it, as a rebuild finds it.
		deleted, err := a.rollupDeletedScan(bucket, prefix, from, upTo, limit, match)
		if err != nil {
			return "", 0, err
		}
		keys = append(keys, deleted...)
	}
	sort.Strings(keys)
	keys = slices.Compact(keys)
	if limit > 0 && len(keys) > limit {
		keys = keys[:limit]
	}
	last := from
	if len(keys) > 0 {
		last = keys[len(keys)-1]
	}
	a.removing, a.inOrder = true, true
	defer func() { a.removing, a.inOrder = false, false }()
	for _, key := range keys {
		if err := a.apply(shape, &provisioner.Message{Seq: m.Seq, Time: m.Time, Key: key, Op: provisioner.OpPurge}); err != nil {
			return "", 0, fmt.Errorf("%s: %w", key, err)
		}
	}
	return last, len(keys), nil
}

// rollupScan lists, in key order, at most limit (0: any number) raw keys of a bucket's rows
// (prefixRow) or anomaly rows (prefixAnomaly, each key once; with keep, of the rows keep takes) that
// start with prefix, come after from and, with upTo, not after it, and match; and how many points the
// scan read. It reads the committed state: a rollup starts its batch.
func (a *applier) rollupScan(bucket string, p byte, prefix, from, upTo string, limit int, match func(string) bool, keep func(storeKey []byte) bool) ([]string, uint64, error) {
	lo := appendEsc(bucketPrefix(nil, p, bucket), prefix)
	it, err := a.db.pdb.NewIter(&pebble.IterOptions{LowerBound: lo, UpperBound: prefixEnd(lo)})
	if err != nil {
		return nil, 0, err
	}
	base := len(bucketPrefix(nil, p, bucket))
	// A later part seeks to where the part before it ended: First would step over every key the parts
	// before removed (tombstones until compacted), each part more than the last.
	var valid bool
	if from != "" {
		valid = it.SeekGE(appendEsc(bucketPrefix(nil, p, bucket), from))
	} else {
		valid = it.First()
	}
	var keys []string
	for ; valid && (limit <= 0 || len(keys) < limit); valid = it.Next() {
		k := it.Key()
		esc := k[base:]
		if p == prefixAnomaly {
			_, e, _, ok := cutAnomalyKey(k)
			if !ok {
				it.Close()
				return nil, 0, fmt.Errorf("%w: anomaly key %q", ErrCorrupt, k)
			}
			esc = e
		}
		key := string(unesc(nil, esc))
		if upTo != "" && key > upTo {
			break
		}
		if key == from || keep != nil && !keep(k) || len(keys) > 0 && keys[len(keys)-1] == key || !match(key) {
			continue
		}
		keys = append(keys, key)
	}
	read := it.Stats().InternalStats.PointCount
	if err := it.Close(); err != nil {
		return nil, 0, err
	}
	return keys, read, nil
}

// rollupPrefix is what every key a rollup that removed other keys can remove starts with: the literal
// tokens of its subject before the first wildcard, each with its dot; "" for a rollup of the stream.
func rollupPrefix(m *provisioner.Message) string {
	var prefix string
	if m.Rollup == provisioner.RollupSub {
		for tok := range strings.SplitSeq(m.Key, ".") {
			if tok == "*" || tok == ">" {
				break
			}
			prefix += tok + "."
		}
	}
	return prefix
}

// rollupDeletedScan lists, in key order, at most limit (0: any number) raw keys of a bucket's event
// log whose newest event is a delete, that start with prefix, come after from and, with upTo, not
// after it, and match: the keys a rollup removes that have neither a row nor an anomaly row.
func (a *applier) rollupDeletedScan(bucket, prefix, from, upTo string, limit int, match func(string) bool) ([]string, error) {
	base := bucketPrefix(nil, prefixHistory, bucket)
	lo := appendEsc(append([]byte(nil), base...), prefix)
	it, err := a.db.pdb.NewIter(&pebble.IterOptions{LowerBound: lo, UpperBound: prefixEnd(lo)})
	if err != nil {
		return nil, err
	}
	var keys []string
	var valid bool
	if from != "" {
		valid = it.SeekGE(prefixEnd(appendComp(append([]byte(nil), base...), from)))
	} else {
		valid = it.First()
	}
	for valid && (limit <= 0 || len(keys) < limit) {
		k := it.Key()
		if len(k) < len(base)+10 {
			it.Close()
			return nil, fmt.Errorf("%w: history key %q", ErrCorrupt, k)
		}
		comp := append([]byte(nil), k[:len(k)-8]...) // the key's prefix: base, escaped key, terminator
		key := string(unesc(nil, comp[len(base):len(comp)-2]))
		if upTo != "" && key > upTo {
			break
		}
		end := prefixEnd(comp)
		// The key's newest event: the last one under its prefix.
		if !it.SeekLT(end) {
			break
		}
		if key != from && match(key) && len(it.Value()) > 0 && eventOp(it.Value()[0]) == provisioner.OpDelete {
			keys = append(keys, key)
		}
		valid = it.SeekGE(end)
	}
	if err := it.Close(); err != nil {
		return nil, err
	}
	return keys, nil
}

func (a *applier) registryKind(kind string, present bool) {
	if a.kindAnswered(kind) == present {
		return
	}
	if a.kindsChanged == nil {
		a.kindsChanged = map[string]bool{}
	}
	a.kindsChanged[kind] = present
}

// reevaluateKinds raises or clears unanswered-kind on every need of each kind whose presence in the
// registry this batch changed: one scan of the needs' kind index per changed kind.
func (a *applier) reevaluateKinds() error {
	a.inOrder = true
	defer func() { a.inOrder = false }()
	for kind, present := range a.kindsChanged {
		if _, before := a.db.kinds[kind]; before == present {
			continue // changed and changed back within the batch
		}
		lo := indexPrefix(nil, provisioner.BucketNeeds, provisioner.IndexKind, kind)
		it, err := a.db.pdb.NewIter(&pebble.IterOptions{LowerBound: lo, UpperBound: prefixEnd(lo)})
		if err != nil {
			return err
		}
		var row provisioner.Row
		for it.First(); it.Valid(); it.Next() {
			key := string(unesc(nil, it.Key()[len(lo):]))
			if present {
				a.clearAnomaly(provisioner.BucketNeeds, key, classKind)
				continue
			}
			if err := decodeRowValue(it.Value(), &row); err != nil {
				it.Close()
				return err
			}
			a.setAnomaly(provisioner.BucketNeeds, key, classKind, row.Revision, provisioner.ReasonUnansweredKind, unansweredDetail(kind))
		}
		if err := it.Close(); err != nil {
			return err
		}
	}
	return nil
}

func unansweredDetail(kind string) string {
	return "no registry entry answers kind " + strconv.Quote(kind)
}
