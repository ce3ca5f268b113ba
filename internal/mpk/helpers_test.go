package mpk

import (
	"bytes"
	"encoding/binary"
	"math"
	"math/rand"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"
)

// genOpts selects which kinds of value gen may produce.
type genOpts struct {
	// jsonSafe restricts values to those encoding/json renders the same way
	// AppendJSON does: no bin, ext, time, non-string keys, NaN or ±Inf,
	// strings that are not UTF-8.
	jsonSafe bool
	// raw allows hand-built, non-canonical encodings (msgpack.RawMessage).
	raw bool
}

// gen returns a random value that vmihailenco/msgpack can encode.
func gen(r *rand.Rand, depth int, o genOpts) any {
	genString := func(r *rand.Rand) string {
		s := genString(r)
		if o.jsonSafe {
			s = strings.ToValidUTF8(s, "\uFFFD") // JSON has no other strings
		}
		return s
	}
	k := r.Intn(16)
	if depth <= 0 && k >= 13 {
		k = r.Intn(13)
	}
	switch k {
	case 0:
		return nil
	case 1:
		return r.Intn(2) == 0
	case 2:
		return genInt(r)
	case 3:
		return genUint(r)
	case 4:
		switch r.Intn(4) {
		case 0:
			return int8(genInt(r))
		case 1:
			return int16(genInt(r))
		case 2:
			return int32(genInt(r))
		default:
			return uint16(genUint(r))
		}
	case 5:
		return genFloat(r, o.jsonSafe)
	case 6:
		f := float32(genFloat(r, o.jsonSafe))
		if o.jsonSafe && (math.IsInf(float64(f), 0) || math.IsNaN(float64(f))) {
			f = 0.5
		}
		return f
	case 7, 8:
		return genString(r)
	case 9:
		if o.jsonSafe {
			return genString(r)
		}
		return []byte(genString(r))
	case 10:
		if o.jsonSafe {
			return genInt(r)
		}
		return genTime(r)
	case 11:
		if o.jsonSafe || !o.raw {
			return genUint(r)
		}
		return genRaw(r, depth)
	case 12:
		return genString(r)[:0]
	case 13, 14:
		n := r.Intn(6)
		if r.Intn(20) == 0 {
			n = 16 + r.Intn(20)
		}
		a := make([]any, n)
		for i := range a {
			a[i] = gen(r, depth-1, o)
		}
		return a
	default:
		n := r.Intn(6)
		if r.Intn(20) == 0 {
			n = 16 + r.Intn(20)
		}
		if o.jsonSafe || r.Intn(3) > 0 {
			m := make(map[string]any, n)
			for i := 0; i < n; i++ {
				m[genString(r)] = gen(r, depth-1, o)
			}
			return m
		}
		m := make(map[any]any, n)
		for i := 0; i < n; i++ {
			m[genInt(r)] = gen(r, depth-1, o)
		}
		return m
	}
}

// intBounds are the edges of every MessagePack integer width.
var intBounds = []int64{
	0, 1, 126, 127, 128, 254, 255, 256, 65534, 65535, 65536,
	math.MaxInt32, math.MaxUint32 - 1, math.MaxUint32, math.MaxUint32 + 1, math.MaxInt64 - 1, math.MaxInt64,
	-1, -31, -32, -33, -127, -128, -129, -32767, -32768, -32769,
	math.MinInt32 + 1, math.MinInt32, math.MinInt32 - 1, math.MinInt64 + 1, math.MinInt64,
}

func genInt(r *rand.Rand) int64 {
	switch r.Intn(4) {
	case 0:
		return intBounds[r.Intn(len(intBounds))]
	case 1:
		return int64(r.Intn(256)) - 128
	default:
		return r.Int63() >> r.Intn(64) * int64(1-2*r.Intn(2))
	}
}

func genUint(r *rand.Rand) uint64 {
	if r.Intn(4) == 0 {
		return math.MaxUint64 - uint64(r.Intn(3))
	}
	return r.Uint64() >> r.Intn(64)
}

func genFloat(r *rand.Rand, finite bool) float64 {
	switch r.Intn(6) {
	case 0:
		specials := []float64{0, math.Copysign(0, -1), 1, -1, 0.1, 1e21, 1e20, 1e-6, 1e-7, math.MaxFloat64, math.SmallestNonzeroFloat64, math.MaxFloat32}
		return specials[r.Intn(len(specials))]
	case 1:
		if !finite {
			return []float64{math.NaN(), math.Inf(1), math.Inf(-1)}[r.Intn(3)]
		}
		return float64(r.Intn(1000))
	case 2:
		return math.Float64frombits(r.Uint64())
	default:
		return r.NormFloat64() * math.Pow(10, float64(r.Intn(60)-30))
	}
}

// stringParts are glued together to make awkward strings.
var stringParts = []string{
	"a", "key", "Ünïcødé", "日本語", "😀", "\"", "\\", "\n", "\t", "\x00", "\x1f", "\x7f",
	"<", ">", "&", "\u2028", "\u2029", "\xff", "\xc3", "\xe2\x82", "\xed\xa0\x80", " ", "/",
}

func genString(r *rand.Rand) string {
	var sb strings.Builder
	switch r.Intn(10) {
	case 0:
		// Around the str8 and str16 boundaries.
		n := []int{31, 32, 33, 255, 256, 257}[r.Intn(6)]
		return strings.Repeat("x", n)
	case 1:
		if r.Intn(10) == 0 {
			return strings.Repeat("y", 65535+r.Intn(3))
		}
		fallthrough
	default:
		for n := r.Intn(8); n > 0; n-- {
			sb.WriteString(stringParts[r.Intn(len(stringParts))])
		}
		return sb.String()
	}
}

func genTime(r *rand.Rand) time.Time {
	switch r.Intn(5) {
	case 0: // 32-bit form
		return time.Unix(int64(r.Uint32()), 0)
	case 1: // 64-bit form
		return time.Unix(r.Int63n(1<<34), r.Int63n(1e9))
	case 2: // 96-bit form, from year 0 to 1969
		return time.Unix(-r.Int63n(-minRFC3339)-1, r.Int63n(1e9))
	case 3: // 96-bit form, from 2514 to year 9999
		return time.Unix(1<<34+r.Int63n(maxRFC3339-1<<34), r.Int63n(1e9))
	default:
		return time.Time{}
	}
}

// genRaw returns a hand-built encoding that vmihailenco's encoder would not
// produce: wide headers for small values, and extensions of other types.
func genRaw(r *rand.Rand, depth int) msgpack.RawMessage {
	var b []byte
	switch r.Intn(6) {
	case 0: // fixext 1/2/4/8/16
		n := 1 << r.Intn(5)
		b = append(b, byte(0xd4+bits(n)), byte(r.Intn(128)))
		b = append(b, randBytes(r, n)...)
	case 1: // ext 8/16/32
		n := r.Intn(40)
		w := 1 << r.Intn(3)
		b = append(b, 0xc7+byte(bits(w)))
		b = appendWidth(b, w, n)
		b = append(b, byte(r.Intn(128)))
		b = append(b, randBytes(r, n)...)
	case 2: // str 8/16/32 or bin 8/16/32 holding a short payload
		s := genString(r)
		w := 1 << r.Intn(3)
		for w < 4 && len(s) >= 1<<(8*w) {
			w *= 2
		}
		if r.Intn(2) == 0 {
			b = append(b, 0xd9+byte(bits(w)))
		} else {
			b = append(b, 0xc4+byte(bits(w)))
		}
		b = appendWidth(b, w, len(s))
		b = append(b, s...)
	case 3: // array 16/32 of a few elements
		n := r.Intn(4)
		b = append(b, 0xdc+byte(r.Intn(2)))
		b = appendWidth(b, 2<<(b[0]-0xdc), n)
		for i := 0; i < n; i++ {
			b = append(b, mustMarshal(gen(r, depth-1, genOpts{raw: true}))...)
		}
	case 4: // map 16/32 of a few pairs
		n := r.Intn(4)
		b = append(b, 0xde+byte(r.Intn(2)))
		b = appendWidth(b, 2<<(b[0]-0xde), n)
		for i := 0; i < 2*n; i++ {
			b = append(b, mustMarshal(gen(r, depth-1, genOpts{raw: true}))...)
		}
	default: // wide integers and float32
		switch r.Intn(3) {
		case 0:
			b = binary.BigEndian.AppendUint64(append(b, 0xcf), uint64(r.Intn(100)))
		case 1:
			b = binary.BigEndian.AppendUint32(append(b, 0xd2), uint32(r.Intn(100)))
		default:
			b = binary.BigEndian.AppendUint32(append(b, 0xca), math.Float32bits(float32(r.NormFloat64())))
		}
	}
	return b
}

func bits(n int) int {
	i := 0
	for n > 1 {
		n >>= 1
		i++
	}
	return i
}

func appendWidth(b []byte, w, n int) []byte {
	switch w {
	case 1:
		return append(b, byte(n))
	case 2:
		return binary.BigEndian.AppendUint16(b, uint16(n))
	default:
		return binary.BigEndian.AppendUint32(b, uint32(n))
	}
}

func randBytes(r *rand.Rand, n int) []byte {
	b := make([]byte, n)
	r.Read(b)
	return b
}

func mustMarshal(v any) []byte {
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	enc.SetSortMapKeys(true)
	if err := enc.Encode(v); err != nil {
		panic(err)
	}
	return buf.Bytes()
}

// marshalCompact encodes v as vmihailenco does with UseCompactInts and
// sorted map keys, which is what the Append writers produce.
func marshalCompact(t testing.TB, v any) []byte {
	t.Helper()
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	enc.UseCompactInts(true)
	enc.SetSortMapKeys(true)
	require.NoError(t, enc.Encode(v))
	return buf.Bytes()
}

// vmSkip returns how many bytes vmihailenco's decoder consumes skipping the
// first object in b.
func vmSkip(b []byte) (int, error) {
	rd := bytes.NewReader(b)
	err := msgpack.NewDecoder(rd).Skip()
	return len(b) - rd.Len(), err
}

// encode writes v with the Append writers, sorting map keys.
func encode(t testing.TB, dst []byte, v any) []byte {
	t.Helper()
	switch v := v.(type) {
	case nil:
		return AppendNil(dst)
	case bool:
		return AppendBool(dst, v)
	case int8:
		return AppendInt(dst, int64(v))
	case int16:
		return AppendInt(dst, int64(v))
	case int32:
		return AppendInt(dst, int64(v))
	case int64:
		return AppendInt(dst, v)
	case uint16:
		return AppendUint(dst, uint64(v))
	case uint64:
		return AppendUint(dst, v)
	case float64:
		return AppendFloat64(dst, v)
	case string:
		return AppendString(dst, v)
	case []byte:
		return AppendBin(dst, v)
	case time.Time:
		return AppendTime(dst, v)
	case []any:
		dst = AppendArrayHeader(dst, len(v))
		for _, e := range v {
			dst = encode(t, dst, e)
		}
		return dst
	case map[string]any:
		keys := make([]string, 0, len(v))
		for k := range v {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		dst = AppendMapHeader(dst, len(v))
		for _, k := range keys {
			dst = AppendStringBytes(dst, []byte(k))
			dst = encode(t, dst, v[k])
		}
		return dst
	}
	t.Fatalf("encode: unsupported %T", v)
	return nil
}
