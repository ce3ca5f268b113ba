package seat_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
)

// The conformance suite asks the verb as a client in another language would, from CONTRACT.md sections
// 1 to 4 alone: raw bodies on the subject, the answer and the micro error headers read off the wire,
// decoded into generic maps. It uses none of the query package.

const verbSubject = "mesh-provisioner.provisioning"

// wire is one answer as it came back.
type wire struct {
	code    int    // 200 when no Nats-Service-Error-Code header
	errText string // Nats-Service-Error
	body    map[string]any
	raw     []byte
	msgpack bool // the body is a MessagePack map
}

func (w wire) String() string {
	return fmt.Sprintf("code %d %q body %.300q", w.code, w.errText, w.raw)
}

// askWire sends body and reads the answer in whichever format it came: a MessagePack map header
// first is MessagePack, '{' is JSON; anything else fails the test.
func askWire(t testing.TB, nc *nats.Conn, body []byte) wire {
	t.Helper()
	msg, err := nc.Request(verbSubject, body, 20*time.Second)
	require.NoError(t, err, "request %q", body)
	w := wire{code: 200, raw: msg.Data}
	if c := msg.Header.Get("Nats-Service-Error-Code"); c != "" {
		w.code, err = strconv.Atoi(c)
		require.NoError(t, err, "error code header %q", c)
		w.errText = msg.Header.Get("Nats-Service-Error")
	}
	require.NotEmpty(t, msg.Data, "request %q: an empty answer body", body)
	switch c := msg.Data[0]; {
	case c == '{':
		dec := json.NewDecoder(bytes.NewReader(msg.Data))
		dec.UseNumber()
		require.NoError(t, dec.Decode(&w.body), "request %q: answer %q", body, msg.Data)
	case c&0xf0 == 0x80 || c == 0xde || c == 0xdf:
		w.msgpack = true
		require.NoError(t, msgpack.Unmarshal(msg.Data, &w.body), "request %q", body)
	default:
		t.Fatalf("request %q: answer is neither a JSON object nor a MessagePack map: %q", body, msg.Data)
	}
	return w
}

// wireBody writes a request in one format: JSON, or MessagePack.
func wireBody(t testing.TB, req map[string]any, asMsgpack bool) []byte {
	t.Helper()
	b, err := natstest.Body(req, asMsgpack)
	require.NoError(t, err)
	return b
}

var wireFormats = []struct {
	name    string
	msgpack bool
}{{"json", false}, {"msgpack", true}}

// wireOK asks and requires a successful answer in the request's format.
func wireOK(t testing.TB, nc *nats.Conn, req map[string]any, asMsgpack bool) wire {
	t.Helper()
	w := askWire(t, nc, wireBody(t, req, asMsgpack))
	require.Equal(t, 200, w.code, "%v: %s", req, w)
	require.Equal(t, asMsgpack, w.msgpack, "%v: the answer is in the request's format", req)
	return w
}

// wireFails asks and requires an error of code, said in the headers and again in the body, in the
// request's format.
func wireFails(t testing.TB, nc *nats.Conn, body []byte, asMsgpack bool, code int) wire {
	t.Helper()
	w := askWire(t, nc, body)
	require.Equal(t, code, w.code, "request %q: %s", body, w)
	require.NotEmpty(t, w.errText, "request %q: Nats-Service-Error says why", body)
	require.Equal(t, asMsgpack, w.msgpack, "request %q: the error body is in the request's format", body)
	require.Equal(t, map[string]any{"error": w.errText}, w.body, "request %q: the body is {\"error\": ...}", body)
	return w
}

// wireKeys is the keys of an answer's rows, in order.
func wireKeys(t testing.TB, w wire) []string {
	t.Helper()
	var keys []string
	for _, r := range wireRows(t, w) {
		k, isStr := r["key"].(string)
		require.True(t, isStr, "a row's key is a string: %v", r)
		keys = append(keys, k)
	}
	return keys
}

// wireRows is an answer's rows; the answer must have them, a list (empty or not) of maps.
func wireRows(t testing.TB, w wire) []map[string]any {
	t.Helper()
	list, isList := w.body["rows"].([]any)
	require.True(t, isList, "rows is a list: %s", w)
	rows := make([]map[string]any, len(list))
	for i, r := range list {
		rows[i], isList = r.(map[string]any)
		require.True(t, isList, "a row is a map: %v", r)
	}
	return rows
}

func wireUint(t testing.TB, v any) uint64 {
	t.Helper()
	switch n := v.(type) {
	case json.Number:
		u, err := strconv.ParseUint(string(n), 10, 64)
		require.NoError(t, err)
		return u
	case int8, int16, int32, int64, uint8, uint16, uint32, uint64:
		u, err := strconv.ParseUint(fmt.Sprint(n), 10, 64)
		require.NoError(t, err)
		return u
	}
	t.Fatalf("not an integer: %T %v", v, v)
	return 0
}

// inByteOrder reports whether keys are in strictly increasing byte order.
func inByteOrder(keys []string) bool {
	for i := 1; i < len(keys); i++ {
		if keys[i-1] >= keys[i] {
			return false
		}
	}
	return true
}

// wireWalk pages through a request to its end, limit rows a page, and calls between after each page.
func wireWalk(t testing.TB, nc *nats.Conn, req map[string]any, asMsgpack bool, between func(page int)) []string {
	t.Helper()
	r := map[string]any{}
	for k, v := range req {
		r[k] = v
	}
	var keys []string
	for page := 0; page < 10000; page++ {
		w := wireOK(t, nc, r, asMsgpack)
		keys = append(keys, wireKeys(t, w)...)
		next, more := w.body["next"]
		if !more {
			return keys
		}
		require.IsType(t, "", next)
		require.NotEmpty(t, next)
		r["after"] = next
		if between != nil {
			between(page)
		}
	}
	t.Fatal("more than 10000 pages")
	return nil
}

// withoutNaN is v with each NaN written "NaN", so that two answers holding the same NaN compare equal.
func withoutNaN(v any) any {
	switch v := v.(type) {
	case float64:
		if math.IsNaN(v) {
			return "NaN"
		}
	case float32:
		if v != v {
			return "NaN"
		}
	case []any:
		out := make([]any, len(v))
		for i, e := range v {
			out[i] = withoutNaN(e)
		}
		return out
	case map[string]any:
		out := make(map[string]any, len(v))
		for k, e := range v {
			out[k] = withoutNaN(e)
		}
		return out
	}
	return v
}

// wireMesh is what the suite's one seat holds before it starts.
type wireMesh struct {
	ordKeys     []string // needs of node ord, modules whose bytes sort oddly
	collectRows map[string]string
	capKeys     []string // applied: 1001 one-token keys, each an anomaly
}

func TestConformance_Verb(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	for _, b := range []string{provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect} {
		_, err := h.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: b, History: 10, LimitMarkerTTL: time.Minute})
		require.NoError(t, err)
	}
	// The registry holds what the seat's writer must put right at start: a kind not in the table, keys
	// out of shape, a kind with another value, one not MessagePack, one deleted.
	R := provisioner.BucketRegistry
	_, err := h.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: R, History: 10})
	require.NoError(t, err)
	h.rawMsg(R, "stray", nil, mp(t, map[string]any{"kind": "stray", "module": "x", "verb": "x.y"}))
	h.rawMsg(R, "two.tokens", nil, mp(t, 1))
	h.rawMsg(R, "config", nil, mp(t, map[string]any{"kind": "config", "module": "another"}))
	h.rawMsg(R, "secret", nil, []byte{0xc1})
	h.rawMsg(R, "port", nil, mp(t, "x"))
	h.rawMsg(R, "port", nats.Header{"KV-Operation": {"DEL"}}, nil)
	var m wireMesh
	put := func(bucket, key string, v []byte) uint64 { return h.rawMsg(bucket, key, nil, v) }
	N, A, C := provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect

	// Modules whose bytes sort around the token separator '.' (0x2e): '-' 0x2d, '/' 0x2f, then digits,
	// '=', upper case, '_', lower case.
	for _, mod := range []string{"a", "a-", "a/", "a_", "a=", "aA", "aa", "A", "Z", "z", "0", "9", "_", "-", "/", "=", "a-b", "a0"} {
		k := "ord." + mod + ".config.x"
		put(N, k, mp(t, k))
		m.ordKeys = append(m.ordKeys, k)
	}
	sort.Strings(m.ordKeys)
	// Anomalies narrowed by node: the raw key's first token.
	put(N, "n1", mp(t, "one token"))
	put(N, "n1.m.config.raw", []byte{0xc1, 'r', 'a', 'w'})
	put(N, "n1.m.config.ok", mp(t, "ok"))
	put(N, "n1.m.nosuchkind.x", mp(t, "unanswered"))
	put(N, "n1x.bad", mp(t, "another node"))
	put(N, "n1.m.config.x.y", mp(t, "five tokens"))
	// Deletes.
	put(N, "del.m.config.deleted", mp(t, "d"))
	purgedPut := put(N, "del.m.config.purged", mp(t, "p"))
	put(N, "del.m.config.kept", mp(t, "k"))
	put(N, "del.bad", mp(t, "out of shape, deleted"))
	h.rawMsg(N, "del.m.config.deleted", nats.Header{"KV-Operation": {"DEL"}}, nil)
	purge := h.rawMsg(N, "del.m.config.purged", nats.Header{"KV-Operation": {"PURGE"}, "Nats-Rollup": {"sub"}}, nil)
	// Values that are MessagePack and have no JSON form: NaN and infinities, strings (and map keys)
	// that are not UTF-8, anywhere in the value.
	noJSON := map[string][]byte{
		"val.m.config.nan":    mp(t, math.NaN()),
		"val.m.config.inf":    mp(t, map[string]any{"limit": math.Inf(1)}),
		"val.m.config.ninf":   {0xca, 0xff, 0x80, 0, 0}, // float 32 -Inf
		"val.m.config.nan32":  {0x91, 0xca, 0x7f, 0xc0, 0, 0},
		"val.m.config.deep":   mp(t, map[string]any{"a": []any{1, map[string]any{"b": []any{"x", math.NaN()}}}}),
		"val.m.config.latin1": mp(t, map[string]any{"motd": "caf\xe9"}),
		"val.m.config.badkey": mp(t, map[string]any{"k\xff": 1}),
	}
	for k, v := range noJSON {
		put(N, k, v)
	}
	put(N, "val.m.config.ok", mp(t, map[string]any{"limit": 1.5, "motd": "café"}))
	// A need of a kind the registry held until the writer deleted it at start.
	put(N, "uk.m.stray.x", mp(t, "stray"))
	put(N, "uk.m.config.x", mp(t, "config"))
	h.rawMsg(N, "del.bad", nats.Header{"KV-Operation": {"DEL"}}, nil)
	// Paging: 60 needs that live throughout.
	for i := 0; i < 60; i++ {
		put(N, fmt.Sprintf("pg.m.config.k%03d", i), mp(t, i))
	}

	// Collections: every escape case of section 1.
	m.collectRows = map[string]string{
		"c1.shell=3Azsh=3Anormal.modA":   "shell:zsh:normal",
		"c1.shell=3azsh=3anormal.modB":   "shell:zsh:normal", // lower-case hex
		"c1.shell.modA":                  "shell",
		"c1.a=3Db.modA":                  "a=b",
		"c1.=C3=A9.modA":                 "é",
		"c1.=c3=a9.modB":                 "é",
		"c1.ports=2Ehttp.modA":           "ports.http",
		"c1.path=20with=20space.modA":    "path with space",
		"c1.=E6=97=A5=E6=9C=AC.modA":     "日本",
		"c1.a=3D3Ab.modA":                "a=3Ab", // the decoded name holds what looks like an escape
		"c2.shell=3Azsh=3Anormal.modA":   "shell:zsh:normal",
		"c3.=73hell.modB":                "shell", // an escape of a byte a token holds
		"c3.=73=68=65=6C=6c.modC":        "shell",
		"c3.SHELL.modA":                  "SHELL",
		"c3.=c3=A9.modA":                 "é",
		"c3.shell=3A.modA":               "shell:",
		"c2.shell=3Azsh=3Anormal.mod-_/": "shell:zsh:normal",
	}
	for k := range m.collectRows {
		put(C, k, mp(t, k))
	}
	for _, k := range []string{
		"c1.bad=.modA",   // '=' at the end
		"c1.bad=4.modA",  // one hex digit
		"c1.bad=ZZ.modA", // not hex
		"c1.=FF.modA",    // decodes to invalid UTF-8
		"c1.=C3.modA",    // a cut UTF-8 sequence
		"c1.=3D=.modA",   // a good escape, then a bad one
	} {
		put(C, k, mp(t, k))
	}

	// Applied: 1001 out-of-shape keys, more than one answer's anomalies hold.
	for i := 0; i < 1001; i++ {
		k := fmt.Sprintf("cap%04d", i)
		put(A, k, mp(t, i))
		m.capKeys = append(m.capKeys, k)
	}
	// And 1001 rows, more than the default limit.
	for i := 0; i < 1001; i++ {
		put(A, fmt.Sprintf("row%04d.m", i), mp(t, i))
	}
	put(A, "ap.m1", mp(t, "applied"))
	put(A, "ap.m2", []byte{0x92, 0x01}) // cut short: not one complete object

	st, _ := h.startSeat(t.TempDir())
	h.waitCaughtUp(st)
	nc := h.nc

	t.Run("discovery", func(t *testing.T) {
		msg, err := nc.Request("$SRV.INFO.mesh-provisioner", nil, 10*time.Second)
		require.NoError(t, err)
		var info struct {
			Name      string `json:"name"`
			Endpoints []struct {
				Name, Subject string
				Queue         string `json:"queue_group"`
			} `json:"endpoints"`
		}
		require.NoError(t, json.Unmarshal(msg.Data, &info))
		require.Equal(t, "mesh-provisioner", info.Name)
		require.Len(t, info.Endpoints, 1)
		require.Equal(t, "provisioning", info.Endpoints[0].Name)
		require.Equal(t, verbSubject, info.Endpoints[0].Subject)
		require.Equal(t, "q", info.Endpoints[0].Queue, "micro's default queue group")
	})

	t.Run("empty body and formats", func(t *testing.T) {
		for _, body := range [][]byte{nil, []byte("{}"), []byte(" {} "), []byte("\n{}\n")} {
			w := askWire(t, nc, body)
			require.Equal(t, 200, w.code, "%q: %s", body, w)
			require.False(t, w.msgpack, "%q: an empty or JSON request is answered in JSON", body)
			require.Equal(t, "registry", w.body["what"], "%q: registry is the default", body)
		}
		w := askWire(t, nc, mp(t, map[string]any{}))
		require.Equal(t, 200, w.code, w.String())
		require.True(t, w.msgpack, "an empty MessagePack map is answered in MessagePack")
		require.Equal(t, "registry", w.body["what"])
	})

	t.Run("every field", func(t *testing.T) {
		seq, _ := st.Store().Applied(C)
		for _, f := range wireFormats {
			collect := map[string]any{"what": "collect", "node": "c1", "module": "modA", "contributor": "modA",
				"collection": "shell:zsh:normal", "limit": 10, "after": "", "min_seq": seq, "wait_ms": 1000}
			w := wireOK(t, nc, collect, f.msgpack)
			require.Equal(t, []string{"c1.shell=3Azsh=3Anormal.modA"}, wireKeys(t, w), f.name)
			needs := map[string]any{"what": "needs", "node": "ord", "module": "a", "kind": "config",
				"limit": 10000, "min_seq": 1, "wait_ms": 0}
			w = wireOK(t, nc, needs, f.msgpack)
			require.Equal(t, []string{"ord.a.config.x"}, wireKeys(t, w), f.name)
			reg := map[string]any{"what": "registry", "module": "mesh-vault", "kind": "secret", "limit": 1}
			w = wireOK(t, nc, reg, f.msgpack)
			require.Equal(t, []string{"secret"}, wireKeys(t, w), f.name)
			at := map[string]any{"what": "applied", "node": "ap", "module": "m1", "at": "seq:999999"}
			w = wireOK(t, nc, at, f.msgpack)
			require.Equal(t, []string{"ap.m1"}, wireKeys(t, w), f.name)
		}
	})

	t.Run("wrong types", func(t *testing.T) {
		strFields := []string{"what", "node", "module", "contributor", "collection", "kind", "after", "at"}
		intFields := []string{"limit", "min_seq", "wait_ms"}
		jsonWrong := map[string][]string{
			"string": {`1`, `1.5`, `true`, `[]`, `["needs"]`, `{}`},
			"int":    {`"5"`, `1.5`, `1e3`, `true`, `[]`, `{}`, `"ten"`},
		}
		mpWrong := map[string][]any{
			"string": {1, -1, 1.5, true, []any{"needs"}, map[string]any{}, time.Unix(0, 0)},
			"int":    {"5", 1.5, float32(2), true, []any{1}, map[string]any{}, []byte{1}},
		}
		what := func(field string) string {
			switch field {
			case "collection", "contributor":
				return "collect"
			}
			return "needs"
		}
		check := func(fields []string, kind string) {
			for _, field := range fields {
				for _, v := range jsonWrong[kind] {
					body := []byte(fmt.Sprintf(`{"what":%q,%q:%s}`, what(field), field, v))
					if field == "what" {
						body = []byte(fmt.Sprintf(`{"what":%s}`, v))
					}
					wireFails(t, nc, body, false, 400)
				}
				for _, v := range mpWrong[kind] {
					req := map[string]any{"what": what(field), field: v}
					wireFails(t, nc, mp(t, req), true, 400)
				}
			}
		}
		check(strFields, "string")
		check(intFields, "int")
	})

	t.Run("unknown fields and bodies that are neither", func(t *testing.T) {
		for _, body := range []string{`{"what":"needs","nod":"n1"}`, `{"What":"needs"}`, `{"what":"needs","":1}`,
			`{"what":"needs","extra":null}`, `[]`, `["needs"]`, `"needs"`, `what=needs`, `null`, `1`,
			`{"what":"needs"`, `{"what":"needs"} {}`, `{"what":"needs","what":"applied"}`} {
			wireFails(t, nc, []byte(body), false, 400)
		}
		mpBodies := [][]byte{
			mp(t, map[string]any{"what": "needs", "nod": "n1"}),
			mp(t, map[int]any{1: "needs"}),
			mp(t, []any{"needs"}),
			mp(t, "needs"),
			{0xc0},                      // nil
			{0xc1},                      // a byte no object starts with
			{0x81, 0xa4, 'w', 'h', 'a'}, // cut short
			append(mp(t, map[string]any{"what": "needs"}), 0x01), // data after the map
		}
		for _, body := range mpBodies {
			wireFails(t, nc, body, true, 400)
		}
		// What is not listed, and narrowing a what does not take.
		for _, f := range wireFormats {
			for _, req := range []map[string]any{
				{"what": "wants"}, {"what": "Needs"}, {"what": "needs", "collection": "shell"},
				{"what": "registry", "collection": "shell"}, {"what": "applied", "collection": "shell"},
				{"what": "needs", "contributor": "m"},
			} {
				wireFails(t, nc, wireBody(t, req, f.msgpack), f.msgpack, 400)
			}
		}
		// The seat still answers.
		wireOK(t, nc, map[string]any{}, false)
	})

	t.Run("limit", func(t *testing.T) {
		for _, f := range wireFormats {
			for _, l := range []any{0, -1, -10000, 10001, 1 << 40} {
				wireFails(t, nc, wireBody(t, map[string]any{"what": "needs", "limit": l}, f.msgpack), f.msgpack, 400)
			}
			for _, l := range []int{1, 10000} {
				w := wireOK(t, nc, map[string]any{"what": "needs", "node": "ord", "limit": l}, f.msgpack)
				require.Len(t, wireRows(t, w), min(l, len(m.ordKeys)), f.name)
			}
		}
		wireFails(t, nc, []byte(`{"what":"needs","limit":2.5}`), false, 400)
		wireFails(t, nc, []byte(`{"what":"needs","limit":"2"}`), false, 400)
		for _, f := range wireFormats {
			// The default is 1000 rows, with next; at most 10000 takes the rest.
			w := wireOK(t, nc, map[string]any{"what": "applied"}, f.msgpack)
			keys := wireKeys(t, w)
			require.Len(t, keys, 1000, f.name)
			require.Equal(t, keys[999], w.body["next"], f.name)
			w = wireOK(t, nc, map[string]any{"what": "applied", "limit": 10000}, f.msgpack)
			require.Len(t, wireRows(t, w), 1003, f.name)
			require.NotContains(t, w.body, "next", "%s: no next on the last page", f.name)
			w = wireOK(t, nc, map[string]any{"what": "applied", "limit": 1003}, f.msgpack)
			require.NotContains(t, w.body, "next", "%s: a page that ends on the last row has no next", f.name)
		}
	})

	t.Run("byte order of raw keys", func(t *testing.T) {
		for _, f := range wireFormats {
			w := wireOK(t, nc, map[string]any{"what": "needs", "node": "ord"}, f.msgpack)
			require.Equal(t, m.ordKeys, wireKeys(t, w), f.name)
			for _, limit := range []int{1, 2, 5} {
				got := wireWalk(t, nc, map[string]any{"what": "needs", "node": "ord", "limit": limit}, f.msgpack, nil)
				require.Equal(t, m.ordKeys, got, "%s: pages of %d", f.name, limit)
			}
			w = wireOK(t, nc, map[string]any{"what": "needs"}, f.msgpack)
			require.True(t, inByteOrder(wireKeys(t, w)), "%s: every need in byte order", f.name)
			w = wireOK(t, nc, map[string]any{"what": "collect"}, f.msgpack)
			require.True(t, inByteOrder(wireKeys(t, w)), f.name)
			w = wireOK(t, nc, map[string]any{"what": "registry"}, f.msgpack)
			require.True(t, inByteOrder(wireKeys(t, w)), f.name)
		}
	})

	t.Run("collections", func(t *testing.T) {
		for _, f := range wireFormats {
			w := wireOK(t, nc, map[string]any{"what": "collect"}, f.msgpack)
			rows := wireRows(t, w)
			var want []string
			for k := range m.collectRows {
				want = append(want, k)
			}
			sort.Strings(want)
			require.Equal(t, want, wireKeys(t, w), "%s: every well-shaped key has a row, no other", f.name)
			for _, r := range rows {
				k := r["key"].(string)
				parts := strings.Split(k, ".")
				require.Equal(t, parts[0], r["node"], k)
				require.Equal(t, m.collectRows[k], r["collection"], "%s: %s decoded", f.name, k)
				require.Equal(t, parts[1], r["collection_key"], "%s: %s raw token", f.name, k)
				require.Equal(t, parts[2], r["contributor"], k)
				require.Equal(t, k, r["value"], k)
			}
			// The bad escapes are anomalies, in byte order.
			var bad []string
			for _, a := range w.body["anomalies"].([]any) {
				an := a.(map[string]any)
				require.Equal(t, provisioner.BucketCollect, an["bucket"])
				require.True(t, strings.HasPrefix(an["reason"].(string), "bad-escape"), "%s: %v", f.name, an)
				require.NotZero(t, wireUint(t, an["revision"]))
				bad = append(bad, an["key"].(string))
			}
			require.Equal(t, []string{"c1.=3D=.modA", "c1.=C3.modA", "c1.=FF.modA", "c1.bad=.modA", "c1.bad=4.modA", "c1.bad=ZZ.modA"}, bad, f.name)
			require.EqualValues(t, 6, wireUint(t, w.body["anomalies_total"]))

			// Filtering by the decoded name.
			for name, keys := range map[string][]string{
				"shell:zsh:normal":     {"c1.shell=3Azsh=3Anormal.modA", "c1.shell=3azsh=3anormal.modB", "c2.shell=3Azsh=3Anormal.mod-_/", "c2.shell=3Azsh=3Anormal.modA"},
				"é":                    {"c1.=C3=A9.modA", "c1.=c3=a9.modB", "c3.=c3=A9.modA"},
				"a=b":                  {"c1.a=3Db.modA"},
				"a=3Ab":                {"c1.a=3D3Ab.modA"},
				"ports.http":           {"c1.ports=2Ehttp.modA"},
				"path with space":      {"c1.path=20with=20space.modA"},
				"日本":                   {"c1.=E6=97=A5=E6=9C=AC.modA"},
				"shell":                {"c1.shell.modA", "c3.=73=68=65=6C=6c.modC", "c3.=73hell.modB"},
				"SHELL":                {"c3.SHELL.modA"},
				"shell:":               {"c3.shell=3A.modA"},
				"shell=3Azsh=3Anormal": nil, // the raw token is not the name
				"a:b":                  nil,
			} {
				w := wireOK(t, nc, map[string]any{"what": "collect", "collection": name}, f.msgpack)
				require.Equal(t, keys, wireKeys(t, w), "%s: collection %q", f.name, name)
			}
			w = wireOK(t, nc, map[string]any{"what": "collect", "collection": "shell:zsh:normal", "node": "c2", "module": "mod-_/"}, f.msgpack)
			require.Equal(t, []string{"c2.shell=3Azsh=3Anormal.mod-_/"}, wireKeys(t, w), f.name)
			w = wireOK(t, nc, map[string]any{"what": "collect", "contributor": "modB"}, f.msgpack)
			require.Equal(t, []string{"c1.=c3=a9.modB", "c1.shell=3azsh=3anormal.modB", "c3.=73hell.modB"}, wireKeys(t, w), "%s: contributor is module", f.name)
			w = wireOK(t, nc, map[string]any{"what": "collect", "contributor": "modB", "module": "modB"}, f.msgpack)
			require.Len(t, wireRows(t, w), 3, f.name)
		}
	})

	t.Run("narrowing", func(t *testing.T) {
		// Each narrowing answers exactly the rows of the whole answer whose parts match, in the same
		// order, on one page and walked a row or three at a time.
		type narrowing struct {
			what   string
			fields map[string]string // request field: row field
		}
		for _, n := range []narrowing{
			{"needs", map[string]string{"node": "node", "module": "module", "kind": "kind"}},
			{"applied", map[string]string{"node": "node", "module": "module"}},
			{"collect", map[string]string{"node": "node", "module": "contributor", "collection": "collection"}},
			{"collect", map[string]string{"contributor": "contributor", "collection": "collection"}},
			{"registry", map[string]string{"module": "module", "kind": "kind"}},
		} {
			for _, f := range wireFormats {
				all := wireRows(t, wireOK(t, nc, map[string]any{"what": n.what, "limit": 10000}, f.msgpack))
				values := map[string]map[string]bool{}
				for _, r := range all {
					for rf, row := range n.fields {
						if values[rf] == nil {
							values[rf] = map[string]bool{}
						}
						if v := r[row].(string); !strings.HasPrefix(v, "row") || v == "row0500" {
							values[rf][v] = true // one of the thousand nodes of one row each is enough
						}
					}
				}
				for rf, vs := range values {
					for v := range vs {
						for _, other := range []string{"", "node", "module", "collection", "kind"} {
							req := map[string]any{"what": n.what, rf: v}
							if other != "" && other != rf {
								if _, takes := n.fields[other]; !takes {
									continue
								}
								// A second narrowing, by the value of the first matching row.
								for _, r := range all {
									if r[n.fields[rf]] == v {
										req[other] = r[n.fields[other]]
										break
									}
								}
							}
							var want []string
							for _, r := range all {
								match := true
								for qf, qv := range req {
									if qf != "what" && r[n.fields[qf]] != qv {
										match = false
									}
								}
								if match {
									want = append(want, r["key"].(string))
								}
							}
							require.NotEmpty(t, want, "%s %v", f.name, req)
							req["limit"] = 10000
							w := wireOK(t, nc, req, f.msgpack)
							require.Equal(t, want, wireKeys(t, w), "%s %v", f.name, req)
							limits := []int{1, 3}
							if len(want) > 60 {
								limits = []int{97}
							}
							for _, limit := range limits {
								req["limit"] = limit
								require.Equal(t, want, wireWalk(t, nc, req, f.msgpack, nil), "%s %v", f.name, req)
							}
						}
					}
				}
			}
		}
	})

	t.Run("anomalies by node", func(t *testing.T) {
		for _, f := range wireFormats {
			w := wireOK(t, nc, map[string]any{"what": "needs", "node": "n1"}, f.msgpack)
			require.Equal(t, []string{"n1.m.config.ok", "n1.m.config.raw", "n1.m.nosuchkind.x"}, wireKeys(t, w), f.name)
			var keys, reasons []string
			for _, a := range w.body["anomalies"].([]any) {
				an := a.(map[string]any)
				keys = append(keys, an["key"].(string))
				reasons = append(reasons, strings.SplitN(an["reason"].(string), ":", 2)[0])
			}
			require.Equal(t, []string{"n1", "n1.m.config.raw", "n1.m.config.x.y", "n1.m.nosuchkind.x"}, keys, "%s: n1x is another node", f.name)
			require.Equal(t, []string{"token-count", "value-not-msgpack", "token-count", "unanswered-kind"}, reasons, f.name)
			require.EqualValues(t, 4, wireUint(t, w.body["anomalies_total"]))
			// module and kind narrow rows, not anomalies.
			w = wireOK(t, nc, map[string]any{"what": "needs", "node": "n1", "module": "zz", "kind": "config"}, f.msgpack)
			require.Empty(t, wireRows(t, w))
			require.EqualValues(t, 4, wireUint(t, w.body["anomalies_total"]), f.name)

			// The row whose value is not MessagePack: value null and value_raw.
			w = wireOK(t, nc, map[string]any{"what": "needs", "node": "n1", "module": "m", "kind": "config"}, f.msgpack)
			raw := wireRows(t, w)[1]
			require.Equal(t, "n1.m.config.raw", raw["key"])
			require.Contains(t, raw, "value")
			require.Nil(t, raw["value"])
			if f.msgpack {
				require.Equal(t, []byte{0xc1, 'r', 'a', 'w'}, raw["value_raw"])
			} else {
				require.Equal(t, base64.StdEncoding.EncodeToString([]byte{0xc1, 'r', 'a', 'w'}), raw["value_raw"])
			}
			w = wireOK(t, nc, map[string]any{"what": "applied", "node": "ap"}, f.msgpack)
			require.Equal(t, []string{"ap.m1", "ap.m2"}, wireKeys(t, w))
			require.Nil(t, wireRows(t, w)[1]["value"])
			require.EqualValues(t, 1, wireUint(t, w.body["anomalies_total"]))
		}
	})

	t.Run("values JSON cannot show", func(t *testing.T) {
		// CONTRACT section 3: value is the decoded value, null (with value_raw) only when it is not
		// MessagePack. JSON has no NaN or infinity, and no string that is not UTF-8: a JSON answer
		// gives their bytes as value_raw, the way it gives any value it cannot show, rather than null
		// or U+FFFD, which are other values.
		w := wireOK(t, nc, map[string]any{"what": "needs", "node": "val"}, false)
		rows := wireRows(t, w)
		want := []string{"val.m.config.ok"}
		for k := range noJSON {
			want = append(want, k)
		}
		sort.Strings(want)
		require.Equal(t, want, wireKeys(t, w))
		for _, r := range rows {
			k := r["key"].(string)
			if k == "val.m.config.ok" {
				require.Equal(t, map[string]any{"limit": json.Number("1.5"), "motd": "café"}, r["value"])
				require.NotContains(t, r, "value_raw")
				continue
			}
			require.Contains(t, r, "value", k)
			require.Nil(t, r["value"], k)
			require.Equal(t, base64.StdEncoding.EncodeToString(noJSON[k]), r["value_raw"], "%s: the bytes as written", k)
		}
		require.EqualValues(t, 0, wireUint(t, w.body["anomalies_total"]), "MessagePack values: no anomaly")

		// MessagePack carries each value as it is, byte for byte.
		w = wireOK(t, nc, map[string]any{"what": "needs", "node": "val"}, true)
		var a struct {
			Rows []map[string]msgpack.RawMessage `msgpack:"rows"`
		}
		require.NoError(t, msgpack.Unmarshal(w.raw, &a))
		require.Len(t, a.Rows, len(want))
		for i, r := range a.Rows {
			require.NotContains(t, r, "value_raw", "MessagePack carries %s as it is", want[i])
			if v, ok := noJSON[want[i]]; ok {
				require.Equal(t, msgpack.RawMessage(v), r["value"], want[i])
			}
		}
	})

	t.Run("unanswered kind", func(t *testing.T) {
		for _, f := range wireFormats {
			w := wireOK(t, nc, map[string]any{"what": "needs", "node": "uk"}, f.msgpack)
			require.Equal(t, []string{"uk.m.config.x", "uk.m.stray.x"}, wireKeys(t, w), "%s: the key still answers", f.name)
			anoms := w.body["anomalies"].([]any)
			require.Len(t, anoms, 1, f.name)
			an := anoms[0].(map[string]any)
			require.Equal(t, "uk.m.stray.x", an["key"])
			require.True(t, strings.HasPrefix(an["reason"].(string), "unanswered-kind"), an["reason"])
		}
	})

	t.Run("anomalies cap", func(t *testing.T) {
		for _, f := range wireFormats {
			w := wireOK(t, nc, map[string]any{"what": "applied"}, f.msgpack)
			var keys []string
			for _, a := range w.body["anomalies"].([]any) {
				keys = append(keys, a.(map[string]any)["key"].(string))
			}
			require.Len(t, keys, 1000, f.name)
			require.Equal(t, append([]string{"ap.m2"}, m.capKeys[:999]...), keys, "%s: the first 1000 in byte order", f.name)
			require.EqualValues(t, 1002, wireUint(t, w.body["anomalies_total"]), f.name)
			w = wireOK(t, nc, map[string]any{"what": "applied", "node": "cap1000"}, f.msgpack)
			require.Len(t, w.body["anomalies"], 1, f.name)
			require.EqualValues(t, 1, wireUint(t, w.body["anomalies_total"]), f.name)
		}
	})

	t.Run("rows and as_of", func(t *testing.T) {
		for _, f := range wireFormats {
			for _, b := range []struct{ what, bucket string }{{"needs", N}, {"applied", A}, {"collect", C}, {"registry", provisioner.BucketRegistry}} {
				last := h.lastMsg(b.bucket)
				w := wireOK(t, nc, map[string]any{"what": b.what, "limit": 1}, f.msgpack)
				require.Equal(t, b.what, w.body["what"])
				require.Equal(t, last.Sequence, wireUint(t, w.body["as_of"]), "%s %s", f.name, b.what)
				require.Equal(t, true, w.body["synced"], "%s %s", f.name, b.what)
			}
			w := wireOK(t, nc, map[string]any{"what": "needs", "node": "ord", "module": "a"}, f.msgpack)
			r := wireRows(t, w)[0]
			for _, field := range []string{"key", "revision", "created", "value", "node", "module", "kind", "name"} {
				require.Contains(t, r, field, f.name)
			}
			stream, err := h.js.Stream(ctx, provisioner.StreamName(N))
			require.NoError(t, err)
			msg, err := stream.GetLastMsgForSubject(ctx, provisioner.SubjectPrefix(N)+"ord.a.config.x")
			require.NoError(t, err)
			require.Equal(t, msg.Sequence, wireUint(t, r["revision"]))
			if f.msgpack {
				require.True(t, msg.Time.Equal(r["created"].(time.Time)), "%s: created %v, want %v", f.name, r["created"], msg.Time)
			} else {
				// The message's time to the nanosecond, in RFC 3339 and UTC (docs/protocol.md).
				s, isStr := r["created"].(string)
				require.True(t, isStr, "created is a string: %v", r["created"])
				created, err := time.Parse(time.RFC3339Nano, s)
				require.NoError(t, err)
				require.True(t, msg.Time.Equal(created), "created %s, want %v", s, msg.Time)
				require.True(t, strings.HasSuffix(s, "Z"), "created %s in UTC", s)
			}
			require.Equal(t, "ord.a.config.x", r["value"])
			require.Equal(t, []any{"ord", "a", "config", "x"}, []any{r["node"], r["module"], r["kind"], r["name"]})
			w = wireOK(t, nc, map[string]any{"what": "applied", "node": "ap", "module": "m1"}, f.msgpack)
			r = wireRows(t, w)[0]
			require.Equal(t, []any{"ap", "m1"}, []any{r["node"], r["module"]})
		}
	})

	t.Run("registry", func(t *testing.T) {
		type entry struct{ module, bucket, shape, verb string }
		want := map[string]entry{
			"config":       {"mesh-config", "mesh-config_values", "<node>.<module>.<name>", ""},
			"secret":       {"mesh-vault", "", "", "mesh-vault.secret"},
			"bound":        {"<provider-module>", "<provider-module>_bound", "<node>.<module>.<provision>[.<local>]", ""},
			"consumers":    {"mesh-vault", "", "", "mesh-vault.consumers"},
			"collected":    {"mesh-provisioner", provisioner.BucketCollect, "<node>.<collection>.<contributor>", ""},
			"shell":        {"mesh-provisioner", provisioner.BucketCollect, "<node>.<collection>.<contributor>", ""},
			"environment":  {"mesh-provisioner", provisioner.BucketCollect, "<node>.<collection>.<contributor>", ""},
			"contribution": {"mesh-provisioner", provisioner.BucketCollect, "<node>.<collection>.<contributor>", ""},
		}
		for _, k := range []string{"dir", "access", "port", "seat", "machine"} {
			want[k] = entry{"mesh-controller", "mesh-controller_assignments", "<node>.<module>", ""}
		}
		for _, f := range wireFormats {
			w := wireOK(t, nc, map[string]any{}, f.msgpack)
			rows := wireRows(t, w)
			require.Len(t, rows, len(want), "%s: the table's kinds, and no other key", f.name)
			require.IsType(t, []any{}, w.body["anomalies"], "%s: anomalies is a list", f.name)
			require.Empty(t, w.body["anomalies"], "%s: the keys out of shape were deleted", f.name)
			require.EqualValues(t, 0, wireUint(t, w.body["anomalies_total"]), f.name)
			for _, r := range rows {
				kind := r["key"].(string)
				e, known := want[kind]
				require.True(t, known, kind)
				require.Equal(t, kind, r["kind"])
				require.Equal(t, e.module, r["module"], kind)
				value := r["value"].(map[string]any)
				require.Equal(t, kind, value["kind"], kind)
				require.Equal(t, e.module, value["module"], kind)
				if e.verb != "" {
					require.Equal(t, e.verb, r["verb"], kind)
					require.Equal(t, e.verb, value["verb"], kind)
					require.NotContains(t, r, "bucket", kind)
					require.NotContains(t, value, "bucket", kind)
				} else {
					require.Equal(t, e.bucket, r["bucket"], kind)
					require.Equal(t, e.bucket, value["bucket"], kind)
					require.Equal(t, e.shape, r["key_shape"], kind)
					require.Equal(t, r["key_shape"], value["key_shape"], kind)
					require.NotContains(t, r, "verb", kind)
				}
			}
			w = wireOK(t, nc, map[string]any{"what": "registry", "module": "mesh-controller"}, f.msgpack)
			require.Equal(t, []string{"access", "dir", "machine", "port", "seat"}, wireKeys(t, w), f.name)
			w = wireOK(t, nc, map[string]any{"what": "registry", "kind": "bound"}, f.msgpack)
			require.Equal(t, []string{"bound"}, wireKeys(t, w), f.name)
			w = wireOK(t, nc, map[string]any{"what": "registry", "module": "<provider-module>"}, f.msgpack)
			require.Equal(t, []string{"bound"}, wireKeys(t, w), f.name)
		}
	})

	t.Run("cursor of another request", func(t *testing.T) {
		for _, f := range wireFormats {
			w := wireOK(t, nc, map[string]any{"what": "needs", "node": "ord", "limit": 2}, f.msgpack)
			next := w.body["next"].(string)
			require.Equal(t, m.ordKeys[1], next)
			for _, req := range []map[string]any{
				{"what": "applied", "after": next},
				{"what": "collect", "after": next},
				{"what": "needs", "node": "n1", "after": next},
				{"what": "needs", "node": "ord", "module": "Z", "after": next},
				{"what": "needs", "after": "ord.nope.config.x"},
			} {
				wireFails(t, nc, wireBody(t, req, f.msgpack), f.msgpack, 404)
			}
			w = wireOK(t, nc, map[string]any{"what": "needs", "node": "ord", "after": next}, f.msgpack)
			require.Equal(t, m.ordKeys[2:], wireKeys(t, w), f.name)
		}
	})

	t.Run("paging while writes land", func(t *testing.T) {
		for fi, f := range wireFormats {
			n := 0
			added := map[string]bool{}
			got := wireWalk(t, nc, map[string]any{"what": "needs", "node": "pg", "limit": 7}, f.msgpack, func(page int) {
				// Keys land behind and ahead of the cursor, and some of them go again.
				for _, k := range []string{fmt.Sprintf("pg.m.config.k%03d-%d-%d", page*7, fi, n), fmt.Sprintf("pg.m.config.k%03d-%d-%d", 59-page, fi, n), fmt.Sprintf("pg.a.config.x%d-%d", fi, n)} {
					put(N, k, mp(t, k))
					added[k] = true
				}
				if n > 0 {
					h.rawMsg(N, fmt.Sprintf("pg.a.config.x%d-%d", fi, n-1), nats.Header{"KV-Operation": {"DEL"}}, nil)
				}
				// The same rows of the pg keys that lived throughout are rewritten too.
				put(N, fmt.Sprintf("pg.m.config.k%03d", (page*13)%60), mp(t, "again"))
				n++
				h.waitCaughtUp(st)
			})
			require.True(t, inByteOrder(got), "%s: no row twice, in byte order", f.name)
			seen := map[string]bool{}
			for _, k := range got {
				seen[k] = true
			}
			for i := 0; i < 60; i++ {
				require.True(t, seen[fmt.Sprintf("pg.m.config.k%03d", i)], "%s: k%03d lived throughout", f.name, i)
			}
		}
	})

	t.Run("min_seq and wait_ms", func(t *testing.T) {
		for _, f := range wireFormats {
			last := h.lastMsg(N).Sequence
			w := wireOK(t, nc, map[string]any{"what": "needs", "node": "ord", "min_seq": last}, f.msgpack)
			require.GreaterOrEqual(t, wireUint(t, w.body["as_of"]), last)
			wireFails(t, nc, wireBody(t, map[string]any{"what": "needs", "min_seq": last + 1000, "wait_ms": 30}, f.msgpack), f.msgpack, 504)
			wireFails(t, nc, wireBody(t, map[string]any{"what": "needs", "min_seq": last + 1000}, f.msgpack), f.msgpack, 504)
			for _, bad := range []map[string]any{
				{"what": "needs", "min_seq": -1}, {"what": "needs", "wait_ms": -1},
				{"what": "needs", "min_seq": 1, "wait_ms": 10001},
			} {
				wireFails(t, nc, wireBody(t, bad, f.msgpack), f.msgpack, 400)
			}
			wireOK(t, nc, map[string]any{"what": "needs", "node": "ord", "min_seq": 1, "wait_ms": 10000}, f.msgpack)
			// A write that lands while the request waits answers it: the write is made once the
			// request waits (else it would prove no wait), and the answer holds it.
			type answered struct {
				msg *nats.Msg
				err error
			}
			done := make(chan answered, 1)
			body := wireBody(t, map[string]any{"what": "needs", "node": "late", "min_seq": last + 1, "wait_ms": 10000}, f.msgpack)
			go func() {
				msg, err := nc.Request(verbSubject, body, 20*time.Second)
				done <- answered{msg, err}
			}()
			natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
				if n := st.Server.Waiting(); n != 1 {
					return fmt.Errorf("%d requests wait for min_seq, want the one", n)
				}
				return nil
			})
			seq := put(N, "late.m.config.x", mp(t, "late"))
			got := natstest.Receive(t, done, 20*time.Second, "the waiting request's answer")
			require.NoError(t, got.err)
			require.Empty(t, got.msg.Header.Get("Nats-Service-Error-Code"), "%s: %q", f.name, got.msg.Data)
			var a map[string]any
			if f.msgpack {
				require.NoError(t, msgpack.Unmarshal(got.msg.Data, &a))
			} else {
				dec := json.NewDecoder(bytes.NewReader(got.msg.Data))
				dec.UseNumber()
				require.NoError(t, dec.Decode(&a))
			}
			lateAnswer := wire{body: a, raw: got.msg.Data, msgpack: f.msgpack}
			require.Equal(t, []string{"late.m.config.x"}, wireKeys(t, lateAnswer), f.name)
			require.GreaterOrEqual(t, wireUint(t, a["as_of"]), seq, f.name)
			h.rawMsg(N, "late.m.config.x", nats.Header{"KV-Operation": {"PURGE"}, "Nats-Rollup": {"sub"}}, nil)
			h.waitCaughtUp(st)
		}
	})

	t.Run("deletes", func(t *testing.T) {
		for _, f := range wireFormats {
			w := wireOK(t, nc, map[string]any{"what": "needs", "node": "del"}, f.msgpack)
			require.Equal(t, []string{"del.m.config.kept"}, wireKeys(t, w), f.name)
			require.EqualValues(t, 0, wireUint(t, w.body["anomalies_total"]), "%s: the deleted out-of-shape key's anomaly went", f.name)
		}
		// A TTL marker as the server writes one when a key ages out (the header set, any value).
		put(A, "ttl.m", mp(t, "short-lived"))
		h.rawMsg(A, "ttl.m", nats.Header{"Nats-Marker-Reason": {"MaxAge"}, "Nats-TTL": {"60s"}, "Nats-Rollup": {"sub"}}, nil)
		put(A, "ttl.bad", []byte{0xc1})
		h.rawMsg(A, "ttl.bad", nats.Header{"Nats-Marker-Reason": {"Remove"}}, nil)
		h.waitCaughtUp(st)
		for _, f := range wireFormats {
			w := wireOK(t, nc, map[string]any{"what": "applied", "node": "ttl"}, f.msgpack)
			require.Empty(t, wireRows(t, w), "%s: the TTL marker removed the key", f.name)
			require.EqualValues(t, 0, wireUint(t, w.body["anomalies_total"]), "%s: and its anomaly", f.name)
		}
	})

	t.Run("at equals live", func(t *testing.T) {
		// As of the sequence a live answer gives as as_of, every answer is the live one: rows,
		// anomalies (narrowed by node, capped), anomalies_total and next, page after page.
		reqs := []map[string]any{
			{"what": "needs"}, {"what": "needs", "node": "n1"}, {"what": "needs", "node": "n1", "module": "m", "kind": "config"},
			{"what": "needs", "node": "ord", "limit": 3}, {"what": "needs", "module": "a"},
			{"what": "applied"}, {"what": "applied", "node": "cap0500"}, {"what": "applied", "node": "ap", "limit": 1},
			{"what": "collect"}, {"what": "collect", "collection": "shell:zsh:normal", "limit": 1},
			{"what": "collect", "collection": "é"}, {"what": "collect", "node": "c1", "contributor": "modB"},
			{"what": "registry"}, {"what": "registry", "module": "mesh-controller", "limit": 2},
		}
		for _, f := range wireFormats {
			for _, req := range reqs {
				for page := 0; ; page++ {
					live := wireOK(t, nc, req, f.msgpack)
					at := map[string]any{"at": fmt.Sprintf("seq:%d", wireUint(t, live.body["as_of"]))}
					for k, v := range req {
						at[k] = v
					}
					then := wireOK(t, nc, at, f.msgpack)
					for _, field := range []string{"what", "rows", "anomalies", "anomalies_total", "as_of", "next"} {
						require.Equal(t, withoutNaN(live.body[field]), withoutNaN(then.body[field]), "%s %v page %d: %s", f.name, req, page, field)
					}
					next, more := live.body["next"]
					if !more {
						break
					}
					req["after"] = next
				}
				delete(req, "after")
			}
		}
	})

	t.Run("at", func(t *testing.T) {
		stream, err := h.js.Stream(ctx, provisioner.StreamName(N))
		require.NoError(t, err)
		// ord.a.config.x was the first message: as of its time the needs hold it alone.
		first, err := stream.GetMsg(ctx, 1)
		require.NoError(t, err)
		second, err := stream.GetMsg(ctx, 2)
		require.NoError(t, err)
		require.True(t, second.Time.After(first.Time), "the first two messages have distinct times")
		t1 := first.Time.UTC()
		east := time.FixedZone("", 2*3600+30*60)
		west := time.FixedZone("", -7*3600)
		for _, f := range wireFormats {
			for _, at := range []string{
				"seq:1",
				t1.Format(time.RFC3339Nano),
				t1.In(east).Format(time.RFC3339Nano),
				t1.In(west).Format(time.RFC3339Nano),
				strings.ToLower(t1.Format(time.RFC3339Nano)),
				t1.Format("2006-01-02T15:04:05.000000000Z07:00"),
			} {
				w := wireOK(t, nc, map[string]any{"what": "needs", "at": at}, f.msgpack)
				require.Equal(t, []string{first.Subject[len(provisioner.SubjectPrefix(N)):]}, wireKeys(t, w), "%s: at %s", f.name, at)
				require.EqualValues(t, 1, wireUint(t, w.body["as_of"]), "%s: at %s", f.name, at)
			}
			// Before the first message, with nothing trimmed: empty.
			for _, at := range []string{"seq:0", t1.Add(-time.Nanosecond).Format(time.RFC3339Nano), "2000-01-01T00:00:00Z", "2000-01-01T00:00:00.5+01:00", "2016-12-31T23:59:60Z"} {
				w := wireOK(t, nc, map[string]any{"what": "needs", "at": at}, f.msgpack)
				require.Empty(t, wireRows(t, w), "%s: at %s", f.name, at)
			}
			// A row's created, sent back as at (in any offset), holds that row at that revision.
			live := wireRows(t, wireOK(t, nc, map[string]any{"what": "needs", "node": "ord"}, false))
			for _, r := range live[:3] {
				created, err := time.Parse(time.RFC3339Nano, r["created"].(string))
				require.NoError(t, err)
				for _, at := range []string{r["created"].(string), created.In(east).Format(time.RFC3339Nano)} {
					w := wireOK(t, nc, map[string]any{"what": "needs", "node": "ord", "at": at}, f.msgpack)
					var found bool
					for _, got := range wireRows(t, w) {
						if got["key"] == r["key"] {
							found = true
							require.Equal(t, wireUint(t, r["revision"]), wireUint(t, got["revision"]), "%s: at %s", f.name, at)
						}
					}
					require.True(t, found, "%s: %s at its own created %s", f.name, r["key"], at)
				}
			}
			// Fractional seconds are read: a time one microsecond after the second message's holds two.
			w := wireOK(t, nc, map[string]any{"what": "needs", "at": second.Time.UTC().Truncate(time.Microsecond).Add(time.Microsecond).Format("2006-01-02T15:04:05.999999Z07:00")}, f.msgpack)
			require.GreaterOrEqual(t, len(wireRows(t, w)), 2, f.name)
			// Bad forms.
			for _, at := range []string{"seq:", "seq:-1", "seq:x", "seq:1.5", "seq: 1", "SEQ:1", "yesterday", "2026-11-01",
				"2026-11-01T12:00:00", "2026-11-01 12:00:00Z", "2026-13-01T12:00:00Z", "1700000000", "2026-11-01T12:00:00+2",
				"2026-11-01T12:00:00,5Z", "2026-11-01T12:00:00+24:00", "2026-11-01T12:00:00.Z", "2026-11-01T12:00Z",
				"2026-11-01T12:00:60Z", "2026-04-31T12:00:00Z", " 2026-11-01T12:00:00Z"} {
				wireFails(t, nc, wireBody(t, map[string]any{"what": "needs", "at": at}, f.msgpack), f.msgpack, 400)
			}
			wireFails(t, nc, wireBody(t, map[string]any{"what": "needs", "at": "seq:1", "min_seq": 1}, f.msgpack), f.msgpack, 400)
		}
		// The purge's rollup removed the put before the seat read it: from there the log cannot say
		// what the bucket held (410), up to the end of the stream as the seat first read it (which
		// later message superseded the removed one is not known; docs/decisions.md, Gaps); before it,
		// and at the newest point, it can.
		for _, f := range wireFormats {
			for _, seq := range []uint64{purgedPut, purgedPut + 1, purge} {
				wireFails(t, nc, wireBody(t, map[string]any{"what": "needs", "node": "del", "at": fmt.Sprintf("seq:%d", seq)}, f.msgpack), f.msgpack, 410)
			}
			w := wireOK(t, nc, map[string]any{"what": "needs", "node": "del", "at": fmt.Sprintf("seq:%d", purgedPut-1)}, f.msgpack)
			require.Equal(t, []string{"del.m.config.deleted"}, wireKeys(t, w), f.name)
			w = wireOK(t, nc, map[string]any{"what": "needs", "node": "del", "at": fmt.Sprintf("seq:%d", h.lastMsg(N).Sequence)}, f.msgpack)
			require.Equal(t, []string{"del.m.config.kept"}, wireKeys(t, w), f.name)
		}
		// Trimmed past a point: 410, in both formats.
		end, _ := st.Store().Applied(C)
		lastC := h.lastMsg(C)
		_, err = st.Store().TrimHistory(ctx, C, end, lastC.Time.UnixNano())
		require.NoError(t, err)
		for _, f := range wireFormats {
			wireFails(t, nc, wireBody(t, map[string]any{"what": "collect", "at": "seq:1"}, f.msgpack), f.msgpack, 410)
			w := wireOK(t, nc, map[string]any{"what": "collect", "at": fmt.Sprintf("seq:%d", end)}, f.msgpack)
			require.NotEmpty(t, wireRows(t, w))
		}
	})
}
