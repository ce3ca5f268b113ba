package seat_test

import (
	"bytes"
	"context"
	"fmt"
	"path/filepath"
	"sort"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/replay"
	"github.com/novox/mesh-provisioner/store"
)

// addSubject gives a bucket's stream one more subject, as an operator does with nats stream edit.
func (h *harness) addSubject(bucket, subject string) {
	h.t.Helper()
	ctx := context.Background()
	s, err := h.js.Stream(ctx, provisioner.StreamName(bucket))
	require.NoError(h.t, err)
	cfg := s.CachedInfo().Config
	cfg.Subjects = append(cfg.Subjects, subject)
	_, err = h.js.UpdateStream(ctx, cfg)
	require.NoError(h.t, err)
}

// publishOn publishes a message on any subject of a stream, with a Nats-Rollup header when rollup is
// set, and returns its sequence.
func (h *harness) publishOn(subject, rollup string, data []byte) uint64 {
	h.t.Helper()
	m := nats.NewMsg(subject)
	if rollup != "" {
		m.Header.Set(provisioner.HeaderRollup, rollup)
	}
	m.Data = data
	ack, err := h.js.PublishMsg(context.Background(), m)
	require.NoError(h.t, err)
	return ack.Sequence
}

// msgTime is the time the server stamped a message of a bucket's stream with.
func (h *harness) msgTime(bucket string, seq uint64) time.Time {
	h.t.Helper()
	ctx := context.Background()
	s, err := h.js.Stream(ctx, provisioner.StreamName(bucket))
	require.NoError(h.t, err)
	m, err := s.GetMsg(ctx, seq)
	require.NoError(h.t, err)
	return m.Time
}

// keysOf lists an answer's raw keys: its rows, then the anomaly rows of keys without one (out of
// shape), each once, in byte order.
func keysOf(a natstest.Answer) []string {
	seen := map[string]bool{}
	for _, r := range a.Rows {
		seen[r["key"].(string)] = true
	}
	for _, an := range a.Anomalies {
		seen[an["key"].(string)] = true
	}
	out := []string{}
	for k := range seen {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// logKeys asks a replay log what a bucket held as of a point: its keys (rows and out-of-shape keys).
// replaySources opens what replay reads that must agree with the seat: the streams, an archive
// exported from them, the state dir's log and an archive exported from that log; each closed when the
// test ends.
func (h *harness) replaySources(t *testing.T, dir string) (fromNATS, fromNATSArchive, fromState, fromStateArchive *replay.Log) {
	t.Helper()
	ctx := context.Background()
	opened := func(l *replay.Log, err error) *replay.Log {
		t.Helper()
		require.NoError(t, err)
		t.Cleanup(func() { l.Close() })
		return l
	}
	fromNATS = opened(replay.FromNATS(ctx, h.js, nil, "nats", nil))
	natsArchive := filepath.Join(t.TempDir(), "nats.mph")
	_, err := replay.ExportNATS(ctx, h.js, nil, natsArchive, "test", nil)
	require.NoError(t, err)
	fromNATSArchive = opened(replay.FromArchive(ctx, natsArchive, nil))
	fromState = opened(replay.OpenState(dir))
	stateArchive := filepath.Join(t.TempDir(), "state.mph")
	_, err = replay.ExportLog(ctx, fromState.DB, stateArchive, "test", nil)
	require.NoError(t, err)
	fromStateArchive = opened(replay.FromArchive(ctx, stateArchive, nil))
	return
}

func logKeys(t *testing.T, l *replay.Log, at string) ([]string, error) {
	t.Helper()
	b, err := l.Ask([]byte(fmt.Sprintf(`{"what":"needs","at":%q}`, at)))
	if err != nil {
		return nil, err
	}
	var a natstest.Answer
	d := decodeAnswer(t, b, false)
	for _, r := range d.Rows {
		a.Rows = append(a.Rows, map[string]any{"key": r.Key})
	}
	for _, an := range d.Anomalies {
		a.Anomalies = append(a.Anomalies, map[string]any{"key": an.Key})
	}
	return keysOf(a), nil
}

// TestSeat_AWholeStreamRollupOnAnAddedSubjectEmptiesTheBucket: an operator added a subject to a
// bucket's stream, and a message published on it with Nats-Rollup: all made the server purge every
// other message of the stream, every key of the bucket with them (a direct KV read finds none). The
// seat passed the message over and kept answering every key, rows and anomalies, until a rebuild,
// which also lost the local history before it. Now it is a rollup of the whole bucket at its sequence,
// as one on a key's subject: the answers equal the bucket, the local log still answers the points
// before it, and replay from the streams, from an archive of them and from an archive of the local log
// agree with the seat.
func TestSeat_AWholeStreamRollupOnAnAddedSubjectEmptiesTheBucket(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	n := provisioner.BucketNeeds
	require.NoError(t, fixtures.CreateBuckets(ctx, h.js, n, provisioner.BucketApplied, provisioner.BucketCollect))
	h.addSubject(n, "extra.>")
	dir := t.TempDir()
	st, _ := h.startSeat(dir)

	before := []string{"extra.x", "n1.m1.config.a", "n1.m1.config.raw", "n2.m1.config.b", "n3.x"}
	for _, k := range before {
		v := mp(t, k)
		if k == "n1.m1.config.raw" {
			v = []byte{0xc1} // with its value anomaly
		}
		// extra.x is a key of the bucket ($KV.<bucket>.extra.x, out of shape) with the text of the
		// added subject the rollup comes on.
		h.rawMsg(n, k, nil, v)
	}
	h.publishOn("extra.y", "", mp(t, "passed over"))
	h.waitCaughtUp(st)
	a, _, err := natstest.Ask(h.nc, query.Subject, []byte(`{"what":"needs"}`), false)
	require.NoError(t, err)
	require.Equal(t, before, keysOf(a))

	roll := h.publishOn("extra.x", "all", mp(t, "the rollup"))
	require.Empty(t, h.bucket(n), "the server purged every key of the bucket")
	a, _, err = natstest.Ask(h.nc, query.Subject, []byte(fmt.Sprintf(`{"what":"needs","min_seq":%d,"wait_ms":5000}`, roll)), false)
	require.NoError(t, err)
	require.Empty(t, a.Rows, "as of the rollup, as the bucket holds")
	require.Empty(t, a.Anomalies)
	require.Zero(t, a.AnomaliesTotal)
	require.EqualValues(t, roll, a.AsOf)
	h.checkAnswer(map[string]any{"what": "needs"})
	h.checkAnswer(map[string]any{"what": "needs", "node": "n1"})

	mid := h.rawMsg(n, "n4.m1.config.c", nil, mp(t, "after"))
	last := h.rawMsg(n, "n5.m1.config.d", nil, mp(t, "after"))
	h.waitCaughtUp(st)
	h.checkAnswer(map[string]any{"what": "needs"})

	// The local log still answers before the rollup: the seat did not start it over with a rebuild.
	for _, tc := range []struct {
		at   string
		want []string
	}{
		{fmt.Sprintf("seq:%d", roll-1), before},
		{fmt.Sprintf("seq:%d", roll), []string{}},
		{fmt.Sprintf("seq:%d", mid), []string{"n4.m1.config.c"}},
		{fmt.Sprintf("seq:%d", last), []string{"n4.m1.config.c", "n5.m1.config.d"}},
	} {
		a, err := h.askAt("needs", tc.at, false)
		require.NoError(t, err, tc.at)
		require.Equal(t, tc.want, keysOf(a), tc.at)
	}
	rollTime := h.msgTime(n, roll)
	a, err = h.askAt("needs", rollTime.Format(time.RFC3339Nano), false)
	require.NoError(t, err)
	require.Empty(t, keysOf(a), "as of the rollup's time")
	require.EqualValues(t, roll, a.AsOf)
	require.Zero(t, st.Rebuilds())

	// Replay and rebuild (the same projector, into a store of their own) agree.
	fromNATS, fromNATSArchive, fromState, fromStateArchive := h.replaySources(t, dir)
	// A key's history read from the stream itself says the gap the store says: closed at the rollup.
	for _, k := range []string{"n1.m1.config.a", "n4.m1.config.c"} {
		var want, got []replay.Revision
		// A revision's Value is valid only during the call: kept, it is copied (Pebble's blocks are
		// poisoned once released under the race detector, and the copy kept read 0xff).
		keep := func(into *[]replay.Revision) func(r *replay.Revision) error {
			return func(r *replay.Revision) error {
				rev := *r
				rev.Value = bytes.Clone(r.Value)
				*into = append(*into, rev)
				return nil
			}
		}
		wantH, err := fromNATS.EachRevision(ctx, n, k, keep(&want))
		require.NoError(t, err)
		gotH, err := replay.EachRevisionInStream(ctx, h.js, n, k, nil, keep(&got))
		require.NoError(t, err)
		require.Equal(t, want, got, k)
		require.Equal(t, wantH, gotH, k)
		require.Equal(t, []store.Gap{{From: 1, To: roll, OpenedAt: roll}}, gotH.Gaps, k)
	}
	for _, l := range []*replay.Log{fromNATS, fromNATSArchive, fromState, fromStateArchive} {
		fromLog := l == fromState || l == fromStateArchive
		for _, tc := range []struct {
			at   string
			want []string
			// gone: read from the streams, which hold nothing from before the rollup, the messages
			// before it were removed unread (store/doc.go, gaps). The rollup removed every one of
			// them, so the points from it on are answered (they were 410 up to the stream's end).
			gone bool
		}{
			{fmt.Sprintf("seq:%d", roll-1), before, true},
			{rollTime.Add(-time.Nanosecond).Format(time.RFC3339Nano), before, true},
			{fmt.Sprintf("seq:%d", roll), []string{}, false},
			{rollTime.Format(time.RFC3339Nano), []string{}, false},
			{fmt.Sprintf("seq:%d", mid), []string{"n4.m1.config.c"}, false},
			{fmt.Sprintf("seq:%d", last), []string{"n4.m1.config.c", "n5.m1.config.d"}, false},
		} {
			got, err := logKeys(t, l, tc.at)
			if tc.gone && !fromLog {
				require.Equal(t, 410, query.Code(err), "%s at %s: %v", l.Source, tc.at, err)
				continue
			}
			require.NoError(t, err, "%s at %s", l.Source, tc.at)
			require.Equal(t, tc.want, got, "%s at %s", l.Source, tc.at)
		}
	}
}

// TestSeat_ASubjectRollupOnAnAddedSubjectLeavesTheBucket: Nats-Rollup: sub on a subject added to a
// bucket's stream purges the earlier messages of that subject alone (of the subjects it matches, with
// a wildcard token: the added subject's, since a stream's subjects never overlap); every key of the
// bucket stays, in the seat, in its local log and in replay.
func TestSeat_ASubjectRollupOnAnAddedSubjectLeavesTheBucket(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	n := provisioner.BucketNeeds
	require.NoError(t, fixtures.CreateBuckets(ctx, h.js, n, provisioner.BucketApplied, provisioner.BucketCollect))
	h.addSubject(n, "extra.>")
	dir := t.TempDir()
	st, _ := h.startSeat(dir)

	keys := []string{"extra.x", "n1.m1.config.a", "n2.x"}
	for _, k := range keys {
		h.rawMsg(n, k, nil, mp(t, k))
	}
	// Each read before the next purges it: a message purged unread leaves a gap in the log (it
	// might have been a key's), and the points in it are not answered.
	h.publishOn("extra.x", "", mp(t, "one"))
	h.waitCaughtUp(st)
	h.publishOn("extra.x", "sub", mp(t, "two"))
	h.waitCaughtUp(st)
	// With wildcards it is a filter of the added subject's messages alone: no key matches it.
	h.publishOn("extra.*", "sub", mp(t, "three"))
	h.waitCaughtUp(st)
	roll := h.publishOn("extra.>", "sub", mp(t, "four"))
	require.Len(t, h.bucket(n), len(keys), "the bucket keeps every key")
	a, _, err := natstest.Ask(h.nc, query.Subject, []byte(fmt.Sprintf(`{"what":"needs","min_seq":%d,"wait_ms":5000}`, roll)), false)
	require.NoError(t, err)
	require.Equal(t, keys, keysOf(a))
	h.waitCaughtUp(st)
	h.checkAnswer(map[string]any{"what": "needs"})
	a, err = h.askAt("needs", fmt.Sprintf("seq:%d", roll), false)
	require.NoError(t, err)
	require.Equal(t, keys, keysOf(a))

	fromNATS, fromNATSArchive, fromState, fromStateArchive := h.replaySources(t, dir)
	for _, l := range []*replay.Log{fromNATS, fromNATSArchive, fromState, fromStateArchive} {
		got, err := logKeys(t, l, fmt.Sprintf("seq:%d", roll))
		require.NoError(t, err, l.Source)
		require.Equal(t, keys, got, l.Source)
	}
}

// TestSeat_AWholeStreamRollupOnTheRegistrysAddedSubjectIsWrittenBack: the same rollup on the
// registry's stream empties the registry bucket. The seat kept answering every kind, and its writer,
// which a lost kind wakes, never learned of the loss: the bucket stayed empty, while the seat said
// otherwise, until the stream check found the purge and rebuilt the projection (the local history
// started afresh) or the next hourly pass. Now the kinds go from the projection at once, the writer
// writes the table back, and the seat answers what the bucket holds, with no rebuild.
func TestSeat_AWholeStreamRollupOnTheRegistrysAddedSubjectIsWrittenBack(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	require.NoError(t, fixtures.CreateBuckets(ctx, h.js, provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect))
	st, _ := h.startSeat(t.TempDir())
	h.waitCaughtUp(st)
	kinds := len(h.bucket(provisioner.BucketRegistry))
	require.Positive(t, kinds)
	h.addSubject(provisioner.BucketRegistry, "extra.>")

	roll := h.publishOn("extra.x", "all", nil)
	natstest.CheckFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		if n := len(h.bucket(provisioner.BucketRegistry)); n != kinds {
			return fmt.Errorf("the registry bucket holds %d kinds of %d", n, kinds)
		}
		return nil
	})
	h.waitCaughtUp(st)
	applied, _ := st.Store().Applied(provisioner.BucketRegistry)
	require.Greater(t, applied, roll, "written back after the rollup")
	h.checkAnswer(map[string]any{"what": "registry"})
	require.Zero(t, st.Rebuilds(), "followed, not found out by the stream check")
}
