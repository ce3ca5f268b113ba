package store

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"sync"

	"github.com/cockroachdb/pebble/v2"

	provisioner "github.com/novox/mesh-provisioner"
)

// Forgetting a composed-<node> bucket whose stream was deleted (doc.go, "Forgetting a bucket").
//
// A deleted composed-<node> bucket no longer holds the node's history, so a seat started after the
// delete has nothing of it: no rows, no anomalies, no build records, and the node's plan rows computed
// from no compositions. Forget brings a seat that did read the bucket to that same state, in place and
// in one Pebble batch, without touching any other bucket's rows or event log. The event log of the
// bucket goes with it, so plans as of a time before the forgetting can no longer be folded again; the
// forgotten mark (0x09 <bucket> 00 01 'd' -> varint Unix ns) says from when they can, and the plans'
// at path refuses earlier times with a 410 (ForgottenAt, Forgotten).

// forgottenTag is the history mark of a forgotten bucket: when its history was forgotten.
const forgottenTag = 'd'

func forgottenKey(dst []byte, bucket string) []byte {
	return append(bucketPrefix(dst, prefixMarks, bucket), forgottenTag)
}

// historyLock is one bucket's lock of lockHistory, with how many hold it or wait for it.
type historyLock struct {
	sync.Mutex
	refs int // under DB.histMu
}

// lockHistory serialises the whole-bucket changes of one bucket's event log: a trim walking it
// (TrimHistory) and Forget deleting it. Without it a trim that began before the forgetting could
// write its floor back after it. The lock lives only while someone holds it or waits for it: the
// last unlock drops it, so a seat that reads and forgets thousands of composed-<node> buckets over
// months does not keep a mutex for each bucket it ever saw.
func (db *DB) lockHistory(bucket string) (unlock func()) {
	db.histMu.Lock()
	l := db.histLocks[bucket]
	if l == nil {
		l = &historyLock{}
		if db.histLocks == nil {
			db.histLocks = map[string]*historyLock{}
		}
		db.histLocks[bucket] = l
	}
	l.refs++
	db.histMu.Unlock()
	l.Lock()
	return func() {
		l.Unlock()
		db.histMu.Lock()
		if l.refs--; l.refs == 0 {
			delete(db.histLocks, bucket)
		}
		db.histMu.Unlock()
	}
}

// Forget removes everything the store holds of a composed-<node> bucket, in one synced Pebble batch:
// its rows, index entries, anomaly rows, event log (by key and by sequence), checkpoint and history
// marks, and the node's build records; it recomputes the node's plan rows as they are with no build
// records, which is what a store that never read the bucket holds, and records at (Unix ns) as the
// time the bucket's history was forgotten (the later one, when it was forgotten before). A crash
// before the commit leaves the bucket as it was; after it, nothing of it. Other buckets are not
// touched. The bucket is then unknown to the store (Buckets does not list it): a stream of the same
// name created later is read from its first message.
//
// Nothing may be applying to the bucket meanwhile: its projector stops first.
func (db *DB) Forget(bucket string, at int64) error { return db.forget(bucket, at, nil) }

// ForgetFrom forgets a composed-<node> bucket as Forget does, and in the same batch sets its checkpoint
// to resume: the bucket is then known again, at resume.Applied of a stream created at
// resume.StreamCreated, and its projector reads that stream on from resume.Applied + 1 with nothing
// before it in the log. It is for a bucket whose stream cannot be resumed (recreated, or purged
// before it was read) but still exists: resume.Applied is the stream's first sequence - 1, so the
// messages the stream removed before at are not a gap of the new log but part of what was
// forgotten, and plans as of at or later are folded from the log alone.
func (db *DB) ForgetFrom(bucket string, at int64, resume Checkpoint) error {
	resume.AnomalyRows = 0
	return db.forget(bucket, at, &resume)
}

func (db *DB) forget(bucket string, at int64, resume *Checkpoint) error {
	if db.closed.Load() {
		return ErrClosed
	}
	if !provisioner.IsComposedBucket(bucket) {
		return fmt.Errorf("store: forget %s: only a composed-<node> bucket is forgotten", bucket)
	}
	node, _ := provisioner.ComposedNode(bucket)
	defer db.lockHistory(bucket)()
	db.applyMu.Lock()
	defer db.applyMu.Unlock()
	if db.closed.Load() {
		return ErrClosed
	}
	a := db.newApplier()
	defer a.close()

	// The ranges first: the point writes below (the forgotten mark, inside the marks' range, and the
	// plan rows) come later in the batch, so they win over them.
	var ranges [][2][]byte
	for _, p := range []byte{prefixRow, prefixIndex, prefixAnomaly, prefixNodeAnom, prefixHistory, prefixEvent, prefixMarks, prefixExpiry} {
		lo := bucketPrefix(nil, p, bucket)
		ranges = append(ranges, [2][]byte{lo, prefixEnd(lo)})
	}
	builds := appendComp([]byte{prefixPlan, planBuildTag}, node)
	ranges = append(ranges, [2][]byte{builds, prefixEnd(builds)})
	for _, r := range ranges {
		if err := a.batch.DeleteRange(r[0], r[1], nil); err != nil {
			return fmt.Errorf("forget %s: %w", bucket, err)
		}
	}
	// The checkpoint key is the bucket's name unterminated, a prefix of longer names' keys: only it.
	if err := a.batch.Delete(checkpointKey(bucket), nil); err != nil {
		return fmt.Errorf("forget %s: %w", bucket, err)
	}
	if err := a.batch.Delete(rollupMarkerKey(bucket), nil); err != nil {
		return fmt.Errorf("forget %s: %w", bucket, err)
	}
	if resume != nil {
		if err := a.batch.Set(checkpointKey(bucket), resume.encode(nil), nil); err != nil {
			return fmt.Errorf("forget %s: %w", bucket, err)
		}
	}
	at, err := laterForgotten(db.pdb, bucket, at)
	if err != nil {
		return fmt.Errorf("forget %s: %w", bucket, err)
	}
	a.set(forgottenKey(nil, bucket), binary.AppendVarint(nil, at))
	// Its anomaly rows leave the sum of every composed-<node> bucket's (nodeanom.go).
	var forgot int64
	db.mu.Lock()
	if b, ok := db.buckets[bucket]; ok {
		forgot = b.cp.AnomalyRows
	}
	db.mu.Unlock()
	composedAnom := a.writeComposedAnom(-forgot)

	// The node's plan rows, whole, with no build records: the host rows and newest builds are as
	// committed, so each row is what a store that never read the bucket computed.
	a.plans = &planBatch{rows: map[[2]string]bool{}, modules: map[string]struct{}{}, hosts: map[string]hostState{},
		newest: map[string]provisioner.OptBuild{}, builds: map[[2]string]map[uint64]*provisioner.BuildRecord{}}
	a.plans.comps.a = a
	a.plans.comps.none = true
	lo := planRowKey(nil, node+".")
	it, err := db.pdb.NewIter(&pebble.IterOptions{LowerBound: lo, UpperBound: prefixEnd(lo)})
	if err != nil {
		return fmt.Errorf("forget %s: %w", bucket, err)
	}
	base := len(planRowPrefix(nil))
	for it.First(); it.Valid(); it.Next() {
		key := string(unesc(nil, it.Key()[base:]))
		_, module, _ := strings.Cut(key, ".")
		a.plans.rows[[2]string{node, module}] = true
	}
	if err := it.Close(); err != nil {
		return fmt.Errorf("forget %s: %w", bucket, err)
	}
	for nm := range a.plans.rows {
		if err := a.recomputePlan(nm[0], nm[1], true); err != nil {
			return fmt.Errorf("forget %s: plan %s.%s: %w", bucket, nm[0], nm[1], err)
		}
	}
	if err := a.w.writeTo(a.batch); err != nil {
		return err
	}
	// A reader reads Applied, then opens its view: the position it reads must never be the old one,
	// synced, once the view can hold the forgotten state (an answer synced at the old as_of with the
	// bucket's plans gone). Positions otherwise only move forward, after their commit; this one goes
	// back, so the bucket is unsynced before the commit, until its projector catches up again.
	db.mu.Lock()
	if b, ok := db.buckets[bucket]; ok {
		b.synced.Store(false)
	}
	db.mu.Unlock()
	if err := db.commit(a.batch, pebble.Sync); err != nil {
		return fmt.Errorf("forget %s: commit: %w", bucket, err)
	}
	a.committed = true
	// The bucket is not synced, but plans answers of synced inputs read the durable state (pin.go).
	db.durableSoon()

	// Committed: memory follows. Whoever waits on the bucket wakes and finds it unknown.
	db.composedAnom = composedAnom
	delete(db.openGaps, bucket)
	db.exp.dropBucket(bucket)
	db.mu.Lock()
	if b, ok := db.buckets[bucket]; ok {
		delete(db.buckets, bucket)
		if !db.closed.Load() {
			b.wake()
		}
	}
	db.mu.Unlock()
	if resume != nil {
		b := db.known(bucket) // a new state: not synced until its projector catches up again
		b.setCheckpoint(*resume)
	}
	return nil
}

// SetForgottenAt records that a composed-<node> bucket's history was forgotten at (Unix ns), as Forget
// does, without touching anything else: a store loaded from an archive carries the marks of the log
// it was written from.
func (db *DB) SetForgottenAt(bucket string, at int64) error {
	if db.closed.Load() {
		return ErrClosed
	}
	if !provisioner.IsComposedBucket(bucket) {
		return fmt.Errorf("store: forgotten mark of %s: only a composed-<node> bucket is forgotten", bucket)
	}
	db.applyMu.Lock()
	defer db.applyMu.Unlock()
	at, err := laterForgotten(db.pdb, bucket, at)
	if err != nil {
		return fmt.Errorf("forgotten mark of %s: %w", bucket, err)
	}
	if err := db.set(forgottenKey(nil, bucket), binary.AppendVarint(nil, at), pebble.NoSync); err != nil {
		return fmt.Errorf("forgotten mark of %s: %w", bucket, err)
	}
	return nil
}

// forgottenAt reads when a bucket's history was forgotten, from any Pebble reader.
func forgottenAt(r pebble.Reader, bucket string) (int64, bool, error) {
	v, closer, err := r.Get(forgottenKey(nil, bucket))
	if errors.Is(err, pebble.ErrNotFound) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, err
	}
	defer closer.Close()
	at, n := binary.Varint(v)
	if n <= 0 {
		return 0, false, fmt.Errorf("%w: forgotten mark of %s", ErrCorrupt, bucket)
	}
	return at, true, nil
}

// laterForgotten returns the later of at and the forgotten mark r holds for bucket, if any: the mark
// only moves forward, so a time before it would let plans at be folded where they cannot be.
func laterForgotten(r pebble.Reader, bucket string, at int64) (int64, error) {
	prev, found, err := forgottenAt(r, bucket)
	if err != nil {
		return 0, err
	}
	if found && prev > at {
		return prev, nil
	}
	return at, nil
}

// ForgottenAt returns when a bucket's history was last forgotten (Unix ns), as this view sees it, and
// whether it ever was.
func (v *View) ForgottenAt(bucket string) (int64, bool, error) { return forgottenAt(v.snap, bucket) }

// Forgotten calls fn for every bucket whose history was forgotten, with when (the latest time), in
// byte order of their names.
func (v *View) Forgotten(fn func(bucket string, at int64)) error {
	it, err := v.snap.NewIter(&pebble.IterOptions{LowerBound: []byte{prefixMarks}, UpperBound: []byte{prefixMarks + 1}})
	if err != nil {
		return err
	}
	for it.First(); it.Valid(); it.Next() {
		rest := it.Key()[1:]
		i := termIndex(rest)
		if i < 0 || len(rest) != i+3 || rest[i+2] != forgottenTag {
			continue
		}
		at, n := binary.Varint(it.Value())
		if n <= 0 {
			it.Close()
			return fmt.Errorf("%w: forgotten mark %q", ErrCorrupt, it.Key())
		}
		fn(string(unesc(nil, rest[:i])), at)
	}
	return it.Close()
}
