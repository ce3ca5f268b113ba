package provisioner

import (
	"sort"
	"strings"
)

// IsPlanInput reports whether a bucket is one of the plans' inputs: mesh-host_modules,
// mesh-indexer_builds, or a composed-<node> bucket.
func IsPlanInput(bucket string) bool {
	if bucket == BucketHostModules || bucket == BucketIndexerBuilds {
		return true
	}
	return IsComposedBucket(bucket)
}

// BuildLog is one module's compositions on one node in memory: a BuildRecord per build.
type BuildLog map[uint64]*BuildRecord

// Status implements Compositions.
func (l BuildLog) Status(build uint64) (CompStatus, error) {
	if r, ok := l[build]; ok {
		return r.Status, nil
	}
	return CompMissing, nil
}

// LastPublished implements Compositions.
func (l BuildLog) LastPublished(lo, hi uint64) (PlanRevision, bool, error) {
	var best PlanRevision
	found := false
	for b, r := range l {
		if b < lo || b > hi || !r.HasPublished {
			continue
		}
		if !found || r.Published.Revision > best.Revision {
			best, found = r.Published, true
		}
	}
	return best, found, nil
}

// PlanInputs folds the plans' input buckets in memory, message by message, and computes plans with
// the same rules as the store's projection. It is the from-scratch reference of that projection:
// replay feeds it a history up to a point (each bucket's messages in stream order) and reads the
// plans as of that point; tests compare the store's incremental projection with it.
type PlanInputs struct {
	host   map[string]HostModule // <node>.<module> -> want, have
	newest map[string]OptBuild   // module -> newest build
	builds map[string]map[string]BuildLog
}

// NewPlanInputs returns empty inputs.
func NewPlanInputs() *PlanInputs {
	return &PlanInputs{host: map[string]HostModule{}, newest: map[string]OptBuild{}, builds: map[string]map[string]BuildLog{}}
}

// Apply folds one message of a plans' input bucket. Messages of other buckets, and keys out of
// shape, change nothing.
func (p *PlanInputs) Apply(bucket string, m *Message) {
	shape, ok := ShapeOf(bucket)
	if !ok || !IsPlanInput(bucket) {
		return
	}
	parts, err := ParseKey(shape, m.Key)
	if err != nil {
		return
	}
	switch bucket {
	case BucketHostModules:
		if m.Op != OpPut {
			delete(p.host, m.Key)
			return
		}
		h, _ := DecodeHostModule(m.Value) // fields out of shape read as absent
		p.host[m.Key] = h
	case BucketIndexerBuilds:
		if m.Op != OpPut {
			delete(p.newest, parts.Module)
			return
		}
		n, _ := DecodeIndexerBuild(m.Value)
		p.newest[parts.Module] = n
	default:
		mods := p.builds[parts.Node]
		if mods == nil {
			mods = map[string]BuildLog{}
			p.builds[parts.Node] = mods
		}
		log := mods[parts.Module]
		if log == nil {
			log = BuildLog{}
			mods[parts.Module] = log
		}
		r := log[parts.Build]
		if r == nil {
			r = &BuildRecord{}
		}
		if r.Fold(m, parts.Build) {
			log[parts.Build] = r
		} else {
			delete(log, parts.Build)
		}
	}
}

// Plan computes the row of one node and module, and reports false when mesh-host_modules does not
// hold it.
func (p *PlanInputs) Plan(node, module string) (PlanRow, bool, error) {
	h, ok := p.host[node+"."+module]
	if !ok {
		return PlanRow{}, false, nil
	}
	log := p.builds[node][module]
	if log == nil {
		log = BuildLog{}
	}
	row, err := ComputePlan(node, module, h, p.newest[module], log)
	return row, err == nil, err
}

// Plans computes every row, in byte order of their keys.
func (p *PlanInputs) Plans() ([]PlanRow, error) {
	keys := make([]string, 0, len(p.host))
	for k := range p.host {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	out := make([]PlanRow, 0, len(keys))
	for _, k := range keys {
		node, module, _ := strings.Cut(k, ".")
		row, _, err := p.Plan(node, module)
		if err != nil {
			return nil, err
		}
		out = append(out, row)
	}
	return out, nil
}
