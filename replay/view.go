package replay

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strings"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/mpk"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/store"
)

// asOf is a query.View of one bucket as of a point, read from the event log: query.AnswerView answers
// from it exactly as it answers from the live projection, paging and all.
type asOf struct {
	// ctx stops a walk of the state (a page, or the anomalies every page counts, which read every key
	// of the bucket, or of the node): at each key.
	ctx    context.Context
	v      *store.View
	shape  provisioner.Shape
	n      uint64
	kinds  map[string]struct{} // the registry's kinds at the moment; needs only
	closer func() error
	// cache keeps the anomalies of the state for the next pages (anomcache.go); nil: none kept.
	cache *anomalyCache
	key   anomalyKey
}

var _ query.View = (*asOf)(nil)

// newAsOf returns the view of a resolved point; for needs it reads the registry's kinds at the moment.
func newAsOf(v *store.View, r Resolved) (*asOf, error) {
	shape, ok := provisioner.ShapeOf(r.Bucket)
	if !ok {
		return nil, fmt.Errorf("replay: no shape for bucket %q", r.Bucket)
	}
	a := &asOf{ctx: context.Background(), v: v, shape: shape, n: r.Seq, key: anomalyKey{store: v.StoreID(), rewrites: v.Rewrites(), bucket: r.Bucket, seq: r.Seq}}
	if r.Bucket == provisioner.BucketNeeds && r.Seq > 0 {
		kinds, n, err := registryKinds(v, r.RegistryAt)
		if err != nil {
			return nil, err
		}
		a.kinds, a.key.registrySeq = kinds, n
	}
	return a, nil
}

// indexed reports whether a key's parts put it in a secondary index range.
func indexed(bucket string, p *provisioner.Parts, idx provisioner.Index, value string) bool {
	var buf [2]provisioner.IndexValue
	for _, iv := range provisioner.Indexes(buf[:0], bucket, *p) {
		if iv.Index == idx && iv.Value == value {
			return true
		}
	}
	return false
}

// Rows reads a range as of the point. The event log is keyed by raw key only, so a secondary index
// range (module, kind, collection, contributor) is the bucket's keys filtered by their parts; a node's
// range (and a node's collection) is a prefix of the log. The log holds every key, out-of-shape ones
// too: those have no row (only their anomaly), as in the live projection.
func (a *asOf) Rows(r provisioner.Range, fn func(*provisioner.Row) bool) error {
	var row provisioner.Row
	var cerr error
	err := a.v.StateAt(r.Bucket, r.Prefix, r.After, a.n, func(key []byte, ev *store.Event) bool {
		if cerr = a.ctx.Err(); cerr != nil {
			return false
		}
		parts, err := provisioner.ParseKey(a.shape, string(key))
		if err != nil || (r.Index != provisioner.IndexPrimary && !indexed(r.Bucket, &parts, r.Index, r.Value)) {
			return true
		}
		row = provisioner.Row{Key: key, Revision: ev.Seq, Created: ev.Time, Msgpack: mpk.Valid(ev.Value), Value: ev.Value}
		return fn(&row)
	})
	return cmp.Or(err, cerr)
}

// HasRow reports whether the key had a row in the range as of the point.
func (a *asOf) HasRow(r provisioner.Range, key string) (bool, error) {
	if !strings.HasPrefix(key, r.Prefix) {
		return false, nil
	}
	_, ok, err := a.v.KeyAt(r.Bucket, key, a.n)
	if err != nil || !ok {
		return false, err
	}
	parts, err := provisioner.ParseKey(a.shape, key)
	if err != nil {
		return false, nil // out of shape: no row
	}
	return r.Index == provisioner.IndexPrimary || indexed(r.Bucket, &parts, r.Index, r.Value), nil
}

// Anomalies derives the anomaly rows of the bucket as of the point, from each live key and value, with
// the rules and texts of the live store; narrowed by node, it reads the node's key and its prefix only.
// With a cache, they are derived once for the pages that follow (anomcache.go).
func (a *asOf) Anomalies(bucket, node string, max int, fn func(provisioner.Anomaly)) (int64, error) {
	k := a.key
	k.bucket, k.node = bucket, node
	if a.cache != nil && bucket == a.shape.Bucket {
		if e, ok := a.cache.get(k, max); ok {
			for _, an := range e.rows[:min(max, len(e.rows))] {
				fn(an)
			}
			return e.total, nil
		}
	}
	var total int64
	var n int
	var rows []provisioner.Anomaly
	err := a.eachAnomaly(bucket, node, func(an *provisioner.Anomaly) bool {
		total++
		if n < max {
			fn(*an)
			if a.cache != nil {
				rows = append(rows, *an) // its strings are its own
			}
			n++
		}
		return true
	})
	if err == nil && a.cache != nil && bucket == a.shape.Bucket {
		a.cache.put(&anomalyEntry{key: k, total: total, rows: rows})
	}
	return total, err
}

// eachAnomaly calls fn for every anomaly row of the bucket as of the point, narrowed by node, in byte
// order of raw keys (a key's rows in class order), until fn returns false.
func (a *asOf) eachAnomaly(bucket, node string, fn func(*provisioner.Anomaly) bool) error {
	var cerr error
	each := func(key []byte, ev *store.Event) bool {
		if cerr = a.ctx.Err(); cerr != nil {
			return false
		}
		for _, an := range a.derive(string(key), ev) {
			if !fn(&an) {
				return false
			}
		}
		return true
	}
	if node == "" {
		return cmp.Or(a.v.StateAt(bucket, "", "", a.n, each), cerr)
	}
	ev, ok, err := a.v.KeyAt(bucket, node, a.n)
	if err != nil {
		return err
	}
	if ok && !each([]byte(node), &ev) {
		return cerr
	}
	return cmp.Or(a.v.StateAt(bucket, node+".", "", a.n, each), cerr)
}

// derive is the anomaly rows of one live key, in the store's class order: shape, value, kind.
func (a *asOf) derive(key string, ev *store.Event) []provisioner.Anomaly {
	bucket := a.shape.Bucket
	parts, err := provisioner.ParseKey(a.shape, key)
	if err != nil {
		var ke *provisioner.KeyError
		if !errors.As(err, &ke) {
			return nil
		}
		return []provisioner.Anomaly{{Bucket: bucket, Key: key, Revision: ev.Seq, Reason: ke.Reason, Detail: ke.Detail}}
	}
	var out []provisioner.Anomaly
	if !mpk.Valid(ev.Value) {
		out = append(out, provisioner.Anomaly{Bucket: bucket, Key: key, Revision: ev.Seq, Reason: provisioner.ReasonValueNotMsgpack,
			Detail: fmt.Sprintf("%d bytes are not one complete MessagePack object", len(ev.Value))})
	}
	if bucket == provisioner.BucketNeeds {
		if _, ok := a.kinds[parts.Kind]; !ok {
			out = append(out, provisioner.Anomaly{Bucket: bucket, Key: key, Revision: ev.Seq, Reason: provisioner.ReasonUnansweredKind,
				Detail: fmt.Sprintf("no registry entry answers kind %q", parts.Kind)})
		}
	}
	return out
}

// Checkpoint is the point: the view answers as of it.
func (a *asOf) Checkpoint(string) (store.Checkpoint, error) {
	return store.Checkpoint{Applied: a.n}, nil
}

// Close closes the underlying view when this view owns it.
func (a *asOf) Close() error {
	if a.closer != nil {
		return a.closer()
	}
	return nil
}
