package seat_test

import (
	"context"
	"encoding/base64"
	"fmt"
	"sort"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/query"
)

// askAt asks the verb as of a point, in JSON or MessagePack.
func (h *harness) askAt(what, at string, asMsgpack bool) (natstest.Answer, error) {
	h.t.Helper()
	req := map[string]any{"what": what, "at": at}
	var body []byte
	var err error
	if asMsgpack {
		body, err = msgpack.Marshal(req)
	} else {
		body = []byte(fmt.Sprintf(`{"what":%q,"at":%q}`, what, at))
	}
	require.NoError(h.t, err)
	a, _, err := natstest.Ask(h.nc, query.Subject, body, asMsgpack)
	return a, err
}

// TestSeat_AtBeforeTheFirstMessageIsEmpty: CONTRACT section 3, "a time before the bucket's first
// message, with nothing trimmed, is simply an empty answer". Also when the stream had removed its first
// messages before the seat read them: a time before the stream was created is before every one of
// them. A time between the stream's creation and the first message the seat read is still unknown
// (410): the removed messages may have come before it.
func TestSeat_AtBeforeTheFirstMessageIsEmpty(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	// applied keeps one revision: written five times before the seat starts, its stream starts at 5.
	applied, err := h.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.BucketApplied, History: 1})
	require.NoError(t, err)
	for i := 0; i < 5; i++ {
		_, err := applied.Put(ctx, "n1.m1", mp(t, i))
		require.NoError(t, err)
	}
	needs, err := h.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.BucketNeeds, History: 4})
	require.NoError(t, err)
	_, err = needs.Put(ctx, "n1.m1.config.a", mp(t, "a"))
	require.NoError(t, err)
	require.NoError(t, fixtures.CreateBuckets(ctx, h.js, provisioner.BucketCollect))
	st, _ := h.startSeat(t.TempDir())
	h.waitCaughtUp(st)

	msgTime := func(bucket string, seq uint64) time.Time {
		stream, err := h.js.Stream(ctx, provisioner.StreamName(bucket))
		require.NoError(t, err)
		m, err := stream.GetMsg(ctx, seq)
		require.NoError(t, err)
		return m.Time
	}
	stream, err := h.js.Stream(ctx, provisioner.StreamName(provisioner.BucketApplied))
	require.NoError(t, err)
	info, err := stream.Info(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 5, info.State.FirstSeq, "the stream removed its first four messages before the seat read them")
	format := func(t time.Time) string { return t.UTC().Format(time.RFC3339Nano) }

	for _, asMsgpack := range []bool{false, true} {
		name := fmt.Sprintf("msgpack=%v", asMsgpack)
		empty := []struct{ what, at string }{
			{"needs", format(msgTime(provisioner.BucketNeeds, 1).Add(-time.Nanosecond))}, // nothing removed, nothing trimmed
			{"needs", "2000-01-01T00:00:00Z"},
			{"applied", format(info.Created.Add(-time.Nanosecond))}, // before the stream existed
			{"applied", "2000-01-01T00:00:00Z"},
			{"collect", "2000-01-01T00:00:00Z"}, // a bucket with no message at all
		}
		for _, c := range empty {
			a, err := h.askAt(c.what, c.at, asMsgpack)
			require.NoError(t, err, "%s: %s at %s is an empty answer", name, c.what, c.at)
			require.Empty(t, a.Rows, "%s: %s at %s", name, c.what, c.at)
			require.Empty(t, a.Anomalies, "%s: %s at %s", name, c.what, c.at)
			require.Zero(t, a.AnomaliesTotal)
			require.Zero(t, a.AsOf, "%s: %s at %s", name, c.what, c.at)
		}

		// After the stream's creation and before the first message read: messages 1 to 4 may have
		// come before it, so the log cannot say.
		_, err := h.askAt("applied", format(msgTime(provisioner.BucketApplied, 5).Add(-time.Nanosecond)), asMsgpack)
		var ve *natstest.VerbError
		require.ErrorAs(t, err, &ve, name)
		require.Equal(t, 410, ve.Code, name)
		require.Equal(t, ve.Description, ve.Body, "%s: the body, in the request's format, says it too", name)

		a, err := h.askAt("applied", format(msgTime(provisioner.BucketApplied, 5)), asMsgpack)
		require.NoError(t, err, name)
		require.Len(t, a.Rows, 1, name)
		require.EqualValues(t, 5, a.AsOf, name)
	}
}

// TestSeat_AnomaliesCappedAndNarrowedByNodeAlone: CONTRACT section 3, anomalies are "narrowed by node
// alone (the raw key's first token ...), at most 1000, in byte order of their raw keys", and
// anomalies_total counts every one that matched before the cap.
func TestSeat_AnomaliesCappedAndNarrowedByNodeAlone(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	n := provisioner.BucketNeeds
	notMsgpack := []byte{0xc1, 'r', 'a', 'w'}
	ops := []fixtures.Op{
		{Bucket: n, Key: "n1", Op: provisioner.OpPut, Value: mp(t, "one token: node n1 and nothing else")},
		{Bucket: n, Key: "n1.m.config.a", Op: provisioner.OpPut, Value: notMsgpack},
		{Bucket: n, Key: "n1.m.config.b", Op: provisioner.OpPut, Value: mp(t, "b")},
		{Bucket: n, Key: "n1x.bad", Op: provisioner.OpPut, Value: mp(t, "another node")},
		{Bucket: n, Key: "n2.bad", Op: provisioner.OpPut, Value: mp(t, "another node")},
	}
	var want []string // n1's anomalies in byte order of raw key
	want = append(want, "n1")
	for i := 0; i < 1005; i++ {
		key := fmt.Sprintf("n1.bad%04d", i) // two tokens of four: token-count
		ops = append(ops, fixtures.Op{Bucket: n, Key: key, Op: provisioner.OpPut, Value: mp(t, i)})
		want = append(want, key)
	}
	want = append(want, "n1.m.config.a")
	require.True(t, sort.StringsAreSorted(want))
	h.load(ops)
	require.NoError(t, fixtures.CreateBuckets(context.Background(), h.js, provisioner.BucketApplied, provisioner.BucketCollect))
	st, _ := h.startSeat(t.TempDir())
	h.waitCaughtUp(st)

	keys := func(a natstest.Answer) []string {
		var out []string
		for _, an := range a.Anomalies {
			out = append(out, an["key"].(string))
		}
		return out
	}
	for _, asMsgpack := range []bool{false, true} {
		for _, req := range []map[string]any{
			{"what": "needs", "node": "n1"},
			{"what": "needs", "node": "n1", "module": "m"},    // module does not narrow anomalies
			{"what": "needs", "node": "n1", "kind": "secret"}, // nor does kind
			{"what": "needs", "node": "n1", "module": "nope"}, // even with no row at all
			{"what": "needs", "node": "n1", "limit": 1},       // nor the page
			{"what": "needs", "node": "n1", "module": "m", "kind": "config"},
		} {
			name := fmt.Sprintf("%v msgpack=%v", req, asMsgpack)
			_, a, err := natstest.AskAll(h.nc, query.Subject, req, asMsgpack)
			require.NoError(t, err, name)
			require.Equal(t, want[:query.MaxAnomalies], keys(a), "%s: the node's first 1000, in byte order", name)
			require.EqualValues(t, len(want), a.AnomaliesTotal, "%s: every one of the node's anomalies counted", name)
		}

		// Without node: every key of the bucket, capped the same way.
		_, a, err := natstest.AskAll(h.nc, query.Subject, map[string]any{"what": "needs"}, asMsgpack)
		require.NoError(t, err)
		require.Len(t, a.Anomalies, query.MaxAnomalies)
		require.EqualValues(t, len(want)+2, a.AnomaliesTotal, "with n1x.bad and n2.bad")
		// A node that is a prefix of another's name is not that node.
		_, a, err = natstest.AskAll(h.nc, query.Subject, map[string]any{"what": "needs", "node": "n1x"}, asMsgpack)
		require.NoError(t, err)
		require.Equal(t, []string{"n1x.bad"}, keys(a))
		require.EqualValues(t, 1, a.AnomaliesTotal)

		// The value that is not MessagePack keeps its row: value null, value_raw its bytes (base64 in JSON).
		rows, _, err := natstest.AskAll(h.nc, query.Subject, map[string]any{"what": "needs", "node": "n1", "module": "m"}, asMsgpack)
		require.NoError(t, err)
		require.Len(t, rows, 2)
		require.Equal(t, "n1.m.config.a", rows[0]["key"])
		require.Contains(t, rows[0], "value")
		require.Nil(t, rows[0]["value"])
		if asMsgpack {
			require.Equal(t, notMsgpack, rows[0]["value_raw"])
		} else {
			require.Equal(t, base64.StdEncoding.EncodeToString(notMsgpack), rows[0]["value_raw"])
		}
		require.NotContains(t, rows[1], "value_raw")
	}
}

// TestSeat_AtFarFromNow: CONTRACT section 3, `at` is an RFC 3339 time. One far in the past (the year
// 1000) is before the bucket's first message: empty while nothing is trimmed, 410 once the log is
// trimmed; one far in the future (the year 9999) is after every message: the current state. Times
// outside the years 1678-2262 have no Unix nanosecond count and must not wrap around to another time.
func TestSeat_AtFarFromNow(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	n := provisioner.BucketNeeds
	h.load([]fixtures.Op{
		{Bucket: n, Key: "n1.m.config.a", Op: provisioner.OpPut, Value: mp(t, "a")},
		{Bucket: n, Key: "n1.m.config.b", Op: provisioner.OpPut, Value: mp(t, "b")},
		{Bucket: n, Key: "n1.bad", Op: provisioner.OpPut, Value: mp(t, "out of shape")},
	})
	require.NoError(t, fixtures.CreateBuckets(context.Background(), h.js, provisioner.BucketApplied, provisioner.BucketCollect))
	st, _ := h.startSeat(t.TempDir())
	h.waitCaughtUp(st)
	applied, _ := st.Store().Applied(n)
	live, _, err := natstest.Ask(h.nc, query.Subject, []byte(`{"what":"needs"}`), false)
	require.NoError(t, err)
	require.Len(t, live.Rows, 2)

	past := []string{"1000-01-01T00:00:00Z", "0001-01-01T00:00:00.000000001Z", "1677-12-31T23:59:59Z"}
	future := []string{"9999-12-31T23:59:59Z", "2262-05-01T00:00:00Z", "3000-01-01T00:00:00+02:00"}
	for _, asMsgpack := range []bool{false, true} {
		for _, at := range past {
			a, err := h.askAt("needs", at, asMsgpack)
			require.NoError(t, err, at)
			require.Empty(t, a.Rows, "%s is before the first message", at)
			require.Empty(t, a.Anomalies, at)
			require.Zero(t, a.AsOf, at)
		}
		for _, at := range future {
			a, err := h.askAt("needs", at, asMsgpack)
			require.NoError(t, err, at)
			require.Len(t, a.Rows, len(live.Rows), "%s is after every message", at)
			require.Equal(t, applied, a.AsOf, at)
			require.EqualValues(t, 1, a.AnomaliesTotal, at)
		}
	}

	// Trimmed: the past is no longer known to be empty; the future still answers.
	last := h.lastMsg(n)
	_, err = st.Store().TrimHistory(context.Background(), n, applied, last.Time.UnixNano())
	require.NoError(t, err)
	for _, at := range past {
		_, err := h.askAt("needs", at, false)
		var ve *natstest.VerbError
		require.ErrorAs(t, err, &ve, at)
		require.Equal(t, 410, ve.Code, at)
	}
	for _, at := range future {
		a, err := h.askAt("needs", at, false)
		require.NoError(t, err, at)
		require.Len(t, a.Rows, len(live.Rows), at)
		require.Equal(t, applied, a.AsOf, at)
	}
}

// lastMsg is the last message of a bucket's stream.
func (h *harness) lastMsg(bucket string) *jetstream.RawStreamMsg {
	h.t.Helper()
	ctx := context.Background()
	stream, err := h.js.Stream(ctx, provisioner.StreamName(bucket))
	require.NoError(h.t, err)
	info, err := stream.Info(ctx)
	require.NoError(h.t, err)
	m, err := stream.GetMsg(ctx, info.State.LastSeq)
	require.NoError(h.t, err)
	return m
}

// TestSeat_MarkerOfAnyValueRemovesTheKey: CONTRACT section 1, "A TTL marker (Nats-Marker-Reason set,
// any value) removes it as well", and section 2, a delete clears the key's anomaly. Markers written on
// the raw subject with reasons the server never writes, the empty one included, on a key that fits,
// one whose value is not MessagePack and one out of shape.
func TestSeat_MarkerOfAnyValueRemovesTheKey(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	n := provisioner.BucketNeeds
	require.NoError(t, fixtures.CreateBuckets(context.Background(), h.js, n, provisioner.BucketApplied, provisioner.BucketCollect))
	st, _ := h.startSeat(t.TempDir())
	keys := []string{"n1.m.config.fits", "n1.m.config.raw", "n1.m:bad.config.x", "n1.out-of-shape"}
	values := [][]byte{mp(t, "fits"), {0xc1}, mp(t, "x"), mp(t, "x")}
	for i, k := range keys {
		h.rawMsg(n, k, nil, values[i])
	}
	h.waitCaughtUp(st)
	a, _, err := natstest.Ask(h.nc, query.Subject, []byte(`{"what":"needs"}`), false)
	require.NoError(t, err)
	require.Len(t, a.Rows, 2)
	require.EqualValues(t, 3, a.AnomaliesTotal)

	for _, reason := range []string{"", "Whatever", "MaxAge"} {
		for i, k := range keys {
			h.rawMsg(n, k, nil, values[i])
			h.rawMsg(n, k, nats.Header{jetstream.MarkerReasonHeader: {reason}}, nil)
		}
		h.waitCaughtUp(st)
		for _, asMsgpack := range []bool{false, true} {
			body := []byte(`{"what":"needs"}`)
			if asMsgpack {
				body = mp(t, map[string]any{"what": "needs"})
			}
			a, _, err := natstest.Ask(h.nc, query.Subject, body, asMsgpack)
			require.NoError(t, err)
			require.Empty(t, a.Rows, "Nats-Marker-Reason %q removes every key", reason)
			require.Empty(t, a.Anomalies, "Nats-Marker-Reason %q clears every anomaly", reason)
			require.Zero(t, a.AnomaliesTotal)
		}
	}
}

// rawMsg publishes a message on a bucket's raw subject, as a client that does not use the KV API would.
func (h *harness) rawMsg(bucket, key string, hdr nats.Header, data []byte) uint64 {
	h.t.Helper()
	m := nats.NewMsg(provisioner.SubjectPrefix(bucket) + key)
	for k, v := range hdr {
		m.Header[k] = v
	}
	m.Data = data
	ack, err := h.js.PublishMsg(context.Background(), m)
	require.NoError(h.t, err)
	return ack.Sequence
}
