package provisioner

import (
	"bytes"
	"errors"
	"fmt"
	"strconv"

	"github.com/vmihailenco/msgpack/v5"
)

// Plans (CONTRACT section 6): the node engine alone composes. For each module on its node it publishes
// a composition per build into composed-<node>, keyed <module>.<build>; mesh-host_modules says which
// build each module on each node wants and has; mesh-indexer_builds says each module's newest build.
// This file holds the rules that read a module's plan from those inputs; the store keeps them as a
// projection, and replay can run them over an event log.

// CompStatus is the status of a module's composition at one build, as its newest message says.
type CompStatus uint8

const (
	// CompMissing: no composition at that build (never published, deleted, or a value out of shape).
	CompMissing CompStatus = iota
	CompPublished
	CompRefused
	CompPending
)

func (s CompStatus) String() string {
	switch s {
	case CompPublished:
		return "published"
	case CompRefused:
		return "refused"
	case CompPending:
		return "pending"
	}
	return "missing"
}

// OptBuild is a build that may be absent.
type OptBuild struct {
	N   uint64
	Set bool
}

// Some is a build that is there.
func Some(n uint64) OptBuild { return OptBuild{N: n, Set: true} }

// Composition is one composed-<node> value as read: its status and its plan, the raw MessagePack of
// the value's `plan` (nil when the value has none).
type Composition struct {
	Status CompStatus
	Plan   []byte
}

// HostModule is one mesh-host_modules value as read: the build the module should run and the build
// it runs now, either of which may be absent.
type HostModule struct {
	Want, Have OptBuild
}

// ValueError says why a plans' input value is out of shape: the anomaly reason bad-value.
type ValueError struct{ Detail string }

func (e *ValueError) Error() string { return "bad-value: " + e.Detail }

func badValue(format string, args ...any) error {
	return &ValueError{Detail: fmt.Sprintf(format, args...)}
}

// mapFields calls fn for each field of a MessagePack map with a string key, with a decoder positioned
// at the field's value; fn must read the value or skip it. A value that is not one map is a
// *ValueError.
func mapFields(v []byte, fn func(name string, dec *msgpack.Decoder) error) error {
	rd := bytes.NewReader(v)
	dec := msgpack.NewDecoder(rd)
	n, err := dec.DecodeMapLen()
	if err != nil || n < 0 {
		return badValue("value is not a map")
	}
	for i := 0; i < n; i++ {
		var name string
		key, err := dec.DecodeInterfaceLoose()
		if err != nil {
			return badValue("value is not a map")
		}
		name, _ = key.(string)
		if err := fn(name, dec); err != nil {
			return err
		}
	}
	if rd.Len() != 0 {
		return badValue("data after the map")
	}
	return nil
}

// decodeBuild reads a build field: an integer that is not negative, or a string of decimal digits.
// nil is an absent build.
func decodeBuild(field string, dec *msgpack.Decoder) (OptBuild, error) {
	v, err := dec.DecodeInterfaceLoose()
	if err != nil {
		return OptBuild{}, badValue("%s: %v", field, err)
	}
	switch x := v.(type) {
	case nil:
		return OptBuild{}, nil
	case uint64:
		return Some(x), nil
	case int64:
		if x >= 0 {
			return Some(uint64(x)), nil
		}
	case string:
		if b, ok := ParseBuild(x); ok {
			return Some(b), nil
		}
		return OptBuild{}, badValue("%s %s", field, notABuild(x))
	}
	return OptBuild{}, badValue("%s %v is not a decimal number", field, v)
}

// DecodeComposition reads a composed-<node> value: a map with `status` published, refused or pending
// and `plan`, any value. Anything else is a *ValueError.
func DecodeComposition(v []byte) (Composition, error) {
	var c Composition
	status := ""
	hasStatus := false
	err := mapFields(v, func(name string, dec *msgpack.Decoder) error {
		switch name {
		case "status":
			hasStatus = true
			x, err := dec.DecodeInterfaceLoose()
			if err != nil {
				return badValue("status: %v", err)
			}
			s, ok := x.(string)
			if !ok {
				return badValue("status %v is not published, refused or pending", x)
			}
			status = s
			return nil
		case "plan":
			raw, err := dec.DecodeRaw()
			if err != nil {
				return badValue("plan: %v", err)
			}
			c.Plan = raw
			return nil
		}
		return dec.Skip()
	})
	if err != nil {
		return Composition{}, err
	}
	switch status {
	case "published":
		c.Status = CompPublished
	case "refused":
		c.Status = CompRefused
	case "pending":
		c.Status = CompPending
	default:
		if !hasStatus {
			return Composition{}, badValue("no status (published, refused or pending)")
		}
		return Composition{}, badValue("status %q is not published, refused or pending", status)
	}
	return c, nil
}

// DecodeHostModule reads a mesh-host_modules value: a map with `want` and `have`, each a decimal
// number when present. A field out of shape is read as absent and reported as a *ValueError beside
// what could be read.
func DecodeHostModule(v []byte) (HostModule, error) {
	var h HostModule
	var bad error
	err := mapFields(v, func(name string, dec *msgpack.Decoder) error {
		var dst *OptBuild
		switch name {
		case "want":
			dst = &h.Want
		case "have":
			dst = &h.Have
		default:
			return dec.Skip()
		}
		b, err := decodeBuild(name, dec)
		var ve *ValueError
		if errors.As(err, &ve) && bad == nil {
			bad = err
			return nil
		}
		if err != nil {
			return err
		}
		*dst = b
		return nil
	})
	if err != nil {
		return HostModule{}, err
	}
	return h, bad
}

// DecodeIndexerBuild reads a mesh-indexer_builds value: a map with `newest`, a decimal number. An
// absent newest is no newest build.
func DecodeIndexerBuild(v []byte) (OptBuild, error) {
	var newest OptBuild
	err := mapFields(v, func(name string, dec *msgpack.Decoder) error {
		if name != "newest" {
			return dec.Skip()
		}
		b, err := decodeBuild(name, dec)
		if err != nil {
			return err
		}
		newest = b
		return nil
	})
	if err != nil {
		return OptBuild{}, err
	}
	return newest, nil
}

// PlanRevision is the composition revision a plan entry comes from.
type PlanRevision struct {
	Build    uint64
	Revision uint64 // stream sequence of the composition in composed-<node>
	Created  int64  // the message's time, Unix nanoseconds
	Plan     []byte // raw MessagePack of the composition's plan; nil when it had none
}

// EntryStatus is a plan entry's status: published, or held at the last plan kept.
type EntryStatus uint8

const (
	EntryPublished EntryStatus = 1
	EntryHeld      EntryStatus = 2
)

func (s EntryStatus) String() string {
	if s == EntryPublished {
		return "published"
	}
	return "held"
}

// PlanEntry is one plan entry of a row: current or newest.
type PlanEntry struct {
	Status EntryStatus
	// HeldBecause is why a held entry is held: the status of the composition it should come from
	// (refused, pending or missing).
	HeldBecause CompStatus
	// HasPlan says From is set: a held entry with no plan ever seen has only Status and HeldBecause.
	HasPlan bool
	From    PlanRevision
}

// PlanRow is one row of what: plans, for one node and module that mesh-host_modules holds.
type PlanRow struct {
	Node, Module string
	Want, Have   OptBuild // as read from mesh-host_modules
	NewestBuild  OptBuild // as read from mesh-indexer_builds
	Current      PlanEntry
	// HasNewest says Newest is set: only when the newest build is ahead of want (of have when there is
	// no want).
	HasNewest bool
	Newest    PlanEntry
}

// Key is the row's key, <node>.<module>.
func (r *PlanRow) Key() string { return r.Node + "." + r.Module }

// Compositions is one module's compositions in one composed-<node> bucket, as the plan rules read
// them: the store keeps them in Pebble, replay in memory (BuildLog).
type Compositions interface {
	// Status is the status of the composition at a build, as its newest message says.
	Status(build uint64) (CompStatus, error)
	// LastPublished is the most recently published revision (the highest stream sequence whose value
	// was published) among the compositions at builds lo..hi, both included, even one that a later
	// message of the same build overwrote.
	LastPublished(lo, hi uint64) (PlanRevision, bool, error)
}

// ComputePlan reads one row's plan from its inputs (CONTRACT section 6):
//
//   - current: the composition at want when published; else the composition at have when published;
//     else held, because of the composition at want (at have when there is no want), at the last plan
//     kept: the most recently published revision at builds not ahead of want (of have).
//   - newest: only when newest is ahead of want (of have when there is no want; always when there is
//     neither): the composition at newest when published; else held at the most recently published
//     revision at builds ahead of want (of have) and not ahead of newest.
//
// With neither want nor have, current has no build to come from: it is held, missing, with no plan.
func ComputePlan(node, module string, host HostModule, newest OptBuild, c Compositions) (PlanRow, error) {
	row := PlanRow{Node: node, Module: module, Want: host.Want, Have: host.Have, NewestBuild: newest}
	var err error
	if row.Current, err = ComputeCurrent(host, c); err != nil {
		return row, err
	}
	row.Newest, row.HasNewest, err = ComputeNewest(host, newest, c)
	return row, err
}

// base is the build a row's entries are read against: want, or have when there is no want.
func (h HostModule) base() OptBuild {
	if h.Want.Set {
		return h.Want
	}
	return h.Have
}

// ComputeCurrent is a row's current entry (ComputePlan). It does not depend on the newest build.
func ComputeCurrent(host HostModule, c Compositions) (PlanEntry, error) {
	heldBecause := CompMissing
	for i, b := range []OptBuild{host.Want, host.Have} {
		if !b.Set {
			continue
		}
		st, err := c.Status(b.N)
		if err != nil {
			return PlanEntry{}, err
		}
		if st == CompPublished {
			rev, ok, err := c.LastPublished(b.N, b.N)
			if err != nil {
				return PlanEntry{}, err
			}
			if ok {
				return PlanEntry{Status: EntryPublished, HasPlan: true, From: rev}, nil
			}
		}
		if i == 0 || !host.Want.Set {
			heldBecause = st // the composition current should come from: want's, or have's without a want
		}
	}
	e := PlanEntry{Status: EntryHeld, HeldBecause: heldBecause}
	if base := host.base(); base.Set {
		rev, ok, err := c.LastPublished(0, base.N)
		if err != nil {
			return PlanEntry{}, err
		}
		e.HasPlan, e.From = ok, rev
	}
	return e, nil
}

// ComputeNewest is a row's newest entry (ComputePlan), and whether it has one.
func ComputeNewest(host HostModule, newest OptBuild, c Compositions) (PlanEntry, bool, error) {
	base := host.base()
	if !newest.Set || (base.Set && newest.N <= base.N) {
		return PlanEntry{}, false, nil
	}
	st, err := c.Status(newest.N)
	if err != nil {
		return PlanEntry{}, false, err
	}
	if st == CompPublished {
		rev, ok, err := c.LastPublished(newest.N, newest.N)
		if err != nil {
			return PlanEntry{}, false, err
		}
		if ok {
			return PlanEntry{Status: EntryPublished, HasPlan: true, From: rev}, true, nil
		}
	}
	lo := uint64(0)
	if base.Set {
		lo = base.N + 1
	}
	rev, ok, err := c.LastPublished(lo, newest.N)
	if err != nil {
		return PlanEntry{}, false, err
	}
	return PlanEntry{Status: EntryHeld, HeldBecause: st, HasPlan: ok, From: rev}, true, nil
}

// BuildRecord is what the plan rules keep of one build of one module in one composed-<node> bucket:
// the status its newest message says, and its most recently published revision. It is a fold of the
// build's messages in stream order, so the bucket's history alone defines it.
type BuildRecord struct {
	Status       CompStatus
	HasPublished bool
	Published    PlanRevision
}

// Fold applies one message of the build's key to the record, and reports whether anything is left to
// keep. A put of a composition sets the status, and a published one becomes the most recently
// published revision; a put out of shape, or a delete, leaves the build missing but keeps its last
// published revision, which the stream's history still holds; a purge or a TTL marker removes that
// history from the stream, and so forgets the build. A put or a delete with a Nats-Rollup (sub on its
// own key, or all) made the stream remove every earlier message of its key: it forgets the build as a
// purge does, then is folded as itself.
func (r *BuildRecord) Fold(m *Message, build uint64) (keep bool) {
	if m.Rollup != RollupNone {
		*r = BuildRecord{}
	}
	switch m.Op {
	case OpPut:
		c, err := DecodeComposition(m.Value)
		if err != nil {
			r.Status = CompMissing
			break
		}
		r.Status = c.Status
		if c.Status == CompPublished {
			r.HasPublished = true
			r.Published = PlanRevision{Build: build, Revision: m.Seq, Created: m.Time, Plan: c.Plan} // c.Plan is a copy
		}
	case OpDelete:
		r.Status = CompMissing
	default: // purge, TTL marker
		*r = BuildRecord{}
		return false
	}
	return r.Status != CompMissing || r.HasPublished
}

// PublishesPlan reports whether a message of a composed-<node> key is a published composition: one
// that BuildRecord.Fold keeps as the build's most recently published revision.
//
// Of a build's history up to a point (every spelling of it: m.0042 and m.42 are one build), the fold
// needs three messages only: the newest, which sets the status (or forgets the build, for a purge or
// a TTL marker), the last purge or TTL marker, which forgets what came before it, and the newest that
// publishes a plan after that marker, which a later refusal, pending composition, value out of shape
// or delete does not replace. Trimming the event log keeps those (store/trim.go), so that a fold of
// the trimmed log finds the same record as the fold of the whole history.
func PublishesPlan(m *Message) bool {
	if m.Op != OpPut {
		return false
	}
	c, err := DecodeComposition(m.Value)
	return err == nil && c.Status == CompPublished
}

// FormatBuild writes a build as the contract does: a decimal number.
func FormatBuild(b uint64) string { return strconv.FormatUint(b, 10) }
