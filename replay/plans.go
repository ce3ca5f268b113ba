package replay

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/streamread"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/store"
)

// answerPlans answers what: plans as of a time. Plans are a projection of several buckets (every
// composed-<node>, mesh-host_modules, mesh-indexer_builds), so the point must be a time: a sequence
// names a position in one stream only. The plans' inputs are applied, up to the point, from the event
// log into a temporary store, whose own Apply derives the plans, their last plans kept and the inputs'
// anomalies exactly as the live projection does; the answer is then written from it as a live one is.
// The work grows with the plans' inputs' history, not with the mesh's needs.
//
// With keep, the temporary stores of the last few points asked are kept for the pages after the
// first: filling one is the answer's whole cost, and a walk of every plan a page at a time filled it
// again for each page, so 10,000 plans (1,000 nodes) cost 12 s of CPU against 0.6 s for 2,500. A
// store is kept under what it holds (plansKey), never under the time asked: on a live store a time
// after the newest event resolves to a sequence that moves as the projection applies more.
func answerPlans(ctx context.Context, v *store.View, r *query.Request, e *query.Encoder, synced bool, keep *keptPlans) error {
	if r.MinSeq > 0 {
		return query.BadRequest("min_seq waits for the live projection and does not go with at")
	}
	p, err := ParsePoint(r.At)
	if err != nil {
		return query.BadRequest("at: %v", err)
	}
	if !p.IsTime() {
		return query.BadRequest("plans are read from several buckets: ask them at an RFC 3339 time, not %s", p)
	}
	if err := forgottenBefore(v, r.Node, unixNano(p.Time)); err != nil {
		return err
	}
	inputs, err := resolvePlanInputs(v, r.Node, p)
	if err != nil {
		return err
	}
	fill := func() (*plansAt, error) { return fillPlans(ctx, v, inputs) }
	if keep == nil {
		pa, err := fill()
		if err != nil {
			return err
		}
		defer pa.close()
		return pa.answer(r, e, synced)
	}
	kept, err := keep.get(ctx, plansKeyOf(v.StoreID(), v.Rewrites(), r.Node, inputs), fill)
	if err != nil {
		return err
	}
	defer keep.release(kept)
	return kept.pa.answer(r, e, synced)
}

// planInput is a plans' input bucket as of a point: the sequence the point resolved to, and the
// creation time of the stream its log was read from (a composed-<node> bucket forgotten and created
// again has a new log whose sequences start again at 1).
type planInput struct {
	bucket  string
	seq     uint64
	created int64
}

// resolvePlanInputs resolves a point in each plans' input bucket the answer reads, in name order: every
// one, or with node that node's composed-<node> only (another node's compositions make only that
// node's rows and anomalies: not read, so that its log, forgotten or with a gap, neither slows nor
// refuses this node's answer).
func resolvePlanInputs(v *store.View, node string, p Point) ([]planInput, error) {
	var inputs []planInput
	for _, b := range v.Buckets() {
		if !provisioner.IsPlanInput(b) {
			continue
		}
		if n, composed := provisioner.ComposedNode(b); composed && node != "" && n != node {
			continue
		}
		res, err := Resolve(v, b, p)
		if err != nil {
			return nil, goneOr(err)
		}
		cp, err := v.Checkpoint(b)
		if err != nil {
			return nil, err
		}
		inputs = append(inputs, planInput{bucket: b, seq: res.Seq, created: cp.StreamCreated})
	}
	slices.SortFunc(inputs, func(a, b planInput) int { return strings.Compare(a.bucket, b.bucket) })
	return inputs, nil
}

// plansKey says exactly what a temporary store of plans holds: the store its events were copied from
// (store.DB.ID: a rebuild swaps in another, whose sequences may be of recreated streams) and its
// rewrites as the view opened (store.View.Rewrites: an expired put's event left the log), the node
// narrowed by, and each input bucket copied with its resolved sequence and stream. Every part is
// length-prefixed or self-delimiting. Two times that resolve alike share a store; a trim changes
// nothing a key names, since it keeps every point from its floor on exactly and a point below it is
// refused before the key is made.
type plansKey string

func plansKeyOf(storeID, rewrites uint64, node string, inputs []planInput) plansKey {
	b := binary.AppendUvarint(nil, storeID)
	b = binary.AppendUvarint(b, rewrites)
	b = binary.AppendUvarint(b, uint64(len(node)))
	b = append(b, node...)
	for _, in := range inputs {
		b = binary.AppendUvarint(b, uint64(len(in.bucket)))
		b = append(b, in.bucket...)
		b = binary.AppendUvarint(b, in.seq)
		b = binary.AppendVarint(b, in.created)
	}
	return plansKey(b)
}

// plansAt is the plans' inputs of a log applied up to a point, in a temporary store.
type plansAt struct {
	dir  string
	db   *store.DB
	asOf map[string]uint64 // each input bucket's resolved sequence
}

// seatPlansKept is how many temporary stores of plans a seat keeps: a walk, another client's, and a
// point compared with another. Each holds up to a memtable and a block cache of 8 MiB, and on disk the
// plans' inputs' events up to its point.
const seatPlansKept = 3

// keptPlans keeps the temporary stores of the last points answered, most recently used first, under
// what they hold. A store is filled once however many ask for it at the same moment (they wait for the
// one filling it), and fills of different keys run side by side: the lock is never held across a
// fill. A store evicted, or kept when close is called, is removed once no answer reads it.
type keptPlans struct {
	max int // 0: 1 (a Log's: its store never changes, and a command walks one point)

	mu      sync.Mutex
	entries []*keptEntry // most recently used first
	closed  bool
	fills   int // stores filled, for the tests
}

type keptEntry struct {
	key     plansKey
	done    chan struct{} // closed once filled, or failed
	pa      *plansAt      // set before done is closed, nil when it failed
	err     error
	refs    int  // under keptPlans.mu: answers reading it, and the fill
	evicted bool // under keptPlans.mu: out of entries; removed when refs reaches 0
}

// get returns the entry of key, filling it with fill unless it is kept or being filled; the caller
// releases it once answered. A fill runs under the context of the answer that started it: when that
// context ends the fill fails, and an answer waiting on it whose own context is live fills it again.
func (k *keptPlans) get(ctx context.Context, key plansKey, fill func() (*plansAt, error)) (*keptEntry, error) {
	k.mu.Lock()
	for i, e := range k.entries {
		if e.key != key {
			continue
		}
		copy(k.entries[1:i+1], k.entries[:i])
		k.entries[0] = e
		e.refs++
		k.mu.Unlock()
		select {
		case <-e.done:
		case <-ctx.Done():
			k.release(e)
			return nil, ctx.Err()
		}
		if e.err != nil {
			k.release(e)
			if ctx.Err() == nil && (errors.Is(e.err, context.Canceled) || errors.Is(e.err, context.DeadlineExceeded)) {
				// The fill was stopped by the context of the answer that started it, not this one's:
				// the failed entry is out of entries, so this answer fills the store itself.
				return k.get(ctx, key, fill)
			}
			return nil, e.err
		}
		return e, nil
	}
	e := &keptEntry{key: key, done: make(chan struct{}), refs: 1}
	k.fills++
	var drop []*keptEntry
	if k.closed {
		e.evicted = true // closed: the answer's own, removed once it is written
	} else {
		k.entries = append([]*keptEntry{e}, k.entries...)
		drop = k.evictLocked()
	}
	k.mu.Unlock()
	removeAll(drop)

	pa, err := fill()
	k.mu.Lock()
	e.pa, e.err = pa, err
	if err != nil {
		k.removeLocked(e)
	}
	close(e.done)
	k.mu.Unlock()
	if err != nil {
		k.release(e)
		return nil, err
	}
	return e, nil
}

// evictLocked takes the least recently used entries past max out, and returns those to remove now.
func (k *keptPlans) evictLocked() []*keptEntry { return k.keepLocked(max(k.max, 1)) }

// keepLocked takes every entry past the n most recently used out, and returns those no answer reads,
// to remove now; the others are removed as their answers end (release).
func (k *keptPlans) keepLocked(n int) []*keptEntry {
	var drop []*keptEntry
	for len(k.entries) > n {
		e := k.entries[len(k.entries)-1]
		k.entries = k.entries[:len(k.entries)-1]
		e.evicted = true
		if e.refs == 0 {
			drop = append(drop, e)
		}
	}
	return drop
}

// removeLocked takes an entry out of entries.
func (k *keptPlans) removeLocked(e *keptEntry) {
	if i := slices.Index(k.entries, e); i >= 0 {
		k.entries = slices.Delete(k.entries, i, i+1)
	}
	e.evicted = true
}

// release ends an answer's (or a fill's) read of an entry; the last read of one evicted removes it.
func (k *keptPlans) release(e *keptEntry) {
	k.mu.Lock()
	e.refs--
	last := e.refs == 0 && e.evicted
	k.mu.Unlock()
	if last {
		e.pa.close()
	}
}

// close removes every store kept, at once those no answer reads, the others as their answers end;
// from then on nothing is kept.
func (k *keptPlans) close() {
	k.mu.Lock()
	k.closed = true
	drop := k.keepLocked(0)
	k.mu.Unlock()
	removeAll(drop)
}

func removeAll(es []*keptEntry) {
	for _, e := range es {
		e.pa.close()
	}
}

// fillPlans applies the plans' inputs of v up to their resolved sequences into a new temporary store.
func fillPlans(ctx context.Context, v *store.View, inputs []planInput) (*plansAt, error) {
	dir, err := os.MkdirTemp("", "mesh-provisioner-plans-at-")
	if err != nil {
		return nil, fmt.Errorf("plans at: %w", err)
	}
	tmp, err := store.Open(dir, withOnFatal(store.Options{CacheSize: 8 << 20, MemTableSize: 8 << 20, MinFreeBytes: -1}))
	if err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("plans at: %w", err)
	}
	pa := &plansAt{dir: dir, db: tmp, asOf: map[string]uint64{}}
	for _, in := range inputs {
		if err := copyEvents(ctx, v, tmp, in.bucket, in.seq); err != nil {
			pa.close()
			return nil, fmt.Errorf("plans at: %s: %w", in.bucket, err)
		}
		tmp.SetSynced(in.bucket, true)
		pa.asOf[in.bucket] = in.seq
	}
	return pa, nil
}

// answer writes one page of plans from the temporary store.
func (pa *plansAt) answer(r *query.Request, e *query.Encoder, synced bool) error {
	tv, err := pa.db.View()
	if err != nil {
		return err
	}
	defer tv.Close()
	return query.AnswerPlans(resolvedView{tv, pa.asOf}, r, e, synced)
}

// close removes the temporary store; a nil plansAt is nothing to close.
func (pa *plansAt) close() {
	if pa == nil {
		return
	}
	pa.db.Close()
	os.RemoveAll(pa.dir)
}

// resolvedView is the temporary store's view with each bucket's applied sequence as resolved: the
// sequence the answer is as of. The last event copied is below it when a trim dropped the events up
// to the floor (a delete of a key that kept nothing), and as_of would say the answer had not seen them.
type resolvedView struct {
	*store.View
	seqs map[string]uint64
}

func (v resolvedView) Checkpoint(bucket string) (store.Checkpoint, error) {
	cp, err := v.View.Checkpoint(bucket)
	if seq, ok := v.seqs[bucket]; ok && err == nil {
		cp.Applied = seq
	}
	return cp, err
}

// copyEvents applies a bucket's logged events up to seq to another store, in batches, until ctx ends.
func copyEvents(ctx context.Context, v *store.View, to *store.DB, bucket string, seq uint64) error {
	var batch []provisioner.Message
	batchBytes := 0 // of the messages in batch: their keys and values
	var applyErr error
	flush := func() bool {
		if len(batch) == 0 {
			return true
		}
		if applyErr = ctx.Err(); applyErr == nil {
			applyErr = to.Apply(bucket, batch, 0, false)
		}
		batch = batch[:0]
		return applyErr == nil
	}
	err := v.Events(bucket, 1, func(key []byte, ev *store.Event) bool {
		if ev.Seq > seq {
			return false
		}
		// The rollup too: the log names a sequence by the message's own key (or a foreign rollup's
		// subject), and the keys its rollup removed are removed again by the store it is copied to
		// (store.DB.Apply).
		m := ev.Message(key)
		m.Value = append([]byte(nil), m.Value...)
		batch = append(batch, m)
		// Applied at 4096 messages or streamread.MaxBytes of values, whichever comes first.
		if batchBytes += len(m.Key) + len(m.Value); len(batch) < 4096 && batchBytes < streamread.MaxBytes {
			return true
		}
		batchBytes = 0
		return flush()
	})
	if err != nil {
		return err
	}
	if !flush() {
		return applyErr
	}
	return applyErr
}
