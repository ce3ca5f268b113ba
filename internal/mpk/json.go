package mpk

import (
	"encoding/base64"
	"encoding/binary"
	"math"
	"strconv"
	"time"
	"unicode/utf8"
	"unsafe"
)

// Timestamps render as RFC 3339, whose years have four digits: seconds must
// lie in [0000-01-01T00:00:00Z, 10000-01-01T00:00:00Z).
const (
	minRFC3339 = -62167219200
	maxRFC3339 = 253402300800
)

// maxKeyDepth bounds how deeply non-string array and map keys may nest inside
// one another in AppendJSON. Each such level quotes the text below it again,
// which can double its size.
const maxKeyDepth = 4

// AppendJSON appends the JSON rendering of the single MessagePack object at
// the start of src to dst, and returns the extended buffer and the number of
// bytes of src consumed. See the package documentation for the mapping.
//
// On error, dst may hold partial output; callers truncate it back.
func AppendJSON(dst, src []byte) ([]byte, int, error) {
	dst, p, err := appendJSON(dst, src, 0, 0, 0)
	if err != nil {
		return dst, 0, err
	}
	return dst, p, nil
}

// appendJSON renders the object at src[p], which lies inside depth open
// arrays and maps and keyDepth non-string array or map keys, and returns
// the offset just past it. It recurses once per nested array or map.
func appendJSON(dst, src []byte, p, depth, keyDepth int) ([]byte, int, error) {
	if p >= len(src) {
		return dst, 0, ErrTruncated
	}
	c := src[p]
	if !isContainer(c) {
		return appendScalar(dst, src, p)
	}
	if depth >= MaxDepth {
		return dst, 0, ErrTooDeep
	}
	var n uint64
	isMap := false
	switch {
	case c <= 0x8f:
		n, isMap = uint64(c&0x0f), true
		p++
	case c <= 0x9f:
		n = uint64(c & 0x0f)
		p++
	default: // 0xdc to 0xdf
		w := 2
		if c&1 == 1 {
			w = 4
		}
		if 1+w > len(src)-p {
			return dst, 0, ErrTruncated
		}
		n, isMap = readLen(src[p+1:], w), c >= 0xde
		p += 1 + w
	}
	// Every element takes at least one byte.
	need := n
	if isMap {
		need *= 2
	}
	if need > uint64(len(src)-p) {
		return dst, 0, ErrTruncated
	}

	var err error
	if !isMap {
		dst = append(dst, '[')
		for i := uint64(0); i < n; i++ {
			if i > 0 {
				dst = append(dst, ',')
			}
			if dst, p, err = appendJSON(dst, src, p, depth+1, keyDepth); err != nil {
				return dst, 0, err
			}
		}
		return append(dst, ']'), p, nil
	}

	dst = append(dst, '{')
	for i := uint64(0); i < n; i++ {
		if i > 0 {
			dst = append(dst, ',')
		}
		if p >= len(src) {
			return dst, 0, ErrTruncated
		}
		k := src[p]
		if k >= 0xa0 && k <= 0xbf || k >= 0xd9 && k <= 0xdb {
			dst, p, err = appendScalar(dst, src, p)
		} else {
			kd := keyDepth
			if isContainer(k) {
				if kd >= maxKeyDepth {
					return dst, 0, ErrTooDeep
				}
				kd++
			}
			start := len(dst)
			if dst, p, err = appendJSON(dst, src, p, depth+1, kd); err == nil {
				dst = quoteTail(dst, start)
			}
		}
		if err != nil {
			return dst, 0, err
		}
		dst = append(dst, ':')
		if dst, p, err = appendJSON(dst, src, p, depth+1, keyDepth); err != nil {
			return dst, 0, err
		}
	}
	return append(dst, '}'), p, nil
}

// isContainer reports whether c starts an array or a map.
func isContainer(c byte) bool {
	return c >= 0x80 && c <= 0x9f || c >= 0xdc && c <= 0xdf
}

// quoteTail replaces dst[start:] with its rendering as a JSON string.
func quoteTail(dst []byte, start int) []byte {
	end := len(dst)
	// If append reallocates, the string still refers to the old array,
	// which is not modified; otherwise append writes only beyond end.
	dst = AppendJSONString(dst, bstr(dst[start:end]))
	n := copy(dst[start:], dst[end:])
	return dst[:start+n]
}

// appendScalar renders the object at src[p], which is not an array or map.
func appendScalar(dst, src []byte, p int) ([]byte, int, error) {
	c := src[p]
	rest := len(src) - p
	switch {
	case c <= 0x7f:
		return strconv.AppendUint(dst, uint64(c), 10), p + 1, nil
	case c >= 0xe0:
		return strconv.AppendInt(dst, int64(int8(c)), 10), p + 1, nil
	case c >= 0xa0 && c <= 0xbf:
		n := int(c & 0x1f)
		if 1+n > rest {
			return dst, 0, ErrTruncated
		}
		return appendValueString(dst, src[p+1:p+1+n], p+1+n)
	}

	// Fixed-size objects.
	var size int
	switch c {
	case 0xc0, 0xc2, 0xc3:
		size = 1
	case 0xcc, 0xd0:
		size = 2
	case 0xcd, 0xd1:
		size = 3
	case 0xca, 0xce, 0xd2:
		size = 5
	case 0xcb, 0xcf, 0xd3:
		size = 9
	case 0xd4, 0xd5, 0xd6, 0xd7, 0xd8:
		return appendExt(dst, src, p, 2, 1<<(c-0xd4))
	}
	if size > 0 {
		if size > rest {
			return dst, 0, ErrTruncated
		}
		b := src[p+1 : p+size]
		switch c {
		case 0xc0:
			dst = append(dst, "null"...)
		case 0xc2:
			dst = append(dst, "false"...)
		case 0xc3:
			dst = append(dst, "true"...)
		case 0xcc:
			dst = strconv.AppendUint(dst, uint64(b[0]), 10)
		case 0xcd:
			dst = strconv.AppendUint(dst, uint64(binary.BigEndian.Uint16(b)), 10)
		case 0xce:
			dst = strconv.AppendUint(dst, uint64(binary.BigEndian.Uint32(b)), 10)
		case 0xcf:
			dst = strconv.AppendUint(dst, binary.BigEndian.Uint64(b), 10)
		case 0xd0:
			dst = strconv.AppendInt(dst, int64(int8(b[0])), 10)
		case 0xd1:
			dst = strconv.AppendInt(dst, int64(int16(binary.BigEndian.Uint16(b))), 10)
		case 0xd2:
			dst = strconv.AppendInt(dst, int64(int32(binary.BigEndian.Uint32(b))), 10)
		case 0xd3:
			dst = strconv.AppendInt(dst, int64(binary.BigEndian.Uint64(b)), 10)
		case 0xca, 0xcb:
			f, bits := float64(math.Float32frombits(binary.BigEndian.Uint32(b))), 32
			if c == 0xcb {
				f, bits = math.Float64frombits(binary.BigEndian.Uint64(b)), 64
			}
			if math.IsNaN(f) || math.IsInf(f, 0) {
				return dst, 0, ErrNoJSON
			}
			dst = appendJSONFloat(dst, f, bits)
		}
		return dst, p + size, nil
	}

	// Variable-size objects: str, bin and ext 8/16/32.
	var w int
	switch c {
	case 0xc4, 0xc7, 0xd9:
		w = 1
	case 0xc5, 0xc8, 0xda:
		w = 2
	case 0xc6, 0xc9, 0xdb:
		w = 4
	default: // 0xc1
		return dst, 0, ErrInvalid
	}
	if 1+w > rest {
		return dst, 0, ErrTruncated
	}
	n := readLen(src[p+1:], w)
	if c >= 0xc7 && c <= 0xc9 {
		if 2+w > rest || n > uint64(rest-w-2) {
			return dst, 0, ErrTruncated
		}
		return appendExt(dst, src, p, 2+w, int(n))
	}
	if n > uint64(rest-w-1) {
		return dst, 0, ErrTruncated
	}
	b := src[p+1+w : p+1+w+int(n)]
	if c >= 0xd9 {
		return appendValueString(dst, b, p+1+w+int(n))
	} else {
		dst = append(dst, '"')
		dst = base64.StdEncoding.AppendEncode(dst, b)
		dst = append(dst, '"')
	}
	return dst, p + 1 + w + int(n), nil
}

// appendExt renders the extension at src[p] whose type byte is at src[p+h-1]
// and whose n bytes of data follow it. The caller has checked the header.
func appendExt(dst, src []byte, p, h, n int) ([]byte, int, error) {
	if h+n > len(src)-p {
		return dst, 0, ErrTruncated
	}
	typ := int8(src[p+h-1])
	b := src[p+h : p+h+n]
	if typ == -1 {
		var sec int64
		var nsec uint64
		switch n {
		case 4:
			sec = int64(binary.BigEndian.Uint32(b))
		case 8:
			v := binary.BigEndian.Uint64(b)
			sec, nsec = int64(v&(1<<34-1)), v>>34
		case 12:
			nsec = uint64(binary.BigEndian.Uint32(b))
			sec = int64(binary.BigEndian.Uint64(b[4:]))
		default:
			return dst, 0, ErrInvalid
		}
		if nsec > 999999999 || sec < minRFC3339 || sec >= maxRFC3339 {
			return dst, 0, ErrInvalid
		}
		dst = append(dst, '"')
		dst = time.Unix(sec, int64(nsec)).UTC().AppendFormat(dst, time.RFC3339Nano)
		dst = append(dst, '"')
		return dst, p + h + n, nil
	}
	dst = append(dst, `{"ext":`...)
	dst = strconv.AppendInt(dst, int64(typ), 10)
	dst = append(dst, `,"data":"`...)
	dst = base64.StdEncoding.AppendEncode(dst, b)
	dst = append(dst, `"}`...)
	return dst, p + h + n, nil
}

// appendJSONFloat formats a finite f as encoding/json does: shortest
// representation, exponent form only for very small or large magnitudes.
func appendJSONFloat(dst []byte, f float64, bits int) []byte {
	fmt := byte('f')
	if abs := math.Abs(f); abs != 0 {
		if bits == 64 && (abs < 1e-6 || abs >= 1e21) ||
			bits == 32 && (float32(abs) < 1e-6 || float32(abs) >= 1e21) {
			fmt = 'e'
		}
	}
	dst = strconv.AppendFloat(dst, f, fmt, -1, bits)
	if fmt == 'e' {
		// Turn e-07 into e-7.
		n := len(dst)
		if n >= 4 && dst[n-4] == 'e' && dst[n-3] == '-' && dst[n-2] == '0' {
			dst[n-2] = dst[n-1]
			dst = dst[:n-1]
		}
	}
	return dst
}

// appendValueString renders a MessagePack str of a value, which ends at end: a string that is not
// UTF-8 is ErrNoJSON, as JSON text holds no other (U+FFFD in its place would say another value).
func appendValueString(dst, b []byte, end int) ([]byte, int, error) {
	dst, ok := appendJSONString(dst, bstr(b), true)
	if !ok {
		return dst, 0, ErrNoJSON
	}
	return dst, end, nil
}

// AppendJSONStringBytes is AppendJSONString for a byte slice.
func AppendJSONStringBytes(dst []byte, s []byte) []byte {
	return AppendJSONString(dst, bstr(s))
}

// AppendJSONString appends s as a quoted JSON string. Quotes, backslashes and
// control characters are escaped, as are U+2028 and U+2029; each byte of
// invalid UTF-8 becomes \ufffd. Unlike encoding/json, <, > and & are not
// escaped.
func AppendJSONString(dst []byte, s string) []byte {
	dst, _ = appendJSONString(dst, s, false)
	return dst
}

// appendJSONString is AppendJSONString; when strict, it stops at the first byte of invalid UTF-8 and
// reports false.
func appendJSONString(dst []byte, s string, strict bool) ([]byte, bool) {
	dst = append(dst, '"')
	start := 0
	for i := 0; i < len(s); {
		// Eight bytes at a time while none needs escaping or is past ASCII: most of what an answer
		// holds (keys, names, plain values) is written in one copy.
		for i+8 <= len(s) && plain8(binary.LittleEndian.Uint64(unsafe.Slice(unsafe.StringData(s[i:]), 8))) {
			i += 8
		}
		if i == len(s) {
			break
		}
		c := s[i]
		if c < utf8.RuneSelf {
			if safe[c] {
				i++
				continue
			}
			dst = append(dst, s[start:i]...)
			switch c {
			case '"', '\\':
				dst = append(dst, '\\', c)
			case '\b':
				dst = append(dst, '\\', 'b')
			case '\f':
				dst = append(dst, '\\', 'f')
			case '\n':
				dst = append(dst, '\\', 'n')
			case '\r':
				dst = append(dst, '\\', 'r')
			case '\t':
				dst = append(dst, '\\', 't')
			default:
				dst = append(dst, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			if strict {
				return dst, false
			}
			dst = append(dst, s[start:i]...)
			dst = append(dst, `\ufffd`...)
		case r == '\u2028' || r == '\u2029':
			dst = append(dst, s[start:i]...)
			dst = append(dst, '\\', 'u', '2', '0', '2', hex[r&0xf])
		default:
			i += size
			continue
		}
		i += size
		start = i
	}
	dst = append(dst, s[start:]...)
	return append(dst, '"'), true
}

// plain8 reports whether the eight bytes of w are all ASCII that a JSON string holds unescaped: none
// below 0x20, none '"' or '\\', none with its high bit set.
func plain8(w uint64) bool {
	const ones, highs = 0x0101010101010101, 0x8080808080808080
	ctl := w - 0x20*ones                // a byte below 0x20 borrows into its high bit
	quote := (w ^ '"'*ones) - ones      // a '"' becomes 0 and borrows
	backslash := (w ^ '\\'*ones) - ones // likewise a '\\'
	// A byte with its high bit set fails on its own (w's term); without one, the borrows above are
	// exact for each byte.
	return (w|(ctl|quote|backslash)&^w)&highs == 0
}

const hex = "0123456789abcdef"

// safe reports which ASCII bytes appear in a JSON string unescaped.
var safe = func() (t [utf8.RuneSelf]bool) {
	for c := ' '; c < utf8.RuneSelf; c++ {
		t[c] = c != '"' && c != '\\'
	}
	return t
}()

// bstr returns a string that shares b's memory. The string must not be used
// after b is modified.
func bstr(b []byte) string {
	return unsafe.String(unsafe.SliceData(b), len(b))
}
