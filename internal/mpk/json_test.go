package mpk

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"math"
	"math/rand"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"
)

func TestAppendJSON_Scalars(t *testing.T) {
	tests := []struct {
		name string
		b    []byte
		want string
	}{
		{"nil", AppendNil(nil), `null`},
		{"true", AppendBool(nil, true), `true`},
		{"false", AppendBool(nil, false), `false`},
		{"zero", AppendInt(nil, 0), `0`},
		{"posfixint", AppendInt(nil, 127), `127`},
		{"negfixint", AppendInt(nil, -32), `-32`},
		{"int8", AppendInt(nil, -128), `-128`},
		{"int16", AppendInt(nil, -32768), `-32768`},
		{"int32", AppendInt(nil, math.MinInt32), `-2147483648`},
		{"int64", AppendInt(nil, math.MinInt64), `-9223372036854775808`},
		{"uint8", AppendUint(nil, 255), `255`},
		{"uint16", AppendUint(nil, 65535), `65535`},
		{"uint32", AppendUint(nil, math.MaxUint32), `4294967295`},
		{"uint64", AppendUint(nil, math.MaxUint64), `18446744073709551615`},
		{"wideInt64", []byte{0xd3, 0, 0, 0, 0, 0, 0, 0, 7}, `7`},
		{"float", AppendFloat64(nil, 1.5), `1.5`},
		{"floatWhole", AppendFloat64(nil, 3), `3`},
		{"floatNegZero", AppendFloat64(nil, math.Copysign(0, -1)), `-0`},
		{"floatBig", AppendFloat64(nil, 1e21), `1e+21`},
		{"floatBelowBig", AppendFloat64(nil, 1e20), `100000000000000000000`},
		{"floatSmall", AppendFloat64(nil, 1e-7), `1e-7`},
		{"floatAboveSmall", AppendFloat64(nil, 1e-6), `0.000001`},
		{"floatMax", AppendFloat64(nil, math.MaxFloat64), `1.7976931348623157e+308`},
		{"floatTiny", AppendFloat64(nil, 5e-324), `5e-324`},
		{"float32", []byte{0xca, 0x3d, 0xcc, 0xcc, 0xcd}, `0.1`},
		{"float32Small", []byte{0xca, 0x33, 0xd6, 0xbf, 0x95}, `1e-7`},
		{"emptyStr", AppendString(nil, ""), `""`},
		{"str", AppendString(nil, "héllo 日本"), `"héllo 日本"`},
		{"strEscapes", AppendString(nil, "q\"b\\n\nr\rt\tb\bf\f\x00\x1f\x7f"), `"q\"b\\n\nr\rt\tb\bf\f\u0000\u001f` + "\x7f" + `"`},
		{"strNoHTML", AppendString(nil, "<a href='x'>&</a>"), `"<a href='x'>&</a>"`},
		{"strLineSep", AppendString(nil, "a\u2028b\u2029c"), `"a\u2028b\u2029c"`},
		{"str8", []byte{0xd9, 1, 'x'}, `"x"`},
		{"str32", []byte{0xdb, 0, 0, 0, 1, 'x'}, `"x"`},
		{"bin", AppendBin(nil, []byte{0, 1, 2, 0xff}), `"AAEC/w=="`},
		{"binEmpty", AppendBin(nil, nil), `""`},
		{"bin32", []byte{0xc6, 0, 0, 0, 1, 0xfb}, `"+w=="`},
		{"ext", []byte{0xd4, 5, 0xab}, `{"ext":5,"data":"qw=="}`},
		{"extNeg", []byte{0xc7, 0, 0x80}, `{"ext":-128,"data":""}`},
		{"ext16", []byte{0xc8, 0, 3, 0x7f, 1, 2, 3}, `{"ext":127,"data":"AQID"}`},
		{"fixext16", append([]byte{0xd8, 1}, make([]byte, 16)...), `{"ext":1,"data":"AAAAAAAAAAAAAAAAAAAAAA=="}`},
		{"ts32", AppendTime(nil, time.Unix(1700000000, 0)), `"2023-11-14T22:13:20Z"`},
		{"ts32Epoch", AppendTime(nil, time.Unix(0, 0)), `"1970-01-01T00:00:00Z"`},
		{"ts64", AppendTime(nil, time.Unix(1700000000, 123456789)), `"2023-11-14T22:13:20.123456789Z"`},
		{"ts64TrimZeros", AppendTime(nil, time.Unix(1700000000, 500000000)), `"2023-11-14T22:13:20.5Z"`},
		{"ts96Past", AppendTime(nil, time.Date(1969, 7, 20, 20, 17, 40, 1000, time.UTC)), `"1969-07-20T20:17:40.000001Z"`},
		{"ts96Future", AppendTime(nil, time.Date(3000, 1, 1, 0, 0, 0, 0, time.UTC)), `"3000-01-01T00:00:00Z"`},
		{"ts96Zero", AppendTime(nil, time.Time{}), `"0001-01-01T00:00:00Z"`},
		{"ts96Year0", AppendTime(nil, time.Date(0, 1, 1, 0, 0, 0, 0, time.UTC)), `"0000-01-01T00:00:00Z"`},
		{"ts96Year9999", AppendTime(nil, time.Date(9999, 12, 31, 23, 59, 59, 999999999, time.UTC)), `"9999-12-31T23:59:59.999999999Z"`},
		{"tsLocal", AppendTime(nil, time.Date(2024, 1, 1, 1, 0, 0, 0, time.FixedZone("CET", 3600))), `"2024-01-01T00:00:00Z"`},
		{"tsExt8Form", []byte{0xc7, 4, 0xff, 0, 0, 0, 1}, `"1970-01-01T00:00:01Z"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out, n, err := AppendJSON([]byte("prefix "), tt.b)
			require.NoError(t, err)
			require.Equal(t, len(tt.b), n)
			require.Equal(t, "prefix "+tt.want, string(out))
			require.True(t, json.Valid(out[len("prefix "):]))
		})
	}
}

func TestAppendJSON_Containers(t *testing.T) {
	// mp builds an encoding from the writers.
	mp := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	str := func(s string) []byte { return AppendString(nil, s) }
	arr := func(n int) []byte { return AppendArrayHeader(nil, n) }
	mh := func(n int) []byte { return AppendMapHeader(nil, n) }
	i := func(v int64) []byte { return AppendInt(nil, v) }

	tests := []struct {
		name string
		b    []byte
		want string
	}{
		{"emptyArray", arr(0), `[]`},
		{"emptyMap", mh(0), `{}`},
		{"array", mp(arr(3), i(1), str("a"), AppendNil(nil)), `[1,"a",null]`},
		{"nestedEmpty", mp(arr(2), arr(0), mh(0)), `[[],{}]`},
		{"map", mp(mh(2), str("a"), i(1), str("b"), mp(arr(1), i(2))), `{"a":1,"b":[2]}`},
		{"mapKeyOrderKept", mp(mh(2), str("z"), i(1), str("a"), i(2)), `{"z":1,"a":2}`},
		{"keyEscaped", mp(mh(1), str("a\"b\n"), i(1)), `{"a\"b\n":1}`},
		{"keyInt", mp(mh(2), i(1), str("a"), i(-5), str("b")), `{"1":"a","-5":"b"}`},
		{"keyUint64", mp(mh(1), AppendUint(nil, math.MaxUint64), i(0)), `{"18446744073709551615":0}`},
		{"keyBool", mp(mh(2), AppendBool(nil, true), i(1), AppendBool(nil, false), i(0)), `{"true":1,"false":0}`},
		{"keyNil", mp(mh(1), AppendNil(nil), i(1)), `{"null":1}`},
		{"keyFloat", mp(mh(2), AppendFloat64(nil, 1.5), i(1), AppendFloat64(nil, -0.25), i(2)), `{"1.5":1,"-0.25":2}`},
		{"keyArray", mp(mh(1), mp(arr(2), i(1), str("a")), i(1)), `{"[1,\"a\"]":1}`},
		{"keyEmptyArray", mp(mh(1), arr(0), i(1)), `{"[]":1}`},
		{"keyMap", mp(mh(1), mp(mh(1), str("k"), str("v")), i(1)), `{"{\"k\":\"v\"}":1}`},
		{"keyMapWithIntKey", mp(mh(1), mp(mh(1), i(1), i(2)), i(3)), `{"{\"1\":2}":3}`},
		{"keyArrayInArrayKey", mp(mh(1), mp(arr(1), arr(1), str(`"`)), i(1)), `{"[[\"\\\"\"]]":1}`},
		{"keyBin", mp(mh(1), AppendBin(nil, []byte{1}), i(1)), `{"\"AQ==\"":1}`},
		{"keyTime", mp(mh(1), AppendTime(nil, time.Unix(0, 0)), i(1)), `{"\"1970-01-01T00:00:00Z\"":1}`},
		{"keyExt", mp(mh(1), []byte{0xd4, 1, 0}, i(1)), `{"{\"ext\":1,\"data\":\"AA==\"}":1}`},
		{"valueAfterKeyArray", mp(mh(2), mp(arr(1), i(1)), mp(arr(1), i(2)), str("x"), mh(0)), `{"[1]":[2],"x":{}}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out, n, err := AppendJSON(nil, tt.b)
			require.NoError(t, err)
			require.Equal(t, len(tt.b), n)
			require.Equal(t, tt.want, string(out))
			require.True(t, json.Valid(out))
		})
	}
}

// keyNest returns a map whose key is a map whose key is ... k levels deep,
// with nil at the bottom and as every value, and the expected JSON.
func keyNest(k int) ([]byte, string) {
	if k == 0 {
		return []byte{0xc0}, "null"
	}
	b, s := keyNest(k - 1)
	if k == 1 {
		return append(append([]byte{0x81}, b...), 0xc0), `{"null":null}`
	}
	return append(append([]byte{0x81}, b...), 0xc0), "{" + string(AppendJSONString(nil, s)) + ":null}"
}

func TestAppendJSON_KeyDepth(t *testing.T) {
	for k := 1; k <= maxKeyDepth+3; k++ {
		t.Run(strconv.Itoa(k), func(t *testing.T) {
			b, want := keyNest(k)
			n, err := Skip(b)
			require.NoError(t, err)
			require.Equal(t, len(b), n)

			out, n, err := AppendJSON(nil, b)
			// The outermost map's key nests k-1 maps with non-string keys.
			if k-1 > maxKeyDepth {
				require.ErrorIs(t, err, ErrTooDeep)
				require.Zero(t, n)
				return
			}
			require.NoError(t, err)
			require.Equal(t, len(b), n)
			require.Equal(t, want, string(out))
			require.True(t, json.Valid(out))
		})
	}
}

func TestAppendJSON_Depth(t *testing.T) {
	b := nest([]byte{0x91}, MaxDepth, 0x01)
	out, n, err := AppendJSON(nil, b)
	require.NoError(t, err)
	require.Equal(t, len(b), n)
	require.Equal(t, strings.Repeat("[", MaxDepth)+"1"+strings.Repeat("]", MaxDepth), string(out))

	b = nest([]byte{0x81, 0xa0}, MaxDepth, 0x01)
	out, n, err = AppendJSON(nil, b)
	require.NoError(t, err)
	require.Equal(t, len(b), n)
	require.True(t, json.Valid(out))

	for _, b := range [][]byte{
		nest([]byte{0x91}, MaxDepth+1, 0x01),
		nest([]byte{0x91}, MaxDepth, 0x90),
		nest([]byte{0x91}, 100000),
		nest([]byte{0x81, 0xa0}, 100000),
		nest([]byte{0xdd, 0, 0, 0, 1}, 100000),
	} {
		_, n, err := AppendJSON(nil, b)
		require.ErrorIs(t, err, ErrTooDeep)
		require.Zero(t, n)
	}
}

func TestAppendJSON_Errors(t *testing.T) {
	tests := []struct {
		name string
		b    []byte
		err  error
	}{
		{"empty", nil, ErrTruncated},
		{"tsLen5", []byte{0xc7, 5, 0xff, 0, 0, 0, 0, 0}, ErrInvalid},
		{"tsLen1", []byte{0xd4, 0xff, 0}, ErrInvalid},
		{"tsLen16", append([]byte{0xd8, 0xff}, make([]byte, 16)...), ErrInvalid},
		{"ts64NsecTooBig", []byte{0xd7, 0xff, 0xee, 0x6b, 0x28, 0x00, 0, 0, 0, 0}, ErrInvalid},
		{"ts96NsecTooBig", []byte{0xc7, 12, 0xff, 0x3b, 0x9a, 0xca, 0x00, 0, 0, 0, 0, 0, 0, 0, 0}, ErrInvalid},
		{"tsInArray", []byte{0x91, 0xd4, 0xff, 0}, ErrInvalid},
		{"tsYearMinus1", AppendTime(nil, time.Date(-1, 12, 31, 23, 59, 59, 0, time.UTC)), ErrInvalid},
		{"tsYear10000", AppendTime(nil, time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC)), ErrInvalid},
		{"tsMaxInt64", []byte{0xc7, 12, 0xff, 0, 0, 0, 0, 0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, ErrInvalid},
		{"tsMinInt64", []byte{0xc7, 12, 0xff, 0, 0, 0, 0, 0x80, 0, 0, 0, 0, 0, 0, 0}, ErrInvalid},
		{"c1", []byte{0xc1}, ErrInvalid},
		{"mapMissingValue", []byte{0x81, 0xa0}, ErrTruncated},
		{"keyArrayTruncated", []byte{0x81, 0x92, 0x01}, ErrTruncated},
		// JSON has no NaN or infinity: null would say another value.
		{"NaN", AppendFloat64(nil, math.NaN()), ErrNoJSON},
		{"Inf", AppendFloat64(nil, math.Inf(1)), ErrNoJSON},
		{"-Inf", AppendFloat64(nil, math.Inf(-1)), ErrNoJSON},
		{"float32NaN", []byte{0xca, 0x7f, 0xc0, 0, 0}, ErrNoJSON},
		{"float32Inf", []byte{0xca, 0xff, 0x80, 0, 0}, ErrNoJSON},
		{"NaNInMap", append([]byte{0x82, 0xa1, 'a', 0x01, 0xa1, 'b'}, AppendFloat64(nil, math.NaN())...), ErrNoJSON},
		{"InfInArray", append([]byte{0x92, 0x01}, AppendFloat64(nil, math.Inf(-1))...), ErrNoJSON},
		{"NaNKey", append(append([]byte{0x81}, AppendFloat64(nil, math.NaN())...), 0x02), ErrNoJSON},
		// Nor a string that is not UTF-8: U+FFFD in its place would say another string.
		{"strInvalidUTF8", AppendString(nil, "a\xffb\xc3"), ErrNoJSON},
		{"strSurrogate", AppendString(nil, "\xed\xa0\x80"), ErrNoJSON},
		{"str8InvalidUTF8", AppendString(nil, strings.Repeat("x", 40)+"\xc3"), ErrNoJSON},
		{"invalidUTF8InArray", append([]byte{0x92, 0xa1, 'a'}, AppendString(nil, "\xff")...), ErrNoJSON},
		{"invalidUTF8Key", append(append([]byte{0x81}, AppendString(nil, "k\xff")...), 0x01), ErrNoJSON},
		{"invalidUTF8InArrayKey", append(append([]byte{0x81, 0x91}, AppendString(nil, "\xe2\x82")...), 0x01), ErrNoJSON},
		{"float32NaNKey", []byte{0x81, 0xca, 0x7f, 0xc0, 0, 0, 0x01}, ErrNoJSON},
		{"NaNDeep", append(append(bytes.Repeat([]byte{0x91}, 100), 0x81, 0xa1, 'k'), AppendFloat64(nil, math.NaN())...), ErrNoJSON},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, n, err := AppendJSON(nil, tt.b)
			require.ErrorIs(t, err, tt.err)
			require.Zero(t, n)
		})
	}
}

func TestAppendJSON_Timestamps(t *testing.T) {
	require.Equal(t, int64(minRFC3339), time.Date(0, 1, 1, 0, 0, 0, 0, time.UTC).Unix())
	require.Equal(t, int64(maxRFC3339), time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC).Unix())

	r := rand.New(rand.NewSource(6))
	for i := 0; i < 2000; i++ {
		tm := genTime(r)
		b := AppendTime(nil, tm)
		out, n, err := AppendJSON(nil, b)
		require.NoError(t, err)
		require.Equal(t, len(b), n)
		want := `"` + tm.UTC().Format(time.RFC3339Nano) + `"`
		require.Equal(t, want, string(out))
		var got time.Time
		require.NoError(t, json.Unmarshal(out, &got))
		require.True(t, tm.Equal(got))
	}
}

func TestAppendJSON_MatchesEncodingJSON(t *testing.T) {
	r := rand.New(rand.NewSource(7))
	var out []byte
	for i := 0; i < 3000; i++ {
		v := gen(r, 5, genOpts{jsonSafe: true})
		b := mustMarshal(v)
		if r.Intn(2) == 0 {
			b = marshalCompact(t, v)
		}

		var err error
		var n int
		out, n, err = AppendJSON(out[:0], b)
		require.NoError(t, err)
		require.Equal(t, len(b), n)
		require.True(t, json.Valid(out), "%s", out)

		var decoded any
		require.NoError(t, msgpack.Unmarshal(b, &decoded))
		ref, err := json.Marshal(decoded)
		require.NoError(t, err)

		require.Equal(t, normJSON(t, ref), normJSON(t, out), "mpk: %s\nref: %s", out, ref)
	}
}

func TestAppendJSON_Random(t *testing.T) {
	// Values with every kind of key, bin, ext and time, including
	// non-canonical encodings: output is valid JSON and consumption
	// agrees with Skip and with vmihailenco.
	r := rand.New(rand.NewSource(8))
	var out []byte
	for i := 0; i < 3000; i++ {
		b := mustMarshal(gen(r, 5, genOpts{raw: true}))
		var err error
		var n int
		out, n, err = AppendJSON(out[:0], b)
		if errors.Is(err, ErrNoJSON) {
			require.True(t, nonFinite(b) || badUTF8(b), "ErrNoJSON without a NaN or infinite float or a string not UTF-8: % x", b)
			continue
		}
		require.NoError(t, err, "% x", b)
		require.Equal(t, len(b), n)
		require.True(t, json.Valid(out), "%s", out)
	}
}

// normJSON decodes JSON text, turning numbers into int64, uint64 or float64
// so that equal values compare equal.
func normJSON(t *testing.T, b []byte) any {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var v any
	require.NoError(t, dec.Decode(&v))
	return normNumbers(v)
}

func normNumbers(v any) any {
	switch v := v.(type) {
	case json.Number:
		if i, err := strconv.ParseInt(string(v), 10, 64); err == nil {
			return i
		}
		if u, err := strconv.ParseUint(string(v), 10, 64); err == nil {
			return u
		}
		f, err := strconv.ParseFloat(string(v), 64)
		if err != nil {
			panic(err)
		}
		return f
	case []any:
		for i := range v {
			v[i] = normNumbers(v[i])
		}
	case map[string]any:
		for k := range v {
			v[k] = normNumbers(v[k])
		}
	}
	return v
}

func TestAppendJSONString_MatchesEncodingJSON(t *testing.T) {
	r := rand.New(rand.NewSource(9))
	for i := 0; i < 5000; i++ {
		var s string
		if i < 256 {
			s = string([]byte{byte(i)})
		} else if i < 512 {
			s = string(rune(i-256)) + "\u2028\u2029"
		} else {
			s = genString(r)
		}
		var buf bytes.Buffer
		enc := json.NewEncoder(&buf)
		enc.SetEscapeHTML(false)
		require.NoError(t, enc.Encode(s))
		want := strings.TrimSuffix(buf.String(), "\n")

		require.Equal(t, want, string(AppendJSONString(nil, s)), "%q", s)
		require.Equal(t, want, string(AppendJSONStringBytes(nil, []byte(s))), "%q", s)
	}
}

func TestAppendJSON_NoAllocs(t *testing.T) {
	var parts [][]byte
	parts = append(parts, benchValue())
	parts = append(parts, mustMarshal(map[any]any{int64(1): []any{"x\"\n\u2028", 1.5}, true: nil}))
	parts = append(parts, mustMarshal([]any{"x", "y\xff"}), mustMarshal([]any{1, math.NaN()})) // ErrNoJSON
	parts = append(parts, AppendTime(nil, time.Unix(1700000000, 5)))
	parts = append(parts, AppendBin(nil, []byte("binary")))
	parts = append(parts, []byte{0xd4, 3, 0})
	b, _ := keyNest(maxKeyDepth + 1)
	parts = append(parts, b)
	parts = append(parts, nest([]byte{0x91}, MaxDepth, 0xc0))

	dst := make([]byte, 0, 1<<16)
	allocs := testing.AllocsPerRun(100, func() {
		for _, p := range parts {
			if _, _, err := AppendJSON(dst[:0], p); err != nil && err != ErrNoJSON {
				panic(err)
			}
		}
		_ = AppendJSONString(dst[:0], "a\"b\x00\xff\u2028")
	})
	require.Zero(t, allocs)
}

// nonFinite reports whether b holds the encoding of a NaN or infinite float 32 or 64 somewhere (it
// may find one inside a string too: it is what an ErrNoJSON must have, not proof of one).
func nonFinite(b []byte) bool {
	for i, c := range b {
		switch {
		case c == 0xca && i+4 < len(b):
			if f := math.Float32frombits(binary.BigEndian.Uint32(b[i+1:])); f != f || math.IsInf(float64(f), 0) {
				return true
			}
		case c == 0xcb && i+8 < len(b):
			if f := math.Float64frombits(binary.BigEndian.Uint64(b[i+1:])); math.IsNaN(f) || math.IsInf(f, 0) {
				return true
			}
		}
	}
	return false
}

// badUTF8 reports whether b holds, somewhere, what reads as a MessagePack str whose bytes are not
// UTF-8 (like nonFinite, what an ErrNoJSON must have, not proof of one).
func badUTF8(b []byte) bool {
	for i, c := range b {
		var n, h int
		switch {
		case c >= 0xa0 && c <= 0xbf:
			n, h = int(c&0x1f), 1
		case c == 0xd9 && i+1 < len(b):
			n, h = int(b[i+1]), 2
		case c == 0xda && i+2 < len(b):
			n, h = int(binary.BigEndian.Uint16(b[i+1:])), 3
		case c == 0xdb && i+4 < len(b):
			n, h = int(binary.BigEndian.Uint32(b[i+1:])), 5
		default:
			continue
		}
		if i+h+n <= len(b) && !utf8.Valid(b[i+h:i+h+n]) {
			return true
		}
	}
	return false
}

// TestPlain8 checks the eight-byte test of AppendJSONString against the byte table, for every byte
// value at every position among plain bytes and beside each other byte that breaks the run.
func TestPlain8(t *testing.T) {
	for pos := range 8 {
		for c := range 256 {
			for _, fill := range []byte{'a', 0x00, 0x7f, 0x80, '"'} {
				var b [8]byte
				for i := range b {
					b[i] = 'a'
				}
				b[pos] = byte(c)
				b[(pos+3)%8] = fill
				want := true
				for _, x := range b {
					want = want && x < utf8.RuneSelf && safe[x]
				}
				if got := plain8(binary.LittleEndian.Uint64(b[:])); got != want {
					t.Fatalf("plain8(%q) = %v, want %v", b, got, want)
				}
			}
		}
	}
}
