package query

import (
	"context"
	"sort"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/store"
)

// What: plans (CONTRACT section 6) reads the plans projection, which the store keeps from three kinds
// of input bucket: mesh-host_modules, mesh-indexer_builds and one composed-<node> per node. So:
//
//   - as_of is a map, bucket -> the stream sequence its projection had applied when the answer was
//     read: mesh-host_modules, mesh-indexer_builds, and composed-<node> of every node with a row in
//     this page (and of the node asked for). One number could not say how far each input was read.
//   - min_seq is a sequence of composed-<node>, the node's own compositions, and needs node: a node
//     engine that just published a composition waits for it to be in its node's plans.
//   - anomalies are those of the inputs, in byte order of bucket then raw key: composed-<node> (of the
//     node asked for, or of every node), mesh-host_modules narrowed by node, and mesh-indexer_builds
//     whole, since its keys name modules, not nodes, and a bad newest build concerns every node.

// PlansView is one consistent read of the projection, with the plans.
type PlansView interface {
	View
	Plans(node, module, after string, fn func(*provisioner.PlanRow) bool) error
	HasPlan(node, module, key string) (bool, error)
	// ComposedAnomalies lists the anomaly rows of every composed-<node> bucket, in byte order of
	// bucket then raw key, at most max, and returns how many there are.
	ComposedAnomalies(max int, fn func(provisioner.Anomaly)) (int64, error)
}

// PlansReader is what the plans answer needs of the projection.
type PlansReader interface {
	// PlansView opens a view for a plans answer that says synced as given (store.DB.AnswerView).
	PlansView(synced bool) (PlansView, error)
	Applied(bucket string) (seq uint64, synced bool)
	Reach(bucket string) uint64
	Changed(bucket string) <-chan struct{}
}

var _ PlansView = (*store.View)(nil)

// StorePlans adapts a store to PlansReader.
func StorePlans(db *store.DB) PlansReader { return storePlans{db} }

type storePlans struct{ *store.DB }

// Applied is as the answers see it (store.DB.Answered).
func (s storePlans) Applied(bucket string) (uint64, bool) { return s.DB.Answered(bucket) }

func (s storePlans) PlansView(synced bool) (PlansView, error) {
	v, err := s.DB.AnswerView(synced)
	if err != nil {
		return nil, err
	}
	return v, nil
}

// Plans answers what: plans from the projection, for Options.Plans. synced says whether the inputs of
// an answer narrowed by node ("" for every node) have caught up with their streams since start. wake,
// when set, is told of a composed-<node> bucket that a request waits on (min_seq) before it is reached:
// an idle bucket without a consumer tails again at once (projector.Projector.Wake).
func Plans(src PlansReader, synced func(node string) bool, wake func(bucket string)) AtFunc {
	return func(ctx context.Context, r *Request, e *Encoder) error {
		var bucket string
		if r.MinSeq > 0 {
			if r.Node == "" {
				return BadRequest("min_seq of plans is a sequence of the node's composed-<node> bucket: name the node")
			}
			bucket = provisioner.ComposedPrefix + r.Node
			if err := reached(r, bucket, src.Reach(bucket)); err != nil {
				if wake != nil {
					wake(bucket)
				}
				return err // the caller waits (waiters.go) or answers 504
			}
		}
		// synced before the view, which it chooses: a synced answer reads what a kill cannot take back
		// (store.DB.AnswerView).
		synced := synced(r.Node)
		v, err := src.PlansView(synced)
		if err != nil {
			return err
		}
		defer v.Close()
		if bucket != "" {
			// The view's composed-<node> is its as_of: a rebuild may have swapped in a store behind
			// min_seq since the check above, or one whose open history gap holds it (as Answer does).
			cp, err := v.Checkpoint(bucket)
			if err != nil {
				return err
			}
			if err := reached(r, bucket, min(cp.Applied, src.Reach(bucket))); err != nil {
				return err
			}
		}
		return AnswerPlans(v, r, e, synced)
	}
}

// AnswerPlans writes the answer to a request of plans from a view: one page of rows narrowed by node
// and module, the inputs' anomalies, as_of per input bucket as the view sees them, and synced as
// given.
func AnswerPlans(v PlansView, r *Request, e *Encoder, synced bool) error {
	if r.After != "" {
		ok, err := v.HasPlan(r.Node, r.Module, r.After)
		if err != nil {
			return err
		}
		if !ok {
			return NotFound("after %q: no such row in this answer any more; start again without after", r.After)
		}
	}
	// The anomalies first, aside: the rows take the room they leave (limits.go).
	ahead, err := e.writeAhead(func(a *Encoder) error { return a.PlanAnomalies(v, r.Node) })
	if err != nil {
		return err
	}
	e.BeginAnswer(r.What)
	limit := r.limit()
	n := 0
	var next, last string
	nodes := map[string]struct{}{}
	// asOfBytes is about what as_of will take: a member per input bucket of the page (limits.go keeps
	// the answer within one NATS message, and as_of grows with the nodes of the page).
	asOfBytes := 2 * asOfMember(provisioner.BucketIndexerBuilds)
	if r.Node != "" {
		nodes[r.Node] = struct{}{}
		asOfBytes += asOfMember(provisioner.ComposedPrefix + r.Node)
	}
	err = v.Plans(r.Node, r.Module, r.After, func(row *provisioner.PlanRow) bool {
		if n == limit {
			next = last
			return false
		}
		m := e.mark()
		e.PlanRow(row)
		key := row.Key()
		grow := 0
		if _, ok := nodes[row.Node]; !ok {
			grow = asOfMember(provisioner.ComposedPrefix + row.Node)
		}
		if n > 0 && e.max > 0 && len(e.buf)+len(key)+tailReserve+asOfBytes+grow > e.rowsShare() {
			// Past the rows' share of the bound: the page ends here, as at its limit.
			e.rewind(m)
			next = last
			return false
		}
		asOfBytes += grow
		last = key
		nodes[row.Node] = struct{}{}
		n++
		return true
	})
	if err != nil {
		return err
	}
	e.EndRows()
	e.reserveTail(len(next) + asOfBytes)
	if !e.appendAhead(ahead) {
		// Larger than a quarter of the bound: written again in place, in what the rows left.
		if err := e.PlanAnomalies(v, r.Node); err != nil {
			return err
		}
	}
	buckets := []string{provisioner.BucketHostModules, provisioner.BucketIndexerBuilds}
	for node := range nodes {
		buckets = append(buckets, provisioner.ComposedPrefix+node)
	}
	sort.Strings(buckets)
	asOf := make([]BucketSeq, 0, len(buckets))
	for _, b := range buckets {
		cp, err := v.Checkpoint(b)
		if err != nil {
			return err
		}
		asOf = append(asOf, BucketSeq{Bucket: b, Seq: cp.Applied})
	}
	e.EndAnswerAsOf(asOf, synced, next)
	return nil
}

// PlanAnomalies writes anomalies and anomalies_total of the plans' inputs: composed-<node> of node
// (of every node when node is empty), mesh-host_modules narrowed by node, and mesh-indexer_builds, in
// byte order of bucket then raw key, at most MaxAnomalies of them.
func (e *Encoder) PlanAnomalies(v PlansView, node string) error {
	var buckets []string
	if node != "" {
		buckets = append(buckets, provisioner.ComposedPrefix+node)
	}
	buckets = append(buckets, provisioner.BucketHostModules, provisioner.BucketIndexerBuilds)
	e.key("anomalies")
	e.openArray(-1)
	var total int64
	left := MaxAnomalies
	write := e.boundedAnomaly() // one for every bucket: once one does not fit, none after it is written
	if node == "" {
		// Every node's: one count and the rows listed, not a read of every node's bucket.
		t, err := v.ComposedAnomalies(left, func(a provisioner.Anomaly) {
			write(a)
			left--
		})
		if err != nil {
			return err
		}
		total += t
	}
	for _, b := range buckets {
		narrow := ""
		if b == provisioner.BucketHostModules {
			narrow = node
		}
		t, err := v.Anomalies(b, narrow, left, func(a provisioner.Anomaly) {
			write(a)
			left--
		})
		if err != nil {
			return err
		}
		total += t
	}
	e.closeArray()
	e.key("anomalies_total")
	e.int(total)
	return nil
}

// asOfMember is about the bytes a bucket's member of as_of takes, in either format.
func asOfMember(bucket string) int { return len(bucket) + 16 }

// BucketSeq is one bucket's applied stream sequence.
type BucketSeq struct {
	Bucket string
	Seq    uint64
}

// EndAnswerAsOf writes as_of as a map of bucket to sequence, synced and, when more rows follow, next;
// and closes the answer.
func (e *Encoder) EndAnswerAsOf(asOf []BucketSeq, synced bool, next string) {
	e.key("as_of")
	e.openMap(len(asOf))
	for _, b := range asOf {
		e.key(b.Bucket)
		e.uint(b.Seq)
	}
	e.closeMap()
	e.key("synced")
	e.bool(synced)
	if next != "" {
		e.key("next")
		e.str(next)
	}
	e.closeMap()
}

// PlanRow writes one row of plans: key, node, module, want, have and newest_build as read (each only
// when set), current, and newest when the newest build is ahead.
func (e *Encoder) PlanRow(r *provisioner.PlanRow) {
	n := 4
	for _, b := range []provisioner.OptBuild{r.Want, r.Have, r.NewestBuild} {
		if b.Set {
			n++
		}
	}
	if r.HasNewest {
		n++
	}
	e.openMap(n)
	e.key("key")
	e.str(r.Key())
	e.key("node")
	e.str(r.Node)
	e.key("module")
	e.str(r.Module)
	for _, f := range []struct {
		k string
		b provisioner.OptBuild
	}{{"want", r.Want}, {"have", r.Have}, {"newest_build", r.NewestBuild}} {
		if f.b.Set {
			e.key(f.k)
			e.uint(f.b.N)
		}
	}
	e.key("current")
	e.planEntry(&r.Current)
	if r.HasNewest {
		e.key("newest")
		e.planEntry(&r.Newest)
	}
	e.closeMap()
}

// planEntry writes a plan entry: status, held_because when held, and, when it has a plan, build,
// revision, created and plan (the composition's plan as published: MessagePack passes through, JSON
// is transcoded; null when the composition had none).
func (e *Encoder) planEntry(p *provisioner.PlanEntry) {
	n := 1
	if p.Status == provisioner.EntryHeld {
		n++
	}
	if p.HasPlan {
		n += 4
	}
	e.openMap(n)
	e.key("status")
	e.str(p.Status.String())
	if p.Status == provisioner.EntryHeld {
		e.key("held_because")
		e.str(p.HeldBecause.String())
	}
	if p.HasPlan {
		e.key("build")
		e.uint(p.From.Build)
		e.key("revision")
		e.uint(p.From.Revision)
		e.key("created")
		e.time(p.From.Created)
		e.key("plan")
		switch {
		case p.From.Plan == nil:
			e.null()
		case !e.msgpack(p.From.Plan):
			// Only JSON can fail (keys nested too deep, a NaN or infinite float), and only JSON has
			// no count to keep.
			e.null()
			e.key("plan_raw")
			e.bin(p.From.Plan)
		}
	}
	e.closeMap()
}
