package query

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/mpk"
)

// Limits of a request (CONTRACT section 3).
const (
	DefaultLimit    = 1000
	MaxLimit        = 10000
	MaxWaitMS       = 10000
	MaxAnomalies    = 1000
	maxRequestBytes = 1 << 20
)

// Request is the verb's request: a JSON object, or a MessagePack map with the same fields.
type Request struct {
	What        string `json:"what" msgpack:"what"`
	Node        string `json:"node" msgpack:"node"`
	Module      string `json:"module" msgpack:"module"`
	Contributor string `json:"contributor" msgpack:"contributor"`
	Collection  string `json:"collection" msgpack:"collection"`
	Kind        string `json:"kind" msgpack:"kind"`
	Limit       *int64 `json:"limit" msgpack:"limit"`
	After       string `json:"after" msgpack:"after"`
	MinSeq      int64  `json:"min_seq" msgpack:"min_seq"`
	WaitMS      int64  `json:"wait_ms" msgpack:"wait_ms"`
	At          string `json:"at" msgpack:"at"`
}

// Format is the encoding of a request, and so of its answer.
type Format uint8

const (
	FormatJSON Format = iota
	FormatMsgpack
)

// badRequest is an error the asker made: it answers 400.
type badRequest struct{ msg string }

func (e *badRequest) Error() string { return e.msg }

func badf(format string, args ...any) error { return &badRequest{msg: fmt.Sprintf(format, args...)} }

// DecodeRequest reads a request body: empty is {}, a body starting with '{' (after a UTF-8 byte order
// mark and white space, either optional) is JSON, one starting with a MessagePack map header is
// MessagePack. It returns the format the answer is to be written in (formatOf), also when the request
// is bad.
func DecodeRequest(body []byte) (Request, Format, error) {
	var req Request
	format := formatOf(body)
	if len(body) > maxRequestBytes {
		return req, format, badf("request is %d bytes, at most %d", len(body), maxRequestBytes)
	}
	trimmed := bytes.TrimLeft(bytes.TrimPrefix(body, utf8BOM), " \t\r\n")
	if len(trimmed) == 0 {
		return req, FormatJSON, req.validate()
	}
	switch format {
	case FormatJSON:
		if bytes.HasPrefix(trimmed, utf16LE) || bytes.HasPrefix(trimmed, utf16BE) {
			return req, FormatJSON, badf("request JSON is UTF-16 (it starts with a UTF-16 byte order mark): send it as UTF-8")
		}
		if trimmed[0] != '{' {
			return req, FormatJSON, badf("request is neither a JSON object nor a MessagePack map")
		}
		if err := jsonFields(trimmed); err != nil {
			return req, FormatJSON, err
		}
		dec := json.NewDecoder(bytes.NewReader(trimmed))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&req); err != nil {
			return req, FormatJSON, badf("request JSON: %s", jsonErr(err))
		}
		if _, err := dec.Token(); err != io.EOF {
			return req, FormatJSON, badf("request JSON: data after the object")
		}
		return req, FormatJSON, req.validate()
	default:
		if !msgpackMap(trimmed[0]) {
			// Not JSON (no JSON text starts with this byte): a MessagePack object other than a map. The
			// decoder would read an array into the fields by position; it is refused, in MessagePack.
			return req, FormatMsgpack, badf("request is neither a JSON object nor a MessagePack map")
		}
		if len(trimmed) < len(body) {
			// White space is JSON's: in MessagePack each of those bytes is an integer, an object
			// before the map.
			return req, FormatMsgpack, badf("request MessagePack: data before the map (%d bytes of white space; a MessagePack request starts with its map)", len(body)-len(trimmed))
		}
		if plain, ok := decodePlainMsgpack(trimmed); ok {
			req = plain
			return req, FormatMsgpack, req.validate()
		}
		req, err := decodeMsgpack(trimmed)
		if err != nil {
			return req, FormatMsgpack, err
		}
		return req, FormatMsgpack, req.validate()
	}
}

// decodeMsgpack reads a MessagePack request's fields, checked member by member first (msgpackFields),
// with the MessagePack decoder: what decodePlainMsgpack leaves, every bad request among it.
func decodeMsgpack(b []byte) (Request, error) {
	var req Request
	if err := msgpackFields(b); err != nil {
		return req, err
	}
	rd := bytes.NewReader(b)
	dec := msgpack.NewDecoder(rd)
	dec.DisallowUnknownFields(true)
	if err := dec.Decode(&req); err != nil {
		return req, badf("request MessagePack: %s", err)
	}
	if rd.Len() > 0 {
		return req, badf("request MessagePack: data after the map")
	}
	return req, nil
}

// decodePlainMsgpack reads a MessagePack request whose every member is plain, in one pass without the
// decoder's reflection (which was about 5% of the seat's CPU a node lookup, docs/performance.md,
// Session 18): a map whose names are distinct request fields written as strings, each string field's
// value a UTF-8 str or bin or nil, each integer field's an integer an int64 holds or nil, and nothing
// after the map. It reads the fields as decodeMsgpack would (TestDecodePlainMsgpack_AsTheDecoder, and
// FuzzDecodeRequest compares the two on every body). For anything else it reports false, and the body
// is left to decodeMsgpack, which says what is wrong with it.
func decodePlainMsgpack(b []byte) (Request, bool) {
	var req Request
	if len(b) == 0 {
		return req, false
	}
	p := 0
	var n int
	switch c := b[0]; {
	case c&0xf0 == 0x80:
		n, p = int(c&0x0f), 1
	case c == 0xde && len(b) >= 3:
		n, p = int(binary.BigEndian.Uint16(b[1:])), 3
	case c == 0xdf && len(b) >= 5:
		n, p = int(binary.BigEndian.Uint32(b[1:])), 5
	default:
		return req, false
	}
	var seen uint16
	for i := 0; i < n; i++ {
		name, q, ok := plainStr(b, p, false)
		if !ok {
			return req, false
		}
		p = q
		f, ok := plainField(name)
		if !ok || seen&(1<<f) != 0 {
			return req, false
		}
		seen |= 1 << f
		if f >= fieldLimit { // limit, min_seq, wait_ms
			v, isNil, q, ok := plainInt(b, p)
			if !ok {
				return req, false
			}
			p = q
			switch {
			case f == fieldLimit && !isNil:
				req.Limit = &v
			case f == fieldMinSeq:
				req.MinSeq = v
			case f == fieldWaitMS:
				req.WaitMS = v
			}
			continue
		}
		if p < len(b) && b[p] == 0xc0 {
			p++ // nil: the field left out
			continue
		}
		v, q, ok := plainStr(b, p, true)
		if !ok || !utf8.Valid(v) {
			return req, false
		}
		p = q
		*req.stringField(f) = string(v)
	}
	return req, p == len(b)
}

// The request's fields, as decodePlainMsgpack numbers them: the string fields, then the integer ones.
const (
	fieldWhat = iota
	fieldNode
	fieldModule
	fieldContributor
	fieldCollection
	fieldKind
	fieldAfter
	fieldAt
	fieldLimit
	fieldMinSeq
	fieldWaitMS
)

// plainField is the number of a request field's name, and whether it is one: the request's fields,
// exactly as the contract writes them.
func plainField(name []byte) (int, bool) {
	switch string(name) {
	case "what":
		return fieldWhat, true
	case "node":
		return fieldNode, true
	case "module":
		return fieldModule, true
	case "contributor":
		return fieldContributor, true
	case "collection":
		return fieldCollection, true
	case "kind":
		return fieldKind, true
	case "after":
		return fieldAfter, true
	case "at":
		return fieldAt, true
	case "limit":
		return fieldLimit, true
	case "min_seq":
		return fieldMinSeq, true
	case "wait_ms":
		return fieldWaitMS, true
	}
	return 0, false
}

// stringField is the string field numbered f.
func (r *Request) stringField(f int) *string {
	switch f {
	case fieldWhat:
		return &r.What
	case fieldNode:
		return &r.Node
	case fieldModule:
		return &r.Module
	case fieldContributor:
		return &r.Contributor
	case fieldCollection:
		return &r.Collection
	case fieldKind:
		return &r.Kind
	case fieldAfter:
		return &r.After
	}
	return &r.At
}

// plainStr reads the MessagePack str (or, when bin is set, str or bin) at b[p]: its bytes and the
// offset after it.
func plainStr(b []byte, p int, bin bool) ([]byte, int, bool) {
	if p >= len(b) || !bin && b[p] >= 0xc4 && b[p] <= 0xc6 {
		return nil, 0, false
	}
	n, err := mpk.Skip(b[p:])
	if err != nil {
		return nil, 0, false
	}
	v, ok := msgpackText(b[p : p+n])
	return v, p + n, ok
}

// plainInt reads the MessagePack integer, or nil, at b[p], when an int64 holds it: its value, whether
// it was nil, and the offset after it.
func plainInt(b []byte, p int) (int64, bool, int, bool) {
	if p >= len(b) {
		return 0, false, 0, false
	}
	c := b[p]
	switch {
	case c <= 0x7f || c >= 0xe0:
		return int64(int8(c)), false, p + 1, true // positive and negative fixint
	case c == 0xc0:
		return 0, true, p + 1, true
	}
	var w int
	switch c {
	case 0xcc, 0xd0:
		w = 1
	case 0xcd, 0xd1:
		w = 2
	case 0xce, 0xd2:
		w = 4
	case 0xcf, 0xd3:
		w = 8
	default:
		return 0, false, 0, false
	}
	if len(b)-p-1 < w {
		return 0, false, 0, false
	}
	v, next := b[p+1:p+1+w], p+1+w
	switch c {
	case 0xcc:
		return int64(v[0]), false, next, true
	case 0xcd:
		return int64(binary.BigEndian.Uint16(v)), false, next, true
	case 0xce:
		return int64(binary.BigEndian.Uint32(v)), false, next, true
	case 0xcf:
		u := binary.BigEndian.Uint64(v)
		return int64(u), false, next, u <= math.MaxInt64
	case 0xd0:
		return int64(int8(v[0])), false, next, true
	case 0xd1:
		return int64(int16(binary.BigEndian.Uint16(v))), false, next, true
	case 0xd2:
		return int64(int32(binary.BigEndian.Uint32(v))), false, next, true
	}
	return int64(binary.BigEndian.Uint64(v)), false, next, true
}

// jsonFields checks a JSON request's members before it is decoded, one after the other as
// msgpackFields does, so both formats tell the same first fault: the name (encoding/json matches
// names regardless of case and lets a repeated name win over the first, so {"WHAT":"needs"} or
// {"what":"needs","what":"applied"} would be read, where a MessagePack reader, or a proxy, reads them
// otherwise), then the value's type, its range (an integer no int64 holds) and its encoding (a
// string that is not UTF-8, which encoding/json would read as another). Each is a bad request.
// Malformed JSON is left for the decoder to describe.
func jsonFields(b []byte) error {
	dec := json.NewDecoder(bytes.NewReader(b))
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return nil
	}
	seen := make(map[string]bool, 4)
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return nil
		}
		name, _ := t.(string)
		if err := checkField(name, seen); err != nil {
			return err
		}
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return nil
		}
		if err := jsonType(name, raw); err != nil {
			return err
		}
		if !intFields[name] && len(raw) > 0 && raw[0] == '"' && (!utf8.Valid(raw) || loneSurrogate(raw)) {
			// encoding/json would read each such byte, or escape, as U+FFFD: another string.
			return notUTF8(name)
		}
		if intFields[name] && jsonInteger(raw) {
			if _, err := strconv.ParseInt(string(raw), 10, 64); err != nil {
				return outOfRange(name, string(raw))
			}
		}
	}
	return nil
}

// jsonType checks the type of a member's value by its first byte, member by member as msgpackFields
// does, so that a request with several faults is told the same first one in both formats (decoding
// whole, encoding/json names a wrong type only after this pass has looked at every name). The words
// are encoding/json's. null is the field left out.
func jsonType(name string, raw []byte) error {
	if len(raw) == 0 {
		return nil
	}
	got := "number"
	switch raw[0] {
	case 'n':
		return nil
	case '"':
		got = "string"
	case 't', 'f':
		got = "bool"
	case '{':
		got = "object"
	case '[':
		got = "array"
	}
	switch {
	case intFields[name] && got == "number" && jsonInteger(raw):
		return nil
	case intFields[name] && got == "number":
		return badf("request JSON: field %q wants int64, not number %s", name, raw)
	case intFields[name]:
		return badf("request JSON: field %q wants int64, not %s", name, got)
	case got != "string":
		return badf("request JSON: field %q wants string, not %s", name, got)
	}
	return nil
}

// notUTF8 is the error of a string field whose value is not UTF-8, alike in both formats: such a
// value cannot match anything (keys are tokens, a collection's name is UTF-8), and encoding/json would
// read it as another string than the one sent.
func notUTF8(name string) error { return badf("field %q is not valid UTF-8", name) }

// outOfRange is the error of an integer field whose value no int64 holds, written as validate writes
// one it does hold, so that the number sent is quoted (not the one it would wrap to, or a type) and
// the error is the same in both formats.
func outOfRange(name, n string) error {
	switch {
	case name == "min_seq" && strings.HasPrefix(n, "-"):
		return badf("min_seq %s is negative", n)
	case name == "limit":
		return badf("limit %s is out of range 1..%d", n, MaxLimit)
	case name == "wait_ms":
		return badf("wait_ms %s is out of range 0..%d", n, MaxWaitMS)
	}
	return badf("%s %s is out of range", name, n)
}

// jsonInteger reports whether a JSON value is an integer literal: a number without fraction or
// exponent.
func jsonInteger(raw []byte) bool {
	b := bytes.TrimPrefix(raw, []byte("-"))
	if len(b) == 0 {
		return false
	}
	for _, c := range b {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

// loneSurrogate reports whether a JSON string holds a \u escape of a UTF-16 surrogate that is not
// half of a pair: no Unicode character, and encoding/json reads it as U+FFFD.
func loneSurrogate(raw []byte) bool {
	hex4 := func(i int) (rune, bool) {
		if i+6 > len(raw) || raw[i] != '\\' || raw[i+1] != 'u' {
			return 0, false
		}
		n, err := strconv.ParseUint(string(raw[i+2:i+6]), 16, 32)
		return rune(n), err == nil
	}
	for i := 1; i < len(raw); {
		if raw[i] != '\\' {
			i++
			continue
		}
		r, ok := hex4(i)
		if !ok {
			i += 2 // another escape: \" \\ \/ \b \f \n \r \t
			continue
		}
		switch {
		case r >= 0xdc00 && r <= 0xdfff:
			return true
		case r >= 0xd800 && r <= 0xdbff:
			if lo, ok := hex4(i + 6); !ok || lo < 0xdc00 || lo > 0xdfff {
				return true
			}
			i += 12
		default:
			i += 6
		}
	}
	return false
}

// msgpackFields does for a MessagePack map what jsonFields does for JSON: every key a known field
// name, none twice. Each member's name and value are stepped over with mpk.Skip first, whose depth is
// bounded and which reads no length the body does not hold: one that is cut short or holds a byte no
// object starts with is a bad request here, in member order, before any decoder reads it (the
// decoder allocates up to a MiB for a string that claims 4 GiB in a body of seven bytes). A name of
// another type is left for the decoder to describe.
func msgpackFields(b []byte) error {
	rd := bytes.NewReader(b)
	dec := msgpack.NewDecoder(rd)
	n, err := dec.DecodeMapLen()
	if err != nil {
		return nil
	}
	seen := make(map[string]bool, 4)
	for i := 0; i < n; i++ {
		if _, err := mpk.Skip(b[len(b)-rd.Len():]); err != nil {
			return malformed(err)
		}
		name, err := dec.DecodeString()
		if err != nil {
			return nil
		}
		if err := checkField(name, seen); err != nil {
			return err
		}
		off := len(b) - rd.Len()
		if v, ok := bigUint(b[off:]); ok && intFields[name] {
			// The decoder would wrap it to a negative int64 and the error would name that number.
			return outOfRange(name, strconv.FormatUint(v, 10))
		}
		if off < len(b) {
			if err := msgpackType(name, b[off]); err != nil {
				return err
			}
		}
		m, err := mpk.Skip(b[off:])
		if err != nil {
			return malformed(err)
		}
		if s, ok := msgpackText(b[off : off+m]); ok && !utf8.Valid(s) {
			return notUTF8(name)
		}
		if _, err := rd.Seek(int64(off+m), io.SeekStart); err != nil {
			return nil
		}
	}
	return nil
}

// malformed is the error of a member that mpk.Skip cannot step over.
func malformed(err error) error {
	switch {
	case errors.Is(err, mpk.ErrTruncated):
		return badf("request MessagePack: the body ends inside the map (a member cut short, or a length longer than what follows)")
	case errors.Is(err, mpk.ErrTooDeep):
		return badf("request MessagePack: a member is nested more than %d deep", mpk.MaxDepth)
	}
	return badf("request MessagePack: a member holds a byte no MessagePack object starts with")
}

// msgpackType checks the type of a field's value by its first byte, as encoding/json does for a JSON
// request, so that the error names the field and what it wants ("field "limit" wants int64, not
// float"), not the decoder's byte code. nil is the field left out; a string field also takes bin,
// which the decoder reads as a string.
func msgpackType(name string, c byte) error {
	want := "string"
	ok := c == 0xc0 || c&0xe0 == 0xa0 || (c >= 0xd9 && c <= 0xdb) || (c >= 0xc4 && c <= 0xc6)
	if intFields[name] {
		want = "int64"
		ok = c == 0xc0 || c <= 0x7f || c >= 0xe0 || (c >= 0xcc && c <= 0xcf) || (c >= 0xd0 && c <= 0xd3)
	}
	if ok {
		return nil
	}
	return badf("request MessagePack: field %q wants %s, not %s", name, want, msgpackTypeName(c))
}

// msgpackText returns the bytes of a MessagePack str or bin value (v is the whole value), which the
// decoder reads into a string field.
func msgpackText(v []byte) ([]byte, bool) {
	if len(v) == 0 {
		return nil, false
	}
	switch c := v[0]; {
	case c&0xe0 == 0xa0:
		return v[1:], true
	case c == 0xd9 || c == 0xc4:
		return v[min(2, len(v)):], true
	case c == 0xda || c == 0xc5:
		return v[min(3, len(v)):], true
	case c == 0xdb || c == 0xc6:
		return v[min(5, len(v)):], true
	}
	return nil, false
}

// msgpackTypeName names the type of a MessagePack value by its first byte.
func msgpackTypeName(c byte) string {
	switch {
	case c == 0xc0:
		return "nil"
	case c == 0xc2 || c == 0xc3:
		return "bool"
	case c == 0xca || c == 0xcb:
		return "float"
	case c <= 0x7f || c >= 0xe0 || (c >= 0xcc && c <= 0xcf) || (c >= 0xd0 && c <= 0xd3):
		return "integer"
	case c&0xe0 == 0xa0 || (c >= 0xd9 && c <= 0xdb):
		return "string"
	case c >= 0xc4 && c <= 0xc6:
		return "bin"
	case c&0xf0 == 0x90 || c == 0xdc || c == 0xdd:
		return "array"
	case c&0xf0 == 0x80 || c == 0xde || c == 0xdf:
		return "map"
	case c == 0xc7 || c == 0xc8 || c == 0xc9 || (c >= 0xd4 && c <= 0xd8):
		return "extension"
	}
	return fmt.Sprintf("byte 0x%02x", c)
}

// intFields are the request's integer fields.
var intFields = map[string]bool{"limit": true, "min_seq": true, "wait_ms": true}

// bigUint reads a MessagePack uint 64 above the largest int64, which no integer field can hold.
func bigUint(b []byte) (uint64, bool) {
	if len(b) < 9 || b[0] != 0xcf {
		return 0, false
	}
	v := binary.BigEndian.Uint64(b[1:9])
	return v, v > math.MaxInt64
}

func checkField(name string, seen map[string]bool) error {
	if _, ok := plainField([]byte(name)); !ok {
		return badf("unknown field %q (fields are what, node, module, contributor, collection, kind, limit, after, min_seq, wait_ms, at)", name)
	}
	if seen[name] {
		return badf("field %q is given twice", name)
	}
	seen[name] = true
	return nil
}

// Byte order marks a text editor or a Windows tool may write before a JSON text (RFC 8259 section 8.1
// lets a parser ignore one). None starts a MessagePack map (0xef, 0xfe and 0xff are negative fixints).
var (
	utf8BOM = []byte{0xef, 0xbb, 0xbf}
	utf16LE = []byte{0xff, 0xfe}
	utf16BE = []byte{0xfe, 0xff}
)

// formatOf is the format of a body, so of its answer and its error: after white space, MessagePack
// when the first byte is one no JSON text starts with (0x80-0xff: maps, arrays, strings, nil, ... of
// MessagePack) and no byte order mark starts there, JSON otherwise. A body with a byte order mark is a
// text, JSON: a UTF-8 one first in the body is skipped (DecodeRequest), any other is a bad request
// told in JSON. A MessagePack request that is not a map is bad, and told so in MessagePack.
func formatOf(body []byte) Format {
	b := bytes.TrimLeft(body, " \t\r\n")
	if len(b) > 0 && b[0] >= 0x80 && !byteOrderMark(b) {
		return FormatMsgpack
	}
	return FormatJSON
}

// byteOrderMark reports whether b starts with a UTF-8 or UTF-16 byte order mark.
func byteOrderMark(b []byte) bool {
	return bytes.HasPrefix(b, utf8BOM) || bytes.HasPrefix(b, utf16LE) || bytes.HasPrefix(b, utf16BE)
}

// msgpackMap reports whether c starts a MessagePack map: fixmap, map 16 or map 32.
func msgpackMap(c byte) bool { return c&0xf0 == 0x80 || c == 0xde || c == 0xdf }

func jsonErr(err error) string {
	var te *json.UnmarshalTypeError
	if errors.As(err, &te) {
		return fmt.Sprintf("field %q wants %s, not %s", te.Field, te.Type, te.Value)
	}
	return err.Error()
}

// validate checks the fields against what they may be asked with, and sets the defaults.
func (r *Request) validate() error {
	if r.What == "" {
		r.What = string(provisioner.WhatRegistry)
	}
	w := provisioner.What(r.What)
	switch w {
	case provisioner.WhatRegistry, provisioner.WhatNeeds, provisioner.WhatApplied, provisioner.WhatCollect, provisioner.WhatPlans:
	default:
		return badf("what %q is not one of registry, needs, applied, collect, plans", r.What)
	}
	if r.Node != "" && w == provisioner.WhatRegistry {
		return badf("node narrows needs, applied, collect and plans, not registry")
	}
	if r.Collection != "" && w != provisioner.WhatCollect {
		return badf("collection narrows collect only")
	}
	if r.Contributor != "" {
		if w != provisioner.WhatCollect {
			return badf("contributor narrows collect only")
		}
		if r.Module != "" && r.Module != r.Contributor {
			return badf("module and contributor are the same field for collect, and differ")
		}
		r.Module = r.Contributor
	}
	if r.Kind != "" && w != provisioner.WhatRegistry && w != provisioner.WhatNeeds {
		return badf("kind narrows registry and needs only")
	}
	module := r.Module
	if w == provisioner.WhatRegistry {
		module = "" // the entry's module, read from the value, not a key's token: <provider-module> is one
	}
	for _, f := range []struct{ name, v string }{{"node", r.Node}, {"module", module}, {"kind", r.Kind}} {
		if f.v != "" && !provisioner.ValidToken(f.v) {
			return badf("%s %q is not a key token (A-Z a-z 0-9 - _ / =)", f.name, f.v)
		}
	}
	if r.Limit != nil && (*r.Limit < 1 || *r.Limit > MaxLimit) {
		return badf("limit %d is out of range 1..%d", *r.Limit, MaxLimit)
	}
	if r.MinSeq < 0 {
		return badf("min_seq %d is negative", r.MinSeq)
	}
	if r.WaitMS < 0 || r.WaitMS > MaxWaitMS {
		return badf("wait_ms %d is out of range 0..%d", r.WaitMS, MaxWaitMS)
	}
	return nil
}

// limit is the rows per answer asked for.
func (r *Request) limit() int {
	if r.Limit == nil {
		return DefaultLimit
	}
	return int(*r.Limit)
}

// size is about what a decoded request holds in memory: its strings, and the rest of it.
func (r *Request) size() int {
	return len(r.What) + len(r.Node) + len(r.Module) + len(r.Contributor) + len(r.Collection) + len(r.Kind) +
		len(r.After) + len(r.At) + 256
}
