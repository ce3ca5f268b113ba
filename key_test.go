package provisioner

import (
	"errors"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"
	"unsafe"

	"github.com/stretchr/testify/require"
)

// composedShape is the shape of the bucket composed-n1.
func composedShape(t testing.TB) Shape {
	t.Helper()
	s, ok := ShapeOf("composed-n1")
	require.True(t, ok)
	return s
}

// fuzzShapes are the shapes FuzzParseKey picks from by index.
func fuzzShapes(t testing.TB) []Shape {
	return []Shape{ShapeRegistry, ShapeNeeds, ShapeApplied, ShapeCollect, ShapeHostModules, ShapeIndexerBuilds, composedShape(t)}
}

func TestParseKey(t *testing.T) {
	composed := composedShape(t)
	tests := []struct {
		name  string
		shape Shape
		key   string
		want  Parts
	}{
		{name: "registry", shape: ShapeRegistry, key: "config", want: Parts{Kind: "config"}},
		{name: "registry all token bytes", shape: ShapeRegistry, key: "a-Z_0/=", want: Parts{Kind: "a-Z_0/="}},

		{name: "needs", shape: ShapeNeeds, key: "n1.mesh-web.config.db-url",
			want: Parts{Node: "n1", Module: "mesh-web", Kind: "config", Name: "db-url"}},
		{name: "needs token bytes", shape: ShapeNeeds, key: "N_1.m/x.secret.a=b/C-9",
			want: Parts{Node: "N_1", Module: "m/x", Kind: "secret", Name: "a=b/C-9"}},

		{name: "applied", shape: ShapeApplied, key: "n1.mesh-vault", want: Parts{Node: "n1", Module: "mesh-vault"}},

		{name: "collect", shape: ShapeCollect, key: "n1.shell=3Azsh=3Anormal.mesh-shell",
			want: Parts{Node: "n1", Collection: "shell:zsh:normal", CollectionKey: "shell=3Azsh=3Anormal", Contributor: "mesh-shell"}},
		{name: "collect equals", shape: ShapeCollect, key: "n1.a=3Db.m",
			want: Parts{Node: "n1", Collection: "a=b", CollectionKey: "a=3Db", Contributor: "m"}},
		{name: "collect rune", shape: ShapeCollect, key: "n1.=C3=A9t=C3=A9.m",
			want: Parts{Node: "n1", Collection: "été", CollectionKey: "=C3=A9t=C3=A9", Contributor: "m"}},
		{name: "collect lower case hex", shape: ShapeCollect, key: "n1.a=3ab.m",
			want: Parts{Node: "n1", Collection: "a:b", CollectionKey: "a=3ab", Contributor: "m"}},
		{name: "collect unescaped", shape: ShapeCollect, key: "n1.environment.mesh-env",
			want: Parts{Node: "n1", Collection: "environment", CollectionKey: "environment", Contributor: "mesh-env"}},

		{name: "host modules", shape: ShapeHostModules, key: "n1.mesh-web", want: Parts{Node: "n1", Module: "mesh-web"}},
		{name: "indexer builds", shape: ShapeIndexerBuilds, key: "mesh-web", want: Parts{Module: "mesh-web"}},

		{name: "composed", shape: composed, key: "mesh-web.1042",
			want: Parts{Node: "n1", Module: "mesh-web", Build: 1042, BuildToken: "1042"}},
		{name: "composed leading zeros", shape: composed, key: "mod.0042",
			want: Parts{Node: "n1", Module: "mod", Build: 42, BuildToken: "0042"}},
		{name: "composed zero", shape: composed, key: "mod.0",
			want: Parts{Node: "n1", Module: "mod", Build: 0, BuildToken: "0"}},
		{name: "composed max build", shape: composed, key: "mod.18446744073709551615",
			want: Parts{Node: "n1", Module: "mod", Build: 18446744073709551615, BuildToken: "18446744073709551615"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseKey(tc.shape, tc.key)
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}

func TestParseKey_OutOfShape(t *testing.T) {
	composed := composedShape(t)
	tests := []struct {
		name   string
		shape  Shape
		key    string
		reason Reason
		detail string // the whole detail when set
		inText string // a part of the detail when set
	}{
		// Token count comes first.
		{name: "needs three", shape: ShapeNeeds, key: "n1.mod.config", reason: ReasonTokenCount,
			detail: "want 4 <node>.<module>.<kind>.<name>, have 3"},
		{name: "needs five", shape: ShapeNeeds, key: "n1.mod.config.a.b", reason: ReasonTokenCount,
			detail: "want 4 <node>.<module>.<kind>.<name>, have 5"},
		{name: "needs empty key", shape: ShapeNeeds, key: "", reason: ReasonTokenCount,
			detail: "want 4 <node>.<module>.<kind>.<name>, have 1"},
		{name: "needs count before bad token", shape: ShapeNeeds, key: "n 1.x", reason: ReasonTokenCount,
			detail: "want 4 <node>.<module>.<kind>.<name>, have 2"},
		{name: "registry two", shape: ShapeRegistry, key: "config.x", reason: ReasonTokenCount,
			detail: "want 1 <kind>, have 2"},
		{name: "registry only dot", shape: ShapeRegistry, key: ".", reason: ReasonTokenCount,
			detail: "want 1 <kind>, have 2"},
		{name: "applied one", shape: ShapeApplied, key: "n1", reason: ReasonTokenCount,
			detail: "want 2 <node>.<module>, have 1"},
		{name: "applied three", shape: ShapeApplied, key: "n1.m.x", reason: ReasonTokenCount,
			detail: "want 2 <node>.<module>, have 3"},
		{name: "collect two", shape: ShapeCollect, key: "n1.shell", reason: ReasonTokenCount,
			detail: "want 3 <node>.<collection>.<contributor>, have 2"},
		{name: "collect unescaped dot", shape: ShapeCollect, key: "n1.a.b.m", reason: ReasonTokenCount,
			detail: "want 3 <node>.<collection>.<contributor>, have 4"},
		{name: "collect count before escape", shape: ShapeCollect, key: "n1.=ZZ", reason: ReasonTokenCount,
			detail: "want 3 <node>.<collection>.<contributor>, have 2"},
		{name: "host modules one", shape: ShapeHostModules, key: "n1", reason: ReasonTokenCount,
			detail: "want 2 <node>.<module>, have 1"},
		{name: "indexer builds two", shape: ShapeIndexerBuilds, key: "mod.1", reason: ReasonTokenCount,
			detail: "want 1 <module>, have 2"},
		{name: "composed one", shape: composed, key: "mod", reason: ReasonTokenCount,
			detail: "want 2 <module>.<build>, have 1"},
		{name: "composed three", shape: composed, key: "mod.1.2", reason: ReasonTokenCount,
			detail: "want 2 <module>.<build>, have 3"},
		{name: "composed count before build", shape: composed, key: "mod.x.y", reason: ReasonTokenCount,
			detail: "want 2 <module>.<build>, have 3"},

		// Then empty tokens and bytes outside A-Z a-z 0-9 - _ / =.
		{name: "needs empty middle", shape: ShapeNeeds, key: "n1..x.y", reason: ReasonBadToken, inText: "<module>"},
		{name: "needs leading dot", shape: ShapeNeeds, key: ".n1.x.y", reason: ReasonBadToken, inText: "<node>"},
		{name: "needs trailing dot", shape: ShapeNeeds, key: "n1.x.y.", reason: ReasonBadToken, inText: "<name>"},
		{name: "needs only dots", shape: ShapeNeeds, key: "...", reason: ReasonBadToken, inText: "<node>"},
		{name: "registry empty key", shape: ShapeRegistry, key: "", reason: ReasonBadToken, inText: "<kind>"},
		{name: "registry star", shape: ShapeRegistry, key: "*", reason: ReasonBadToken, inText: `"*"`},
		{name: "registry gt", shape: ShapeRegistry, key: ">", reason: ReasonBadToken},
		{name: "applied space", shape: ShapeApplied, key: "n 1.m", reason: ReasonBadToken, inText: `<node> token "n 1"`},
		{name: "applied star", shape: ShapeApplied, key: "n*.m", reason: ReasonBadToken, inText: `"n*"`},
		{name: "applied non ascii", shape: ShapeApplied, key: "é.m", reason: ReasonBadToken, inText: "<node>"},
		{name: "applied non ascii module", shape: ShapeApplied, key: "n1.é", reason: ReasonBadToken, inText: "<module>"},
		{name: "applied nul", shape: ShapeApplied, key: "n1.m\x00", reason: ReasonBadToken},
		{name: "applied tab", shape: ShapeApplied, key: "n1\t.m", reason: ReasonBadToken},
		{name: "applied colon", shape: ShapeApplied, key: "n1.m:x", reason: ReasonBadToken},
		{name: "needs non ascii name", shape: ShapeNeeds, key: "n1.m.k.é", reason: ReasonBadToken, inText: "<name>"},
		{name: "collect unescaped colon", shape: ShapeCollect, key: "n1.shell:zsh.m", reason: ReasonBadToken, inText: "<collection>"},
		{name: "collect raw utf8", shape: ShapeCollect, key: "n1.été.m", reason: ReasonBadToken, inText: "<collection>"},
		{name: "collect bad token before escape", shape: ShapeCollect, key: "n 1.=ZZ.m", reason: ReasonBadToken, inText: "<node>"},
		{name: "collect bad contributor before escape", shape: ShapeCollect, key: "n1.=ZZ.m*", reason: ReasonBadToken, inText: "<contributor>"},
		{name: "collect empty collection", shape: ShapeCollect, key: "n1..m", reason: ReasonBadToken, inText: "<collection>"},
		{name: "host modules space", shape: ShapeHostModules, key: "n1.m x", reason: ReasonBadToken},
		{name: "indexer builds empty", shape: ShapeIndexerBuilds, key: "", reason: ReasonBadToken, inText: "<module>"},
		{name: "composed empty build", shape: composed, key: "mod.", reason: ReasonBadToken, inText: "<build>"},
		{name: "composed space in build", shape: composed, key: "mod.1 2", reason: ReasonBadToken, inText: "<build>"},
		{name: "composed bad module before build", shape: composed, key: "m*.12a", reason: ReasonBadToken, inText: "<module>"},

		// Then the collection's escape.
		{name: "collect non hex", shape: ShapeCollect, key: "n1.=ZZ.m", reason: ReasonBadEscape, inText: `"=ZZ"`},
		{name: "collect equals at end", shape: ShapeCollect, key: "n1.a=.m", reason: ReasonBadEscape, inText: `"a="`},
		{name: "collect one digit at end", shape: ShapeCollect, key: "n1.a=4.m", reason: ReasonBadEscape},
		{name: "collect hex then non hex", shape: ShapeCollect, key: "n1.=3G.m", reason: ReasonBadEscape},
		{name: "collect invalid utf8", shape: ShapeCollect, key: "n1.=FF.m", reason: ReasonBadEscape},
		{name: "collect lead byte alone", shape: ShapeCollect, key: "n1.=C3.m", reason: ReasonBadEscape},

		// Then the composition's build.
		{name: "composed build with letter", shape: composed, key: "mod.12a", reason: ReasonBadBuild, inText: `"12a"`},
		{name: "composed negative build", shape: composed, key: "mod.-1", reason: ReasonBadBuild, inText: `"-1"`},
		{name: "composed hex build", shape: composed, key: "mod.0x1F", reason: ReasonBadBuild},
		{name: "composed escaped build", shape: composed, key: "mod.=31", reason: ReasonBadBuild},
		{name: "composed build overflow", shape: composed, key: "mod.18446744073709551616", reason: ReasonBadBuild,
			inText: `"18446744073709551616" is a decimal number beyond 18446744073709551615`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseKey(tc.shape, tc.key)
			require.Error(t, err)
			require.Equal(t, Parts{}, got)

			var ke *KeyError
			require.True(t, errors.As(err, &ke), "error %T is not a *KeyError", err)
			require.Equal(t, tc.reason, ke.Reason, "detail: %s", ke.Detail)
			require.NotEmpty(t, ke.Detail)
			if tc.detail != "" {
				require.Equal(t, tc.detail, ke.Detail)
			}
			if tc.inText != "" {
				require.Contains(t, ke.Detail, tc.inText)
			}
			require.Equal(t, "key out of shape: "+string(ke.Reason)+": "+ke.Detail, err.Error())
		})
	}
}

// TestParseKey_AnomalyText checks the reason text of CONTRACT section 2 as an anomaly row answers it.
func TestParseKey_AnomalyText(t *testing.T) {
	_, err := ParseKey(ShapeNeeds, "n1.mod.config")
	var ke *KeyError
	require.ErrorAs(t, err, &ke)
	a := Anomaly{Bucket: BucketNeeds, Key: "n1.mod.config", Revision: 7, Reason: ke.Reason, Detail: ke.Detail}
	require.Equal(t, "token-count: want 4 <node>.<module>.<kind>.<name>, have 3", a.Text())

	a.Detail = ""
	require.Equal(t, "token-count", a.Text())
}

func TestParseBuild(t *testing.T) {
	tests := []struct {
		in   string
		want uint64
		ok   bool
	}{
		{in: "1042", want: 1042, ok: true},
		{in: "0042", want: 42, ok: true},
		{in: "0", want: 0, ok: true},
		{in: "18446744073709551615", want: 18446744073709551615, ok: true},
		{in: "18446744073709551616"},
		{in: ""},
		{in: "-1"},
		{in: "+1"},
		{in: "12a"},
		{in: "1_000"},
		{in: " 1"},
		{in: "٣"}, // an Arabic-Indic digit is not decimal here
	}
	for _, tc := range tests {
		t.Run(tc.in, func(t *testing.T) {
			got, ok := ParseBuild(tc.in)
			require.Equal(t, tc.ok, ok)
			if ok {
				require.Equal(t, tc.want, got)
			}
		})
	}
}

func TestFirstToken(t *testing.T) {
	tests := []struct {
		name string
		key  string
		want string
	}{
		{name: "needs key", key: "n1.mod.config.db", want: "n1"},
		{name: "one token", key: "n1", want: "n1"},
		{name: "empty", key: "", want: ""},
		{name: "leading dot", key: ".n1.x", want: ""},
		{name: "trailing dot", key: "n1.", want: "n1"},
		{name: "empty second", key: "n1..x", want: "n1"},
		{name: "out of shape token", key: "n 1.x", want: "n 1"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, FirstToken(tc.key))
		})
	}
}

func TestShapeOf(t *testing.T) {
	tests := []struct {
		bucket string
		want   Shape
		ok     bool
		str    string
	}{
		{bucket: "mesh-provisioner_registry", want: ShapeRegistry, ok: true, str: "<kind>"},
		{bucket: "mesh-provisioner_needs", want: ShapeNeeds, ok: true, str: "<node>.<module>.<kind>.<name>"},
		{bucket: "mesh-provisioner_applied", want: ShapeApplied, ok: true, str: "<node>.<module>"},
		{bucket: "mesh-provisioner_collect", want: ShapeCollect, ok: true, str: "<node>.<collection>.<contributor>"},
		{bucket: "mesh-host_modules", want: ShapeHostModules, ok: true, str: "<node>.<module>"},
		{bucket: "mesh-indexer_builds", want: ShapeIndexerBuilds, ok: true, str: "<module>"},
		{bucket: "composed-n1", ok: true, str: "<module>.<build>",
			want: Shape{Bucket: "composed-n1", What: WhatPlans, Tokens: []string{"module", "build"}, Escaped: -1}},
		{bucket: "composed-node_2/a=b", ok: true, str: "<module>.<build>",
			want: Shape{Bucket: "composed-node_2/a=b", What: WhatPlans, Tokens: []string{"module", "build"}, Escaped: -1}},
		{bucket: "composed-"},
		{bucket: "composed"},
		{bucket: "composed-n 1"},
		{bucket: "composed-n.1"},
		{bucket: "composed-*"},
		{bucket: "Composed-n1"},
		{bucket: "mesh-provisioner_other"},
		{bucket: "KV_mesh-provisioner_needs"},
		{bucket: "mesh-config_values"},
		{bucket: ""},
	}
	for _, tc := range tests {
		t.Run(tc.bucket, func(t *testing.T) {
			got, ok := ShapeOf(tc.bucket)
			require.Equal(t, tc.ok, ok)
			require.Equal(t, tc.want, got)
			if tc.ok {
				require.Equal(t, tc.str, got.String())
			}
		})
	}

	// Asking for a composed bucket leaves the shared shape alone.
	require.Equal(t, ComposedPrefix, ShapeComposed.Bucket)

	// The collection is the only escaped token.
	require.Equal(t, 1, ShapeCollect.Escaped)
	require.Equal(t, "collection", ShapeCollect.Tokens[ShapeCollect.Escaped])
}

func TestComposedNode(t *testing.T) {
	node, ok := ComposedNode("composed-n1")
	require.True(t, ok)
	require.Equal(t, "n1", node)

	_, ok = ComposedNode("composed-")
	require.False(t, ok)
	_, ok = ComposedNode("mesh-host_modules")
	require.False(t, ok)
}

func FuzzParseKey(f *testing.F) {
	shapes := fuzzShapes(f)
	for _, k := range []string{
		"config", "n1.mod.config.db", "n1.mod", "n1.shell=3Azsh=3Anormal.m", "n1.=C3=A9.m", "n1.=ZZ.m",
		"n1.=FF.m", "n1.a=.m", "mod.1042", "mod.0042", "mod.12a", "mod.-1", "n1..x.y", ".n1", "n1.", "", "n 1.m",
		"é.m", "mod.18446744073709551616",
	} {
		for i := range shapes {
			f.Add(uint8(i), k)
		}
	}
	f.Fuzz(func(t *testing.T, idx uint8, key string) {
		s := shapes[int(idx)%len(shapes)]
		p, err := ParseKey(s, key)
		if err != nil {
			require.Equal(t, Parts{}, p)
			var ke *KeyError
			require.True(t, errors.As(err, &ke), "error %T is not a *KeyError", err)
			switch ke.Reason {
			case ReasonTokenCount:
				require.NotEqual(t, len(s.Tokens), strings.Count(key, ".")+1)
			case ReasonBadToken:
				require.Equal(t, len(s.Tokens), strings.Count(key, ".")+1)
			case ReasonBadEscape:
				require.Equal(t, WhatCollect, s.What)
			case ReasonBadBuild:
				require.True(t, strings.HasPrefix(s.Bucket, ComposedPrefix))
			default:
				t.Fatalf("ParseKey(%s, %q): reason %q is none of the key reasons", s.Bucket, key, ke.Reason)
			}
			return
		}

		toks := strings.Split(key, ".")
		require.Len(t, toks, len(s.Tokens))
		for _, tok := range toks {
			require.True(t, ValidToken(tok), "token %q of %q", tok, key)
		}

		composedNode, composed := ComposedNode(s.Bucket)
		// Every string part but Collection is a substring of the raw key, except a composition's Node,
		// which is its bucket's.
		for _, field := range []struct{ name, v string }{
			{"Node", p.Node}, {"Module", p.Module}, {"Kind", p.Kind}, {"Name", p.Name},
			{"CollectionKey", p.CollectionKey}, {"Contributor", p.Contributor}, {"BuildToken", p.BuildToken},
		} {
			if composed && field.name == "Node" {
				require.Equal(t, composedNode, field.v)
				continue
			}
			require.True(t, strings.Contains(key, field.v), "%s %q is not in key %q", field.name, field.v, key)
		}

		// The parts are the key's tokens, in the shape's order.
		var rebuilt []string
		switch {
		case s.What == WhatRegistry:
			rebuilt = []string{p.Kind}
		case s.What == WhatNeeds:
			rebuilt = []string{p.Node, p.Module, p.Kind, p.Name}
		case s.What == WhatApplied, s.Bucket == BucketHostModules:
			rebuilt = []string{p.Node, p.Module}
		case s.What == WhatCollect:
			rebuilt = []string{p.Node, p.CollectionKey, p.Contributor}
			require.True(t, utf8.ValidString(p.Collection))
			back, err := DecodeCollection(EncodeCollection(p.Collection))
			require.NoError(t, err)
			require.Equal(t, p.Collection, back)
		case s.Bucket == BucketIndexerBuilds:
			rebuilt = []string{p.Module}
		case composed:
			rebuilt = []string{p.Module, p.BuildToken}
			trimmed := strings.TrimLeft(p.BuildToken, "0")
			if trimmed == "" {
				trimmed = "0"
			}
			require.Equal(t, trimmed, strconv.FormatUint(p.Build, 10))
		default:
			t.Fatalf("no shape for %s", s.Bucket)
		}
		require.Equal(t, key, strings.Join(rebuilt, "."))
	})
}

func TestPartsOfStored_AgreesWithParseKey(t *testing.T) {
	cases := []struct {
		shape Shape
		key   string
	}{
		{ShapeRegistry, "config"}, {ShapeNeeds, "n1.m.config.a"}, {ShapeApplied, "n1.m"},
		{ShapeCollect, "n1.shell=3Azsh.c"}, {ShapeCollect, "n1.=C3=A9.c"},
	}
	for _, tc := range cases {
		want, err := ParseKey(tc.shape, tc.key)
		require.NoError(t, err)
		got, ok := PartsOfStored(tc.shape, tc.key)
		require.True(t, ok, tc.key)
		require.Equal(t, want, got, tc.key)
	}
	for _, bad := range []string{"n1.m.config", "n1.m.config.a.b"} {
		_, ok := PartsOfStored(ShapeNeeds, bad)
		require.False(t, ok, bad)
	}
}

// TestStoredParts_ReusedAcrossRows reads the keys of one answer with one StoredParts, each from a buffer
// that the next key overwrites (as the store's iterator does): every row's parts are its own.
func TestStoredParts_ReusedAcrossRows(t *testing.T) {
	keys := []struct {
		shape Shape
		key   string
	}{
		{ShapeCollect, "n1.shell=3Azsh.c"}, {ShapeCollect, "n2.shell=3Azsh.c"}, {ShapeCollect, "n2.shell=3Abash.c"},
		{ShapeCollect, "n3.shell=3Azsh.d"}, {ShapeCollect, "n3.plain.d"}, {ShapeCollect, "n4.=C3=A9.c"},
		{ShapeCollect, "n4.=C3=A9.d"}, {ShapeCollect, "n5.aa=41.c"}, {ShapeCollect, "n5.bb=41.c"}, {ShapeNeeds, "n1.m.config.a"}, {ShapeApplied, "n1.m"}, {ShapeRegistry, "config"},
	}
	var r StoredParts
	var buf []byte
	for _, tc := range keys {
		want, err := ParseKey(tc.shape, tc.key)
		require.NoError(t, err)
		for i := range buf {
			buf[i] = 'x' // the previous key's memory is reused
		}
		buf = append(buf[:0], tc.key...)
		var got Parts
		require.True(t, r.Read(tc.shape, unsafe.String(unsafe.SliceData(buf), len(buf)), &got), tc.key)
		require.Equal(t, want, got, tc.key)
	}
	var p Parts
	require.False(t, r.Read(ShapeCollect, "n1.=ZZ.c", &p), "a bad escape")
	require.False(t, r.Read(ShapeCollect, "n1.a.b.c", &p), "too many tokens")
}
