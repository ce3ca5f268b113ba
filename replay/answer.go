package replay

import (
	"context"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/store"
)

// Answer writes the verb's answer to a request with at, from the event log in v: the same rows,
// anomalies, paging and cursor rules as a live answer, as of the point. as_of is the sequence answered
// as of; synced is passed through. The encoder must have been reset for the answer's format.
func Answer(v *store.View, r *query.Request, e *query.Encoder, synced bool) error {
	return answer(context.Background(), v, viewPoints{v}, r, e, synced, nil, nil)
}

// answer is Answer, resolving the point against ix, keeping the anomalies of the state in cache for the pages after this one, and
// with plans, the plans' inputs as of the point in plans (either may be nil: nothing kept). ctx stops
// the filling of plans' inputs.
func answer(ctx context.Context, v *store.View, ix pointIndex, r *query.Request, e *query.Encoder, synced bool, cache *anomalyCache, plans *keptPlans) error {
	w := provisioner.What(r.What)
	if w == provisioner.WhatPlans {
		return answerPlans(ctx, v, r, e, synced, plans)
	}
	shape, ok := provisioner.ShapeOfWhat(w)
	if !ok {
		return query.NotImplemented("at is answered for registry, needs, applied, collect and plans, not %s", r.What)
	}
	if r.MinSeq > 0 {
		return query.BadRequest("min_seq waits for the live projection and does not go with at; ask at seq:<n> instead")
	}
	p, err := ParsePoint(r.At)
	if err != nil {
		return query.BadRequest("at: %v", err)
	}
	res, err := resolve(ix, shape.Bucket, p)
	if err != nil {
		return goneOr(err)
	}
	view, err := newAsOf(v, res)
	if err != nil {
		return goneOr(err)
	}
	view.cache, view.ctx = cache, ctx
	return query.AnswerView(view, r, e, res.Seq, synced)
}

// Opener opens a consistent read of the current store for an answer that says synced as given
// (store.DB.AnswerView: on a first fill's store without a log, a synced answer reads what a kill
// cannot take back), with a release to call when done with it (a seat that swaps stores after a
// rebuild keeps the old one open until every reader has released it).
type Opener func(synced bool) (v *store.View, release func(), err error)

// Handler answers the verb's at from the store an Opener opens, for a seat. It keeps the anomalies of
// the last states it answered, and the temporary stores of the plans' inputs as of the last points
// it answered plans at (plans.go), for the pages after the first; Close removes the stores kept.
type Handler struct {
	open      Opener
	synced    func(bucket string) bool
	anomalies anomalyCache
	plans     keptPlans
}

// NewHandler is a Handler reading the store open opens; synced says whether a bucket's projection has
// caught up (it is passed through to the answer).
func NewHandler(open Opener, synced func(bucket string) bool) *Handler {
	return &Handler{open: open, synced: synced, plans: keptPlans{max: seatPlansKept}}
}

// Answer answers a request with at: a query.AtFunc.
func (h *Handler) Answer(ctx context.Context, r *query.Request, e *query.Encoder) error {
	// synced before the view, which it chooses.
	s := false
	if shape, ok := provisioner.ShapeOfWhat(provisioner.What(r.What)); ok {
		s = h.synced(shape.Bucket)
	} else if r.What == string(provisioner.WhatPlans) {
		s = h.synced(provisioner.BucketHostModules)
	}
	v, release, err := h.open(s)
	if err != nil {
		return err
	}
	defer release()
	return answer(ctx, v, viewPoints{v}, r, e, s, &h.anomalies, &h.plans)
}

// Close removes the temporary stores of plans kept: at once those no answer reads, the others as the
// answers reading them end. An answer after Close keeps nothing.
func (h *Handler) Close() { h.plans.close() }
