package query

import (
	"encoding/base64"
	"encoding/binary"
	"strconv"
	"time"

	"github.com/novox/mesh-provisioner/internal/mpk"
)

// Encoder writes an answer straight into a reused buffer, as JSON or MessagePack, with the same calls.
// Stored MessagePack values pass through untouched into MessagePack answers and are transcoded
// without decoding into JSON answers.
//
// MessagePack maps and arrays whose length is known only at the end are written with a header of
// fixed width that is patched when they close; JSON tracks commas per open level.
type Encoder struct {
	f       Format
	buf     []byte
	first   []bool // JSON: whether the open level has no member yet
	marks   []int  // MessagePack: offset of each open header to patch, -1 when the count was known
	count   []int  // MessagePack: members written at each open level
	max     int    // bound on an answer's size in bytes, 0 for none (limits.go)
	reserve int    // bytes kept free for the answer's tail (limits.go)
	next    string // the answer's next, once written (readahead.go)
	scan    *rowScan
	// part is the bytes this answer's anomalies take, written ahead of the rows, or -1 when they were
	// not (limits.go); ahead is the encoder they are written ahead into, reused.
	part  int
	ahead *Encoder
}

// Reset empties the encoder for an answer in format f.
func (e *Encoder) Reset(f Format) {
	e.f = f
	e.buf = e.buf[:0]
	e.first = e.first[:0]
	e.marks = e.marks[:0]
	e.count = e.count[:0]
	e.reserve = 0
	e.next = ""
	e.part = -1
}

// sep writes the comma before a JSON member and counts a MessagePack member.
func (e *Encoder) sep() {
	if e.f == FormatJSON {
		n := len(e.first) - 1
		if n < 0 {
			return
		}
		if !e.first[n] {
			e.buf = append(e.buf, ',')
		}
		e.first[n] = false
		return
	}
	if n := len(e.count) - 1; n >= 0 {
		e.count[n]++
	}
}

// openMap opens a map of n members, or of a number told at close when n < 0.
func (e *Encoder) openMap(n int) {
	e.sep()
	if e.f == FormatJSON {
		e.buf = append(e.buf, '{')
		e.first = append(e.first, true)
		return
	}
	e.open(n, 0xdf)
}

// openArray opens an array of n items, or of a number told at close when n < 0.
func (e *Encoder) openArray(n int) {
	e.sep()
	if e.f == FormatJSON {
		e.buf = append(e.buf, '[')
		e.first = append(e.first, true)
		return
	}
	e.open(n, 0xdd)
}

func (e *Encoder) open(n int, code32 byte) {
	if n >= 0 {
		if code32 == 0xdf {
			e.buf = mpk.AppendMapHeader(e.buf, n)
		} else {
			e.buf = mpk.AppendArrayHeader(e.buf, n)
		}
		e.marks = append(e.marks, -1)
	} else {
		e.marks = append(e.marks, len(e.buf))
		e.buf = append(e.buf, code32, 0, 0, 0, 0)
	}
	e.count = append(e.count, 0)
	// Members of a MessagePack level are counted by sep, but keys and values of a map are two calls:
	// closeMap halves the count.
}

func (e *Encoder) closeMap()   { e.close('}', true) }
func (e *Encoder) closeArray() { e.close(']', false) }

func (e *Encoder) close(c byte, isMap bool) {
	if e.f == FormatJSON {
		e.buf = append(e.buf, c)
		e.first = e.first[:len(e.first)-1]
		return
	}
	n := len(e.marks) - 1
	if m := e.marks[n]; m >= 0 {
		cnt := e.count[n]
		if isMap {
			cnt /= 2
		}
		binary.BigEndian.PutUint32(e.buf[m+1:], uint32(cnt))
	}
	e.marks = e.marks[:n]
	e.count = e.count[:n]
}

// key writes a map key; the value follows with one of the value calls.
func (e *Encoder) key(k string) {
	if e.f == FormatJSON {
		e.sep()
		e.buf = mpk.AppendJSONString(e.buf, k)
		e.buf = append(e.buf, ':')
		// The value that follows is no new member.
		e.first[len(e.first)-1] = true
		return
	}
	e.sep()
	e.buf = mpk.AppendString(e.buf, k)
}

// valueSep is sep for a value: in JSON a map's value follows its key without a comma.
func (e *Encoder) valueSep() {
	if e.f == FormatJSON {
		n := len(e.first) - 1
		if n >= 0 && e.first[n] && e.isAfterKey() {
			e.first[n] = false
			return
		}
	}
	e.sep()
}

// isAfterKey reports whether the JSON buffer ends with the ':' of a key.
func (e *Encoder) isAfterKey() bool { return len(e.buf) > 0 && e.buf[len(e.buf)-1] == ':' }

func (e *Encoder) str(s string) {
	e.valueSep()
	if e.f == FormatJSON {
		e.buf = mpk.AppendJSONString(e.buf, s)
	} else {
		e.buf = mpk.AppendString(e.buf, s)
	}
}

func (e *Encoder) strBytes(s []byte) {
	e.valueSep()
	if e.f == FormatJSON {
		e.buf = mpk.AppendJSONStringBytes(e.buf, s)
	} else {
		e.buf = mpk.AppendStringBytes(e.buf, s)
	}
}

func (e *Encoder) uint(v uint64) {
	e.valueSep()
	if e.f == FormatJSON {
		e.buf = strconv.AppendUint(e.buf, v, 10)
	} else {
		e.buf = mpk.AppendUint(e.buf, v)
	}
}

func (e *Encoder) int(v int64) {
	e.valueSep()
	if e.f == FormatJSON {
		e.buf = strconv.AppendInt(e.buf, v, 10)
	} else {
		e.buf = mpk.AppendInt(e.buf, v)
	}
}

func (e *Encoder) bool(v bool) {
	e.valueSep()
	if e.f == FormatJSON {
		e.buf = strconv.AppendBool(e.buf, v)
	} else {
		e.buf = mpk.AppendBool(e.buf, v)
	}
}

func (e *Encoder) null() {
	e.valueSep()
	if e.f == FormatJSON {
		e.buf = append(e.buf, "null"...)
	} else {
		e.buf = mpk.AppendNil(e.buf)
	}
}

// time writes a time: RFC 3339 with nanoseconds in JSON, the timestamp extension in MessagePack.
func (e *Encoder) time(ns int64) {
	e.valueSep()
	t := time.Unix(0, ns).UTC()
	if e.f == FormatJSON {
		e.buf = append(e.buf, '"')
		e.buf = t.AppendFormat(e.buf, time.RFC3339Nano)
		e.buf = append(e.buf, '"')
	} else {
		e.buf = mpk.AppendTime(e.buf, t)
	}
}

// bin writes bytes: base64 in JSON, bin in MessagePack.
func (e *Encoder) bin(b []byte) {
	e.valueSep()
	if e.f == FormatJSON {
		e.buf = append(e.buf, '"')
		e.buf = base64.StdEncoding.AppendEncode(e.buf, b)
		e.buf = append(e.buf, '"')
	} else {
		e.buf = mpk.AppendBin(e.buf, b)
	}
}

// msgpack writes one stored MessagePack object: as is into MessagePack, transcoded into JSON. It
// reports false, having written nothing, when the object cannot be rendered.
func (e *Encoder) msgpack(v []byte) bool {
	if e.f == FormatJSON {
		mark := len(e.buf)
		firstSave := e.first[len(e.first)-1]
		e.valueSep()
		out, _, err := mpk.AppendJSON(e.buf, v)
		if err != nil {
			e.buf = e.buf[:mark]
			e.first[len(e.first)-1] = firstSave
			return false
		}
		e.buf = out
		return true
	}
	e.valueSep()
	e.buf = append(e.buf, v...)
	return true
}

// Bytes is the answer written so far.
func (e *Encoder) Bytes() []byte { return e.buf }
