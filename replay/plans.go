package replay

import (
	"fmt"
	"os"

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
func answerPlans(v *store.View, r *query.Request, e *query.Encoder, synced bool) error {
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
	dir, err := os.MkdirTemp("", "mesh-provisioner-plans-at-")
	if err != nil {
		return fmt.Errorf("plans at: %w", err)
	}
	defer os.RemoveAll(dir)
	tmp, err := store.Open(dir, store.Options{CacheSize: 8 << 20, MemTableSize: 8 << 20, MinFreeBytes: -1})
	if err != nil {
		return fmt.Errorf("plans at: %w", err)
	}
	defer tmp.Close()
	asOf := map[string]uint64{}
	for _, b := range v.Buckets() {
		if !provisioner.IsPlanInput(b) {
			continue
		}
		if node, composed := provisioner.ComposedNode(b); composed && r.Node != "" && node != r.Node {
			// Another node's compositions make only that node's rows and anomalies: not read, so that
			// its log (forgotten, or with a gap) neither slows nor refuses this node's answer.
			continue
		}
		res, err := Resolve(v, b, p)
		if err != nil {
			return goneOr(err)
		}
		if err := copyEvents(v, tmp, b, res.Seq); err != nil {
			return fmt.Errorf("plans at: %s: %w", b, err)
		}
		tmp.SetSynced(b, true)
		asOf[b] = res.Seq
	}
	tv, err := tmp.View()
	if err != nil {
		return err
	}
	defer tv.Close()
	return query.AnswerPlans(resolvedView{tv, asOf}, r, e, synced)
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
