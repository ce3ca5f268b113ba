package mpk

import (
	"encoding/binary"
	"errors"
)

var (
	// ErrTruncated is returned when the input ends inside an object.
	ErrTruncated = errors.New("mpk: truncated")
	// ErrInvalid is returned for the never-used type byte 0xc1 and for
	// otherwise malformed input.
	ErrInvalid = errors.New("mpk: invalid byte")
	// ErrTooDeep is returned when arrays and maps nest beyond MaxDepth.
	ErrTooDeep = errors.New("mpk: nested too deep")
	// ErrNoJSON is returned by AppendJSON for a well-formed object that JSON has no form for: a float
	// that is NaN or ±Inf, a string that is not UTF-8.
	ErrNoJSON = errors.New("mpk: a NaN or infinite float, or a string not UTF-8, has no JSON form")
)

// MaxDepth is the maximum number of arrays and maps that may be open at once.
const MaxDepth = 512

// Classes of type bytes, used by Skip.
const (
	clsInvalid  = iota
	clsFixed    // the whole object is entry.n bytes long
	clsVar      // str or bin: type byte, entry.n length bytes, payload
	clsExt      // ext: type byte, entry.n length bytes, ext type byte, payload
	clsFixArray // count in the low four bits
	clsFixMap   // pair count in the low four bits
	clsArray    // type byte and entry.n count bytes
	clsMap      // type byte and entry.n pair count bytes
)

type entry struct {
	cls uint8
	n   uint8
}

var table = func() (t [256]entry) {
	for c := 0x00; c <= 0x7f; c++ {
		t[c] = entry{clsFixed, 1}
	}
	for c := 0x80; c <= 0x8f; c++ {
		t[c] = entry{clsFixMap, 0}
	}
	for c := 0x90; c <= 0x9f; c++ {
		t[c] = entry{clsFixArray, 0}
	}
	for c := 0xa0; c <= 0xbf; c++ {
		t[c] = entry{clsFixed, uint8(1 + c&0x1f)}
	}
	for c := 0xe0; c <= 0xff; c++ {
		t[c] = entry{clsFixed, 1}
	}
	t[0xc0] = entry{clsFixed, 1} // nil
	t[0xc1] = entry{clsInvalid, 0}
	t[0xc2] = entry{clsFixed, 1}  // false
	t[0xc3] = entry{clsFixed, 1}  // true
	t[0xc4] = entry{clsVar, 1}    // bin8
	t[0xc5] = entry{clsVar, 2}    // bin16
	t[0xc6] = entry{clsVar, 4}    // bin32
	t[0xc7] = entry{clsExt, 1}    // ext8
	t[0xc8] = entry{clsExt, 2}    // ext16
	t[0xc9] = entry{clsExt, 4}    // ext32
	t[0xca] = entry{clsFixed, 5}  // float32
	t[0xcb] = entry{clsFixed, 9}  // float64
	t[0xcc] = entry{clsFixed, 2}  // uint8
	t[0xcd] = entry{clsFixed, 3}  // uint16
	t[0xce] = entry{clsFixed, 5}  // uint32
	t[0xcf] = entry{clsFixed, 9}  // uint64
	t[0xd0] = entry{clsFixed, 2}  // int8
	t[0xd1] = entry{clsFixed, 3}  // int16
	t[0xd2] = entry{clsFixed, 5}  // int32
	t[0xd3] = entry{clsFixed, 9}  // int64
	t[0xd4] = entry{clsFixed, 3}  // fixext1
	t[0xd5] = entry{clsFixed, 4}  // fixext2
	t[0xd6] = entry{clsFixed, 6}  // fixext4
	t[0xd7] = entry{clsFixed, 10} // fixext8
	t[0xd8] = entry{clsFixed, 18} // fixext16
	t[0xd9] = entry{clsVar, 1}    // str8
	t[0xda] = entry{clsVar, 2}    // str16
	t[0xdb] = entry{clsVar, 4}    // str32
	t[0xdc] = entry{clsArray, 2}  // array16
	t[0xdd] = entry{clsArray, 4}  // array32
	t[0xde] = entry{clsMap, 2}    // map16
	t[0xdf] = entry{clsMap, 4}    // map32
	return t
}()

// readLen reads a big-endian length of w (1, 2 or 4) bytes from b.
// The caller has checked that len(b) >= w.
func readLen(b []byte, w int) uint64 {
	switch w {
	case 1:
		return uint64(b[0])
	case 2:
		return uint64(binary.BigEndian.Uint16(b))
	default:
		return uint64(binary.BigEndian.Uint32(b))
	}
}

// Skip returns the length in bytes of the first complete MessagePack object
// in b. It checks structure only; see the package documentation.
func Skip(b []byte) (int, error) {
	return skip(b, 0, 1, 0)
}

// Valid reports whether b holds exactly one complete MessagePack object with
// no trailing bytes. An empty b is not valid.
func Valid(b []byte) bool {
	n, err := Skip(b)
	return err == nil && n == len(b)
}

// skip skips n objects starting at b[p], which lie inside depth open arrays
// and maps, and returns the offset just past them. It recurses once per
// nested array or map, at most MaxDepth deep.
func skip(b []byte, p int, n uint64, depth int) (int, error) {
	for ; n > 0; n-- {
		if p >= len(b) {
			return 0, ErrTruncated
		}
		c := b[p]
		e := table[c]
		var cnt uint64
		switch e.cls {
		case clsFixed:
			if int(e.n) > len(b)-p {
				return 0, ErrTruncated
			}
			p += int(e.n)
			continue
		case clsVar, clsExt:
			w := int(e.n)
			h := 1 + w
			if e.cls == clsExt {
				h++
			}
			if h > len(b)-p {
				return 0, ErrTruncated
			}
			size := readLen(b[p+1:], w)
			if size > uint64(len(b)-p-h) {
				return 0, ErrTruncated
			}
			p += h + int(size)
			continue
		case clsInvalid:
			return 0, ErrInvalid
		}

		// An array or map.
		if depth >= MaxDepth {
			return 0, ErrTooDeep
		}
		switch e.cls {
		case clsFixArray:
			cnt = uint64(c & 0x0f)
			p++
		case clsFixMap:
			cnt = 2 * uint64(c&0x0f)
			p++
		default:
			w := int(e.n)
			if 1+w > len(b)-p {
				return 0, ErrTruncated
			}
			cnt = readLen(b[p+1:], w)
			if e.cls == clsMap {
				cnt *= 2
			}
			p += 1 + w
		}
		// Every element takes at least one byte.
		if cnt > uint64(len(b)-p) {
			return 0, ErrTruncated
		}
		if cnt > 0 {
			var err error
			if p, err = skip(b, p, cnt, depth+1); err != nil {
				return 0, err
			}
		}
	}
	return p, nil
}
