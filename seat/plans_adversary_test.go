package seat_test

import (
	"context"
	"fmt"
	"math/rand"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/seat"
	"github.com/novox/mesh-provisioner/store"
)

// The adversary: the reference model of plans_model_test.go, driven one message at a time with what a
// node engine, the host, the indexer or an operator can write by hand, and compared after every
// message. Beside the model test's messages it writes rollups: a purge on a wildcard subject
// (`a.*`, `*.3`, `>`), a put with `Nats-Rollup: all`, and a put with `Nats-Rollup: sub` on its own key
// (the stream keeps that put alone of its key). It also writes refusals over the published composition
// of the same build on purpose, and creates, deletes and creates again composed-<node> buckets between
// messages.
//
// What the stream removes is part of the bucket's history (CONTRACT section 6: the last plan kept is
// defined by the node's bucket history alone, so a rebuild finds the same one): the model reads a
// rollup as a purge, at the rollup's sequence and before it, of every key whose earlier messages it
// removed (rolledUp), which is how the purge of a key is read for the last plan kept already.

// natsMatch reports whether a rollup on pattern removes the earlier messages of key, as the server's
// subject matching does: `*` one token, `>` as the last token the rest (one token or more).
func natsMatch(pattern, key string) bool {
	p, k := strings.Split(pattern, "."), strings.Split(key, ".")
	for i, tok := range p {
		if tok == ">" && i == len(p)-1 {
			return len(k) > i
		}
		if i >= len(k) || tok != "*" && tok != k[i] {
			return false
		}
	}
	return len(p) == len(k)
}

// rolledUp is the model's history with each rollup read as purges: before a message with a
// Nats-Rollup, a purge at its sequence and time of every key whose earlier messages the rollup removed
// from the stream (its own key included: a put with `Nats-Rollup: sub` leaves that put alone of its
// key) and whose last message was a put or a delete. A key whose last message was a purge or a TTL
// marker is left as it was: the build it names was forgotten already, and the marker's removal only
// shows where another spelling of the build (`a.03` beside `a.3`, which `*.3` does not match) keeps
// messages: left alone (docs/decisions.md, Plans, "A rollup forgets the builds it removed").
func rolledUp(p *planModel) *planModel {
	out := &planModel{hist: map[string][]mMsg{}, created: p.created, rolledAway: map[string]map[uint64]bool{}}
	for b, hist := range p.hist {
		var msgs []mMsg
		away := map[uint64]bool{}
		out.rolledAway[b] = away
		for i, m := range hist {
			if m.rollup == "" {
				msgs = append(msgs, m)
				continue
			}
			for _, e := range hist[:i] {
				if m.rollup == "all" || natsMatch(m.key, e.key) {
					away[e.seq] = true
				}
			}
			if !(m.op == "purge" && !provisioner.HasWildcard(m.key)) {
				last := map[string]string{}
				for _, e := range msgs {
					last[e.key] = e.op
				}
				if !provisioner.HasWildcard(m.key) {
					last[m.key] = "put" // its own key: its build forgotten, whatever came before
				}
				keys := make([]string, 0, len(last))
				for k, op := range last {
					if (op == "put" || op == "del") && (m.rollup == "all" || natsMatch(m.key, k)) {
						keys = append(keys, k)
					}
				}
				sort.Strings(keys)
				for _, k := range keys {
					msgs = append(msgs, mMsg{seq: m.seq, at: m.at, key: k, op: "purge"})
				}
			}
			msgs = append(msgs, m)
		}
		out.hist[b] = msgs
	}
	return out
}

// adversary writes one message at a time on top of the model test's generator.
type adversary struct {
	g *modelGen
	w *modelWriter
}

// publishedKey is a key of a bucket whose last message is a published composition, or "".
func (a *adversary) publishedKey(bucket string) string {
	var keys []string
	for k, m := range a.w.model.live(bucket, allOf) {
		if keyReason(bucket, k) == "" {
			if s, _ := comp(m); s == "published" {
				keys = append(keys, k)
			}
		}
	}
	if len(keys) == 0 {
		return ""
	}
	sort.Strings(keys)
	return keys[a.g.r.Intn(len(keys))]
}

// holdsGt reports whether a bucket holds a key with a `>` token.
func (a *adversary) holdsGt(bucket string) bool {
	for _, m := range a.w.model.hist[bucket] {
		if slices.Contains(strings.Split(m.key, "."), ">") {
			return true
		}
	}
	return false
}

// step writes one message to one of the buckets; it says what it wrote.
func (a *adversary) step(composedNodes []string) string {
	g, w := a.g, a.w
	r := g.r
	x := r.Intn(100)
	if len(composedNodes) == 0 && x < 60 {
		x += 60
	}
	var bucket string
	if len(composedNodes) > 0 {
		bucket = provisioner.ComposedPrefix + g.pick(composedNodes)
	}
	compOf := func(status string) []byte {
		return g.mp(map[string]any{"status": status, "plan": g.plan()})
	}
	var m mMsg
	switch {
	case x < 8: // a refusal (or pending) over the published composition of the same build
		key := a.publishedKey(bucket)
		if key == "" {
			key = g.composedKey()
		}
		m = w.write(bucket, key, "put", compOf([]string{"refused", "pending"}[r.Intn(2)]))
	case x < 12: // a delete of a published composition: its plan stays kept
		key := a.publishedKey(bucket)
		if key == "" {
			key = g.composedKey()
		}
		m = w.write(bucket, key, "del", nil)
	case x < 15: // a purge on a wildcard subject
		patterns := []string{g.pick(g.modules) + ".*", "*." + strconv.FormatUint(modelBuilds[r.Intn(len(modelBuilds))], 10), "*.*", ">", g.pick(g.modules) + ".>"}
		if a.holdsGt(bucket) {
			// A `*` meeting a key stored with a `>` token is not covered (docs/decisions.md,
			// "A rollup removes what it removed from the stream"): the server purges the rollup too.
			patterns = patterns[3:]
		}
		m = w.writeRollup(bucket, patterns[r.Intn(len(patterns))], "purge", "sub", nil)
	case x < 17: // a put that rolls the whole stream up
		m = w.writeRollup(bucket, g.composedKey(), "put", "all", g.compValue())
	case x < 21: // a put that rolls its own key up
		m = w.writeRollup(bucket, g.composedKey(), "put", "sub", g.compValue())
	case x < 60:
		op := g.op()
		var val []byte
		if op == "put" {
			val = g.compValue()
		}
		m = w.write(bucket, g.composedKey(), op, val)
	case x < 63: // the host's keys of a node purged at once
		m = w.writeRollup(provisioner.BucketHostModules, g.pick(g.nodes)+".*", "purge", "sub", nil)
	case x < 65: // a put that rolls the host's whole bucket up
		m = w.writeRollup(provisioner.BucketHostModules, g.hostKey(), "put", "all", g.buildsValue("want", "have"))
	case x < 85:
		op := g.op()
		var val []byte
		if op == "put" {
			val = g.buildsValue("want", "have")
		}
		m = w.write(provisioner.BucketHostModules, g.hostKey(), op, val)
	case x < 98:
		op := g.op()
		var val []byte
		if op == "put" {
			val = g.buildsValue("newest")
		}
		m = w.write(provisioner.BucketIndexerBuilds, g.indexerKey(), op, val)
	default: // the indexer's keys purged at once, or its whole bucket rolled up by a put
		if r.Intn(2) == 0 {
			m = w.writeRollup(provisioner.BucketIndexerBuilds, "*", "purge", "sub", nil)
		} else {
			m = w.writeRollup(provisioner.BucketIndexerBuilds, g.indexerKey(), "put", "all", g.buildsValue("newest"))
		}
	}
	b := bucket
	switch {
	case x >= 85:
		b = provisioner.BucketIndexerBuilds
	case x >= 60:
		b = provisioner.BucketHostModules
	}
	what := fmt.Sprintf("%s %s %s seq %d", b, m.op, m.key, m.seq)
	if m.rollup != "" {
		what += " rollup " + m.rollup
	}
	if m.op == "put" {
		s, _ := comp(m)
		what += " " + s
	}
	return what
}

// read waits until the seat has applied every bucket of the model to its last message, so that the next
// step is written, and a step compared, only once the seat has read what came before. A rollup written
// past messages the seat had not read yet removed them from the stream unread: a composed-<node>
// bucket whose stream then starts past its checkpoint + 1 is forgotten and read again from the stream
// (docs/decisions.md, Plans, "A composed-<node> bucket that cannot be resumed is forgotten and read
// again"), and its plans as of any time before that are 410 and its trim floor that of the new log,
// which the model does not follow; and a step whose message changes no answer was compared before
// the seat had read it.
func (w *modelWriter) read(st *seat.Seat) {
	w.h.t.Helper()
	natstest.CheckFor(w.h.t, 20*time.Second, 10*time.Millisecond, func() error {
		for b := range w.model.hist {
			want := w.model.lastSeq(b, allOf)
			if seq, _ := st.Store().Applied(b); seq < want {
				return fmt.Errorf("%s: applied %d of %d", b, seq, want)
			}
		}
		return nil
	})
}

// adversaryCheck is a modelCheck of the model's history with its rollups read as purges.
func adversaryCheck(mc *modelCheck) *modelCheck {
	return &modelCheck{h: mc.h, model: rolledUp(mc.model), nodes: mc.nodes, mods: mc.mods, seen: mc.seen}
}

// TestPlans_Adversary drives a seat one message at a time (PLANS_ADVERSARY_STEPS, default 160, on
// PLANS_ADVERSARY_SEED) and compares its plans answer across every node with the model after each
// message; every so often every narrowing, paged and in both formats. Then a seat on an empty state
// dir (a rebuild from the streams) must answer the same, and the live seat as of the times between
// the checks.
func TestPlans_Adversary(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	model := newPlanModel()
	w := &modelWriter{h: h, model: model, streams: map[string]jetstream.Stream{}}
	seed, steps := int64(69), 160
	if s := os.Getenv("PLANS_ADVERSARY_SEED"); s != "" {
		var err error
		seed, err = strconv.ParseInt(s, 10, 64)
		require.NoError(t, err)
	}
	if s := os.Getenv("PLANS_ADVERSARY_STEPS"); s != "" {
		var err error
		steps, err = strconv.Atoi(s)
		require.NoError(t, err)
	}
	t.Logf("seed %d (PLANS_ADVERSARY_SEED), %d steps (PLANS_ADVERSARY_STEPS)", seed, steps)
	g := &modelGen{r: rand.New(rand.NewSource(seed)), nodes: []string{"n1", "n2", "n3", "n10", "n/x=1"}, modules: []string{"a", "b"}}
	a := &adversary{g: g, w: w}
	mc := &modelCheck{h: h, model: model, nodes: g.nodes, mods: g.modules, seen: map[string]int{}}
	c := func(node string) string { return provisioner.ComposedPrefix + node }
	for _, b := range []string{provisioner.BucketHostModules, provisioner.BucketIndexerBuilds, c("n1"), c("n10")} {
		w.create(b)
	}
	composedNodes := []string{"n1", "n10"}

	po := projector.Options{Poll: 50 * time.Millisecond, DiscoverEvery: time.Hour, Verify: 200 * time.Millisecond, ParkAfter: -1}
	st, stop := h.startPlansSeatWith(t.TempDir(), po)
	caughtUp := func() { h.waitPlansCaughtUp(st) }

	type point struct {
		at   int64
		gone []string // composed-<node> buckets forgotten since
	}
	var points []point
	var log []string
	for i := 0; i < steps; i++ {
		switch i {
		case steps / 4: // created late: found by its advisory
			w.create(c("n2"))
			composedNodes = append(composedNodes, "n2")
		case steps / 2: // deleted: forgotten once confirmed
			w.deleteBucket(c("n2"))
			composedNodes = slices.DeleteFunc(composedNodes, func(n string) bool { return n == "n2" })
			for j := range points {
				points[j].gone = append(points[j].gone, "n2")
			}
			natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
				if st.Current().Tails(c("n2")) || slices.Contains(st.Store().Buckets(), c("n2")) {
					return fmt.Errorf("%s not forgotten yet", c("n2"))
				}
				return nil
			})
		case steps/2 + steps/8: // created again
			w.create(c("n2"))
			composedNodes = append(composedNodes, "n2")
		}
		log = append(log, a.step(composedNodes))
		w.read(st)
		ac := adversaryCheck(mc)
		natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
			if err := ac.matches(ac.req("", "")); err != nil {
				return fmt.Errorf("after step %d (%s): %w\nthe steps: %s", i, log[len(log)-1], err, strings.Join(log, "\n"))
			}
			return nil
		})
		if i%40 == 39 {
			ac.live(st, fmt.Sprintf("step %d", i), caughtUp)
			points = append(points, point{at: time.Now().UnixNano()})
		}
	}
	ac := adversaryCheck(mc)
	ac.live(st, "the end", caughtUp)
	for i, p := range points {
		ac.at(st, fmt.Sprintf("point %d", i), p.at, p.gone, nil)
	}
	require.Zero(t, st.Rebuilds())

	// The event log trimmed to a point, with more written after it: as of that point and later the
	// answers are unchanged.
	horizon := time.Now().UnixNano()
	for i := 0; i < 40; i++ {
		log = append(log, a.step(composedNodes))
		w.read(st)
	}
	ac = adversaryCheck(mc)
	ac.live(st, "past the horizon", caughtUp)
	end := time.Now().UnixNano()
	ret := store.NewRetention(st.Store(), store.RetentionOptions{MaxAge: time.Nanosecond, Now: func() time.Time { return time.Unix(0, horizon+1) }})
	_, err := ret.Apply(context.Background())
	require.NoError(t, err)
	floors := map[string]uint64{}
	for b := range ac.model.hist {
		floors[b] = ac.model.lastSeq(b, upToTime(horizon))
	}
	ac.live(st, "trimmed", caughtUp)
	ac.at(st, "the horizon, trimmed", horizon, nil, floors)
	ac.at(st, "past the horizon, trimmed", end, nil, floors)

	// Rebuilt from the streams: the same last plans kept (the live seat stopped, so that the fresh
	// one alone answers).
	stop()
	fresh, _ := h.startPlansSeatWith(t.TempDir(), po)
	ac.live(fresh, "rebuilt", func() { h.waitPlansCaughtUp(fresh) })
	t.Logf("kinds of entries compared: %v", mc.seen)
}

// TestPlans_RollupForgetsThePlanItRemoved: a rollup that removed a published composition from the
// stream forgets it, as a rebuild from the stream does, live, as of a time and after a trim. Each node
// is one history; its module a wants build 2.
func TestPlans_RollupForgetsThePlanItRemoved(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	model := newPlanModel()
	w := &modelWriter{h: h, model: model, streams: map[string]jetstream.Stream{}}
	w.create(provisioner.BucketHostModules)
	w.create(provisioner.BucketIndexerBuilds)
	pub := msgpackOf(t, map[string]any{"status": "published", "plan": "p"})
	refused := msgpackOf(t, map[string]any{"status": "refused", "plan": "r"})
	type msg struct{ key, op, rollup string }
	cases := []struct {
		node string
		msgs []msg
	}{
		// A wildcard purge or a rollup of the stream over a composition whose last message is a delete:
		// the delete kept the plan (the stream still held it), the rollup removed it.
		{"n1", []msg{{"a.2", "pub", ""}, {"a.2", "del", ""}, {"a.*", "purge", "sub"}}},
		{"n2", []msg{{"a.2", "pub", ""}, {"a.2", "del", ""}, {"b.1", "pub", "all"}}},
		// A refusal or a delete that rolled its own key up: the stream holds it alone of its key.
		{"n3", []msg{{"a.2", "pub", ""}, {"a.2", "refused", "sub"}}},
		{"n4", []msg{{"a.2", "pub", ""}, {"a.2", "del", "sub"}}},
		// The same, then a delete: the trim must keep the rollup that forgot the plan.
		{"n5", []msg{{"a.2", "pub", ""}, {"a.2", "refused", "sub"}, {"a.2", "del", ""}}},
		// A wildcard purge over a published composition, and over the host's keys of a node: the
		// trim must keep the rollup, or a fill of the log as of a point after it finds them again.
		{"n6", []msg{{"a.2", "pub", ""}, {"a.*", "purge", "sub"}}},
		{"n7", []msg{{"a.2", "pub", ""}, {"host n7.*", "purge", "sub"}}},
		// A later rollup of the same key: the first still removed what the second did not see.
		{"n8", []msg{{"a.2", "pub", ""}, {"a.*", "purge", "sub"}, {"a.*", "purge", "sub"}}},
		// A put that rolled the indexer's bucket up, then deleted: the trim keeps the rollup, and
		// the delete beside it.
		{"n11", []msg{{"idx a", "newest", "all"}, {"idx a", "del", ""}}},
	}
	want := map[string]string{
		"n1.a": "held/missing | -", "n2.a": "held/missing | -", "n3.a": "held/refused | -",
		"n4.a": "held/missing | -", "n5.a": "held/missing | -", "n6.a": "held/missing | -",
		"n8.a": "held/missing | -", "n11.a": "held/missing | -",
	}
	po := projector.Options{Poll: 50 * time.Millisecond, DiscoverEvery: time.Hour, Verify: 200 * time.Millisecond, ParkAfter: -1}
	st, stop := h.startPlansSeatWith(t.TempDir(), po)
	for _, c := range cases {
		w.create(provisioner.ComposedPrefix + c.node)
		w.write(provisioner.BucketHostModules, c.node+".a", "put", msgpackOf(t, map[string]any{"want": 2}))
	}
	// A message of each history at a time, read before the next: a rollup read with what it removed
	// unread removes nothing the seat holds.
	for i := 0; i < 3; i++ {
		h.waitPlansCaughtUp(st)
		for _, c := range cases {
			if i >= len(c.msgs) {
				continue
			}
			bucket, m := provisioner.ComposedPrefix+c.node, c.msgs[i]
			switch m.op {
			case "pub":
				w.writeRollup(bucket, m.key, "put", m.rollup, pub)
			case "refused":
				w.writeRollup(bucket, m.key, "put", m.rollup, refused)
			case "newest":
				w.writeRollup(provisioner.BucketIndexerBuilds, strings.TrimPrefix(m.key, "idx "), "put", m.rollup, msgpackOf(t, map[string]any{"newest": 5}))
			default:
				if key, ok := strings.CutPrefix(m.key, "host "); ok {
					w.writeRollup(provisioner.BucketHostModules, key, m.op, m.rollup, nil)
					continue
				}
				if key, ok := strings.CutPrefix(m.key, "idx "); ok {
					w.writeRollup(provisioner.BucketIndexerBuilds, key, m.op, m.rollup, nil)
					continue
				}
				w.writeRollup(bucket, m.key, m.op, m.rollup, nil)
			}
		}
	}
	h.expectPlans(st, want)
	atNow := func(label string) {
		t.Helper()
		now := time.Now().UTC().Format(time.RFC3339Nano)
		rows, _ := h.askAllPlans(map[string]any{"what": "plans", "at": now}, false)
		got := map[string]string{}
		for _, r := range rows {
			row := r.(map[string]any)
			got[row["key"].(string)] = entry(row, "current") + " | " + entry(row, "newest")
		}
		require.Equal(t, want, got, label)
	}
	atNow("as of now")

	// Trimmed up to the last message: the log keeps what forgot the plan.
	w.write(provisioner.BucketHostModules, "n9.a", "put", msgpackOf(t, map[string]any{}))
	h.waitPlansCaughtUp(st)
	horizon := time.Now()
	ret := store.NewRetention(st.Store(), store.RetentionOptions{MaxAge: time.Nanosecond, Now: func() time.Time { return horizon }})
	_, err := ret.Apply(context.Background())
	require.NoError(t, err)
	want["n9.a"] = "held/missing | -"
	atNow("as of now, trimmed")

	stop() // the rebuilt seat alone answers
	fresh, _ := h.startPlansSeatWith(t.TempDir(), po)
	h.expectPlans(fresh, want)
}

func msgpackOf(tb testing.TB, v any) []byte {
	tb.Helper()
	b, err := msgpack.Marshal(v)
	require.NoError(tb, err)
	return b
}
