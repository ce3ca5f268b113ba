package replay

import (
	"context"
	"fmt"
	"iter"
	"time"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/store"
)

// EachRevision calls fn for every revision of one key that the log keeps, oldest first, one at a time:
// a key with a million revisions costs the memory of one. It stops with ctx's error once ctx is done,
// and with fn's error. The KeyHistory returned has the floor and gaps, and no Revisions. The
// revision's Value is valid only during the call.
func (l *Log) EachRevision(ctx context.Context, bucket, key string, fn func(*Revision) error) (KeyHistory, error) {
	h := KeyHistory{Bucket: bucket, Key: key}
	if _, ok := provisioner.ShapeOf(bucket); !ok {
		return h, fmt.Errorf("replay: %q is not a bucket the seat tails", bucket)
	}
	v, err := l.DB.View()
	if err != nil {
		return h, err
	}
	defer v.Close()
	marks, err := v.HistoryMarks(bucket)
	if err != nil {
		return h, err
	}
	h.Floor, h.Gaps = marks.Floor, marks.Gaps
	var ferr error
	var rev Revision
	err = v.KeyHistory(bucket, key, func(ev *store.Event) bool {
		if ferr = ctx.Err(); ferr != nil {
			return false
		}
		rev = Revision{Seq: ev.Seq, Time: time.Unix(0, ev.Time).UTC(), Op: ev.Op, Value: ev.Value}
		ferr = fn(&rev)
		return ferr == nil
	})
	if err == nil {
		err = ferr
	}
	return h, err
}

// DiffKind says what a DiffItem is.
type DiffKind int

const (
	DiffAdded DiffKind = iota
	DiffChanged
	DiffRemoved
	DiffAppeared // an anomaly row
	DiffCleared  // an anomaly row
)

// DiffItem is one thing that differs between two points: a row added (Row), changed (From to Row) or
// removed (Row, as it was), or an anomaly row that appeared or cleared (Anomaly). Its byte slices
// are valid only during the call that received it.
type DiffItem struct {
	Kind    DiffKind
	Row     Row
	From    Row
	Anomaly provisioner.Anomaly
}

// DiffEach compares what a request (what and its narrowing) answers as of two points, walking the two
// states side by side in byte order of raw keys: fn is called for each row added, changed or removed,
// in key order, then for each anomaly row that appeared or cleared, in key order. Nothing is held but
// the current key of each side, so a diff of a bucket of millions of keys costs the memory of a few.
// Both points are resolved before anything is read; ordered is then told their sequences, and its
// error, if any, is returned before fn is called. The walk stops with ctx's error once ctx is done.
func (l *Log) DiffEach(ctx context.Context, r query.Request, from, to Point, ordered func(fromSeq, toSeq uint64) error, fn func(*DiffItem) error) error {
	if err := l.checkNode(&r); err != nil {
		return err
	}
	shape, ok := provisioner.ShapeOfWhat(provisioner.What(r.What))
	if !ok {
		return query.NotImplemented("replay answers registry, needs, applied and collect, not %s", r.What)
	}
	v, err := l.DB.View()
	if err != nil {
		return err
	}
	defer v.Close()
	ix := l.pointsOf(v)
	ra, err := resolve(ix, shape.Bucket, from)
	if err != nil {
		return goneOr(err)
	}
	rb, err := resolve(ix, shape.Bucket, to)
	if err != nil {
		return goneOr(err)
	}
	if ordered != nil {
		if err := ordered(ra.Seq, rb.Seq); err != nil {
			return err
		}
	}
	va, err := newAsOf(v, ra)
	if err != nil {
		return goneOr(err)
	}
	vb, err := newAsOf(v, rb)
	if err != nil {
		return goneOr(err)
	}
	rg, filter := query.Plan(shape.Bucket, &r)
	rows := func(a *asOf, errp *error) iter.Seq[*Row] {
		return func(yield func(*Row) bool) {
			var out Row
			*errp = a.Rows(rg, func(row *provisioner.Row) bool {
				if *errp = ctx.Err(); *errp != nil {
					return false
				}
				parts, perr := provisioner.ParseKey(shape, string(row.Key))
				if perr != nil || !filter(&parts, row) {
					return true
				}
				out = Row{Key: string(row.Key), Revision: row.Revision, Created: time.Unix(0, row.Created).UTC(), Msgpack: row.Msgpack, Value: row.Value}
				return yield(&out)
			})
		}
	}
	var errA, errB error
	if err := mergeRows(rows(va, &errA), rows(vb, &errB), fn); err != nil {
		return err
	}
	if err := firstErr(errA, errB, ctx.Err()); err != nil {
		return err
	}
	anomalies := func(a *asOf, errp *error) iter.Seq[*provisioner.Anomaly] {
		return func(yield func(*provisioner.Anomaly) bool) {
			*errp = a.eachAnomaly(shape.Bucket, r.Node, func(an *provisioner.Anomaly) bool {
				if *errp = ctx.Err(); *errp != nil {
					return false
				}
				return yield(an)
			})
		}
	}
	if err := mergeAnomalies(anomalies(va, &errA), anomalies(vb, &errB), fn); err != nil {
		return err
	}
	return firstErr(errA, errB, ctx.Err())
}

func firstErr(errs ...error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// mergeRows walks two states' rows, each in byte order of raw keys, and reports what differs: a key
// in b alone is added, in a alone removed, in both with another revision changed.
func mergeRows(a, b iter.Seq[*Row], fn func(*DiffItem) error) error {
	nextA, stopA := iter.Pull(a)
	defer stopA()
	nextB, stopB := iter.Pull(b)
	defer stopB()
	// The pulled row is valid until the next pull of its side: kept in a copy across the other's.
	var ra, rb Row
	var bufA, bufB []byte
	pull := func(next func() (*Row, bool), dst *Row, buf *[]byte) bool {
		r, ok := next()
		if ok {
			*buf = append((*buf)[:0], r.Value...)
			*dst = *r
			dst.Value = *buf
		}
		return ok
	}
	okA, okB := pull(nextA, &ra, &bufA), pull(nextB, &rb, &bufB)
	var item DiffItem
	for okA || okB {
		// fn is called before the side it read from is pulled again: the row's value is that side's.
		switch {
		case !okB || (okA && ra.Key < rb.Key):
			item = DiffItem{Kind: DiffRemoved, Row: ra}
			if err := fn(&item); err != nil {
				return err
			}
			okA = pull(nextA, &ra, &bufA)
		case !okA || rb.Key < ra.Key:
			item = DiffItem{Kind: DiffAdded, Row: rb}
			if err := fn(&item); err != nil {
				return err
			}
			okB = pull(nextB, &rb, &bufB)
		default:
			if ra.Revision != rb.Revision {
				item = DiffItem{Kind: DiffChanged, From: ra, Row: rb}
				if err := fn(&item); err != nil {
					return err
				}
			}
			okA, okB = pull(nextA, &ra, &bufA), pull(nextB, &rb, &bufB)
		}
	}
	return nil
}

// mergeAnomalies walks two states' anomaly rows, each in byte order of raw keys (a key's rows in class
// order), and reports the rows that appeared or cleared, by key and reason code.
func mergeAnomalies(a, b iter.Seq[*provisioner.Anomaly], fn func(*DiffItem) error) error {
	nextA, stopA := iter.Pull(a)
	defer stopA()
	nextB, stopB := iter.Pull(b)
	defer stopB()
	// One key's rows of each side (at most one per class).
	var pendA, pendB *provisioner.Anomaly
	group := func(next func() (*provisioner.Anomaly, bool), pend **provisioner.Anomaly) []provisioner.Anomaly {
		var out []provisioner.Anomaly
		if *pend == nil {
			if an, ok := next(); ok {
				c := *an
				*pend = &c
			}
		}
		for *pend != nil && (len(out) == 0 || (*pend).Key == out[0].Key) {
			out = append(out, **pend)
			*pend = nil
			if an, ok := next(); ok {
				c := *an
				*pend = &c
			}
		}
		return out
	}
	ga, gb := group(nextA, &pendA), group(nextB, &pendB)
	has := func(g []provisioner.Anomaly, reason provisioner.Reason) bool {
		for _, x := range g {
			if x.Reason == reason {
				return true
			}
		}
		return false
	}
	var item DiffItem
	for len(ga) > 0 || len(gb) > 0 {
		var fromA, fromB []provisioner.Anomaly
		switch {
		case len(gb) == 0 || (len(ga) > 0 && ga[0].Key < gb[0].Key):
			fromA = ga
			ga = group(nextA, &pendA)
		case len(ga) == 0 || gb[0].Key < ga[0].Key:
			fromB = gb
			gb = group(nextB, &pendB)
		default:
			fromA, fromB = ga, gb
			ga, gb = group(nextA, &pendA), group(nextB, &pendB)
		}
		for _, x := range fromB {
			if !has(fromA, x.Reason) {
				item = DiffItem{Kind: DiffAppeared, Anomaly: x}
				if err := fn(&item); err != nil {
					return err
				}
			}
		}
		for _, x := range fromA {
			if !has(fromB, x.Reason) {
				item = DiffItem{Kind: DiffCleared, Anomaly: x}
				if err := fn(&item); err != nil {
					return err
				}
			}
		}
	}
	return nil
}
