package main

import (
	"encoding/json"
	"errors"
	"fmt"

	"github.com/novox/mesh-provisioner/internal/mpk"
)

func jsonBody(r map[string]any) ([]byte, error) { return json.Marshal(r) }

// countRows reads an answer page as a client paging through it must: it finds its rows, counts them
// and reads next, stepping over each row without building it (a client that decodes rows into its own
// types pays for that on any path, the direct watch's too).
func countRows(data []byte, asJSON bool) (int, string, error) {
	if asJSON {
		return countJSONRows(data)
	}
	// The answer is a map of a few members; its keys are short strings.
	p := 0
	n, err := header(data, &p, 0x80, 0xde)
	if err != nil {
		return 0, "", err
	}
	rows, next := -1, ""
	for i := 0; i < n; i++ {
		k, err := str(data, &p)
		if err != nil {
			return 0, "", err
		}
		switch k {
		case "rows":
			if rows, err = header(data, &p, 0x90, 0xdc); err != nil {
				return 0, "", err
			}
			for j := 0; j < rows; j++ {
				w, err := mpk.Skip(data[p:])
				if err != nil {
					return 0, "", err
				}
				p += w
			}
		case "next":
			if next, err = str(data, &p); err != nil {
				return 0, "", err
			}
		default:
			w, err := mpk.Skip(data[p:])
			if err != nil {
				return 0, "", err
			}
			p += w
		}
	}
	if rows < 0 {
		return 0, "", fmt.Errorf("answer without rows")
	}
	return rows, next, nil
}

// header reads a map or array header at *p: fix is its fix form's first byte (0x80 map, 0x90 array),
// code16 its 16-bit form's (0xde, 0xdc), and the 32-bit form follows that.
func header(b []byte, p *int, fix, code16 byte) (int, error) {
	if *p >= len(b) {
		return 0, errShort
	}
	c := b[*p]
	switch {
	case c >= fix && c <= fix+0x0f:
		*p++
		return int(c - fix), nil
	case c == code16 && *p+3 <= len(b):
		*p += 3
		return int(b[*p-2])<<8 | int(b[*p-1]), nil
	case c == code16+1 && *p+5 <= len(b):
		*p += 5
		return int(b[*p-4])<<24 | int(b[*p-3])<<16 | int(b[*p-2])<<8 | int(b[*p-1]), nil
	}
	return 0, fmt.Errorf("want a map or array at byte %d, have 0x%02x", *p, c)
}

// str reads a string at *p.
func str(b []byte, p *int) (string, error) {
	if *p >= len(b) {
		return "", errShort
	}
	c, n, h := b[*p], 0, 1
	switch {
	case c >= 0xa0 && c <= 0xbf:
		n = int(c - 0xa0)
	case c == 0xd9 && *p+2 <= len(b):
		n, h = int(b[*p+1]), 2
	case c == 0xda && *p+3 <= len(b):
		n, h = int(b[*p+1])<<8|int(b[*p+2]), 3
	default:
		return "", fmt.Errorf("want a string at byte %d, have 0x%02x", *p, c)
	}
	if *p+h+n > len(b) {
		return "", errShort
	}
	s := string(b[*p+h : *p+h+n])
	*p += h + n
	return s, nil
}

var errShort = errors.New("answer ends early")

// countJSONRows is countRows for a JSON page: the answer is an object whose members are scanned by
// nesting depth, strings stepped over with their escapes.
func countJSONRows(b []byte) (int, string, error) {
	rows, next := -1, ""
	depth := 0
	var key string    // the last string read at depth 1 (a member name, or a value)
	var member string // the member whose value is being read at depth 1
	for p := 0; p < len(b); p++ {
		switch c := b[p]; c {
		case '"':
			q := p + 1
			for ; q < len(b) && b[q] != '"'; q++ {
				if b[q] == '\\' {
					q++
				}
			}
			if q >= len(b) {
				return 0, "", errShort
			}
			if depth == 1 {
				var s string
				if err := json.Unmarshal(b[p:q+1], &s); err != nil {
					return 0, "", err
				}
				if member == "next" {
					next, member = s, ""
				} else {
					key = s
				}
			}
			p = q
		case ':':
			if depth == 1 {
				member = key
			}
		case ',':
			if depth == 1 {
				member = ""
			}
		case '{', '[':
			depth++
			if depth == 2 && member == "rows" {
				rows = 0
			}
			if depth == 3 && member == "rows" {
				rows++
			}
		case '}', ']':
			depth--
			if depth == 0 {
				if rows < 0 {
					return 0, "", fmt.Errorf("answer without rows")
				}
				return rows, next, nil
			}
		}
	}
	return 0, "", errShort
}
