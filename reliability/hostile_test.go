package reliability_test

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nats.go/micro"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/internal/verbcheck"
	"github.com/novox/mesh-provisioner/query"
)

// hostileMesh is a small mesh, enough to answer pages of.
var hostileMesh = fixtures.Mesh{Seed: 11, Nodes: 12, Modules: 3, NeedsPerModule: 2, Collections: 3, BadKeys: 2, BadValues: 1}

// ask sends a raw body and returns the micro error code (200 when none), the error text, and the body.
func ask(tb testing.TB, nc *nats.Conn, body []byte) (int, string, []byte) {
	tb.Helper()
	msg, err := nc.Request(query.Subject, body, 10*time.Second)
	require.NoError(tb, err, "the verb answers %d bytes", len(body))
	if c := msg.Header.Get(micro.ErrorCodeHeader); c != "" {
		code, _ := strconv.Atoi(c)
		return code, msg.Header.Get(micro.ErrorHeader), msg.Data
	}
	return 200, "", msg.Data
}

// stillServing asks a plain request and checks it is answered.
func stillServing(tb testing.TB, nc *nats.Conn) {
	tb.Helper()
	a, _, err := natstest.Ask(nc, query.Subject, nil, false)
	require.NoError(tb, err, "the seat keeps serving")
	require.Equal(tb, "registry", a.What)
}

// TestHostile_RequestSize: a request of exactly 1 MiB is read and answered; one byte more is a 400,
// in JSON and in MessagePack. The server allows larger messages here, so the seat's own bound is what
// is tested (with NATS' default max_payload of 1 MiB the client refuses to send more).
func TestHostile_RequestSize(t *testing.T) {
	t.Parallel()
	url := runServer(t, "max_payload: 4MB")
	_, js := natstest.Connect(t, url)
	require.NoError(t, fixtures.Load(context.Background(), js, hostileMesh.Ops(), 0, nil))
	s := startSeat(t, url, t.TempDir())
	waitRegistry(t, js, 10*time.Second)
	nc, _ := natstest.Connect(t, url)

	const mib = 1 << 20
	jsonOf := func(n int) []byte { // {"what":"needs"} padded with spaces to n bytes
		b := []byte(`{"what":"needs","limit":3}`)
		return append(bytes.Repeat([]byte{' '}, n-len(b)), b...)
	}
	code, _, body := ask(t, nc, jsonOf(mib))
	require.Equal(t, 200, code, "%s", body)
	require.Contains(t, string(body), `"what":"needs"`)

	code, desc, body := ask(t, nc, jsonOf(mib+1))
	require.Equal(t, 400, code)
	require.Contains(t, desc, "at most 1048576")
	require.Contains(t, string(body), `"error"`)

	// MessagePack: a map whose after is long enough to make the body 1 MiB + 1.
	mp := func(n int) []byte {
		b, _ := msgpack.Marshal(map[string]any{"what": "needs", "after": ""})
		after := strings.Repeat("a", n-len(b)-4) // str32 header grows by 4
		b, _ = msgpack.Marshal(map[string]any{"what": "needs", "after": after})
		require.Len(t, b, n)
		return b
	}
	code, desc, body = ask(t, nc, mp(mib+1))
	require.Equal(t, 400, code)
	require.Contains(t, desc, "at most 1048576")
	var eb map[string]string
	require.NoError(t, msgpack.Unmarshal(body, &eb), "a MessagePack request gets a MessagePack error")
	require.Equal(t, desc, eb["error"])
	code, desc, _ = ask(t, nc, mp(mib))
	require.Equal(t, 404, code, "a cursor that names no row: %s", desc)

	stillServing(t, nc)
	checkEqual(t, nc, js, 10*time.Second)
	_ = s
}

// TestHostile_Requests sends what a broken or hostile client could: each is a 400 with the reason in
// the header and the body, or a correct answer, and the seat answers the next request.
func TestHostile_Requests(t *testing.T) {
	t.Parallel()
	url := runServer(t, "")
	_, js := natstest.Connect(t, url)
	require.NoError(t, fixtures.Load(context.Background(), js, hostileMesh.Ops(), 0, nil))
	startSeat(t, url, t.TempDir())
	waitRegistry(t, js, 10*time.Second)
	nc, _ := natstest.Connect(t, url)

	mp := func(v any) []byte { b, err := msgpack.Marshal(v); require.NoError(t, err); return b }
	deepMsgpack := func(depth int, inner []byte) []byte {
		return append(append([]byte{0x81, 0xa4, 'w', 'h', 'a', 't'}, bytes.Repeat([]byte{0x91}, depth)...), inner...)
	}
	cases := []struct {
		name string
		body []byte
		code int
		msg  string
	}{
		{"deep MessagePack value", deepMsgpack(900_000, []byte{0xc0}), 400, "MessagePack"},
		{"deep MessagePack at the top", append(bytes.Repeat([]byte{0x91}, 900_000), 0xc0), 400, "neither"},
		{"deep MessagePack maps", append(bytes.Repeat([]byte{0x81, 0xc0}, 400_000), 0xc0), 400, ""},
		{"deep JSON", []byte(`{"what":` + strings.Repeat("[", 900_000) + strings.Repeat("]", 100) + `}`), 400, "JSON"},
		{"deep JSON in an unknown field", []byte(`{"x":` + strings.Repeat(`{"a":`, 150_000) + `}`), 400, "unknown field"},
		{"limit 10001", []byte(`{"what":"needs","limit":10001}`), 400, "limit"},
		{"limit 1e18", []byte(`{"what":"needs","limit":1000000000000000000}`), 400, "limit"},
		{"limit 2^64", []byte(`{"what":"needs","limit":18446744073709551616}`), 400, "limit"},
		{"limit as float", []byte(`{"what":"needs","limit":1.5}`), 400, "limit"},
		{"MessagePack limit uint64 max", mp(map[string]any{"what": "needs", "limit": uint64(math.MaxUint64)}), 400, "limit"},
		{"MessagePack limit -2^63", mp(map[string]any{"what": "needs", "limit": int64(math.MinInt64)}), 400, "limit"},
		{"wait_ms huge", []byte(`{"what":"needs","min_seq":1,"wait_ms":9223372036854775807}`), 400, "wait_ms"},
		{"unknown field", []byte(`{"what":"needs","nodes":"n1"}`), 400, "unknown field"},
		{"unknown field, other case", []byte(`{"What":"needs"}`), 400, "unknown field"},
		{"repeated field", []byte(`{"what":"needs","what":"registry"}`), 400, "twice"},
		{"MessagePack unknown field", mp(map[string]any{"what": "needs", "x": []any{1, 2}}), 400, "unknown field"},
		{"not MessagePack: 0xc1", []byte{0xc1, 0xc1, 0xc1}, 400, "neither"},
		{"MessagePack map, garbage inside", []byte{0x83, 0xa4, 'w', 'h', 'a', 't', 0xc1, 0xff}, 400, "MessagePack"},
		{"MessagePack map claiming 4G members", []byte{0xdf, 0xff, 0xff, 0xff, 0xff, 0xa4, 'w', 'h', 'a', 't', 0xa5, 'n', 'e', 'e', 'd', 's'}, 400, "MessagePack"},
		{"binary that starts with {", append([]byte("{"), bytes.Repeat([]byte{0xff, 0x00}, 1000)...), 400, "JSON"},
		{"text", []byte("what=needs&node=n1"), 400, "neither"},
		{"NUL bytes", make([]byte, 4096), 400, "neither"},
		{"node not a token", []byte(`{"what":"needs","node":"n1.m"}`), 400, "not a key token"},
		{"node of 900 KB", []byte(`{"what":"needs","node":"` + strings.Repeat("n", 900_000) + `"}`), 200, ""},
		{"after of 900 KB", []byte(`{"what":"needs","after":"` + strings.Repeat("n", 900_000) + `"}`), 404, "start again"},
		{"collection not UTF-8", mp(map[string]any{"what": "collect", "collection": "\xff\xfe\x00"}), 400, "not valid UTF-8"},
		{"min_seq far ahead, no wait", []byte(`{"what":"needs","min_seq":9223372036854775807}`), 504, "min_seq"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			code, desc, body := ask(t, nc, tc.body)
			require.Equal(t, tc.code, code, "%s %s", desc, body)
			if code != 200 {
				require.NotEmpty(t, desc)
				require.Contains(t, desc, tc.msg)
				require.Less(t, len(body), 64<<10, "the error body does not echo the request")
			}
			stillServing(t, nc)
		})
	}
	checkEqual(t, nc, js, 10*time.Second)
}

// hostileValues are values node clients could put: not MessagePack, MessagePack that is odd, and
// MessagePack nested at and past the depth the seat renders.
func hostileValues() map[string][]byte {
	nest := func(depth int) []byte { return append(bytes.Repeat([]byte{0x91}, depth), 0xc0) }
	nan, _ := msgpack.Marshal(math.NaN())
	return map[string][]byte{
		"empty":            {},
		"never-used-byte":  {0xc1},
		"truncated-map":    {0x82, 0xa1, 'a'},
		"trailing-bytes":   {0x01, 0x02},
		"two-objects":      {0x80, 0x80},
		"str-claims-4g":    {0xdb, 0xff, 0xff, 0xff, 0xff, 'x'},
		"invalid-utf8-str": {0xa3, 0xff, 0xfe, 0xfd},
		"nan":              nan,
		"ext-type-5":       {0xd6, 0x05, 1, 2, 3, 4},
		"bad-timestamp":    {0xd7, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0}, // nanoseconds past 999999999
		"int-keys":         {0x81, 0x01, 0x02},
		"nested-512":       nest(512),
		"nested-513":       nest(513),
		"nested-100000":    nest(100_000),
		"text":             []byte("hello, not MessagePack at all"),
		"json":             []byte(`{"a":1}`),
	}
}

// TestHostile_Values puts each hostile value under needs, applied and collect: every key answers, the
// values that are not MessagePack (or too deep to render) as value_raw with an anomaly, the others as
// they are, and the answers equal the buckets in both formats.
func TestHostile_Values(t *testing.T) {
	t.Parallel()
	url := runServer(t, "")
	_, js := natstest.Connect(t, url)
	var ops []fixtures.Op
	for name, v := range hostileValues() {
		ops = append(ops,
			fixtures.Op{Bucket: provisioner.BucketNeeds, Key: "n1.mod-h.config." + name, Op: provisioner.OpPut, Value: v},
			fixtures.Op{Bucket: provisioner.BucketApplied, Key: "n1." + name, Op: provisioner.OpPut, Value: v},
			fixtures.Op{Bucket: provisioner.BucketCollect, Key: "n1." + name + ".mod-h", Op: provisioner.OpPut, Value: v})
	}
	require.NoError(t, fixtures.Load(context.Background(), js, ops, 0, nil))
	startSeat(t, url, t.TempDir())
	waitRegistry(t, js, 10*time.Second)
	nc, _ := natstest.Connect(t, url)
	checkEqual(t, nc, js, 10*time.Second)

	// The anomalies say which values are kept raw.
	a, _, err := natstest.Ask(nc, query.Subject, []byte(`{"what":"applied","node":"n1"}`), false)
	require.NoError(t, err)
	raw := map[string]bool{}
	for _, an := range a.Anomalies {
		if strings.HasPrefix(fmt.Sprint(an["reason"]), "value-not-msgpack") {
			raw[strings.TrimPrefix(fmt.Sprint(an["key"]), "n1.")] = true
		}
	}
	for name, v := range hostileValues() {
		require.Equal(t, !verbcheck.IsMsgpack(v), raw[name], "%s: kept raw", name)
	}
	require.True(t, raw["nested-513"] && !raw["nested-512"], "the depth bound is 512")
}

// TestHostile_LongKeys writes keys at the longest subject the server takes (its max_control_line),
// in shape and out of it, many of them: each is answered or said as an anomaly, and every answer
// still fits in a NATS message.
func TestHostile_LongKeys(t *testing.T) {
	t.Parallel()
	url := runServer(t, "")
	nc, js := natstest.Connect(t, url)
	require.NoError(t, fixtures.Load(context.Background(), js, hostileMesh.Ops(), 0, nil))

	longest := map[string]int{}
	for _, b := range mixBuckets {
		longest[b] = longestKey(t, url, b)
		t.Logf("%s: the longest key a put can carry is %d bytes", b, longest[b])
		require.Greater(t, longest[b], 3000)
	}
	pad := func(prefix string, n int, suffix string) string {
		return prefix + strings.Repeat("x", n-len(prefix)-len(suffix)) + suffix
	}
	var ops []fixtures.Op
	val, _ := msgpack.Marshal(map[string]any{"v": 1})
	for i := 0; i < 40; i++ { // in shape: rows
		l := longest[provisioner.BucketNeeds]
		ops = append(ops,
			fixtures.Op{Bucket: provisioner.BucketNeeds, Key: pad(fmt.Sprintf("n2.mod-long.config.k%02d", i), l, ""), Op: provisioner.OpPut, Value: val},
			fixtures.Op{Bucket: provisioner.BucketApplied, Key: pad(fmt.Sprintf("n2.m%02d", i), longest[provisioner.BucketApplied], ""), Op: provisioner.OpPut, Value: val},
			fixtures.Op{Bucket: provisioner.BucketCollect, Key: pad(fmt.Sprintf("n2.c%02d", i), longest[provisioner.BucketCollect], ".mod-long"), Op: provisioner.OpPut, Value: val})
	}
	// A node made only of long keys out of shape: more anomaly text than one message can hold.
	for i := 0; i < 400; i++ {
		ops = append(ops,
			fixtures.Op{Bucket: provisioner.BucketNeeds, Key: pad(fmt.Sprintf("n3.bad%03d.", i), longest[provisioner.BucketNeeds], ""), Op: provisioner.OpPut, Value: val},
			fixtures.Op{Bucket: provisioner.BucketApplied, Key: pad(fmt.Sprintf("n3.bad%03d.", i), longest[provisioner.BucketApplied], ""), Op: provisioner.OpPut, Value: val})
	}
	// A long node name, in shape.
	node := pad("n", 2000, "")
	ops = append(ops, fixtures.Op{Bucket: provisioner.BucketNeeds, Key: node + ".mod-long.config.a", Op: provisioner.OpPut, Value: val})
	// One at a time, as kv.Put sends them: the reply subject of a synchronous publish is the one
	// longestKey measured with.
	for _, op := range ops {
		_, err := js.PublishMsg(context.Background(), fixtures.OpMsg(op))
		require.NoError(t, err, "put %d bytes on %s", len(op.Key), op.Bucket)
	}

	startSeat(t, url, t.TempDir())
	waitRegistry(t, js, 10*time.Second)
	checkEqual(t, nc, js, 20*time.Second)

	truth, err := verbcheck.ReadTruth(context.Background(), js)
	require.NoError(t, err)
	for _, req := range []map[string]any{
		{"what": "needs", "node": node}, {"what": "needs", "node": "n2", "limit": 1}, {"what": "needs", "node": "n3"},
		{"what": "needs", "module": "mod-long", "limit": 10000}, {"what": "applied", "node": "n3"},
		{"what": "collect", "contributor": "mod-long", "limit": 3},
	} {
		for _, asMsgpack := range []bool{false, true} {
			require.NoError(t, truth.Check(nc, req, asMsgpack, 0))
		}
	}
	stillServing(t, nc)
}

// longestKey finds, by bisection against the server, the longest key of a bucket that a KV put
// (a JetStream publish with a reply subject) can carry: past it the server refuses the protocol line
// and closes that connection, so each probe uses a connection of its own.
func longestKey(tb testing.TB, url, bucket string) int {
	tb.Helper()
	fits := func(n int) bool {
		nc, err := nats.Connect(url, nats.NoReconnect(), nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}))
		require.NoError(tb, err)
		defer nc.Close()
		js, err := jetstream.New(nc)
		require.NoError(tb, err)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		key := "probe." + strings.Repeat("p", n-len("probe."))
		_, err = js.Publish(ctx, provisioner.SubjectPrefix(bucket)+key, []byte{0x01})
		require.False(tb, err != nil && n < 1000, "probe %d: %v", n, err)
		return err == nil
	}
	defer func() {
		// Leave no probe behind: the bucket's content is what the test compares. (A KV purge of a key
		// this long would not fit the protocol line either: its headers make the line longer.)
		nc, js := natstest.Connect(tb, url)
		defer nc.Close()
		st, err := js.Stream(context.Background(), provisioner.StreamName(bucket))
		require.NoError(tb, err)
		require.NoError(tb, st.Purge(context.Background(), jetstream.WithPurgeSubject(provisioner.SubjectPrefix(bucket)+"probe.>")))
	}()
	lo, hi := 100, 8192 // fits(lo), !fits(hi)
	require.True(tb, fits(lo))
	require.False(tb, fits(hi))
	for hi-lo > 1 {
		mid := (lo + hi) / 2
		if fits(mid) {
			lo = mid
		} else {
			hi = mid
		}
	}
	return lo
}
