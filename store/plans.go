package store

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"

	"github.com/cockroachdb/pebble/v2"

	provisioner "github.com/novox/mesh-provisioner"
)

// The plans projection (CONTRACT section 6) lives under prefixPlan, in three parts (doc.go has the
// layout):
//
//   - 'b' a BuildRecord per node, module and build: the fold of composed-<node> messages that the
//     plan rules read (the status at a build, the most recently published revision at builds in a
//     range). It is the "last plan kept" state, derived from the bucket's history alone.
//   - 'r' a plan row per <node>.<module> that mesh-host_modules holds, as ComputePlan made it.
//   - 'm' the rows by module, so a module's new newest build finds its rows on every node in one scan.
//
// Apply updates them in the batch of the input message: a message of composed-<node> recomputes the
// one row of its node and module, one of mesh-host_modules its own row, one of mesh-indexer_builds the
// rows of its module. Rows are recomputed once per batch however many of its messages touch them.
const (
	planRowTag   = 'r'
	planIndexTag = 'm'
	planBuildTag = 'b'
)

func planRowPrefix(dst []byte) []byte { return append(dst, prefixPlan, planRowTag) }

func planRowKey(dst []byte, key string) []byte { return appendEsc(planRowPrefix(dst), key) }

func planIndexPrefix(dst []byte, module string) []byte {
	return appendComp(append(dst, prefixPlan, planIndexTag), module)
}

func planIndexKey(dst []byte, module, key string) []byte {
	return appendEsc(planIndexPrefix(dst, module), key)
}

func planBuildPrefix(dst []byte, node, module string) []byte {
	return appendComp(appendComp(append(dst, prefixPlan, planBuildTag), node), module)
}

func planBuildKey(dst []byte, node, module string, build uint64) []byte {
	return binary.BigEndian.AppendUint64(planBuildPrefix(dst, node, module), build)
}

// A build record: status byte, flags (bit 0: has a published revision, bit 1: that revision has a
// plan), then for the published revision uvarint revision, varint created and the plan.
const (
	recPublished = 1
	recPlan      = 2
)

func appendBuildRecord(dst []byte, r *provisioner.BuildRecord) []byte {
	var f byte
	if r.HasPublished {
		f |= recPublished
		if r.Published.Plan != nil {
			f |= recPlan
		}
	}
	dst = append(dst, byte(r.Status), f)
	if r.HasPublished {
		dst = binary.AppendUvarint(dst, r.Published.Revision)
		dst = binary.AppendVarint(dst, r.Published.Created)
		dst = append(dst, r.Published.Plan...)
	}
	return dst
}

// decodeBuildRecord reads a build record; the plan aliases b.
func decodeBuildRecord(b []byte, build uint64, r *provisioner.BuildRecord) error {
	if len(b) < 2 {
		return fmt.Errorf("%w: plan build record", ErrCorrupt)
	}
	f := b[1]
	*r = provisioner.BuildRecord{Status: provisioner.CompStatus(b[0]), HasPublished: f&recPublished != 0}
	if !r.HasPublished {
		return nil
	}
	b = b[2:]
	var n int
	r.Published.Build = build
	if r.Published.Revision, n = binary.Uvarint(b); n <= 0 {
		return fmt.Errorf("%w: plan build record revision", ErrCorrupt)
	}
	b = b[n:]
	if r.Published.Created, n = binary.Varint(b); n <= 0 {
		return fmt.Errorf("%w: plan build record time", ErrCorrupt)
	}
	if f&recPlan != 0 {
		r.Published.Plan = b[n:len(b):len(b)]
	}
	return nil
}

// A plan row: flags (bit 0 want, 1 have, 2 newest build, 3 a newest entry), uvarints of the builds
// set, then the current entry and, when there is one, the newest entry. An entry: status, held
// because, flags (bit 0 has a plan revision, bit 1 that revision has a plan), then uvarint build,
// uvarint revision, varint created, uvarint plan length and the plan.
const (
	rowWant   = 1
	rowHave   = 2
	rowNewest = 4
	rowEntry2 = 8
)

func appendPlanRow(dst []byte, r *provisioner.PlanRow) []byte {
	var f byte
	if r.Want.Set {
		f |= rowWant
	}
	if r.Have.Set {
		f |= rowHave
	}
	if r.NewestBuild.Set {
		f |= rowNewest
	}
	if r.HasNewest {
		f |= rowEntry2
	}
	dst = append(dst, f)
	for _, b := range []provisioner.OptBuild{r.Want, r.Have, r.NewestBuild} {
		if b.Set {
			dst = binary.AppendUvarint(dst, b.N)
		}
	}
	dst = appendPlanEntry(dst, &r.Current)
	if r.HasNewest {
		dst = appendPlanEntry(dst, &r.Newest)
	}
	return dst
}

func appendPlanEntry(dst []byte, e *provisioner.PlanEntry) []byte {
	var f byte
	if e.HasPlan {
		f |= recPublished
		if e.From.Plan != nil {
			f |= recPlan
		}
	}
	dst = append(dst, byte(e.Status), byte(e.HeldBecause), f)
	if e.HasPlan {
		dst = binary.AppendUvarint(dst, e.From.Build)
		dst = binary.AppendUvarint(dst, e.From.Revision)
		dst = binary.AppendVarint(dst, e.From.Created)
		dst = binary.AppendUvarint(dst, uint64(len(e.From.Plan)))
		dst = append(dst, e.From.Plan...)
	}
	return dst
}

// decodePlanRow reads a plan row stored under a raw key; plans alias b.
func decodePlanRow(key, b []byte, r *provisioner.PlanRow) error {
	node, module, ok := strings.Cut(string(key), ".")
	if !ok || len(b) < 1 {
		return fmt.Errorf("%w: plan row %q", ErrCorrupt, key)
	}
	*r = provisioner.PlanRow{Node: node, Module: module}
	f := b[0]
	b = b[1:]
	for i, dst := range []*provisioner.OptBuild{&r.Want, &r.Have, &r.NewestBuild} {
		if f&(1<<i) == 0 {
			continue
		}
		v, n := binary.Uvarint(b)
		if n <= 0 {
			return fmt.Errorf("%w: plan row %q builds", ErrCorrupt, key)
		}
		*dst = provisioner.Some(v)
		b = b[n:]
	}
	var err error
	if b, err = decodePlanEntry(b, &r.Current); err != nil {
		return fmt.Errorf("plan row %q: %w", key, err)
	}
	if f&rowEntry2 != 0 {
		r.HasNewest = true
		if _, err = decodePlanEntry(b, &r.Newest); err != nil {
			return fmt.Errorf("plan row %q: %w", key, err)
		}
	}
	return nil
}

func decodePlanEntry(b []byte, e *provisioner.PlanEntry) ([]byte, error) {
	if len(b) < 3 {
		return nil, fmt.Errorf("%w: plan entry", ErrCorrupt)
	}
	*e = provisioner.PlanEntry{Status: provisioner.EntryStatus(b[0]), HeldBecause: provisioner.CompStatus(b[1]), HasPlan: b[2]&recPublished != 0}
	hasPlanBytes := b[2]&recPlan != 0
	b = b[3:]
	if !e.HasPlan {
		return b, nil
	}
	var vals [4]uint64
	for i := range vals {
		var n int
		if i == 2 {
			var c int64
			c, n = binary.Varint(b)
			e.From.Created = c
		} else {
			vals[i], n = binary.Uvarint(b)
		}
		if n <= 0 {
			return nil, fmt.Errorf("%w: plan entry", ErrCorrupt)
		}
		b = b[n:]
	}
	e.From.Build, e.From.Revision = vals[0], vals[1]
	if uint64(len(b)) < vals[3] {
		return nil, fmt.Errorf("%w: plan entry plan", ErrCorrupt)
	}
	if hasPlanBytes {
		e.From.Plan = b[:vals[3]:vals[3]]
	}
	return b[vals[3]:], nil
}

// planBatch is what one Apply of a plans' input bucket touches: the rows to recompute at the end of
// the batch, and the modules whose newest build changed. The batch is write-only, so what its own
// messages changed is kept here too, and read before the committed state: the host rows (a batch of
// mesh-host_modules), the newest builds (of mesh-indexer_builds), the build records (of a
// composed-<node>). Everything else a recompute reads is committed, and stable under applyMu.
type planBatch struct {
	rows    map[[2]string]bool // node, module -> whole row (false: only its newest entry)
	modules map[string]struct{}
	hosts   map[string]hostState                              // <node>.<module> -> as this batch leaves it
	newest  map[string]provisioner.OptBuild                   // module -> newest: this batch's, or read once
	builds  map[[2]string]map[uint64]*provisioner.BuildRecord // node, module -> build -> record; nil: gone
	comps   planComps
	row     []byte
}

type hostState struct {
	host    provisioner.HostModule
	present bool
}

// PlanStats counts the plans projection's work since the store was opened.
type PlanStats struct {
	// RowsRecomputed is how many plan rows Apply recomputed: one per row touched by a batch.
	RowsRecomputed int64
}

// PlanStats returns the plans projection's counters.
func (db *DB) PlanStats() PlanStats {
	return PlanStats{RowsRecomputed: db.planRows.Load()}
}

// planMessage folds one message of a plans' input bucket whose key fits its shape: a bad-value
// anomaly for a value out of shape, the composition's build record, and the rows it touches.
func (a *applier) planMessage(bucket string, p *provisioner.Parts, m *provisioner.Message, valid bool) error {
	pb := a.plans
	if pb == nil {
		pb = &planBatch{rows: map[[2]string]bool{}, modules: map[string]struct{}{}, hosts: map[string]hostState{},
			newest: map[string]provisioner.OptBuild{}, builds: map[[2]string]map[uint64]*provisioner.BuildRecord{}}
		pb.comps.a = a
		a.plans = pb
	}
	var verr error
	put := m.Op == provisioner.OpPut
	switch bucket {
	case provisioner.BucketHostModules:
		var h provisioner.HostModule
		if put && valid {
			h, verr = provisioner.DecodeHostModule(m.Value)
		}
		pb.hosts[m.Key] = hostState{host: h, present: put}
		pb.rows[[2]string{p.Node, p.Module}] = true
	case provisioner.BucketIndexerBuilds:
		var n provisioner.OptBuild
		if put && valid {
			n, verr = provisioner.DecodeIndexerBuild(m.Value)
		}
		pb.newest[p.Module] = n
		pb.modules[p.Module] = struct{}{}
	default: // composed-<node>
		if put && valid {
			_, verr = provisioner.DecodeComposition(m.Value)
		}
		if err := a.foldBuild(p, m); err != nil {
			return err
		}
		pb.rows[[2]string{p.Node, p.Module}] = true
	}
	var ve *provisioner.ValueError
	if errors.As(verr, &ve) {
		a.setAnomaly(bucket, m.Key, classValue, m.Seq, provisioner.ReasonBadValue, ve.Detail)
		return nil
	}
	return verr
}

// foldBuild folds a composed-<node> message into its build's record: as this batch left it, or as
// committed.
func (a *applier) foldBuild(p *provisioner.Parts, m *provisioner.Message) error {
	nm := [2]string{p.Node, p.Module}
	recs := a.plans.builds[nm]
	if recs == nil {
		recs = map[uint64]*provisioner.BuildRecord{}
		a.plans.builds[nm] = recs
	}
	key := planBuildKey(nil, p.Node, p.Module, p.Build)
	rec, ok := recs[p.Build]
	if !ok {
		rec = &provisioner.BuildRecord{}
		v, closer, err := a.db.pdb.Get(key)
		switch {
		case errors.Is(err, pebble.ErrNotFound):
		case err != nil:
			return err
		default:
			err = decodeBuildRecord(v, p.Build, rec)
			if err == nil && rec.Published.Plan != nil {
				rec.Published.Plan = append([]byte(nil), rec.Published.Plan...)
			}
			closer.Close()
			if err != nil {
				return err
			}
		}
	} else if rec == nil {
		rec = &provisioner.BuildRecord{}
	}
	if !rec.Fold(m, p.Build) {
		recs[p.Build] = nil
		a.delete(key)
		return nil
	}
	recs[p.Build] = rec
	a.val = appendBuildRecord(a.val[:0], rec)
	a.set(key, a.val)
	return nil
}

// recomputePlans recomputes every row the batch touched: the rows touched one by one, and the rows of
// the modules whose newest build changed, found by the module index; of those, only the newest entry,
// since the current one does not depend on the newest build.
func (a *applier) recomputePlans() error {
	pb := a.plans
	for module := range pb.modules {
		lo := planIndexPrefix(nil, module)
		it, err := a.db.pdb.NewIter(&pebble.IterOptions{LowerBound: lo, UpperBound: prefixEnd(lo)})
		if err != nil {
			return err
		}
		for it.First(); it.Valid(); it.Next() {
			key := unesc(nil, it.Key()[len(lo):])
			node, _, _ := strings.Cut(string(key), ".")
			nm := [2]string{node, module}
			pb.rows[nm] = pb.rows[nm] // whole when touched otherwise too

		}
		if err := it.Close(); err != nil {
			return err
		}
	}
	for nm, whole := range pb.rows {
		if err := a.recomputePlan(nm[0], nm[1], whole); err != nil {
			return fmt.Errorf("plan %s.%s: %w", nm[0], nm[1], err)
		}
	}
	return nil
}

// recomputePlan recomputes one row from its inputs as the batch leaves them, and writes it (with its
// module index entry) when it changed; a row whose mesh-host_modules key is gone is deleted. Unless
// whole, only the newest entry is recomputed, and the rest kept from the stored row.
func (a *applier) recomputePlan(node, module string, whole bool) error {
	pb := a.plans
	key := node + "." + module
	a.db.planRows.Add(1)
	newest, ok := pb.newest[module]
	if !ok {
		var err error
		if newest, err = a.indexerNewest(module); err != nil {
			return err
		}
		pb.newest[module] = newest
	}
	pb.comps.node, pb.comps.module = node, module
	pb.comps.overlay = pb.builds[[2]string{node, module}]

	rk := planRowKey(nil, key)
	old, closer, err := a.db.pdb.Get(rk)
	switch {
	case errors.Is(err, pebble.ErrNotFound):
		old, whole = nil, true
	case err != nil:
		return err
	default:
		defer closer.Close()
	}
	var row provisioner.PlanRow
	if whole {
		hs, ok := pb.hosts[key]
		if !ok {
			if hs, err = a.hostModule(key); err != nil {
				return err
			}
		}
		if !hs.present {
			if old == nil {
				return nil
			}
			a.delete(rk)
			a.delete(planIndexKey(nil, module, key))
			return nil
		}
		if row, err = provisioner.ComputePlan(node, module, hs.host, newest, &pb.comps); err != nil {
			return err
		}
	} else {
		if err := decodePlanRow([]byte(key), old, &row); err != nil {
			return err
		}
		row.NewestBuild = newest
		host := provisioner.HostModule{Want: row.Want, Have: row.Have}
		if row.Newest, row.HasNewest, err = provisioner.ComputeNewest(host, newest, &pb.comps); err != nil {
			return err
		}
	}
	pb.row = appendPlanRow(pb.row[:0], &row)
	if bytes.Equal(old, pb.row) {
		return nil
	}
	a.set(rk, pb.row)
	if old != nil {
		return nil // its index entry is there
	}
	a.set(planIndexKey(nil, module, key), nil)
	return nil
}

// hostModule reads want and have of a committed mesh-host_modules row. A value out of shape reads
// what it can (its anomaly says the rest).
func (a *applier) hostModule(key string) (hostState, error) {
	v, closer, err := a.db.pdb.Get(rowKey(nil, provisioner.BucketHostModules, key))
	if errors.Is(err, pebble.ErrNotFound) {
		return hostState{}, nil
	}
	if err != nil {
		return hostState{}, err
	}
	defer closer.Close()
	var row provisioner.Row
	if err := decodeRowValue(v, &row); err != nil {
		return hostState{}, err
	}
	hs := hostState{present: true}
	if row.Msgpack {
		hs.host, _ = provisioner.DecodeHostModule(row.Value)
	}
	return hs, nil
}

// indexerNewest reads a module's committed newest build.
func (a *applier) indexerNewest(module string) (provisioner.OptBuild, error) {
	v, closer, err := a.db.pdb.Get(rowKey(nil, provisioner.BucketIndexerBuilds, module))
	if errors.Is(err, pebble.ErrNotFound) {
		return provisioner.OptBuild{}, nil
	}
	if err != nil {
		return provisioner.OptBuild{}, err
	}
	defer closer.Close()
	var row provisioner.Row
	if err := decodeRowValue(v, &row); err != nil {
		return provisioner.OptBuild{}, err
	}
	if !row.Msgpack {
		return provisioner.OptBuild{}, nil
	}
	n, _ := provisioner.DecodeIndexerBuild(row.Value)
	return n, nil
}

// planComps reads one module's build records on one node, this batch's before the committed ones:
// provisioner.Compositions for ComputePlan.
type planComps struct {
	a            *applier
	node, module string
	overlay      map[uint64]*provisioner.BuildRecord // this batch's records; nil: gone
	// none says the node's build records are all gone in this batch (Forget): there are none.
	none bool
}

func (c *planComps) Status(build uint64) (provisioner.CompStatus, error) {
	if c.none {
		return provisioner.CompMissing, nil
	}
	if rec, ok := c.overlay[build]; ok {
		if rec == nil {
			return provisioner.CompMissing, nil
		}
		return rec.Status, nil
	}
	v, closer, err := c.a.db.pdb.Get(planBuildKey(nil, c.node, c.module, build))
	if errors.Is(err, pebble.ErrNotFound) {
		return provisioner.CompMissing, nil
	}
	if err != nil {
		return 0, err
	}
	defer closer.Close()
	if len(v) < 1 {
		return 0, fmt.Errorf("%w: plan build record", ErrCorrupt)
	}
	return provisioner.CompStatus(v[0]), nil
}

func (c *planComps) LastPublished(lo, hi uint64) (provisioner.PlanRevision, bool, error) {
	if c.none {
		return provisioner.PlanRevision{}, false, nil
	}
	best, found, err := lastPublished(c.a.db.pdb.NewIter, c.node, c.module, lo, hi, c.overlay)
	if err != nil {
		return best, found, err
	}
	for b, rec := range c.overlay {
		if b < lo || b > hi || rec == nil || !rec.HasPublished {
			continue
		}
		if !found || rec.Published.Revision > best.Revision {
			best, found = rec.Published, true
		}
	}
	return best, found, nil
}

// lastPublished scans the build records of builds lo..hi for the most recently published revision,
// skipping the builds in skip (read elsewhere). The plan is copied out of the iterator.
func lastPublished(newIter func(*pebble.IterOptions) (*pebble.Iterator, error), node, module string, lo, hi uint64, skip map[uint64]*provisioner.BuildRecord) (provisioner.PlanRevision, bool, error) {
	var best provisioner.PlanRevision
	found := false
	if lo > hi {
		return best, false, nil
	}
	p := planBuildPrefix(nil, node, module)
	lower := binary.BigEndian.AppendUint64(append([]byte(nil), p...), lo)
	var upper []byte
	if hi == ^uint64(0) {
		upper = prefixEnd(p)
	} else {
		upper = binary.BigEndian.AppendUint64(append([]byte(nil), p...), hi+1)
	}
	it, err := newIter(&pebble.IterOptions{LowerBound: lower, UpperBound: upper})
	if err != nil {
		return best, false, err
	}
	var rec provisioner.BuildRecord
	for it.First(); it.Valid(); it.Next() {
		k := it.Key()
		if len(k) != len(p)+8 {
			it.Close()
			return best, false, fmt.Errorf("%w: plan build key %q", ErrCorrupt, k)
		}
		build := binary.BigEndian.Uint64(k[len(p):])
		if _, ok := skip[build]; ok {
			continue
		}
		if err := decodeBuildRecord(it.Value(), build, &rec); err != nil {
			it.Close()
			return best, false, err
		}
		if rec.HasPublished && (!found || rec.Published.Revision > best.Revision) {
			best, found = rec.Published, true
			if best.Plan != nil {
				best.Plan = append([]byte(nil), best.Plan...)
			}
		}
	}
	return best, found, it.Close()
}

// Plans calls fn for the plan rows narrowed by node and module, in byte order of their keys
// <node>.<module>, strictly after the key after when it is set, until fn returns false. The row and
// its plans are valid only during the call.
func (v *View) Plans(node, module, after string, fn func(*provisioner.PlanRow) bool) error {
	var row provisioner.PlanRow
	if node == "" && module != "" {
		// Every node's row of one module: the module index, then each row by its key.
		base := planIndexPrefix(nil, module)
		lo := base
		if after != "" {
			lo = append(appendEsc(append([]byte(nil), base...), after), 0x00)
		}
		it, err := v.snap.NewIter(&pebble.IterOptions{LowerBound: lo, UpperBound: prefixEnd(base)})
		if err != nil {
			return err
		}
		var rk []byte
		for it.First(); it.Valid(); it.Next() {
			key := unesc(nil, it.Key()[len(base):])
			rk = planRowKey(rk[:0], string(key))
			val, closer, err := v.snap.Get(rk)
			if errors.Is(err, pebble.ErrNotFound) {
				it.Close()
				return fmt.Errorf("%w: plan index names %q, which has no row", ErrCorrupt, key)
			}
			if err != nil {
				it.Close()
				return err
			}
			err = decodePlanRow(key, val, &row)
			more := err == nil && fn(&row)
			closer.Close()
			if err != nil {
				it.Close()
				return err
			}
			if !more {
				break
			}
		}
		return it.Close()
	}
	base := planRowPrefix(nil)
	prefix := ""
	switch {
	case node != "" && module != "":
		prefix = node + "." + module
	case node != "":
		prefix = node + "."
	}
	lo := appendEsc(append([]byte(nil), base...), prefix)
	var hi []byte
	if node != "" && module != "" {
		hi = append(append([]byte(nil), lo...), 0x00) // the one key
	} else {
		hi = prefixEnd(lo)
	}
	if after != "" {
		a := append(appendEsc(append([]byte(nil), base...), after), 0x00)
		if bytes.Compare(a, lo) > 0 {
			lo = a
		}
	}
	if bytes.Compare(lo, hi) >= 0 {
		return nil
	}
	it, err := v.snap.NewIter(&pebble.IterOptions{LowerBound: lo, UpperBound: hi})
	if err != nil {
		return err
	}
	for it.First(); it.Valid(); it.Next() {
		if err := decodePlanRow(unesc(nil, it.Key()[len(base):]), it.Value(), &row); err != nil {
			it.Close()
			return err
		}
		if !fn(&row) {
			break
		}
	}
	return it.Close()
}

// HasPlan reports whether the plan row of a key exists and is one that node and module narrow to: a
// cursor that names a row no longer there cannot be paged on.
func (v *View) HasPlan(node, module, key string) (bool, error) {
	n, m, ok := strings.Cut(key, ".")
	if !ok || (node != "" && n != node) || (module != "" && m != module) {
		return false, nil
	}
	_, closer, err := v.snap.Get(planRowKey(nil, key))
	if errors.Is(err, pebble.ErrNotFound) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	closer.Close()
	return true, nil
}

// Checkpoints calls fn for the checkpoint of every bucket whose name starts with prefix, in byte order
// of their names, as this view sees them.
func (v *View) Checkpoints(prefix string, fn func(bucket string, cp Checkpoint)) error {
	lo := checkpointKey(prefix)
	it, err := v.snap.NewIter(&pebble.IterOptions{LowerBound: lo, UpperBound: prefixEnd(lo)})
	if err != nil {
		return err
	}
	for it.First(); it.Valid(); it.Next() {
		cp, err := decodeCheckpoint(it.Value())
		if err != nil {
			it.Close()
			return err
		}
		fn(string(unesc(nil, it.Key()[1:])), cp)
	}
	return it.Close()
}
