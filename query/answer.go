package query

import (
	"context"
	"fmt"
	"strings"
	"unsafe"

	provisioner "github.com/novox/mesh-provisioner"
)

// Answer answers a decoded, validated request into e, in the given format.
func (s *Server) Answer(ctx context.Context, r *Request, format Format, e *Encoder) error {
	e.Reset(format)
	if r.At != "" {
		if s.opts.At == nil {
			return fmt.Errorf("%w: at is not served by this seat", errNotImplemented)
		}
		return s.opts.At(ctx, r, e)
	}
	w := provisioner.What(r.What)
	if w == provisioner.WhatPlans {
		if s.opts.Plans == nil {
			return fmt.Errorf("%w: plans are not served by this seat", errNotImplemented)
		}
		return s.opts.Plans(ctx, r, e)
	}
	shape, _ := provisioner.ShapeOfWhat(w)
	// Reach, not the applied sequence: a min_seq inside an open history gap waits for what removed it
	// (store.DB.Reach). The view opened after it is at or past it, and any gap it holds starts past it.
	if err := reached(r, shape.Bucket, s.r.Reach(shape.Bucket)); err != nil {
		return err // before a view is opened: the caller waits (waiters.go) or answers 504
	}
	v, synced, err := s.r.View(shape.Bucket)
	if err != nil {
		return err
	}
	defer v.Close()
	cp, err := v.Checkpoint(shape.Bucket)
	if err != nil {
		return err
	}
	// as_of is the view's: a rebuild may have swapped in a store behind min_seq since the check above,
	// or one whose open history gap holds it (Reach, read after the view: a gap of the store checked
	// above that opened since starts past what the check passed).
	if err := reached(r, shape.Bucket, min(cp.Applied, s.r.Reach(shape.Bucket))); err != nil {
		return err
	}
	return AnswerView(v, r, e, cp.Applied, synced)
}

// AnswerView writes the answer to a request of registry, needs, applied or collect from a view: the
// rows of one bounded range scan, filtered by what the range does not narrow, one page of them, and
// the bucket's anomalies. asOf and synced are written as given.
func AnswerView(v View, r *Request, e *Encoder, asOf uint64, synced bool) error {
	w := provisioner.What(r.What)
	shape, _ := provisioner.ShapeOfWhat(w)
	rg, filter := Plan(shape.Bucket, r)
	if r.After != "" {
		ok, err := cursorInAnswer(v, shape, rg, filter, r.After)
		if err != nil {
			return err
		}
		if !ok {
			return NotFound("after %q: no such row in this answer any more; start again without after", r.After)
		}
		rg.After = r.After
	}

	// The anomalies first, aside: the rows take the room they leave (limits.go).
	node := r.Node
	ahead, err := e.writeAhead(func(a *Encoder) error { return a.AnomaliesFrom(v, shape.Bucket, node) })
	if err != nil {
		return err
	}
	e.BeginAnswer(r.What)
	sc := e.rowScan()
	sc.w, sc.shape, sc.filter, sc.limit = w, shape, filter, r.limit()
	err = v.Rows(rg, sc.fn)
	next, rowErr := sc.done()
	if err == nil {
		err = rowErr
	}
	if err != nil {
		return err
	}
	e.EndRows()
	e.reserveTail(len(next))
	if !e.appendAhead(ahead) {
		// Larger than a quarter of the bound: written again in place, in what the rows left.
		if err := e.AnomaliesFrom(v, shape.Bucket, node); err != nil {
			return err
		}
	}
	e.EndAnswer(asOf, synced, next)
	return nil
}

// cursorInAnswer reports whether after names a row of this very answer: one the range holds and the
// filter keeps. A row the range holds but the filter drops (a cursor of another kind, module or
// contributor on the same node, or a registry entry whose module changed since) is no row of the
// answer, and paging on from it would answer rows of a walk that was never started.
func cursorInAnswer(v View, shape provisioner.Shape, rg provisioner.Range, filter func(*provisioner.Parts, *provisioner.Row) bool, after string) (bool, error) {
	if !strings.HasPrefix(after, rg.Prefix) {
		return false, nil // outside the range's prefix, which the filter does not check again
	}
	// The cursor's own row, when the range holds it, is the first of the range's rows that start with
	// it: one seek finds the row and lets the filter judge it.
	at := rg
	at.Prefix = after
	ok := false
	var parts provisioner.Parts
	var pr provisioner.StoredParts
	err := v.Rows(at, func(row *provisioner.Row) bool {
		ok = string(row.Key) == after && pr.Read(shape, after, &parts) && filter(&parts, row)
		return false
	})
	return ok, err
}

// Plan chooses the range scan that answers a request, and the filter for what the range does not
// narrow. Every choice is bounded by what the request names: a node's rows, a module's, a kind's, a
// collection's, a contributor's.
func Plan(bucket string, r *Request) (provisioner.Range, func(*provisioner.Parts, *provisioner.Row) bool) {
	rg := provisioner.Range{Bucket: bucket, Index: provisioner.IndexPrimary}
	all := func(*provisioner.Parts, *provisioner.Row) bool { return true }
	switch provisioner.What(r.What) {
	case provisioner.WhatRegistry:
		if r.Kind != "" {
			rg.Prefix = r.Kind
		}
		kind, module := r.Kind, r.Module
		return rg, func(p *provisioner.Parts, row *provisioner.Row) bool {
			if kind != "" && p.Kind != kind {
				return false
			}
			if module == "" {
				return true
			}
			return row.Msgpack && provisioner.RegistryFields(row.Value).Module == module // the module is the value's
		}
	case provisioner.WhatNeeds:
		node, module, kind := r.Node, r.Module, r.Kind
		switch {
		case node != "" && module != "":
			rg.Prefix = node + "." + module + "."
		case node != "":
			rg.Prefix = node + "."
		case module != "":
			rg.Index, rg.Value = provisioner.IndexModule, module
		case kind != "":
			rg.Index, rg.Value = provisioner.IndexKind, kind
		}
		if kind == "" {
			return rg, all
		}
		return rg, func(p *provisioner.Parts, _ *provisioner.Row) bool { return p.Kind == kind }
	case provisioner.WhatApplied:
		node, module := r.Node, r.Module
		switch {
		case node != "" && module != "":
			rg.Prefix = node + "." + module
		case node != "":
			rg.Prefix = node + "."
		case module != "":
			rg.Index, rg.Value = provisioner.IndexModule, module
		}
		if module == "" {
			return rg, all
		}
		return rg, func(p *provisioner.Parts, _ *provisioner.Row) bool { return p.Module == module }
	case provisioner.WhatCollect:
		node, contributor, collection := r.Node, r.Module, r.Collection
		switch {
		case collection != "":
			rg.Index, rg.Value = provisioner.IndexCollection, collection
			if node != "" {
				rg.Prefix = node + "."
			}
		case node != "":
			rg.Prefix = node + "."
		case contributor != "":
			rg.Index, rg.Value = provisioner.IndexContributor, contributor
		}
		return rg, func(p *provisioner.Parts, _ *provisioner.Row) bool {
			return (contributor == "" || p.Contributor == contributor) && (collection == "" || p.Collection == collection)
		}
	}
	return rg, all
}

// rowScan is an answer's walk of its rows, kept by the Encoder with its callback bound once: a
// closure over the walk's variables, made for each answer, moved each of them to the heap (seven
// allocations an answer, and the last key's buffer grown again each time).
type rowScan struct {
	e      *Encoder
	w      provisioner.What
	shape  provisioner.Shape
	filter func(*provisioner.Parts, *provisioner.Row) bool
	limit  int
	n      int
	next   string
	last   []byte // the last row's key, for next
	err    error
	// One Parts for the whole answer, filled in place for each row: a Parts per row would be allocated.
	parts provisioner.Parts
	pr    provisioner.StoredParts
	fn    func(*provisioner.Row) bool // row, bound to this scan
}

// rowScan returns the encoder's scan, emptied for an answer.
func (e *Encoder) rowScan() *rowScan {
	if e.scan == nil {
		e.scan = &rowScan{}
		e.scan.fn = e.scan.row
	}
	sc := e.scan
	sc.e = e // an Encoder copied by value shares its scan, and each answer names its own encoder
	sc.n, sc.next, sc.last, sc.err = 0, "", sc.last[:0], nil
	return sc
}

// done ends the scan: the answer's next and the error of a row's writing. What the scan holds of the
// answer's rows and request is let go.
func (sc *rowScan) done() (string, error) {
	next, err := sc.next, sc.err
	sc.e, sc.filter, sc.parts, sc.next, sc.err = nil, nil, provisioner.Parts{}, "", nil
	return next, err
}

func (sc *rowScan) row(row *provisioner.Row) bool {
	e := sc.e
	// The key's bytes live until the callback returns, and so do the parts read from them: they are
	// written into the answer before it does. No copy of the key is made.
	ok := sc.pr.Read(sc.shape, unsafe.String(unsafe.SliceData(row.Key), len(row.Key)), &sc.parts)
	if !ok || !sc.filter(&sc.parts, row) {
		return true // out-of-shape keys have no row; the filter narrows what the range could not
	}
	if sc.n == sc.limit {
		sc.next = string(sc.last)
		return false
	}
	m := e.mark()
	if sc.err = e.Row(sc.w, row, &sc.parts); sc.err != nil {
		return false
	}
	if e.rowsFull(row.Key) { // past the rows' share of one NATS message (limits.go)
		e.rewind(m)
		if sc.n > 0 {
			sc.next = string(sc.last)
			return false
		}
		if sc.err = e.rowOmitted(sc.w, row, &sc.parts); sc.err != nil {
			return false
		}
	}
	sc.last = append(sc.last[:0], row.Key...)
	sc.n++
	return true
}
