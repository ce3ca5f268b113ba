package query

import (
	"bytes"
	"encoding/json"
	"runtime"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"
)

// TestDecodeRequest_SameInBothFormats reads the same members as JSON and as MessagePack: both formats
// accept or refuse them alike, whatever case, repetition or depth they come in.
func TestDecodeRequest_SameInBothFormats(t *testing.T) {
	type member struct {
		k string
		v any
	}
	deep := any(nil)
	for i := 0; i < 600; i++ { // deeper than mpk.MaxDepth
		deep = []any{deep}
	}
	tests := []struct {
		name    string
		members []member
		ok      bool
		msg     string
	}{
		{"exact names", []member{{"what", "needs"}, {"node", "n1"}, {"limit", 5}}, true, ""},
		{"upper-case name", []member{{"WHAT", "needs"}}, false, `unknown field "WHAT"`},
		{"title-case name", []member{{"what", "needs"}, {"Node", "n1"}}, false, `unknown field "Node"`},
		{"repeated name", []member{{"what", "needs"}, {"what", "applied"}}, false, `field "what" is given twice`},
		{"unknown name", []member{{"what", "needs"}, {"nodes", "n1"}}, false, `unknown field "nodes"`},
		{"deep value of a known field", []member{{"what", deep}}, false, ""},
		{"deep value then a repeat", []member{{"limit", deep}, {"limit", 1}}, false, ""},
		{"registry module from the value", []member{{"what", "registry"}, {"module", "<provider-module>"}}, true, ""},
		{"needs module not a token", []member{{"what", "needs"}, {"module", "<provider-module>"}}, false, `module "<provider-module>" is not a key token`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var js bytes.Buffer
			mp := msgpackMapHeader(len(tc.members))
			js.WriteByte('{')
			for i, m := range tc.members {
				if i > 0 {
					js.WriteByte(',')
				}
				k, _ := msgpack.Marshal(m.k)
				v, _ := msgpack.Marshal(m.v)
				mp = append(append(mp, k...), v...)
				js.WriteString(`"` + m.k + `":` + jsonOf(m.v))
			}
			js.WriteByte('}')
			for _, body := range [][]byte{js.Bytes(), mp} {
				_, _, err := DecodeRequest(body)
				if tc.ok {
					require.NoError(t, err, "%q", body)
					continue
				}
				require.Error(t, err, "%q", body)
				require.Equal(t, 400, Code(err))
				require.Contains(t, err.Error(), tc.msg)
			}
		})
	}
}

func msgpackMapHeader(n int) []byte { return []byte{0x80 | byte(n)} }

func jsonOf(v any) string {
	switch v := v.(type) {
	case string:
		return `"` + v + `"`
	case int:
		return strconv.Itoa(v)
	case []any:
		if len(v) == 0 {
			return "[]"
		}
		return "[" + jsonOf(v[0]) + "]"
	case nil:
		return "null"
	}
	panic("jsonOf")
}

// TestDecodeRequest_Size refuses a body above 1 MiB, and reads one of exactly 1 MiB.
func TestDecodeRequest_Size(t *testing.T) {
	pad := func(n int) []byte {
		b := []byte(`{"what":"needs"}`)
		return append(bytes.Repeat([]byte{' '}, n-len(b)), b...)
	}
	_, _, err := DecodeRequest(pad(maxRequestBytes))
	require.NoError(t, err)
	_, _, err = DecodeRequest(pad(maxRequestBytes + 1))
	require.Error(t, err)
	require.Equal(t, 400, Code(err))
	require.Contains(t, err.Error(), "at most 1048576")
	// White space alone is the empty body, {}, but its size is bounded all the same.
	blank := bytes.Repeat([]byte{' '}, maxRequestBytes)
	r, _, err := DecodeRequest(blank)
	require.NoError(t, err)
	require.Equal(t, "registry", r.What)
	_, format, err := DecodeRequest(append(blank, '\n'))
	require.Error(t, err)
	require.Equal(t, 400, Code(err))
	require.Equal(t, FormatJSON, format)
	require.Contains(t, err.Error(), "at most 1048576")
}

// TestDecodeRequest_MessagePackNotAMap: a body no JSON text starts with is MessagePack, so its error is
// told in MessagePack; one that is not a map is a bad request, never read by position into the fields.
func TestDecodeRequest_MessagePackNotAMap(t *testing.T) {
	for name, v := range map[string]any{
		"array":  []any{"needs", "n1"},
		"string": "needs",
		"nil":    nil,
		"bin":    []byte("{}"),
	} {
		t.Run(name, func(t *testing.T) {
			body, err := msgpack.Marshal(v)
			require.NoError(t, err)
			r, format, err := DecodeRequest(body)
			require.Error(t, err)
			require.Equal(t, 400, Code(err))
			require.Contains(t, err.Error(), "nor a MessagePack map")
			require.Equal(t, FormatMsgpack, format, "the error is answered in MessagePack")
			require.Empty(t, r.What, "nothing read from it")
		})
	}
	// A JSON value that is not an object stays JSON.
	_, format, err := DecodeRequest([]byte(`["needs"]`))
	require.Error(t, err)
	require.Equal(t, FormatJSON, format)
}

// TestDecodeRequest_IntegerOutOfRange: an integer no int64 holds is refused with its own value, in
// both formats, not a wrapped negative one.
func TestDecodeRequest_IntegerOutOfRange(t *testing.T) {
	for _, field := range []string{"limit", "min_seq", "wait_ms"} {
		body, err := msgpack.Marshal(map[string]any{"what": "needs", field: uint64(1) << 63})
		require.NoError(t, err)
		_, _, err = DecodeRequest(body)
		require.Error(t, err, field)
		require.Equal(t, 400, Code(err))
		require.Contains(t, err.Error(), field+" 9223372036854775808 is out of range")

		_, _, err = DecodeRequest([]byte(`{"what":"needs","` + field + `":9223372036854775808}`))
		require.Error(t, err, field)
		require.Equal(t, 400, Code(err))
	}
}

// TestDecodeRequest_NullAndEmptyAreAbsent pins docs/decisions.md: a field given as null, or a string
// field given as "", is the field left out, alike in both formats.
func TestDecodeRequest_NullAndEmptyAreAbsent(t *testing.T) {
	for _, members := range []map[string]any{
		{"what": nil}, {"what": ""}, {"what": "needs", "node": nil, "limit": nil},
		{"what": "needs", "collection": ""}, {"what": "applied", "kind": "", "contributor": ""},
	} {
		js, err := json.Marshal(members)
		require.NoError(t, err)
		mp, err := msgpack.Marshal(members)
		require.NoError(t, err)
		for _, body := range [][]byte{js, mp} {
			r, _, err := DecodeRequest(body)
			require.NoError(t, err, "%q", body)
			require.Nil(t, r.Limit)
			require.Empty(t, r.Node+r.Collection+r.Kind+r.Contributor)
			if w, _ := members["what"].(string); w != "" {
				require.Equal(t, w, r.What)
			} else {
				require.Equal(t, "registry", r.What, "the default")
			}
		}
	}
}

// TestDecodeRequest_WrongTypeNamesTheField: a field of the wrong type is a bad request that names the
// field and the type it wants, in MessagePack as in JSON, so a client sees which member to fix.
func TestDecodeRequest_WrongTypeNamesTheField(t *testing.T) {
	for _, tc := range []struct {
		field string
		v     any
		want  string
	}{
		{"limit", 1.5, "int64"}, {"min_seq", "5", "int64"}, {"wait_ms", true, "int64"},
		{"limit", []any{1}, "int64"}, {"node", 12, "string"}, {"what", false, "string"}, {"after", 1.0, "string"},
		{"collection", map[string]any{"a": 1}, "string"},
	} {
		req := map[string]any{tc.field: tc.v}
		if tc.field != "what" {
			req["what"] = "needs"
		}
		js, err := json.Marshal(req)
		require.NoError(t, err)
		mp, err := msgpack.Marshal(req)
		require.NoError(t, err)
		for _, body := range [][]byte{js, mp} {
			_, _, err := DecodeRequest(body)
			require.Error(t, err, "%q", body)
			require.Equal(t, 400, Code(err))
			require.Contains(t, err.Error(), `field "`+tc.field+`" wants `+tc.want, "%q", body)
		}
	}
	// Integers of every MessagePack width, and nil, are read.
	for _, v := range []any{int8(5), uint8(200), int16(-1), uint16(60000), int32(7), uint32(9), int64(3), uint64(4), nil} {
		mp, err := msgpack.Marshal(map[string]any{"what": "needs", "min_seq": v})
		require.NoError(t, err)
		_, _, err = DecodeRequest(mp)
		if v == int16(-1) {
			require.Error(t, err)
			require.Contains(t, err.Error(), "negative")
			continue
		}
		require.NoError(t, err, "%T", v)
	}
}

// TestDecodeRequest_HostileLengthsAllocateNothing: a MessagePack body whose lengths claim more than it
// holds (a name or value of 4 GiB in a dozen bytes, a map of 4G members) is a bad request that says it
// is cut short, read without allocating for what it claims: the decoder used to take a MiB (two, for
// a name) for each such body before finding it short.
func TestDecodeRequest_HostileLengthsAllocateNothing(t *testing.T) {
	what := []byte{0x81, 0xa4, 'w', 'h', 'a', 't'}
	for name, body := range map[string][]byte{
		"name str32 4G":         {0x81, 0xdb, 0xff, 0xff, 0xff, 0xff, 'a'},
		"name str16 64K":        {0x81, 0xda, 0xff, 0xff, 'a'},
		"value str32 4G":        append(bytes.Clone(what), 0xdb, 0xff, 0xff, 0xff, 0xff, 'a'),
		"value bin32 4G":        append(bytes.Clone(what), 0xc6, 0xff, 0xff, 0xff, 0xff, 'a'),
		"value str32 1M":        append(bytes.Clone(what), 0xdb, 0x00, 0x10, 0x00, 0x00, 'a'),
		"second member cut":     append(append([]byte{0x82}, what[1:]...), 0xa1, 'x', 0xa5, 'l', 'i', 'm', 'i', 't'),
		"map32 of 4G members":   {0xdf, 0xff, 0xff, 0xff, 0xff, 0xa4, 'w', 'h', 'a', 't', 0xa1, 'x'},
		"never-used byte value": append(bytes.Clone(what), 0xc1),
	} {
		t.Run(name, func(t *testing.T) {
			_, format, err := DecodeRequest(body)
			require.Error(t, err)
			require.Equal(t, 400, Code(err))
			require.Equal(t, FormatMsgpack, format)
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			const runs = 50
			for i := 0; i < runs; i++ {
				_, _, _ = DecodeRequest(body)
			}
			runtime.ReadMemStats(&after)
			require.Less(t, (after.TotalAlloc-before.TotalAlloc)/runs, uint64(16<<10), "bytes allocated to decode %d bytes", len(body))
		})
	}
	_, _, err := DecodeRequest([]byte{0x81, 0xda, 0xff, 0xff, 'a'})
	require.ErrorContains(t, err, "ends inside the map")
}

// TestDecodeRequest_WhiteSpaceBeforeMessagePack: white space before a MessagePack map is a bad request
// that says so, answered in MessagePack; it is not skipped, nor the body read as JSON. White space
// before a JSON object is JSON's (docs/decisions.md, White space before a MessagePack map).
func TestDecodeRequest_WhiteSpaceBeforeMessagePack(t *testing.T) {
	m, err := msgpack.Marshal(map[string]any{"what": "needs"})
	require.NoError(t, err)
	for _, ws := range []string{" ", "\t", "\r\n", "\n\n\n"} {
		t.Run(strconv.Quote(ws), func(t *testing.T) {
			r, format, err := DecodeRequest(append([]byte(ws), m...))
			require.Error(t, err)
			require.Equal(t, 400, Code(err))
			require.Contains(t, err.Error(), "data before the map ("+strconv.Itoa(len(ws))+" bytes of white space")
			require.Equal(t, FormatMsgpack, format, "the asker reads MessagePack")
			require.Empty(t, r.What, "nothing read from it")

			r, format, err = DecodeRequest([]byte(ws + `{"what":"needs"}`))
			require.NoError(t, err)
			require.Equal(t, FormatJSON, format)
			require.Equal(t, "needs", r.What)
		})
	}
}

// TestDecodePlainMsgpack_AsTheDecoder reads every encoding a plain request's members can come in (each
// string as str of every width and as bin, nil, each integer width signed and unsigned, map headers of
// every width) in one pass, as the MessagePack decoder reads them; and leaves to the decoder every body
// that is not plain, so that its error is the one it was.
func TestDecodePlainMsgpack_AsTheDecoder(t *testing.T) {
	str := func(b []byte, h []byte, s string) []byte { return append(append(b, h...), s...) }
	name := func(b []byte, s string) []byte { return str(b, []byte{0xa0 | byte(len(s))}, s) }
	be := func(n, w int) []byte {
		out := make([]byte, w)
		for i := w - 1; i >= 0; i-- {
			out[i], n = byte(n), n>>8
		}
		return out
	}
	// A member's value in each encoding: strings of 5 bytes, integers.
	strs := map[string]func(string) []byte{
		"fixstr": func(s string) []byte { return str(nil, []byte{0xa0 | byte(len(s))}, s) },
		"str8":   func(s string) []byte { return str(nil, []byte{0xd9, byte(len(s))}, s) },
		"str16":  func(s string) []byte { return str(nil, append([]byte{0xda}, be(len(s), 2)...), s) },
		"str32":  func(s string) []byte { return str(nil, append([]byte{0xdb}, be(len(s), 4)...), s) },
		"bin8":   func(s string) []byte { return str(nil, []byte{0xc4, byte(len(s))}, s) },
		"bin16":  func(s string) []byte { return str(nil, append([]byte{0xc5}, be(len(s), 2)...), s) },
		"bin32":  func(s string) []byte { return str(nil, append([]byte{0xc6}, be(len(s), 4)...), s) },
		"nil":    func(string) []byte { return []byte{0xc0} },
	}
	ints := map[string][]byte{
		"fixint 7": {0x07}, "negative fixint -3": {0xfd}, "uint8 200": {0xcc, 200}, "uint16": {0xcd, 0x12, 0x34},
		"uint32": {0xce, 0x01, 0x02, 0x03, 0x04}, "uint64": {0xcf, 0, 0, 0, 1, 2, 3, 4, 5},
		"int8 -100": {0xd0, 0x9c}, "int16 -2": {0xd1, 0xff, 0xfe}, "int32": {0xd2, 0x00, 0x01, 0x00, 0x00},
		"int64 -1": {0xd3, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, "int64 max": {0xd3, 0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff},
		"uint64 max int64": {0xcf, 0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, "nil": {0xc0},
	}
	headers := map[string]func(n int) []byte{
		"fixmap": func(n int) []byte { return []byte{0x80 | byte(n)} },
		"map16":  func(n int) []byte { return append([]byte{0xde}, be(n, 2)...) },
		"map32":  func(n int) []byte { return append([]byte{0xdf}, be(n, 4)...) },
	}
	check := func(t *testing.T, body []byte) Request {
		t.Helper()
		plain, ok := decodePlainMsgpack(body)
		require.True(t, ok, "% x is plain", body)
		dec, err := decodeMsgpack(body)
		require.NoError(t, err)
		require.True(t, equalRequest(plain, dec), "plain %+v, decoder %+v", plain, dec)
		return plain
	}
	strFields := []string{"what", "node", "module", "contributor", "collection", "kind", "after", "at"}
	for hn, h := range headers {
		for sn, enc := range strs {
			t.Run(hn+"/"+sn, func(t *testing.T) {
				body := h(len(strFields))
				for i, f := range strFields {
					body = append(name(body, f), enc(strconv.Itoa(i)+"é-x")...)
				}
				r := check(t, body)
				if sn != "nil" {
					require.Equal(t, "1é-x", r.Node)
				}
			})
		}
		for in, v := range ints {
			t.Run(hn+"/"+in, func(t *testing.T) {
				body := h(3)
				for _, f := range []string{"limit", "min_seq", "wait_ms"} {
					body = append(name(body, f), v...)
				}
				r := check(t, body)
				require.Equal(t, in == "nil", r.Limit == nil)
			})
		}
	}
	// A node lookup as clients send it, and an empty map.
	check(t, []byte{0x80})
	b, err := msgpack.Marshal(map[string]any{"what": "needs", "node": "n1", "limit": 10000, "min_seq": 12345, "wait_ms": 500})
	require.NoError(t, err)
	require.Equal(t, Request{What: "needs", Node: "n1", Limit: ptr(int64(10000)), MinSeq: 12345, WaitMS: 500}, check(t, b))

	// Not plain: left to the decoder, and DecodeRequest says what it said before.
	for _, body := range [][]byte{
		name([]byte{0x81}, "nod"),                                                      // an unknown field (no value either)
		append(name([]byte{0x81}, "WHAT"), 0xa1, 'x'),                                  // a name in another case
		append(name(append(name([]byte{0x82}, "what"), 0xa1, 'x'), "what"), 0xa1, 'y'), // twice
		append(name([]byte{0x81}, "what"), 0xa2, 0xff, 0xfe),                           // not UTF-8
		append(name([]byte{0x81}, "what"), 0x07),                                       // an integer for a string
		append(name([]byte{0x81}, "limit"), 0xa1, '1'),                                 // a string for an integer
		append(name([]byte{0x81}, "limit"), 0xcb, 0, 0, 0, 0, 0, 0, 0, 0),              // a float
		append(name([]byte{0x81}, "min_seq"), 0xcf, 0x80, 0, 0, 0, 0, 0, 0, 0),         // past int64
		append(name([]byte{0x81}, "what"), 0xa5, 'n', 'e'),                             // cut short
		append(append(name([]byte{0x81}, "what"), 0xa1, 'x'), 0xc0),                    // data after the map
		{0x81, 0xc4, 4, 'w', 'h', 'a', 't', 0xa1, 'x'},                                 // a name in bin
		{0x81, 0x01, 0xa1, 'x'},                                                        // an integer name
		{0x82, 0xa4, 'w', 'h', 'a', 't'},                                               // fewer members than the header says
	} {
		_, ok := decodePlainMsgpack(body)
		require.False(t, ok, "% x", body)
		_, _, err := DecodeRequest(body)
		_, old := decodeMsgpack(body)
		if old != nil {
			require.EqualError(t, err, old.Error())
		}
	}
}
