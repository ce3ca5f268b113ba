package provisioner

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"
)

func mp(t testing.TB, v any) []byte {
	t.Helper()
	b, err := msgpack.Marshal(v)
	require.NoError(t, err)
	return b
}

// planMsg is one message of a plans' input bucket, for the rule tests: the bucket is named by a
// letter, c (composed-n1), h (mesh-host_modules) or i (mesh-indexer_builds).
type planMsg struct {
	bucket byte
	key    string
	op     Op
	value  map[string]any
}

func comp(key, status string, plan any) planMsg {
	return planMsg{bucket: 'c', key: key, op: OpPut, value: map[string]any{"status": status, "plan": plan}}
}

func host(want, have any) planMsg {
	v := map[string]any{}
	if want != nil {
		v["want"] = want
	}
	if have != nil {
		v["have"] = have
	}
	return planMsg{bucket: 'h', key: "n1.m", op: OpPut, value: v}
}

func newest(n any) planMsg {
	return planMsg{bucket: 'i', key: "m", op: OpPut, value: map[string]any{"newest": n}}
}

func delComp(key string, op Op) planMsg { return planMsg{bucket: 'c', key: key, op: op} }

// fold feeds messages into PlanInputs, each bucket's sequence counting from 1, and returns the row of
// n1.m.
func fold(t *testing.T, msgs ...planMsg) PlanRow {
	t.Helper()
	p := NewPlanInputs()
	seqs := map[byte]uint64{}
	names := map[byte]string{'c': "composed-n1", 'h': BucketHostModules, 'i': BucketIndexerBuilds}
	for _, pm := range msgs {
		seqs[pm.bucket]++
		m := Message{Seq: seqs[pm.bucket], Time: int64(seqs[pm.bucket]) * 1000, Key: pm.key, Op: pm.op}
		if pm.op == OpPut {
			m.Value = mp(t, pm.value)
		}
		p.Apply(names[pm.bucket], &m)
	}
	row, ok, err := p.Plan("n1", "m")
	require.NoError(t, err)
	require.True(t, ok, "n1.m has a row")
	return row
}

// entry is a plan entry as the tests expect it: "published 5@3 p5" is published, build 5, revision
// 3, plan "p5"; "held refused 4@2 p4" is held because refused at the last plan kept; "held missing"
// has no plan.
type entry struct {
	status, because string
	build, rev      uint64
	plan            string
}

func pub(build, rev uint64, plan string) entry {
	return entry{status: "published", build: build, rev: rev, plan: plan}
}

func held(because string, build, rev uint64, plan string) entry {
	return entry{status: "held", because: because, build: build, rev: rev, plan: plan}
}

func heldEmpty(because string) entry { return entry{status: "held", because: because} }

func checkEntry(t *testing.T, name string, want entry, got PlanEntry) {
	t.Helper()
	require.Equal(t, want.status, got.Status.String(), "%s: status", name)
	if want.status == "held" {
		require.Equal(t, want.because, got.HeldBecause.String(), "%s: held_because", name)
	}
	if want.plan == "" {
		require.False(t, got.HasPlan, "%s: no plan ever seen", name)
		return
	}
	require.True(t, got.HasPlan, "%s: has a plan", name)
	require.Equal(t, want.build, got.From.Build, "%s: build", name)
	require.Equal(t, want.rev, got.From.Revision, "%s: revision", name)
	var plan string
	require.NoError(t, msgpack.Unmarshal(got.From.Plan, &plan))
	require.Equal(t, want.plan, plan, "%s: plan", name)
}

// TestComputePlan_Rules walks every rule of CONTRACT section 6; each case fails when its rule is
// broken. Revisions are the sequences in composed-n1, counted from 1 in the order of the case.
func TestComputePlan_Rules(t *testing.T) {
	tests := []struct {
		name    string
		msgs    []planMsg
		current entry
		newest  *entry // nil: no newest entry
	}{
		{name: "current is the composition at want when published",
			msgs:    []planMsg{comp("m.4", "published", "p4"), comp("m.5", "published", "p5"), host(5, 4)},
			current: pub(5, 2, "p5")},
		{name: "want as a string of digits",
			msgs:    []planMsg{comp("m.5", "published", "p5"), host("5", nil)},
			current: pub(5, 1, "p5")},
		{name: "want refused, have published: current is have's",
			msgs:    []planMsg{comp("m.4", "published", "p4"), comp("m.5", "refused", "x"), host(5, 4)},
			current: pub(4, 1, "p4")},
		{name: "want pending, have published: current is have's",
			msgs:    []planMsg{comp("m.4", "published", "p4"), comp("m.5", "pending", nil), host(5, 4)},
			current: pub(4, 1, "p4")},
		{name: "want missing, have published: current is have's",
			msgs:    []planMsg{comp("m.4", "published", "p4"), host(5, 4)},
			current: pub(4, 1, "p4")},
		{name: "want refused then published: current moves to want",
			msgs:    []planMsg{comp("m.4", "published", "p4"), comp("m.5", "refused", "x"), comp("m.5", "published", "p5"), host(5, 4)},
			current: pub(5, 3, "p5")},
		{name: "neither published: held because of want's status, at the last plan kept",
			msgs:    []planMsg{comp("m.3", "published", "p3"), comp("m.4", "refused", nil), comp("m.5", "pending", nil), host(5, 4)},
			current: held("pending", 3, 1, "p3")},
		{name: "held because want is missing",
			msgs:    []planMsg{comp("m.3", "published", "p3"), comp("m.4", "refused", nil), host(5, 4)},
			current: held("missing", 3, 1, "p3")},
		{name: "held because want is refused",
			msgs:    []planMsg{comp("m.3", "published", "p3"), comp("m.5", "refused", nil), host(5, nil)},
			current: held("refused", 3, 1, "p3")},
		{name: "a refusal that overwrote a published composition of the same build still finds its plan",
			msgs:    []planMsg{comp("m.3", "published", "p3"), comp("m.5", "published", "p5"), comp("m.5", "refused", nil), host(5, nil)},
			current: held("refused", 5, 2, "p5")},
		{name: "a pending that overwrote a published composition of the same build holds it",
			msgs:    []planMsg{comp("m.5", "published", "p5"), comp("m.5", "pending", nil), host(5, nil)},
			current: held("pending", 5, 1, "p5")},
		{name: "the last plan kept is the most recently published revision, not the highest build",
			msgs:    []planMsg{comp("m.4", "published", "p4"), comp("m.2", "published", "p2"), comp("m.5", "refused", nil), host(5, nil)},
			current: held("refused", 2, 2, "p2")},
		{name: "the last plan kept is never ahead of want",
			msgs:    []planMsg{comp("m.3", "published", "p3"), comp("m.9", "published", "p9"), comp("m.5", "refused", nil), host(5, nil)},
			current: held("refused", 3, 1, "p3")},
		{name: "without want, have is the entry's build: held because of have's status",
			msgs:    []planMsg{comp("m.3", "published", "p3"), comp("m.4", "refused", nil), comp("m.6", "published", "p6"), host(nil, 4)},
			current: held("refused", 3, 1, "p3")},
		{name: "every composition refused from the start: held with no plan",
			msgs:    []planMsg{comp("m.4", "refused", nil), comp("m.5", "refused", nil), host(5, 4)},
			current: heldEmpty("refused")},
		{name: "no composition at all: held missing with no plan",
			msgs:    []planMsg{host(5, 4)},
			current: heldEmpty("missing")},
		{name: "neither want nor have: held missing with no plan, whatever was published",
			msgs:    []planMsg{comp("m.4", "published", "p4"), host(nil, nil)},
			current: heldEmpty("missing")},
		{name: "a delete keeps the last published revision as the plan kept",
			msgs:    []planMsg{comp("m.5", "published", "p5"), delComp("m.5", OpDelete), host(5, nil)},
			current: held("missing", 5, 1, "p5")},
		{name: "a purge forgets the build's history, as the stream does",
			msgs:    []planMsg{comp("m.4", "published", "p4"), comp("m.5", "published", "p5"), delComp("m.5", OpPurge), host(5, nil)},
			current: held("missing", 4, 1, "p4")},
		{name: "a value out of shape leaves the build missing, its plan kept",
			msgs:    []planMsg{comp("m.5", "published", "p5"), {bucket: 'c', key: "m.5", op: OpPut, value: map[string]any{"status": "done"}}, host(5, nil)},
			current: held("missing", 5, 1, "p5")},
		{name: "a build written with leading zeros is the same build",
			msgs:    []planMsg{comp("m.05", "published", "p5"), host(5, nil)},
			current: pub(5, 1, "p5")},

		{name: "newest ahead of want: the composition at newest when published",
			msgs:    []planMsg{comp("m.5", "published", "p5"), comp("m.7", "published", "p7"), host(5, nil), newest(7)},
			current: pub(5, 1, "p5"), newest: &entry{status: "published", build: 7, rev: 2, plan: "p7"}},
		{name: "newest equal to want: no newest entry",
			msgs:    []planMsg{comp("m.5", "published", "p5"), host(5, nil), newest(5)},
			current: pub(5, 1, "p5")},
		{name: "newest behind want: no newest entry",
			msgs:    []planMsg{comp("m.5", "published", "p5"), host(5, 4), newest(4)},
			current: pub(5, 1, "p5")},
		{name: "without want, newest is compared with have",
			msgs:    []planMsg{comp("m.4", "published", "p4"), comp("m.6", "published", "p6"), host(nil, 4), newest(6)},
			current: pub(4, 1, "p4"), newest: &entry{status: "published", build: 6, rev: 2, plan: "p6"}},
		{name: "without want, newest equal to have: no newest entry",
			msgs:    []planMsg{comp("m.4", "published", "p4"), host(nil, 4), newest(4)},
			current: pub(4, 1, "p4")},
		{name: "a key ahead of its want still carries its plan entry, want published or not",
			msgs:    []planMsg{comp("m.5", "refused", nil), comp("m.7", "published", "p7"), host(5, nil), newest(7)},
			current: heldEmpty("refused"), newest: &entry{status: "published", build: 7, rev: 2, plan: "p7"}},
		{name: "newest refused: held at the last newest plan, ahead of want",
			msgs:    []planMsg{comp("m.5", "published", "p5"), comp("m.6", "published", "p6"), comp("m.8", "refused", nil), host(5, nil), newest(8)},
			current: pub(5, 1, "p5"), newest: &entry{status: "held", because: "refused", build: 6, rev: 2, plan: "p6"}},
		{name: "newest pending: held, and never at builds not ahead of want",
			msgs:    []planMsg{comp("m.6", "published", "p6"), comp("m.5", "published", "p5"), comp("m.8", "pending", nil), host(5, nil), newest(8)},
			current: pub(5, 2, "p5"), newest: &entry{status: "held", because: "pending", build: 6, rev: 1, plan: "p6"}},
		{name: "newest refused with no plan ahead of want: held with no plan",
			msgs:    []planMsg{comp("m.5", "published", "p5"), comp("m.8", "refused", nil), host(5, nil), newest(8)},
			current: pub(5, 1, "p5"), newest: &entry{status: "held", because: "refused"}},
		{name: "newest refused over its own published revision keeps that plan",
			msgs:    []planMsg{comp("m.5", "published", "p5"), comp("m.8", "published", "p8"), comp("m.8", "refused", nil), host(5, nil), newest(8)},
			current: pub(5, 1, "p5"), newest: &entry{status: "held", because: "refused", build: 8, rev: 2, plan: "p8"}},
		{name: "newest missing, never ahead of newest",
			msgs:    []planMsg{comp("m.5", "published", "p5"), comp("m.9", "published", "p9"), host(5, nil), newest(8)},
			current: pub(5, 1, "p5"), newest: &entry{status: "held", because: "missing"}},
		{name: "neither want nor have: newest is ahead",
			msgs:    []planMsg{comp("m.3", "published", "p3"), host(nil, nil), newest(3)},
			current: heldEmpty("missing"), newest: &entry{status: "published", build: 3, rev: 1, plan: "p3"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			row := fold(t, tc.msgs...)
			checkEntry(t, "current", tc.current, row.Current)
			if tc.newest == nil {
				require.False(t, row.HasNewest, "no newest entry")
				return
			}
			require.True(t, row.HasNewest, "a newest entry")
			checkEntry(t, "newest", *tc.newest, row.Newest)
		})
	}
}

func TestComputePlan_RowCarriesInputsAsRead(t *testing.T) {
	row := fold(t, host(5, "4"), newest(7))
	require.Equal(t, Some(5), row.Want)
	require.Equal(t, Some(4), row.Have)
	require.Equal(t, Some(7), row.NewestBuild)
	require.Equal(t, "n1.m", row.Key())
}

func TestDecodePlanValues(t *testing.T) {
	badValue := func(t *testing.T, err error) {
		t.Helper()
		var ve *ValueError
		require.True(t, errors.As(err, &ve), "a *ValueError, got %v", err)
	}
	t.Run("composition", func(t *testing.T) {
		c, err := DecodeComposition(mp(t, map[string]any{"status": "published", "plan": map[string]any{"a": 1}, "extra": true}))
		require.NoError(t, err)
		require.Equal(t, CompPublished, c.Status)
		require.Equal(t, mp(t, map[string]any{"a": 1}), c.Plan, "the plan passes through as raw MessagePack")
		c, err = DecodeComposition(mp(t, map[string]any{"status": "refused"}))
		require.NoError(t, err)
		require.Equal(t, CompRefused, c.Status)
		require.Nil(t, c.Plan)
		for name, v := range map[string]any{
			"no status": map[string]any{"plan": 1}, "other status": map[string]any{"status": "done"},
			"status not a string": map[string]any{"status": 1}, "not a map": []int{1}, "nil": nil,
		} {
			_, err := DecodeComposition(mp(t, v))
			badValue(t, err)
			require.NotEmpty(t, err.Error(), name)
		}
		_, err = DecodeComposition([]byte{0xc1})
		badValue(t, err)
	})
	t.Run("host module", func(t *testing.T) {
		h, err := DecodeHostModule(mp(t, map[string]any{"want": uint64(1042), "have": "1041", "other": "x"}))
		require.NoError(t, err)
		require.Equal(t, HostModule{Want: Some(1042), Have: Some(1041)}, h)
		h, err = DecodeHostModule(mp(t, map[string]any{}))
		require.NoError(t, err)
		require.Equal(t, HostModule{}, h, "either may be absent")
		h, err = DecodeHostModule(mp(t, map[string]any{"want": nil}))
		require.NoError(t, err)
		require.False(t, h.Want.Set)
		for name, v := range map[string]any{
			"negative": map[string]any{"want": -1, "have": 3}, "float": map[string]any{"want": 1.5, "have": 3},
			"word": map[string]any{"want": "latest", "have": 3}, "signed string": map[string]any{"want": "+4", "have": 3},
		} {
			h, err := DecodeHostModule(mp(t, v))
			badValue(t, err)
			require.False(t, h.Want.Set, name)
			require.Equal(t, Some(3), h.Have, "%s: what could be read is read", name)
		}
		_, err = DecodeHostModule(mp(t, "1042"))
		badValue(t, err)
	})
	t.Run("indexer build", func(t *testing.T) {
		n, err := DecodeIndexerBuild(mp(t, map[string]any{"newest": 7}))
		require.NoError(t, err)
		require.Equal(t, Some(7), n)
		n, err = DecodeIndexerBuild(mp(t, map[string]any{}))
		require.NoError(t, err)
		require.False(t, n.Set)
		_, err = DecodeIndexerBuild(mp(t, map[string]any{"newest": "seven"}))
		badValue(t, err)
		require.Contains(t, err.Error(), `newest "seven" is not a decimal number`)
		_, err = DecodeIndexerBuild(mp(t, map[string]any{"newest": "18446744073709551616"}))
		badValue(t, err)
		require.Contains(t, err.Error(), `newest "18446744073709551616" is a decimal number beyond 18446744073709551615`,
			"a number too large is said so, not called no number")
	})
}
