package query

import (
	"bytes"
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
}
