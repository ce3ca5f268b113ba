package replay

import (
	"fmt"
	"os"
	"sync"

	provisioner "github.com/novox/mesh-provisioner"
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
// With keep, the temporary store of the last point and node asked is kept for the pages after the
// first (a Log's, whose store never changes): filling it is the answer's whole cost, and a walk of
// every plan a page at a time filled it again for each page, so 10,000 plans (1,000 nodes) cost
// 12 s of CPU against 0.6 s for 2,500.
func answerPlans(v *store.View, r *query.Request, e *query.Encoder, synced bool, keep *keptPlans) error {
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
	key := plansKey{store: v.StoreID(), at: unixNano(p.Time), node: r.Node}
	if keep != nil {
		keep.mu.Lock()
		defer keep.mu.Unlock()
		if keep.cur != nil && keep.cur.key == key {
			return keep.cur.answer(r, e, synced)
		}
	}
	pa, err := fillPlans(v, key, p)
	if err != nil {
		return err
	}
	if keep == nil {
		defer pa.close()
	} else {
		keep.cur.close()
		keep.cur = pa
	}
	return pa.answer(r, e, synced)
}

// plansKey is what a temporary store of plans as of a point holds: the store read, the time, and
// the node narrowed by (another node's compositions are not copied).
type plansKey struct {
	store uint64 // store.DB.ID
	at    int64
	node  string
}

// plansAt is the plans' inputs of a log applied up to a point, in a temporary store.
type plansAt struct {
	key  plansKey
	dir  string
	db   *store.DB
	asOf map[string]uint64 // each input bucket's resolved sequence
}

// keptPlans keeps the last plansAt a Log answered, until the Log closes.
type keptPlans struct {
	mu  sync.Mutex
	cur *plansAt
}

func (k *keptPlans) close() {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.cur.close()
	k.cur = nil
}

// fillPlans applies the plans' inputs of v up to p into a new temporary store.
func fillPlans(v *store.View, key plansKey, p Point) (*plansAt, error) {
	dir, err := os.MkdirTemp("", "mesh-provisioner-plans-at-")
	if err != nil {
		return nil, fmt.Errorf("plans at: %w", err)
	}
	tmp, err := store.Open(dir, store.Options{CacheSize: 8 << 20, MemTableSize: 8 << 20, MinFreeBytes: -1})
	if err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("plans at: %w", err)
	}
	pa := &plansAt{key: key, dir: dir, db: tmp, asOf: map[string]uint64{}}
	for _, b := range v.Buckets() {
		if !provisioner.IsPlanInput(b) {
			continue
		}
		if node, composed := provisioner.ComposedNode(b); composed && key.node != "" && node != key.node {
			// Another node's compositions make only that node's rows and anomalies: not read, so that
			// its log (forgotten, or with a gap) neither slows nor refuses this node's answer.
			continue
		}
		res, err := Resolve(v, b, p)
		if err != nil {
			pa.close()
			return nil, goneOr(err)
		}
		if err := copyEvents(v, tmp, b, res.Seq); err != nil {
			pa.close()
			return nil, fmt.Errorf("plans at: %s: %w", b, err)
		}
		tmp.SetSynced(b, true)
		pa.asOf[b] = res.Seq
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

// copyEvents applies a bucket's logged events up to seq to another store, in batches.
func copyEvents(v *store.View, to *store.DB, bucket string, seq uint64) error {
	var batch []provisioner.Message
	var applyErr error
	flush := func() bool {
		if len(batch) == 0 {
			return true
		}
		applyErr = to.Apply(bucket, batch, 0, false)
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
		return len(batch) < 4096 || flush()
	})
	if err != nil {
		return err
	}
	if !flush() {
		return applyErr
	}
	return applyErr
}
