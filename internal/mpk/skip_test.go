package mpk

import (
	"bytes"
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"
)

// samples are hand-written encodings of every type byte family.
var samples = []struct {
	name string
	b    []byte
}{
	{"posfixint", []byte{0x05}},
	{"negfixint", []byte{0xff}},
	{"nil", []byte{0xc0}},
	{"false", []byte{0xc2}},
	{"true", []byte{0xc3}},
	{"uint8", []byte{0xcc, 0xff}},
	{"uint16", []byte{0xcd, 0xff, 0xff}},
	{"uint32", []byte{0xce, 0, 0, 0, 1}},
	{"uint64", []byte{0xcf, 0, 0, 0, 0, 0, 0, 0, 1}},
	{"int8", []byte{0xd0, 0x80}},
	{"int16", []byte{0xd1, 0x80, 0}},
	{"int32", []byte{0xd2, 0x80, 0, 0, 0}},
	{"int64", []byte{0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0}},
	{"float32", []byte{0xca, 0x3f, 0xc0, 0, 0}},
	{"float64", []byte{0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0}},
	{"fixstr", []byte{0xa3, 'a', 'b', 'c'}},
	{"str8", []byte{0xd9, 2, 'h', 'i'}},
	{"str16", []byte{0xda, 0, 2, 'h', 'i'}},
	{"str32", []byte{0xdb, 0, 0, 0, 2, 'h', 'i'}},
	{"bin8", []byte{0xc4, 2, 1, 2}},
	{"bin16", []byte{0xc5, 0, 2, 1, 2}},
	{"bin32", []byte{0xc6, 0, 0, 0, 2, 1, 2}},
	{"fixext1", []byte{0xd4, 5, 1}},
	{"fixext2", []byte{0xd5, 5, 1, 2}},
	{"fixext4", []byte{0xd6, 0xff, 0, 0, 0, 1}},
	{"fixext8", []byte{0xd7, 0xff, 0, 0, 0, 4, 0, 0, 0, 1}},
	{"fixext16", []byte{0xd8, 5, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}},
	{"ext8", []byte{0xc7, 2, 5, 1, 2}},
	{"ext16", []byte{0xc8, 0, 2, 5, 1, 2}},
	{"ext32", []byte{0xc9, 0, 0, 0, 2, 5, 1, 2}},
	{"ext8ts96", []byte{0xc7, 12, 0xff, 0, 0, 0, 1, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}},
	{"fixarray", []byte{0x92, 0x01, 0xa1, 'x'}},
	{"array16", []byte{0xdc, 0, 2, 0x01, 0xc0}},
	{"array32", []byte{0xdd, 0, 0, 0, 2, 0x01, 0xc0}},
	{"fixmap", []byte{0x81, 0xa1, 'k', 0x92, 0x01, 0x02}},
	{"map16", []byte{0xde, 0, 1, 0x01, 0xc3}},
	{"map32", []byte{0xdf, 0, 0, 0, 1, 0x90, 0x80}},
	{"emptyStr", []byte{0xa0}},
	{"emptyBin", []byte{0xc4, 0}},
	{"emptyExt", []byte{0xc7, 0, 5}},
	{"emptyArray", []byte{0x90}},
	{"emptyMap", []byte{0x80}},
	{"nested", []byte{0x82, 0xa1, 'a', 0x91, 0x80, 0x01, 0x93, 0x90, 0x91, 0x90, 0xc4, 1, 0}},
}

func TestSkip_Samples(t *testing.T) {
	for _, tt := range samples {
		t.Run(tt.name, func(t *testing.T) {
			n, err := Skip(tt.b)
			require.NoError(t, err)
			require.Equal(t, len(tt.b), n)
			require.True(t, Valid(tt.b))

			want, err := vmSkip(tt.b)
			require.NoError(t, err)
			require.Equal(t, want, n)

			// Trailing bytes are not consumed, but make the input invalid.
			withTail := append(append([]byte(nil), tt.b...), 0xc1, 0x00)
			n, err = Skip(withTail)
			require.NoError(t, err)
			require.Equal(t, len(tt.b), n)
			require.False(t, Valid(withTail))
		})
	}
}

func TestSkip_Truncated(t *testing.T) {
	// Every proper prefix of a valid encoding is truncated.
	check := func(t *testing.T, b []byte) {
		t.Helper()
		for i := 0; i < len(b); i++ {
			n, err := Skip(b[:i])
			require.ErrorIs(t, err, ErrTruncated, "prefix %d of % x", i, b)
			require.Zero(t, n)
			require.False(t, Valid(b[:i]))
			_, _, err = AppendJSON(nil, b[:i])
			if err != ErrInvalid && err != ErrNoJSON { // a malformed timestamp or a NaN may be found first
				require.ErrorIs(t, err, ErrTruncated, "prefix %d of % x", i, b)
			}
		}
	}
	for _, tt := range samples {
		t.Run(tt.name, func(t *testing.T) { check(t, tt.b) })
	}
	t.Run("random", func(t *testing.T) {
		r := rand.New(rand.NewSource(4))
		for i := 0; i < 300; i++ {
			check(t, mustMarshal(gen(r, 3, genOpts{raw: true})))
		}
	})
}

func TestSkip_Invalid(t *testing.T) {
	tests := []struct {
		name string
		b    []byte
	}{
		{"c1", []byte{0xc1}},
		{"c1InArray", []byte{0x92, 0x01, 0xc1}},
		{"c1AsMapKey", []byte{0x81, 0xc1, 0x01}},
		{"c1AsMapValue", []byte{0x81, 0x01, 0xc1}},
		{"c1Deep", []byte{0x91, 0x91, 0x91, 0x81, 0xa0, 0xc1}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			n, err := Skip(tt.b)
			require.ErrorIs(t, err, ErrInvalid)
			require.Zero(t, n)
			require.False(t, Valid(tt.b))
			_, n, err = AppendJSON(nil, tt.b)
			require.ErrorIs(t, err, ErrInvalid)
			require.Zero(t, n)
		})
	}
}

func TestSkip_HugeLengths(t *testing.T) {
	tests := []struct {
		name string
		b    []byte
	}{
		{"str32Max", []byte{0xdb, 0xff, 0xff, 0xff, 0xff, 'a'}},
		{"str32MaxMinus1", []byte{0xdb, 0xff, 0xff, 0xff, 0xfe, 'a', 'b'}},
		{"str32Top", []byte{0xdb, 0x80, 0, 0, 0}},
		{"str16Max", []byte{0xda, 0xff, 0xff, 'a'}},
		{"str8Max", []byte{0xd9, 0xff, 'a'}},
		{"bin32Max", []byte{0xc6, 0xff, 0xff, 0xff, 0xff, 0}},
		{"ext32Max", []byte{0xc9, 0xff, 0xff, 0xff, 0xff, 5, 0}},
		{"ext32MaxNoType", []byte{0xc9, 0xff, 0xff, 0xff, 0xff}},
		{"ext32MaxTs", []byte{0xc9, 0xff, 0xff, 0xff, 0xff, 0xff, 0}},
		{"array32Max", []byte{0xdd, 0xff, 0xff, 0xff, 0xff, 0xc0, 0xc0}},
		{"array32MaxEmpty", []byte{0xdd, 0xff, 0xff, 0xff, 0xff}},
		{"map32Max", []byte{0xdf, 0xff, 0xff, 0xff, 0xff, 0xc0, 0xc0}},
		{"map32Half", []byte{0xdf, 0x80, 0, 0, 0, 0xc0, 0xc0}},
		{"map16Max", []byte{0xde, 0xff, 0xff, 0xc0, 0xc0}},
		{"fixmapOneByteShort", []byte{0x82, 0xc0, 0xc0, 0xc0}},
		{"nestedStr32", []byte{0x92, 0xc0, 0xdb, 0xff, 0xff, 0xff, 0xff, 'a'}},
		{"mapValueBin32", []byte{0x81, 0xa1, 'k', 0xc6, 0xff, 0xff, 0xff, 0xf0}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			n, err := Skip(tt.b)
			require.ErrorIs(t, err, ErrTruncated)
			require.Zero(t, n)
			_, n, err = AppendJSON(nil, tt.b)
			require.ErrorIs(t, err, ErrTruncated)
			require.Zero(t, n)
		})
	}
}

// nest returns n copies of prefix followed by tail.
func nest(prefix []byte, n int, tail ...byte) []byte {
	return append(bytes.Repeat(prefix, n), tail...)
}

func TestSkip_Depth(t *testing.T) {
	tests := []struct {
		name string
		b    []byte
		err  error
	}{
		{"arraysAtMax", nest([]byte{0x91}, MaxDepth, 0xc0), nil},
		{"arraysOverMax", nest([]byte{0x91}, MaxDepth+1, 0xc0), ErrTooDeep},
		{"emptyArrayOverMax", nest([]byte{0x91}, MaxDepth, 0x90), ErrTooDeep},
		{"emptyMapOverMax", nest([]byte{0x91}, MaxDepth, 0x80), ErrTooDeep},
		{"array16OverMax", nest([]byte{0xdc, 0, 1}, MaxDepth+1, 0xc0), ErrTooDeep},
		{"mapValuesAtMax", nest([]byte{0x81, 0xc0}, MaxDepth, 0xc0), nil},
		{"mapValuesOverMax", nest([]byte{0x81, 0xc0}, MaxDepth+1, 0xc0), ErrTooDeep},
		{"mapKeysAtMax", append(nest([]byte{0x81}, MaxDepth, 0xc0), bytes.Repeat([]byte{0xc0}, MaxDepth)...), nil},
		{"arrays100000", nest([]byte{0x91}, 100000), ErrTooDeep},
		{"map32s100000", nest([]byte{0xdf, 0, 0, 0, 1, 0xa0}, 100000), ErrTooDeep},
		{"mapKeys100000", nest([]byte{0x81}, 100000), ErrTooDeep},
		{"wideArrays", nest([]byte{0x92, 0x01}, 100000, 0x01), ErrTooDeep},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			n, err := Skip(tt.b)
			if tt.err != nil {
				require.ErrorIs(t, err, tt.err)
				require.Zero(t, n)
				require.False(t, Valid(tt.b))
				return
			}
			require.NoError(t, err)
			require.Equal(t, len(tt.b), n)
		})
	}
}

func TestSkip_MatchesDecoder(t *testing.T) {
	r := rand.New(rand.NewSource(5))
	var buf []byte
	for i := 0; i < 5000; i++ {
		v := gen(r, 5, genOpts{raw: true})
		var enc []byte
		if r.Intn(2) == 0 {
			enc = mustMarshal(v)
		} else {
			enc = marshalCompact(t, v)
		}
		// Follow the value with another so Skip must stop at the boundary.
		buf = append(append(buf[:0], enc...), mustMarshal(gen(r, 1, genOpts{}))...)

		want, err := vmSkip(buf)
		require.NoError(t, err)
		require.Equal(t, len(enc), want)

		n, err := Skip(buf)
		require.NoError(t, err, "% x", enc)
		require.Equal(t, want, n, "% x", enc)
		require.True(t, Valid(enc))
		require.Equal(t, len(buf) == len(enc), Valid(buf))
	}
}

func TestValid_Edges(t *testing.T) {
	tests := []struct {
		name string
		b    []byte
		want bool
	}{
		{"nilSlice", nil, false},
		{"empty", []byte{}, false},
		{"one", []byte{0x01}, true},
		{"two", []byte{0x01, 0x02}, false},
		{"trailingNil", []byte{0x90, 0xc0}, false},
		{"trailingInvalid", []byte{0xc0, 0xc1}, false},
		{"truncated", []byte{0x92, 0x01}, false},
		{"invalid", []byte{0xc1}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			require.Equal(t, tt.want, Valid(tt.b))
		})
	}
}

func TestSkip_NoAllocs(t *testing.T) {
	b := benchValue()
	deep := nest([]byte{0x91}, MaxDepth, 0xc0)
	allocs := testing.AllocsPerRun(100, func() {
		if _, err := Skip(b); err != nil {
			panic(err)
		}
		if !Valid(deep) {
			panic("deep")
		}
		_, _ = Skip(b[:len(b)-1])
	})
	require.Zero(t, allocs)
}
