package provisioner

import (
	"fmt"
	"math/rand"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
)

// decodeCollectionCases are the collection tokens of CONTRACT section 1 and the ways a token can be out
// of shape. They seed FuzzDecodeCollection too.
var decodeCollectionCases = []struct {
	name    string
	tok     string
	want    string
	wantErr bool
}{
	// The contract's own examples.
	{name: "colons", tok: "shell=3Azsh=3Anormal", want: "shell:zsh:normal"},
	{name: "equals", tok: "a=3Db", want: "a=b"},
	{name: "two byte rune", tok: "=C3=A9", want: "é"},

	// Either case of hex is read.
	{name: "lower case hex", tok: "shell=3azsh=3anormal", want: "shell:zsh:normal"},
	{name: "lower case rune", tok: "=c3=a9", want: "é"},
	{name: "mixed case hex", tok: "=c3=A9t=C3=a9", want: "été"},

	// Other escapes.
	{name: "space", tok: "a=20b", want: "a b"},
	{name: "dot", tok: "a=2Eb", want: "a.b"},
	{name: "only escapes", tok: "=3D=3D", want: "=="},
	{name: "escape at end", tok: "ab=3A", want: "ab:"},
	{name: "escaped token byte", tok: "=41", want: "A"},
	{name: "nul byte", tok: "=00", want: "\x00"},
	{name: "three byte rune", tok: "=E6=97=A5", want: "日"},
	{name: "four byte rune", tok: "=F0=9F=99=82", want: "🙂"},
	{name: "raw utf8 kept", tok: "été", want: "été"},

	// Without '=' the token is the name.
	{name: "no escape", tok: "environment", want: "environment"},
	{name: "no escape token bytes", tok: "AZaz09-_/", want: "AZaz09-_/"},
	{name: "empty", tok: "", want: ""},

	// '=' not followed by two hex digits.
	{name: "equals at end", tok: "abc=", wantErr: true},
	{name: "equals alone", tok: "=", wantErr: true},
	{name: "one hex digit at end", tok: "abc=4", wantErr: true},
	{name: "one hex digit alone", tok: "=4", wantErr: true},
	{name: "non hex", tok: "=ZZ", wantErr: true},
	{name: "non hex first", tok: "=G3", wantErr: true},
	{name: "non hex second", tok: "=3G", wantErr: true},
	{name: "hex then dash", tok: "=3-x", wantErr: true},
	{name: "hex then equals", tok: "=3=3A", wantErr: true},
	{name: "hex then dot", tok: "=3.", wantErr: true},
	{name: "good then bad", tok: "=3A=ZZ", wantErr: true},
	{name: "bad after good text", tok: "shell=3Azsh=3", wantErr: true},
	{name: "double equals", tok: "==3A", wantErr: true},

	// Decoded bytes that are not UTF-8.
	{name: "invalid byte", tok: "=FF", wantErr: true},
	{name: "lead byte alone", tok: "=C3", wantErr: true},
	{name: "lead byte then ascii", tok: "=C3a", wantErr: true},
	{name: "continuation alone", tok: "=A9", wantErr: true},
	{name: "truncated three byte", tok: "=E6=97", wantErr: true},
	{name: "overlong", tok: "=C0=AF", wantErr: true},
	{name: "surrogate", tok: "=ED=A0=80", wantErr: true},
	{name: "raw invalid byte", tok: "a\xffb", wantErr: true},
	{name: "raw invalid byte with escape", tok: "a\xff=41", wantErr: true},
}

func TestDecodeCollection(t *testing.T) {
	for _, tc := range decodeCollectionCases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := DecodeCollection(tc.tok)
			if tc.wantErr {
				require.ErrorIs(t, err, ErrBadEscape)
				require.Empty(t, got)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}

func TestDecodeCollection_NoEscapeDoesNotAllocate(t *testing.T) {
	tok := "shell-zsh_normal/x"
	var got string
	allocs := testing.AllocsPerRun(100, func() {
		got, _ = DecodeCollection(tok)
	})
	require.Equal(t, tok, got)
	require.Zero(t, allocs)
}

func TestEncodeCollection(t *testing.T) {
	tests := []struct {
		name string
		in   string
		want string
	}{
		{name: "colons", in: "shell:zsh:normal", want: "shell=3Azsh=3Anormal"},
		{name: "equals", in: "a=b", want: "a=3Db"},
		{name: "two byte rune", in: "é", want: "=C3=A9"},
		{name: "space", in: "a b", want: "a=20b"},
		{name: "dot", in: "a.b", want: "a=2Eb"},
		{name: "colon", in: ":", want: "=3A"},
		{name: "only equals", in: "==", want: "=3D=3D"},
		{name: "nats wildcards", in: "*>", want: "=2A=3E"},
		{name: "tilde and del", in: "~\x7f", want: "=7E=7F"},
		{name: "control bytes", in: "\x00\t\n", want: "=00=09=0A"},
		{name: "three byte rune", in: "日本", want: "=E6=97=A5=E6=9C=AC"},
		{name: "four byte rune", in: "🙂", want: "=F0=9F=99=82"},
		{name: "mixed", in: "été 2.0", want: "=C3=A9t=C3=A9=202=2E0"},
		{name: "token bytes kept", in: "AZaz09-_/", want: "AZaz09-_/"},
		{name: "plain", in: "environment", want: "environment"},
		{name: "empty", in: "", want: ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := EncodeCollection(tc.in)
			require.Equal(t, tc.want, got)

			back, err := DecodeCollection(got)
			require.NoError(t, err)
			require.Equal(t, tc.in, back)
			if tc.in != "" {
				require.True(t, ValidToken(got), "EncodeCollection(%q) = %q is not a token", tc.in, got)
			}
		})
	}
}

// TestEncodeCollection_EveryByte checks each of the 256 bytes alone: A-Z a-z 0-9 - _ / are kept, every
// other byte, '=' included, becomes =XX with upper-case hex.
func TestEncodeCollection_EveryByte(t *testing.T) {
	for c := 0; c < 256; c++ {
		b := byte(c)
		kept := 'a' <= b && b <= 'z' || 'A' <= b && b <= 'Z' || '0' <= b && b <= '9' || b == '-' || b == '_' || b == '/'
		want := fmt.Sprintf("=%02X", b)
		if kept {
			want = string([]byte{b})
		}
		require.Equal(t, want, EncodeCollection(string([]byte{b})), "byte 0x%02X", b)
		inside := EncodeCollection("x" + string([]byte{b}) + "y")
		require.Equal(t, "x"+want+"y", inside, "byte 0x%02X inside a name", b)
	}
}

// randomName returns a name of up to 24 runes drawn from ASCII punctuation, spaces, letters, digits,
// '=' and '.', and multi-byte runes, some of them random valid code points.
func randomName(r *rand.Rand) string {
	const ascii = " !\"#$%&'()*+,-./:;<>?@[\\]^_`{|}~=..==  abcXYZ019"
	fixed := []rune{'é', 'ß', '\u00a0', '日', '本', '€', '🙂', '\u2028', '\ufeff', '\U0010FFFF'}
	n := r.Intn(25)
	var b strings.Builder
	for i := 0; i < n; i++ {
		switch k := r.Intn(10); {
		case k < 6:
			b.WriteByte(ascii[r.Intn(len(ascii))])
		case k < 8:
			b.WriteRune(fixed[r.Intn(len(fixed))])
		case k < 9:
			b.WriteByte(byte(r.Intn(0x80))) // any ASCII byte, control bytes included
		default:
			for {
				c := rune(r.Intn(utf8.MaxRune + 1))
				if utf8.ValidRune(c) {
					b.WriteRune(c)
					break
				}
			}
		}
	}
	return b.String()
}

func TestEncodeCollection_RoundTrip(t *testing.T) {
	r := rand.New(rand.NewSource(57))
	for i := 0; i < 20000; i++ {
		name := randomName(r)
		require.True(t, utf8.ValidString(name))

		tok := EncodeCollection(name)
		if name == "" {
			require.Empty(t, tok)
			continue
		}
		require.True(t, ValidToken(tok), "EncodeCollection(%q) = %q is not a token", name, tok)

		got, err := DecodeCollection(tok)
		require.NoError(t, err, "DecodeCollection(EncodeCollection(%q)) = DecodeCollection(%q)", name, tok)
		require.Equal(t, name, got)

		// The encoded token is canonical: encoding its decoded name writes it again.
		require.Equal(t, tok, EncodeCollection(got))
	}
}

func TestEncodeCollection_CanonicalTokens(t *testing.T) {
	t.Run("canonical", func(t *testing.T) {
		for _, tok := range []string{
			"shell=3Azsh=3Anormal", "a=3Db", "=C3=A9", "environment", "a=20b=2Ec", "=3D", "x/y-z_0",
			"=F0=9F=99=82", "=00",
		} {
			name, err := DecodeCollection(tok)
			require.NoError(t, err, tok)
			require.Equal(t, tok, EncodeCollection(name), "encode(decode(%q))", tok)
		}
	})
	// Tokens that decode but are not how EncodeCollection writes the name: lower-case hex and escaped
	// token bytes. They name the same collection as their canonical token.
	t.Run("not canonical", func(t *testing.T) {
		for tok, canonical := range map[string]string{
			"shell=3azsh=3anormal": "shell=3Azsh=3Anormal",
			"=c3=a9":               "=C3=A9",
			"=41=62":               "Ab",
			"a=2Fb":                "a/b",
		} {
			name, err := DecodeCollection(tok)
			require.NoError(t, err, tok)
			require.Equal(t, canonical, EncodeCollection(name), "encode(decode(%q))", tok)
		}
	})
}

func FuzzDecodeCollection(f *testing.F) {
	for _, tc := range decodeCollectionCases {
		f.Add(tc.tok)
	}
	f.Fuzz(func(t *testing.T, tok string) {
		got, err := DecodeCollection(tok)
		if err != nil {
			require.ErrorIs(t, err, ErrBadEscape)
			require.Empty(t, got)
			return
		}
		if !strings.Contains(tok, "=") {
			require.Equal(t, tok, got, "a token without '=' is its name")
		}
		require.True(t, utf8.ValidString(got), "DecodeCollection(%q) = %q is not UTF-8", tok, got)

		enc := EncodeCollection(got)
		back, err := DecodeCollection(enc)
		require.NoError(t, err, "DecodeCollection(EncodeCollection(%q)) = DecodeCollection(%q)", got, enc)
		require.Equal(t, got, back)
		if got != "" {
			require.True(t, ValidToken(enc), "EncodeCollection(%q) = %q is not a token", got, enc)
		}
	})
}
