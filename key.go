package provisioner

import (
	"fmt"
	"math"
	"strconv"
	"strings"
	"unicode/utf8"
)

// Parts are the named tokens of a key that fits its bucket's shape. Strings other than Collection are
// substrings of the raw key, but for composed-<node> keys, whose Node is the bucket's; Collection is the
// decoded name and CollectionKey its raw token.
type Parts struct {
	Node          string
	Module        string
	Kind          string
	Name          string
	Collection    string
	CollectionKey string
	Contributor   string
	Build         uint64 // composed-<node> keys: the build as a number
	BuildToken    string // composed-<node> keys: the build as written
}

// ParseKey reads a raw key by its bucket's shape. A key out of shape returns a *KeyError that names
// the anomaly reason: token-count first, then bad-token, then bad-escape (collect) or bad-build
// (composed-<node>).
func ParseKey(s Shape, key string) (Parts, error) {
	var toks [4]string
	n := len(s.Tokens)
	have := strings.Count(key, ".") + 1
	if have != n {
		return Parts{}, &KeyError{Reason: ReasonTokenCount, Detail: fmt.Sprintf("want %d %s, have %d", n, s, have)}
	}
	rest := key
	for i := 0; i < n; i++ {
		tok := rest
		if i < n-1 {
			j := strings.IndexByte(rest, '.')
			tok, rest = rest[:j], rest[j+1:]
		}
		if !ValidToken(tok) {
			return Parts{}, &KeyError{Reason: ReasonBadToken, Detail: fmt.Sprintf("<%s> token %q is not made of A-Z a-z 0-9 - _ / =", s.Tokens[i], tok)}
		}
		toks[i] = tok
	}
	return partsOf(s, toks)
}

// partsOf names the tokens of a key split by its shape, and reads the collection and the build.
func partsOf(s Shape, toks [4]string) (Parts, error) {
	var p Parts
	switch s.What {
	case WhatRegistry:
		p.Kind = toks[0]
	case WhatNeeds:
		p.Node, p.Module, p.Kind, p.Name = toks[0], toks[1], toks[2], toks[3]
	case WhatApplied:
		p.Node, p.Module = toks[0], toks[1]
	case WhatCollect:
		name, err := DecodeCollection(toks[1])
		if err != nil {
			return Parts{}, &KeyError{Reason: ReasonBadEscape, Detail: fmt.Sprintf("collection %q: want =XX with two hex digits and valid UTF-8", toks[1])}
		}
		p.Node, p.Collection, p.CollectionKey, p.Contributor = toks[0], name, toks[1], toks[2]
	case WhatPlans:
		switch {
		case s.Bucket == BucketHostModules:
			p.Node, p.Module = toks[0], toks[1]
		case s.Bucket == BucketIndexerBuilds:
			p.Module = toks[0]
		default: // composed-<node>
			b, ok := ParseBuild(toks[1])
			if !ok {
				return Parts{}, &KeyError{Reason: ReasonBadBuild, Detail: "build " + notABuild(toks[1])}
			}
			p.Node, _ = ComposedNode(s.Bucket)
			p.Module, p.Build, p.BuildToken = toks[0], b, toks[1]
		}
	}
	return p, nil
}

// ParseBuild reads a build: a decimal number written as a token (1042), at most MaxBuild.
func ParseBuild(s string) (uint64, bool) {
	if s == "" {
		return 0, false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return 0, false
		}
	}
	b, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		return 0, false
	}
	return b, true
}

// MaxBuild is the largest build the seat reads: answers carry builds as integers, and MessagePack has
// none larger. A longer decimal number is out of shape, and said so.
const MaxBuild = math.MaxUint64

// notABuild says why ParseBuild refused s.
func notABuild(s string) string {
	if s != "" && strings.Trim(s, "0123456789") == "" {
		return fmt.Sprintf("%q is a decimal number beyond %d, the largest build an answer can carry", s, uint64(MaxBuild))
	}
	return fmt.Sprintf("%q is not a decimal number", s)
}

// FirstToken is a raw key's first token (all of it when it has no '.'): the node an anomaly row is
// narrowed by, since an out-of-shape key may lack its other parts.
func FirstToken(key string) string {
	if i := strings.IndexByte(key, '.'); i >= 0 {
		return key[:i]
	}
	return key
}

// PartsOfStored reads the parts of a key the store holds a row for: a key that already fit its shape
// when it was applied, so its tokens are split without being checked again. It is the read path's
// ParseKey; a key that does not split into the shape's tokens reports false.
func PartsOfStored(s Shape, key string) (Parts, bool) {
	var r StoredParts
	var p Parts
	ok := r.Read(s, key, &p)
	return p, ok
}

// StoredParts reads the parts of the stored keys of one answer, as PartsOfStored does, into a Parts of
// the caller's, without allocating: the rows of an answer mostly share their collection token (a
// collection lookup reads one collection), so the last one decoded is remembered.
type StoredParts struct {
	tok, name string
}

// Read sets *p to the parts of key, and reports whether the key split into the shape's tokens.
func (r *StoredParts) Read(s Shape, key string, p *Parts) bool {
	var toks [4]string
	n := len(s.Tokens)
	rest := key
	for i := 0; i < n-1; i++ {
		j := strings.IndexByte(rest, '.')
		if j < 0 {
			return false
		}
		toks[i], rest = rest[:j], rest[j+1:]
	}
	if strings.IndexByte(rest, '.') >= 0 {
		return false
	}
	toks[n-1] = rest
	switch s.What {
	case WhatNeeds:
		*p = Parts{Node: toks[0], Module: toks[1], Kind: toks[2], Name: toks[3]}
		return true
	case WhatApplied:
		*p = Parts{Node: toks[0], Module: toks[1]}
		return true
	case WhatCollect:
		name := toks[1]
		if strings.IndexByte(name, '=') >= 0 {
			// Decoding allocates: keep the name, with a copy of its token (the key's memory is the caller's).
			if name != r.tok {
				dec, err := DecodeCollection(name)
				if err != nil {
					return false
				}
				r.tok, r.name = strings.Clone(name), dec
			}
			name = r.name
		} else if !utf8.ValidString(name) {
			return false
		}
		*p = Parts{Node: toks[0], Collection: name, CollectionKey: toks[1], Contributor: toks[2]}
		return true
	}
	q, err := partsOf(s, toks)
	*p = q
	return err == nil
}
