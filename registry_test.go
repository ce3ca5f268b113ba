package provisioner

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"sort"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"
)

// contractRegistry is the table of CONTRACT section 4, in kind order.
var contractRegistry = []RegistryEntry{
	{Kind: "access", Module: "mesh-controller", Bucket: "mesh-controller_assignments", KeyShape: "<node>.<module>"},
	{Kind: "bound", Module: "<provider-module>", Bucket: "<provider-module>_bound", KeyShape: "<node>.<module>.<provision>[.<local>]"},
	{Kind: "collected", Module: "mesh-provisioner", Bucket: "mesh-provisioner_collect", KeyShape: "<node>.<collection>.<contributor>"},
	{Kind: "config", Module: "mesh-config", Bucket: "mesh-config_values", KeyShape: "<node>.<module>.<name>"},
	{Kind: "consumers", Module: "mesh-vault", Verb: "mesh-vault.consumers"},
	{Kind: "contribution", Module: "mesh-provisioner", Bucket: "mesh-provisioner_collect", KeyShape: "<node>.<collection>.<contributor>"},
	{Kind: "dir", Module: "mesh-controller", Bucket: "mesh-controller_assignments", KeyShape: "<node>.<module>"},
	{Kind: "environment", Module: "mesh-provisioner", Bucket: "mesh-provisioner_collect", KeyShape: "<node>.<collection>.<contributor>"},
	{Kind: "machine", Module: "mesh-controller", Bucket: "mesh-controller_assignments", KeyShape: "<node>.<module>"},
	{Kind: "port", Module: "mesh-controller", Bucket: "mesh-controller_assignments", KeyShape: "<node>.<module>"},
	{Kind: "seat", Module: "mesh-controller", Bucket: "mesh-controller_assignments", KeyShape: "<node>.<module>"},
	{Kind: "secret", Module: "mesh-vault", Verb: "mesh-vault.secret"},
	{Kind: "shell", Module: "mesh-provisioner", Bucket: "mesh-provisioner_collect", KeyShape: "<node>.<collection>.<contributor>"},
}

func TestRegistry_Table(t *testing.T) {
	require.Equal(t, contractRegistry, Registry.Entries)
}

func TestRegistry_Entries(t *testing.T) {
	t.Run("sorted by kind", func(t *testing.T) {
		require.True(t, sort.SliceIsSorted(Registry.Entries, func(i, j int) bool {
			return Registry.Entries[i].Kind < Registry.Entries[j].Kind
		}))
		for i := 1; i < len(Registry.Entries); i++ {
			require.Less(t, Registry.Entries[i-1].Kind, Registry.Entries[i].Kind, "kinds are unique")
		}
	})

	for _, e := range Registry.Entries {
		t.Run(e.Kind, func(t *testing.T) {
			require.True(t, ValidToken(e.Kind), "a kind is a registry key of one token")
			_, err := ParseKey(ShapeRegistry, e.Kind)
			require.NoError(t, err)
			require.NotEmpty(t, e.Module)
			if e.Verb != "" {
				require.Empty(t, e.Bucket, "an entry with a verb has no bucket")
				require.Empty(t, e.KeyShape, "an entry with a verb has no key shape")
				return
			}
			require.NotEmpty(t, e.Bucket, "an entry has a bucket or a verb")
			require.NotEmpty(t, e.KeyShape, "a bucket comes with its key shape")
		})
	}

	t.Run("secrets are never in a bucket", func(t *testing.T) {
		for _, kind := range []string{"secret", "consumers"} {
			e, ok := Registry.Lookup(kind)
			require.True(t, ok, kind)
			require.Equal(t, "mesh-vault", e.Module)
			require.Equal(t, "mesh-vault."+kind, e.Verb)
			require.Empty(t, e.Bucket)
			require.Empty(t, e.KeyShape)
		}
	})

	t.Run("collections are the provisioner's", func(t *testing.T) {
		for _, kind := range []string{"collected", "shell", "environment", "contribution"} {
			e, ok := Registry.Lookup(kind)
			require.True(t, ok, kind)
			require.Equal(t, "mesh-provisioner", e.Module)
			require.Equal(t, BucketCollect, e.Bucket)
			require.Equal(t, ShapeCollect.String(), e.KeyShape)
			require.Empty(t, e.Verb)
		}
	})

	t.Run("placement is the controller's", func(t *testing.T) {
		for _, kind := range []string{"dir", "access", "port", "seat", "machine"} {
			e, ok := Registry.Lookup(kind)
			require.True(t, ok, kind)
			require.Equal(t, "mesh-controller", e.Module)
			require.Equal(t, "mesh-controller_assignments", e.Bucket)
			require.Equal(t, "<node>.<module>", e.KeyShape)
			require.Empty(t, e.Verb)
		}
	})
}

func TestRegistryTable_Lookup(t *testing.T) {
	for _, want := range contractRegistry {
		t.Run(want.Kind, func(t *testing.T) {
			got, ok := Registry.Lookup(want.Kind)
			require.True(t, ok)
			require.Equal(t, want, got)
		})
	}
	for _, kind := range []string{"", "nope", "Config", "config ", "secrets", "mesh-vault.secret", "shell.x"} {
		t.Run("unknown "+kind, func(t *testing.T) {
			got, ok := Registry.Lookup(kind)
			require.False(t, ok)
			require.Equal(t, RegistryEntry{}, got)
		})
	}
}

// decodeMapKeys reads a MessagePack map of strings to strings, keeping the order its keys were written.
func decodeMapKeys(t *testing.T, b []byte) ([]string, map[string]string) {
	t.Helper()
	dec := msgpack.NewDecoder(bytes.NewReader(b))
	n, err := dec.DecodeMapLen()
	require.NoError(t, err)
	keys := make([]string, 0, n)
	m := make(map[string]string, n)
	for i := 0; i < n; i++ {
		k, err := dec.DecodeString()
		require.NoError(t, err)
		v, err := dec.DecodeString()
		require.NoError(t, err)
		keys = append(keys, k)
		m[k] = v
	}
	_, err = dec.PeekCode()
	require.Error(t, err, "the value is one complete MessagePack object, nothing after it")
	return keys, m
}

// entryMap is an entry as the map of CONTRACT section 4: kind, module, and either bucket and key_shape,
// or verb.
func entryMap(e RegistryEntry) map[string]string {
	m := map[string]string{"kind": e.Kind, "module": e.Module}
	if e.Verb != "" {
		m["verb"] = e.Verb
	} else {
		m["bucket"] = e.Bucket
		m["key_shape"] = e.KeyShape
	}
	return m
}

func TestRegistryEntry_Value(t *testing.T) {
	for _, e := range Registry.Entries {
		t.Run(e.Kind, func(t *testing.T) {
			v := e.Value()
			require.Equal(t, v, e.Value(), "the value is the same at every write")

			got, err := DecodeRegistryEntry(v)
			require.NoError(t, err)
			require.Equal(t, e, got)

			keys, m := decodeMapKeys(t, v)
			require.Equal(t, entryMap(e), m)
			if e.Verb != "" {
				require.Equal(t, []string{"kind", "module", "verb"}, keys)
			} else {
				require.Equal(t, []string{"kind", "module", "bucket", "key_shape"}, keys)
			}
		})
	}
}

// TestDecodeRegistryEntry_OtherEncodings checks that map order and encoding widths do not matter: another
// writer's encoding of the same entry decodes to an equal entry.
func TestDecodeRegistryEntry_OtherEncodings(t *testing.T) {
	for _, e := range Registry.Entries {
		t.Run(e.Kind, func(t *testing.T) {
			m := entryMap(e)
			keys := make([]string, 0, len(m))
			for k := range m {
				keys = append(keys, k)
			}

			// msgpack's own map[string]string, keys sorted: bucket, key_shape, kind, module / kind, module, verb.
			var sorted bytes.Buffer
			enc := msgpack.NewEncoder(&sorted)
			enc.SetSortMapKeys(true)
			require.NoError(t, enc.Encode(m))

			// The same map by hand, keys in reverse of Value's order.
			sort.Sort(sort.Reverse(sort.StringSlice(keys)))
			var reversed bytes.Buffer
			enc = msgpack.NewEncoder(&reversed)
			require.NoError(t, enc.EncodeMapLen(len(keys)))
			for _, k := range keys {
				require.NoError(t, enc.EncodeString(k))
				require.NoError(t, enc.EncodeString(m[k]))
			}

			// Wider than needed: map16 header, str8 keys and str16 values.
			wide := []byte{0xde, 0, byte(len(keys))}
			for _, k := range keys {
				wide = append(wide, 0xd9, byte(len(k)))
				wide = append(wide, k...)
				wide = append(wide, 0xda, 0, byte(len(m[k])))
				wide = append(wide, m[k]...)
			}

			for name, b := range map[string][]byte{"sorted": sorted.Bytes(), "reversed": reversed.Bytes(), "wide": wide} {
				_, got := decodeMapKeys(t, b)
				require.Equal(t, m, got, name)

				entry, err := DecodeRegistryEntry(b)
				require.NoError(t, err, name)
				require.Equal(t, e, entry, name)
			}
			require.NotEqual(t, e.Value(), reversed.Bytes(), "the reversed encoding is another order")
			require.NotEqual(t, e.Value(), wide)
		})
	}
}

func TestDecodeRegistryEntry_NotAnEntry(t *testing.T) {
	for name, b := range map[string][]byte{
		"empty":         {},
		"never used":    {0xc1},
		"string":        {0xa3, 'a', 'b', 'c'},
		"truncated map": {0x82, 0xa4, 'k', 'i', 'n', 'd'},
		"int value":     {0x81, 0xa4, 'k', 'i', 'n', 'd', 0x01},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := DecodeRegistryEntry(b)
			require.Error(t, err)
		})
	}
}

func TestRegistryEntry_Matches(t *testing.T) {
	secret, _ := Registry.Lookup("secret")
	config, _ := Registry.Lookup("config")
	enc := func(kvs ...any) []byte {
		var b bytes.Buffer
		e := msgpack.NewEncoder(&b)
		require.NoError(t, e.EncodeMapLen(len(kvs)/2))
		for _, x := range kvs {
			switch v := x.(type) {
			case string:
				require.NoError(t, e.EncodeString(v))
			case []byte:
				require.NoError(t, e.EncodeBytes(v))
			case nil:
				require.NoError(t, e.EncodeNil())
			}
		}
		return b.Bytes()
	}
	for _, tc := range []struct {
		name  string
		e     RegistryEntry
		value []byte
		want  bool
	}{
		{"its own value", secret, secret.Value(), true},
		{"its own value, bucket entry", config, config.Value(), true},
		{"another order", secret, enc("verb", "mesh-vault.secret", "module", "mesh-vault", "kind", "secret"), true},
		{"map16 and str16", secret, []byte{0xde, 0, 3,
			0xda, 0, 4, 'k', 'i', 'n', 'd', 0xda, 0, 6, 's', 'e', 'c', 'r', 'e', 't',
			0xda, 0, 6, 'm', 'o', 'd', 'u', 'l', 'e', 0xda, 0, 10, 'm', 'e', 's', 'h', '-', 'v', 'a', 'u', 'l', 't',
			0xda, 0, 4, 'v', 'e', 'r', 'b', 0xd9, 17, 'm', 'e', 's', 'h', '-', 'v', 'a', 'u', 'l', 't', '.', 's', 'e', 'c', 'r', 'e', 't'}, true},
		{"an extra field", secret, enc("kind", "secret", "module", "mesh-vault", "verb", "mesh-vault.secret", "note", "x"), false},
		{"an extra empty field", secret, enc("kind", "secret", "module", "mesh-vault", "verb", "mesh-vault.secret", "bucket", ""), false},
		{"a missing field", config, enc("kind", "config", "module", "mesh-config", "bucket", "mesh-config_values"), false},
		{"a repeated field", secret, enc("kind", "secret", "kind", "secret", "verb", "mesh-vault.secret"), false},
		{"a bin value", secret, enc("kind", "secret", "module", []byte("mesh-vault"), "verb", "mesh-vault.secret"), false},
		{"a nil value", secret, enc("kind", "secret", "module", nil, "verb", "mesh-vault.secret"), false},
		{"another value", secret, enc("kind", "secret", "module", "mesh-vault", "verb", "mesh-vault.consumers"), false},
		{"another entry", secret, config.Value(), false},
		{"bytes after the map", secret, append(secret.Value(), 0xc0), false},
		{"truncated", secret, secret.Value()[:len(secret.Value())-1], false},
		{"not a map", secret, []byte{0xa6, 's', 'e', 'c', 'r', 'e', 't'}, false},
		{"nil", secret, []byte{0xc0}, false},
		{"empty", secret, nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, tc.e.Matches(tc.value))
		})
	}
}

// TestRegistryFields reads what a registry row answers from a value: each known field held as a string,
// whatever else the map holds.
func TestRegistryFields(t *testing.T) {
	enc := func(kvs ...any) []byte {
		var b bytes.Buffer
		e := msgpack.NewEncoder(&b)
		require.NoError(t, e.EncodeMapLen(len(kvs)/2))
		for _, v := range kvs {
			require.NoError(t, e.Encode(v))
		}
		return b.Bytes()
	}
	for _, e := range Registry.Entries {
		require.Equal(t, e, RegistryFields(e.Value()), e.Kind)
	}
	for name, tc := range map[string]struct {
		value []byte
		want  RegistryEntry
	}{
		"a field more": {enc("kind", "secret", "since", map[string]any{"v": []int{2}}, "module", "mesh-vault", "verb", "mesh-vault.secret"),
			RegistryEntry{Kind: "secret", Module: "mesh-vault", Verb: "mesh-vault.secret"}},
		"a field of another type": {enc("kind", "port", "module", "mesh-controller", "bucket", 7, "key_shape", "<node>.<module>"),
			RegistryEntry{Kind: "port", Module: "mesh-controller", KeyShape: "<node>.<module>"}},
		"bin is not a string":     {enc("module", []byte("m"), "verb", "v"), RegistryEntry{Verb: "v"}},
		"a key that is no string": {enc(1, "x", "module", "m", nil, nil), RegistryEntry{Module: "m"}},
		"repeated: the first":     {enc("module", "a", "module", "b"), RegistryEntry{Module: "a"}},
		"not a map":               {[]byte{0x92, 0x01, 0x02}, RegistryEntry{}},
		"empty":                   {nil, RegistryEntry{}},
		"cut short":               {[]byte{0x82, 0xa6, 'm', 'o', 'd', 'u', 'l', 'e', 0xa1, 'm', 0xa4}, RegistryEntry{Module: "m"}},
	} {
		require.Equal(t, tc.want, RegistryFields(tc.value), name)
	}
}

// registryVersions records the table of each RegistryVersion by a hash of its entries' values, in key
// order. Changing the table without raising the version would let the seats of two binaries with the
// same version and different tables rewrite each other's kinds every interval.
var registryVersions = map[uint64]string{
	1: "a694f87c7634d2d256df69055153f851fff49c1d94731577b3abc9c6f8063154",
}

func TestRegistry_VersionFollowsTheTable(t *testing.T) {
	h := sha256.New()
	for _, e := range Registry.Entries {
		h.Write(e.Value())
	}
	got := hex.EncodeToString(h.Sum(nil))
	require.EqualValues(t, RegistryVersion, Registry.Version)
	want, ok := registryVersions[RegistryVersion]
	require.True(t, ok, "record version %d's hash %s in registryVersions", RegistryVersion, got)
	require.Equal(t, want, got, "the table changed: raise RegistryVersion and record the new table's hash under it")
	for v, hash := range registryVersions {
		if v != RegistryVersion {
			require.NotEqual(t, hash, got, "the table is version %d's again: a version never goes back", v)
		}
	}
}
