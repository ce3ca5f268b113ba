package provisioner

import (
	"errors"
	"strings"
	"unicode/utf8"
)

// ErrBadEscape is returned by DecodeCollection for a token that holds '=' not followed by two hex digits,
// or that decodes to bytes that are not valid UTF-8.
var ErrBadEscape = errors.New("provisioner: bad escape")

const hexUpper = "0123456789ABCDEF"

// tokenByte reports whether c may stand in a key's token.
func tokenByte(c byte) bool {
	return 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '_' || c == '/' || c == '='
}

// ValidToken reports whether s is a non-empty token of A-Z a-z 0-9 - _ / =.
func ValidToken(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if !tokenByte(s[i]) {
			return false
		}
	}
	return true
}

// EncodeCollection writes a collection's name as a key token: every byte a token cannot hold, and '='
// itself, becomes =XX with two upper-case hex digits (shell:zsh:normal is shell=3Azsh=3Anormal).
// The empty name has no token; EncodeCollection returns "" for it.
func EncodeCollection(name string) string {
	n := 0
	for i := 0; i < len(name); i++ {
		if c := name[i]; c == '=' || !tokenByte(c) {
			n++
		}
	}
	if n == 0 {
		return name
	}
	b := make([]byte, 0, len(name)+2*n)
	for i := 0; i < len(name); i++ {
		c := name[i]
		if c == '=' || !tokenByte(c) {
			b = append(b, '=', hexUpper[c>>4], hexUpper[c&0xf])
			continue
		}
		b = append(b, c)
	}
	return string(b)
}

// DecodeCollection reads a collection token back into its name: every =XX, XX two hex digits of either
// case, becomes the byte XX. A '=' not followed by two hex digits, or a name that is not valid UTF-8, is
// ErrBadEscape. A token without '=' is returned as is, without allocating.
func DecodeCollection(tok string) (string, error) {
	i := strings.IndexByte(tok, '=')
	if i < 0 {
		if !utf8.ValidString(tok) {
			return "", ErrBadEscape
		}
		return tok, nil
	}
	b := make([]byte, 0, len(tok))
	b = append(b, tok[:i]...)
	for ; i < len(tok); i++ {
		c := tok[i]
		if c != '=' {
			b = append(b, c)
			continue
		}
		if i+2 >= len(tok) {
			return "", ErrBadEscape
		}
		hi, ok1 := unhex(tok[i+1])
		lo, ok2 := unhex(tok[i+2])
		if !ok1 || !ok2 {
			return "", ErrBadEscape
		}
		b = append(b, hi<<4|lo)
		i += 2
	}
	if !utf8.Valid(b) {
		return "", ErrBadEscape
	}
	return string(b), nil
}

func unhex(c byte) (byte, bool) {
	switch {
	case '0' <= c && c <= '9':
		return c - '0', true
	case 'a' <= c && c <= 'f':
		return c - 'a' + 10, true
	case 'A' <= c && c <= 'F':
		return c - 'A' + 10, true
	}
	return 0, false
}
