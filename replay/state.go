package replay

import (
	"context"
	"math"
	"time"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/mpk"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/store"
)

// Ask answers one page of a verb request with at from the log, as the seat would: the answer's bytes
// in the request's format, or an error that query.Code maps to the verb's code. The anomalies of a
// state are derived on its first page and kept for the pages after it, as the seat keeps them: a walk
// of a bucket of N keys a page at a time derived them from all N keys on every page, N²/1000 in all.
// So are the plans' inputs as of a point, applied to a temporary store on the first page (plans.go).
func (l *Log) Ask(body []byte) ([]byte, error) { return l.AskContext(context.Background(), body) }

// AskContext is Ask, stopped with ctx's error once ctx is done: the first page of a state reads every
// key of the bucket (or of the node) to count its anomalies, and of plans fills the inputs as of the
// point, which Ctrl-C did not reach.
func (l *Log) AskContext(ctx context.Context, body []byte) ([]byte, error) {
	r, format, err := query.DecodeRequest(body)
	if err != nil {
		return nil, err
	}
	if r.At == "" {
		return nil, query.BadRequest("replay answers as of a point: at is required")
	}
	if err := l.checkNode(&r); err != nil {
		return nil, err
	}
	l.asking.RLock()
	defer l.asking.RUnlock()
	if l.closed {
		return nil, store.ErrClosed
	}
	v, err := l.DB.View()
	if err != nil {
		return nil, err
	}
	defer v.Close()
	var e query.Encoder
	e.Reset(format)
	_, synced := l.DB.Applied(bucketOfWhat(r.What))
	if err := answer(ctx, v, l.pointsOf(v), &r, &e, synced, &l.anomalies, &l.plans); err != nil {
		return nil, err
	}
	return append([]byte(nil), e.Bytes()...), nil
}

// bucketOfWhat is the bucket whose synced an answer carries; for plans mesh-host_modules', as Handler
// reads it.
func bucketOfWhat(what string) string {
	if s, ok := provisioner.ShapeOfWhat(provisioner.What(what)); ok {
		return s.Bucket
	}
	if what == string(provisioner.WhatPlans) {
		return provisioner.BucketHostModules
	}
	return ""
}

// Row is one row of a state: a key's newest put as of the point.
type Row struct {
	Key      string
	Revision uint64
	Created  time.Time
	Msgpack  bool
	Value    []byte
}

// State is everything a question answers as of a point, unpaged: rows in byte order of raw keys and
// every anomaly row (not capped).
type State struct {
	What      string
	Point     Point
	AsOf      uint64
	Rows      []Row
	Anomalies []provisioner.Anomaly
}

// State reads what a request (what and its narrowing; at, limit and after are ignored) answers as of
// a point. The request must be valid (query.DecodeRequest checks it).
func (l *Log) State(r query.Request, p Point) (State, error) {
	if err := l.checkNode(&r); err != nil {
		return State{}, err
	}
	w := provisioner.What(r.What)
	shape, ok := provisioner.ShapeOfWhat(w)
	if !ok {
		return State{}, query.NotImplemented("replay answers registry, needs, applied and collect, not %s", r.What)
	}
	v, err := l.DB.View()
	if err != nil {
		return State{}, err
	}
	defer v.Close()
	res, err := resolve(l.pointsOf(v), shape.Bucket, p)
	if err != nil {
		return State{}, goneOr(err)
	}
	view, err := newAsOf(v, res)
	if err != nil {
		return State{}, goneOr(err)
	}
	st := State{What: r.What, Point: p, AsOf: res.Seq}
	rg, filter := query.Plan(shape.Bucket, &r)
	var rowErr error
	err = view.Rows(rg, func(row *provisioner.Row) bool {
		parts, perr := provisioner.ParseKey(shape, string(row.Key))
		if perr != nil || !filter(&parts, row) {
			return true
		}
		st.Rows = append(st.Rows, Row{Key: string(row.Key), Revision: row.Revision, Created: time.Unix(0, row.Created).UTC(),
			Msgpack: row.Msgpack, Value: append([]byte(nil), row.Value...)})
		return true
	})
	if err == nil {
		err = rowErr
	}
	if err != nil {
		return State{}, err
	}
	_, err = view.Anomalies(shape.Bucket, r.Node, math.MaxInt, func(a provisioner.Anomaly) {
		st.Anomalies = append(st.Anomalies, a)
	})
	return st, err
}

// Revision is one event of a key's history.
type Revision struct {
	Seq   uint64
	Time  time.Time
	Op    provisioner.Op
	Value []byte
}

// KeyHistory is every revision of one key the log keeps, oldest first, and what the log cannot show.
type KeyHistory struct {
	Bucket    string
	Key       string
	Revisions []Revision
	// Floor is the bucket's history floor: revisions of the key at or below it were compacted to the
	// newest one (a delete at or below it is gone with the revisions it removed), and of a
	// composed-<node> key to its newest published one too, which a later refusal, pending composition
	// or delete (then kept) holds the module at.
	Floor uint64
	// Gaps are ranges of messages the stream removed before they were read; a revision of this key
	// may be among them.
	Gaps []store.Gap
}

// History reads every revision of one key that the log keeps, all in memory (EachRevision walks them
// one at a time).
func (l *Log) History(bucket, key string) (KeyHistory, error) {
	var revs []Revision
	h, err := l.EachRevision(context.Background(), bucket, key, func(r *Revision) error {
		c := *r
		c.Value = append([]byte(nil), r.Value...)
		revs = append(revs, c)
		return nil
	})
	h.Revisions = revs
	return h, err
}

// ValueJSON renders a stored value for people and scripts: its JSON when it is one MessagePack object,
// and ok false when it is not (the caller shows the raw bytes).
func ValueJSON(v []byte) (string, bool) {
	if !mpk.Valid(v) {
		return "", false
	}
	out, _, err := mpk.AppendJSON(nil, v)
	if err != nil {
		return "", false
	}
	return string(out), true
}
