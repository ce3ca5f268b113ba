package query

import (
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/store"
)

// serveVerb serves the verb from a small store of needs on a real NATS server, and returns a client
// connection to ask it with.
func serveVerb(t *testing.T) *nats.Conn {
	t.Helper()
	db := smallStore(t)
	var msgs []provisioner.Message
	for i, key := range []string{"n1.m1.config.a", "n1.m2.config.b", "n2.m1.config.c"} {
		msgs = append(msgs, provisioner.Message{Seq: uint64(i + 1), Time: int64(i + 1), Key: key, Op: provisioner.OpPut, Value: []byte{0x80}})
	}
	require.NoError(t, db.Apply(provisioner.BucketNeeds, msgs, 1, true))
	db.SetSynced(provisioner.BucketNeeds, true)
	_, nc := serveStore(t, db)
	return nc
}

// serveStore serves the verb from db on a real NATS server of its own, and returns the Server and a
// client connection to ask it with.
func serveStore(t *testing.T, db *store.DB) (*Server, *nats.Conn) {
	t.Helper()
	ns := natstest.RunServer(t)
	snc, _ := natstest.Connect(t, ns.ClientURL())
	s := NewServer(StoreReader(db), Options{})
	require.NoError(t, s.Start(snc, nil))
	t.Cleanup(s.Stop)
	nc, _ := natstest.Connect(t, ns.ClientURL())
	return s, nc
}

// verbAnswer is an answer of the verb as a client reads it: the error code (200 when none) and
// description from the micro headers, and the body decoded in the format asked for.
type verbAnswer struct {
	code int
	desc string
	body map[string]any
}

// askRaw sends a raw body to the verb and decodes the answer as format: it fails the test when the
// answer is not in that format, or when an error's body does not say what its header says.
func askRaw(t *testing.T, nc *nats.Conn, body []byte, format Format) verbAnswer {
	t.Helper()
	msg, err := nc.Request(Subject, body, 10*time.Second)
	require.NoError(t, err, "the verb answers %q", body)
	a := verbAnswer{code: 200}
	if c := msg.Header.Get(micro.ErrorCodeHeader); c != "" {
		a.code, err = strconv.Atoi(c)
		require.NoError(t, err)
		a.desc = msg.Header.Get(micro.ErrorHeader)
	}
	if format == FormatMsgpack {
		require.NoError(t, msgpack.Unmarshal(msg.Data, &a.body), "a MessagePack answer to %q: %q", body, msg.Data)
	} else {
		require.NoError(t, json.Unmarshal(msg.Data, &a.body), "a JSON answer to %q: %q", body, msg.Data)
	}
	if a.code != 200 {
		require.Equal(t, a.desc, a.body["error"], "the error body says what the header says")
	}
	return a
}

// TestVerb_ByteOrderMark: a JSON request that starts with a byte order mark, as some Windows tools
// write, is JSON, and its answer and its errors are JSON. A UTF-8 mark is skipped; a UTF-16 one is a
// bad request that says to send UTF-8. Either used to be read as MessagePack, and the client got a
// MessagePack 400 it could not read.
func TestVerb_ByteOrderMark(t *testing.T) {
	nc := serveVerb(t)
	bom := "\xef\xbb\xbf"
	utf16 := func(s string, bigEndian bool) []byte {
		b := []byte{0xff, 0xfe}
		if bigEndian {
			b = []byte{0xfe, 0xff}
		}
		for _, c := range []byte(s) {
			if bigEndian {
				b = append(b, 0, c)
			} else {
				b = append(b, c, 0)
			}
		}
		return b
	}
	for _, tc := range []struct {
		name string
		body []byte
		code int
		want string // the what answered, or a part of the error
	}{
		{"UTF-8 mark", []byte(bom + `{"what":"needs","node":"n1"}`), 200, "needs"},
		{"UTF-8 mark and white space", []byte(bom + " \r\n\t" + `{"what":"needs"}`), 200, "needs"},
		{"UTF-8 mark alone is empty", []byte(bom), 200, "registry"},
		{"UTF-8 mark and white space alone is empty", []byte(bom + "\r\n"), 200, "registry"},
		{"UTF-8 mark, bad what", []byte(bom + `{"what":"wants"}`), 400, `what "wants" is not one of`},
		{"UTF-8 mark, unknown field", []byte(bom + `{"what":"needs","nodes":"n1"}`), 400, `unknown field "nodes"`},
		{"UTF-8 mark, not an object", []byte(bom + `["needs"]`), 400, "neither a JSON object"},
		{"UTF-8 mark twice", []byte(bom + bom + `{}`), 400, "neither a JSON object"},
		{"UTF-8 mark after white space", []byte(" " + bom + `{}`), 400, "neither a JSON object"},
		{"UTF-16 little-endian", utf16(`{"what":"needs"}`, false), 400, "UTF-16"},
		{"UTF-16 big-endian", utf16(`{"what":"needs"}`, true), 400, "UTF-16"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := askRaw(t, nc, tc.body, FormatJSON)
			require.Equal(t, tc.code, a.code, "%s", a.desc)
			if tc.code == 200 {
				require.Equal(t, tc.want, a.body["what"])
				if tc.want == "needs" {
					require.NotEmpty(t, a.body["rows"])
				}
			} else {
				require.True(t, strings.Contains(a.desc, tc.want), "%q says %q", a.desc, tc.want)
			}
			// And the verb goes on serving.
			require.Equal(t, "registry", askRaw(t, nc, nil, FormatJSON).body["what"])
		})
	}
}

// TestVerb_SameInBothFormats asks the same request as JSON and as MessagePack through the verb: both
// are answered alike (the same code, and the same rows or the same error), each in its own format, and
// the verb goes on serving. Where exact is set the error is word for word the same.
func TestVerb_SameInBothFormats(t *testing.T) {
	nc := serveVerb(t)
	mp := func(kv ...any) []byte { // a MessagePack map of the members in order, not a Go map's
		b := []byte{0x80 | byte(len(kv)/2)}
		for _, x := range kv {
			v, err := msgpack.Marshal(x)
			require.NoError(t, err)
			b = append(b, v...)
		}
		return b
	}
	const bigU = uint64(1) << 63
	for _, tc := range []struct {
		name     string
		json     string
		msgpack  []byte
		code     int
		rows     int    // for a 200
		msg      string // a part of the error of a 400
		verbatim bool   // the two errors are the same
	}{
		{"plain", `{"what":"needs","node":"n1"}`, mp("what", "needs", "node", "n1"), 200, 2, "", false},
		{"null is left out", `{"what":"needs","node":null,"limit":null}`, mp("what", "needs", "node", nil, "limit", nil), 200, 3, "", false},
		{"integer as float", `{"what":"needs","limit":1.0}`, mp("what", "needs", "limit", 1.0), 400, 0, `field "limit" wants int64`, false},
		{"fraction", `{"what":"needs","limit":1.5}`, mp("what", "needs", "limit", 1.5), 400, 0, `field "limit" wants int64`, false},
		{"negative", `{"what":"needs","limit":-1}`, mp("what", "needs", "limit", -1), 400, 0, "limit -1 is out of range 1..10000", true},
		{"string for an integer", `{"what":"needs","min_seq":"5"}`, mp("what", "needs", "min_seq", "5"), 400, 0, `field "min_seq" wants int64, not string`, false},
		{"string not UTF-8 for an integer", `{"what":"needs","limit":"\ud800"}`, mp("what", "needs", "limit", "\xed\xa0\x80"), 400, 0, `field "limit" wants int64, not string`, false},
		{"integer for a string", `{"what":"needs","node":1}`, mp("what", "needs", "node", 1), 400, 0, `field "node" wants string`, false},
		{"wrong type before an unknown name", `{"limit":"5","nodes":1}`, mp("limit", "5", "nodes", 1), 400, 0, `field "limit" wants int64, not string`, false},
		{"wrong type before a repeat", `{"what":1,"what":"needs"}`, mp("what", 1, "what", "needs"), 400, 0, `field "what" wants string`, false},
		{"repeated", `{"what":"needs","what":"applied"}`, mp("what", "needs", "what", "applied"), 400, 0, `field "what" is given twice`, true},
		{"unknown", `{"what":"needs","Node":"n1"}`, mp("what", "needs", "Node", "n1"), 400, 0, `unknown field "Node"`, true},
		{"limit past int64", `{"what":"needs","limit":9223372036854775808}`, mp("what", "needs", "limit", bigU), 400, 0,
			"limit 9223372036854775808 is out of range 1..10000", true},
		{"wait_ms past int64", `{"what":"needs","wait_ms":9223372036854775808}`, mp("what", "needs", "wait_ms", bigU), 400, 0,
			"wait_ms 9223372036854775808 is out of range 0..10000", true},
		{"min_seq past int64", `{"what":"needs","min_seq":9223372036854775808}`, mp("what", "needs", "min_seq", bigU), 400, 0,
			"min_seq 9223372036854775808 is out of range", true},
		{"collection not UTF-8", "{\"what\":\"collect\",\"collection\":\"caf\xe9\"}", mp("what", "collect", "collection", "caf\xe9"), 400, 0,
			`field "collection" is not valid UTF-8`, true},
		{"collection a lone surrogate", `{"what":"collect","collection":"a\ud800b"}`, mp("what", "collect", "collection", "a\xed\xa0\x80b"), 400, 0,
			`field "collection" is not valid UTF-8`, true},
		{"collection a lone low surrogate", `{"what":"collect","collection":"\udc00"}`, mp("what", "collect", "collection", "\xed\xb0\x80"), 400, 0,
			`field "collection" is not valid UTF-8`, true},
		{"collection a surrogate pair", `{"what":"collect","collection":"\ud83d\ude00 \\ud800"}`, mp("what", "collect", "collection", "\U0001F600 \\ud800"), 200, 0, "", false},
		{"after not UTF-8", "{\"what\":\"needs\",\"after\":\"n1\xff\"}", mp("what", "needs", "after", "n1\xff"), 400, 0,
			`field "after" is not valid UTF-8`, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			j := askRaw(t, nc, []byte(tc.json), FormatJSON)
			m := askRaw(t, nc, tc.msgpack, FormatMsgpack)
			require.Equal(t, tc.code, j.code, "JSON: %s", j.desc)
			require.Equal(t, tc.code, m.code, "MessagePack: %s", m.desc)
			if tc.code == 200 {
				require.Len(t, j.body["rows"], tc.rows)
				require.Len(t, m.body["rows"], tc.rows)
			} else {
				require.Contains(t, j.desc, tc.msg)
				require.Contains(t, m.desc, tc.msg)
				if tc.verbatim {
					require.Equal(t, j.desc, m.desc)
				}
			}
			require.Equal(t, "registry", askRaw(t, nc, nil, FormatJSON).body["what"], "the verb goes on serving")
		})
	}
	// White space is JSON's: before a MessagePack map it is data, each byte an integer.
	a := askRaw(t, nc, append([]byte(" \n"), mp("what", "needs")...), FormatMsgpack)
	require.Equal(t, 400, a.code)
	require.Contains(t, a.desc, "data before the map")
	a = askRaw(t, nc, []byte(" \n"+`{"what":"needs"}`), FormatJSON)
	require.Equal(t, 200, a.code, a.desc)
}

// TestServer_StartReturnsOnceTheVerbIsServed: a request sent right after Start, on another connection,
// is answered. Start returned before the subscription had reached the server, and a test asking at
// once got "no responders" (TestVerb_SameInBothFormats, 1 full run in 6).
func TestServer_StartReturnsOnceTheVerbIsServed(t *testing.T) {
	db := smallStore(t)
	ns := natstest.RunServer(t)
	snc, _ := natstest.Connect(t, ns.ClientURL())
	nc, _ := natstest.Connect(t, ns.ClientURL())
	for i := range 50 {
		s := NewServer(StoreReader(db), Options{})
		require.NoError(t, s.Start(snc, nil))
		_, err := nc.Request(Subject, nil, 5*time.Second)
		s.Stop()
		require.NoError(t, err, "request %d, sent right after Start", i)
	}
}
