package mpk

import (
	"bytes"
	"math"
	"math/rand"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"
)

func TestAppendInt_Boundaries(t *testing.T) {
	tests := []struct {
		v    int64
		size int
	}{
		{0, 1}, {1, 1}, {127, 1},
		{128, 2}, {255, 2},
		{256, 3}, {65535, 3},
		{65536, 5}, {math.MaxInt32, 5}, {math.MaxUint32, 5},
		{math.MaxUint32 + 1, 9}, {math.MaxInt64, 9},
		{-1, 1}, {-32, 1},
		{-33, 2}, {math.MinInt8, 2},
		{math.MinInt8 - 1, 3}, {math.MinInt16, 3},
		{math.MinInt16 - 1, 5}, {math.MinInt32, 5},
		{math.MinInt32 - 1, 9}, {math.MinInt64, 9},
	}
	for _, tt := range tests {
		b := AppendInt([]byte{0xaa}, tt.v)
		require.Equal(t, byte(0xaa), b[0], "dst prefix kept")
		b = b[1:]
		require.Len(t, b, tt.size, "v=%d", tt.v)
		require.Equal(t, marshalCompact(t, tt.v), b, "v=%d", tt.v)

		var got int64
		require.NoError(t, msgpack.Unmarshal(b, &got))
		require.Equal(t, tt.v, got)
		require.True(t, Valid(b))
	}
}

func TestAppendUint_Boundaries(t *testing.T) {
	tests := []struct {
		v    uint64
		size int
	}{
		{0, 1}, {127, 1}, {128, 2}, {255, 2}, {256, 3}, {65535, 3}, {65536, 5},
		{math.MaxUint32, 5}, {math.MaxUint32 + 1, 9}, {math.MaxInt64 + 1, 9}, {math.MaxUint64, 9},
	}
	for _, tt := range tests {
		b := AppendUint(nil, tt.v)
		require.Len(t, b, tt.size, "v=%d", tt.v)
		require.Equal(t, marshalCompact(t, tt.v), b, "v=%d", tt.v)

		var got uint64
		require.NoError(t, msgpack.Unmarshal(b, &got))
		require.Equal(t, tt.v, got)
	}
}

func TestAppendInt_Random(t *testing.T) {
	r := rand.New(rand.NewSource(1))
	var b []byte
	for i := 0; i < 10000; i++ {
		v := genInt(r)
		b = AppendInt(b[:0], v)
		var got int64
		require.NoError(t, msgpack.Unmarshal(b, &got))
		require.Equal(t, v, got)

		u := genUint(r)
		b = AppendUint(b[:0], u)
		var gotU uint64
		require.NoError(t, msgpack.Unmarshal(b, &gotU))
		require.Equal(t, u, gotU)
	}
}

func TestAppendBool_RoundTrip(t *testing.T) {
	for _, v := range []bool{false, true} {
		var got bool
		require.NoError(t, msgpack.Unmarshal(AppendBool(nil, v), &got))
		require.Equal(t, v, got)
	}
	got := new(int)
	require.NoError(t, msgpack.Unmarshal(AppendNil(nil), &got))
	require.Nil(t, got)
}

func TestAppendFloat64_RoundTrip(t *testing.T) {
	tests := []float64{
		0, math.Copysign(0, -1), 1, -1.5, 0.1, 1e300, math.MaxFloat64, -math.MaxFloat64,
		math.SmallestNonzeroFloat64, math.Inf(1), math.Inf(-1), math.NaN(),
	}
	for _, v := range tests {
		b := AppendFloat64(nil, v)
		require.Len(t, b, 9)
		require.Equal(t, mustMarshal(v), b)
		var got float64
		require.NoError(t, msgpack.Unmarshal(b, &got))
		require.Equal(t, math.Float64bits(v), math.Float64bits(got))
	}
}

func TestAppendString_Lengths(t *testing.T) {
	tests := []struct {
		n   int
		hdr int
	}{
		{0, 1}, {1, 1}, {31, 1}, {32, 2}, {255, 2}, {256, 3}, {65535, 3}, {65536, 5}, {70000, 5},
	}
	for _, tt := range tests {
		s := strings.Repeat("é", tt.n/2) + strings.Repeat("x", tt.n%2)
		require.Len(t, s, tt.n)

		b := AppendString(nil, s)
		require.Len(t, b, tt.hdr+tt.n, "n=%d", tt.n)
		require.Equal(t, mustMarshal(s), b, "n=%d", tt.n)
		require.Equal(t, b, AppendStringBytes(nil, []byte(s)))

		var got string
		require.NoError(t, msgpack.Unmarshal(b, &got))
		require.Equal(t, s, got)
		n, err := Skip(b)
		require.NoError(t, err)
		require.Equal(t, len(b), n)
	}
}

func TestAppendBin_Lengths(t *testing.T) {
	tests := []struct {
		n   int
		hdr int
	}{
		{0, 2}, {1, 2}, {255, 2}, {256, 3}, {65535, 3}, {65536, 5},
	}
	r := rand.New(rand.NewSource(2))
	for _, tt := range tests {
		v := randBytes(r, tt.n)
		b := AppendBin(nil, v)
		require.Len(t, b, tt.hdr+tt.n, "n=%d", tt.n)
		require.Equal(t, mustMarshal(v), b, "n=%d", tt.n)

		var got []byte
		require.NoError(t, msgpack.Unmarshal(b, &got))
		require.True(t, bytes.Equal(v, got))
	}
}

func TestAppendArrayHeader_Lengths(t *testing.T) {
	tests := []struct {
		n   int
		hdr int
	}{
		{0, 1}, {1, 1}, {15, 1}, {16, 3}, {65535, 3}, {65536, 5},
	}
	for _, tt := range tests {
		b := AppendArrayHeader(nil, tt.n)
		require.Len(t, b, tt.hdr)
		for i := 0; i < tt.n; i++ {
			b = AppendInt(b, int64(i))
		}
		var got []int
		require.NoError(t, msgpack.Unmarshal(b, &got))
		require.Len(t, got, tt.n)
		for i, v := range got {
			require.Equal(t, i, v)
		}
		require.True(t, Valid(b))
	}
}

func TestAppendMapHeader_Lengths(t *testing.T) {
	tests := []struct {
		n   int
		hdr int
	}{
		{0, 1}, {1, 1}, {15, 1}, {16, 3}, {65535, 3}, {65536, 5},
	}
	for _, tt := range tests {
		b := AppendMapHeader(nil, tt.n)
		require.Len(t, b, tt.hdr)
		for i := 0; i < tt.n; i++ {
			b = AppendInt(b, int64(i))
			b = AppendBool(b, i%2 == 0)
		}
		var got map[int]bool
		require.NoError(t, msgpack.Unmarshal(b, &got))
		require.Len(t, got, tt.n)
		for k, v := range got {
			require.Equal(t, k%2 == 0, v)
		}
		require.True(t, Valid(b))
	}
}

func TestAppendTime_Forms(t *testing.T) {
	tests := []struct {
		name string
		t    time.Time
		size int // 6: timestamp 32, 10: timestamp 64, 15: timestamp 96
	}{
		{"epoch", time.Unix(0, 0), 6},
		{"max32", time.Unix(math.MaxUint32, 0), 6},
		{"after32", time.Unix(math.MaxUint32+1, 0), 10},
		{"nsec", time.Unix(1, 1), 10},
		{"nsecMax", time.Unix(0, 999999999), 10},
		{"max34", time.Unix(1<<34-1, 999999999), 10},
		{"after34", time.Unix(1<<34, 0), 15},
		{"beforeEpoch", time.Unix(-1, 0), 15},
		{"beforeEpochNsec", time.Unix(-1, 500), 15},
		{"year1", time.Date(1, 1, 1, 0, 0, 0, 1, time.UTC), 15},
		{"zero", time.Time{}, 15},
		{"year9999", time.Date(9999, 12, 31, 23, 59, 59, 999999999, time.UTC), 15},
		{"yearMinus100", time.Date(-100, 3, 1, 0, 0, 0, 7, time.UTC), 15},
		{"year20000", time.Date(20000, 3, 1, 0, 0, 0, 7, time.UTC), 15},
		{"now", time.Date(2024, 5, 6, 7, 8, 9, 123456789, time.FixedZone("x", 3600)), 10},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := AppendTime(nil, tt.t)
			require.Len(t, b, tt.size)
			require.Equal(t, mustMarshal(tt.t), b)

			var got time.Time
			require.NoError(t, msgpack.Unmarshal(b, &got))
			require.True(t, tt.t.Equal(got), "want %v got %v", tt.t, got)
			require.True(t, Valid(b))
		})
	}
}

func TestAppend_MatchesCompactEncoder(t *testing.T) {
	// A tree built with the writers is byte-for-byte what vmihailenco
	// produces with UseCompactInts and sorted map keys.
	r := rand.New(rand.NewSource(3))
	var b []byte
	for i := 0; i < 2000; i++ {
		v := gen(r, 4, genOpts{})
		if hasFloat32(v) {
			continue
		}
		b = encode(t, b[:0], v)
		require.Equal(t, marshalCompact(t, v), b)
	}
}

func hasFloat32(v any) bool {
	switch v := v.(type) {
	case float32:
		return true
	case []any:
		for _, e := range v {
			if hasFloat32(e) {
				return true
			}
		}
	case map[string]any:
		for _, e := range v {
			if hasFloat32(e) {
				return true
			}
		}
	case map[any]any:
		return true // not supported by encode
	}
	return false
}

func TestAppend_PanicsOnBadLength(t *testing.T) {
	require.PanicsWithValue(t, "mpk: length out of range", func() { AppendArrayHeader(nil, -1) })
	require.PanicsWithValue(t, "mpk: length out of range", func() { AppendMapHeader(nil, -1) })
	if math.MaxInt > math.MaxUint32 {
		big := uint64(math.MaxUint32) + 1
		n := int(big)
		require.PanicsWithValue(t, "mpk: length out of range", func() { AppendArrayHeader(nil, n) })
	}
}

func TestAppend_NoAllocs(t *testing.T) {
	dst := make([]byte, 0, 4096)
	s := strings.Repeat("s", 300)
	bs := []byte(s)
	now := time.Now()
	allocs := testing.AllocsPerRun(100, func() {
		b := AppendMapHeader(dst[:0], 3)
		b = AppendString(b, "a")
		b = AppendArrayHeader(b, 6)
		b = AppendInt(b, -1<<40)
		b = AppendUint(b, 1<<40)
		b = AppendFloat64(b, 1.5)
		b = AppendBool(b, true)
		b = AppendNil(b)
		b = AppendTime(b, now)
		b = AppendStringBytes(b, bs)
		b = AppendBin(b, bs)
		b = AppendString(b, s)
		_ = AppendStringBytes(b, bs)
	})
	require.Zero(t, allocs)
}

// TestAppendUnixNano_AsAppendTime and TestAppendRFC3339Nano_AsTimeFormat check the answer's fast time
// writers against the general ones, at the edges of each form and at random points.
func TestAppendUnixNano_AsAppendTime(t *testing.T) {
	for _, ns := range timePoints() {
		require.Equal(t, AppendTime(nil, time.Unix(0, ns)), AppendUnixNano(nil, ns), "%d", ns)
	}
}

func TestAppendRFC3339Nano_AsTimeFormat(t *testing.T) {
	for _, ns := range timePoints() {
		require.Equal(t, time.Unix(0, ns).UTC().Format(time.RFC3339Nano), string(AppendRFC3339Nano(nil, ns)), "%d", ns)
	}
}

func timePoints() []int64 {
	ps := []int64{0, 1, -1, 999999999, 1e9, -1e9, -1e9 - 1, math.MaxUint32 * 1e9, (math.MaxUint32 + 1) * 1e9,
		math.MaxInt64, math.MinInt64, 951782400 * 1e9, 951868800*1e9 - 1, 4107542400 * 1e9, 1e17 + 100}
	r := rand.New(rand.NewSource(7))
	for i := 0; i < 100000; i++ {
		ps = append(ps, r.Int63(), r.Int63n(1e10)*1e9+r.Int63n(10)*1e8, -r.Int63n(3e18))
	}
	return ps
}
