package provisioner

import (
	"bytes"
	"fmt"
	"sort"
	"strconv"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// RegistryEntry is the value of one key of mesh-provisioner_registry: which module answers a kind of
// placeholder, and where a client finds the values, a bucket with its key shape or a seat's verb asked on
// request and reply. Exactly one of Bucket (with KeyShape) and Verb is set.
type RegistryEntry struct {
	Kind     string `msgpack:"kind"`
	Module   string `msgpack:"module"`
	Bucket   string `msgpack:"bucket,omitempty"`
	KeyShape string `msgpack:"key_shape,omitempty"`
	Verb     string `msgpack:"verb,omitempty"`
}

// Registry is the table of CONTRACT section 4, one place to read and change it. The server writes it
// into mesh-provisioner_registry at start and every --registry-interval, only where the stored value
// differs, and deletes every key the table does not hold.
var Registry = NewRegistryTable(RegistryVersion,
	// config: configuration values are not secret and are read far more often than they change, so
	// mesh-config keeps them per node and module in its own bucket: a client reads (or watches) them
	// straight from the bucket, with no request to a seat per read.
	RegistryEntry{Kind: "config", Module: "mesh-config", Bucket: "mesh-config_values", KeyShape: "<node>.<module>.<name>"},

	// secret: a secret is never in a bucket, because a bucket's history stays readable by every user the
	// stream's account lets read it, long after the secret was rotated. The client asks the vault's verb
	// on request and reply, and the vault answers only the node that may have it, at the moment it asks.
	RegistryEntry{Kind: "secret", Module: "mesh-vault", Verb: "mesh-vault.secret"},

	// bound: what a provider bound for a consumer is written by that provider alone, so it lives in the
	// provider's own bucket (mesh-sdkgo/provider) under the provider's account; the module is whichever
	// provider the need names, hence the placeholder.
	RegistryEntry{Kind: "bound", Module: "<provider-module>", Bucket: "<provider-module>_bound", KeyShape: "<node>.<module>.<provision>[.<local>]"},

	// consumers: a provider's consumers' credentials are secrets too, so for the same reason as secret
	// they are asked of the vault's verb, by the provider machine's client (novox/hq ADR 0373).
	RegistryEntry{Kind: "consumers", Module: "mesh-vault", Verb: "mesh-vault.consumers"},

	// collected, shell, environment, contribution: a collection gathers items that many modules of a node
	// contribute, so no single domain owns it; the provisioner keeps them, written by each node's client
	// into mesh-provisioner_collect, and answers them from its projection by collection name. For shell,
	// environment and contribution the collection is the kind's own name (design 57 L1); collected names
	// it in the need.
	RegistryEntry{Kind: "collected", Module: "mesh-provisioner", Bucket: BucketCollect, KeyShape: ShapeCollect.String()},
	RegistryEntry{Kind: "shell", Module: "mesh-provisioner", Bucket: BucketCollect, KeyShape: ShapeCollect.String()},
	RegistryEntry{Kind: "environment", Module: "mesh-provisioner", Bucket: BucketCollect, KeyShape: ShapeCollect.String()},
	RegistryEntry{Kind: "contribution", Module: "mesh-provisioner", Bucket: BucketCollect, KeyShape: ShapeCollect.String()},

	// dir, access, port, seat, machine: placement is decided by the controller, the one writer that sees
	// the whole mesh, so these are read from its assignments mirror, which holds per node and module the
	// placement and the provisioner's plan of the module handed to it.
	RegistryEntry{Kind: "dir", Module: "mesh-controller", Bucket: "mesh-controller_assignments", KeyShape: "<node>.<module>"},
	RegistryEntry{Kind: "access", Module: "mesh-controller", Bucket: "mesh-controller_assignments", KeyShape: "<node>.<module>"},
	RegistryEntry{Kind: "port", Module: "mesh-controller", Bucket: "mesh-controller_assignments", KeyShape: "<node>.<module>"},
	RegistryEntry{Kind: "seat", Module: "mesh-controller", Bucket: "mesh-controller_assignments", KeyShape: "<node>.<module>"},
	RegistryEntry{Kind: "machine", Module: "mesh-controller", Bucket: "mesh-controller_assignments", KeyShape: "<node>.<module>"},
)

// RegistryVersion is the version of the compiled table (Registry). Raise it by one with every change
// of the table: each write of the registry carries it in the header HeaderRegistryVersion, and a seat
// never rewrites or deletes a key whose last message carries a higher one, so that during a rolling
// upgrade the seats of the old binary leave the new table alone (docs/decisions.md, The registry).
// TestRegistry_VersionFollowsTheTable fails when the table changes and the version does not.
const RegistryVersion = 1

// HeaderRegistryVersion is the header of a registry message (a put or a delete marker of a stray)
// that names the version of the table whose writer wrote it. A message without it (a hand edit, a
// seat from before versions) is of version 0.
const HeaderRegistryVersion = "Mesh-Provisioner-Registry-Version"

// RegistryVersionOfHeaders reads HeaderRegistryVersion from a message's headers (a nats.Header): 0
// when absent or not a decimal number.
func RegistryVersionOfHeaders(h map[string][]string) uint64 {
	v := h[HeaderRegistryVersion]
	if len(v) == 0 {
		return 0
	}
	n, err := strconv.ParseUint(v[0], 10, 64)
	if err != nil {
		return 0
	}
	return n
}

// RegistryTable is the compiled table: entries in key order and an index by kind, and the table's
// version (RegistryVersion for Registry).
type RegistryTable struct {
	Entries []RegistryEntry
	Version uint64
	byKind  map[string]int
}

// NewRegistryTable compiles a table of entries at a version, as Registry is compiled: another seat
// version's table, in tests. It panics on an entry that is not well formed.
func NewRegistryTable(version uint64, entries ...RegistryEntry) RegistryTable {
	t := buildRegistry(entries...)
	t.Version = version
	return t
}

func buildRegistry(entries ...RegistryEntry) RegistryTable {
	sort.Slice(entries, func(i, j int) bool { return entries[i].Kind < entries[j].Kind })
	t := RegistryTable{Entries: entries, byKind: make(map[string]int, len(entries))}
	for i, e := range entries {
		if _, dup := t.byKind[e.Kind]; dup || !ValidToken(e.Kind) || (e.Bucket == "") == (e.Verb == "") {
			panic(fmt.Sprintf("provisioner: registry entry %q is not well formed", e.Kind))
		}
		t.byKind[e.Kind] = i
	}
	return t
}

// Lookup returns the entry of a kind.
func (t RegistryTable) Lookup(kind string) (RegistryEntry, bool) {
	i, ok := t.byKind[kind]
	if !ok {
		return RegistryEntry{}, false
	}
	return t.Entries[i], true
}

// Value is the entry as stored in the registry bucket: a MessagePack map of kind, module and either
// bucket and key_shape, or verb, in that order.
func (e RegistryEntry) Value() []byte {
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	if err := enc.Encode(e); err != nil {
		panic(err) // a struct of strings always encodes
	}
	return buf.Bytes()
}

// Matches reports whether a stored registry value holds exactly this entry, as a reader decodes it: one
// MessagePack map and nothing after it, whose keys are the entry's fields (kind, module, and bucket with
// key_shape, or verb), each once, each a string equal to the entry's. Map order and header widths do not
// matter, so another writer's encoding of the same entry matches and is not written again; a missing,
// extra or repeated field, or a field of another type (bytes, nil), does not match.
func (e RegistryEntry) Matches(value []byte) bool {
	want := e.fields()
	if len(value) == 0 || !(msgpcode.IsFixedMap(value[0]) || value[0] == msgpcode.Map16 || value[0] == msgpcode.Map32) {
		return false
	}
	rd := bytes.NewReader(value)
	dec := msgpack.NewDecoder(rd)
	n, err := dec.DecodeMapLen()
	if err != nil || n != len(want) {
		return false
	}
	seen := make(map[string]bool, n)
	for i := 0; i < n; i++ {
		k, ok := decodeStr(dec)
		if !ok || seen[k] {
			return false
		}
		seen[k] = true
		v, ok := decodeStr(dec)
		if w, known := want[k]; !ok || !known || v != w {
			return false
		}
	}
	return rd.Len() == 0
}

// fields are the entry's map as the contract writes it.
func (e RegistryEntry) fields() map[string]string {
	m := map[string]string{"kind": e.Kind, "module": e.Module}
	if e.Verb != "" {
		m["verb"] = e.Verb
	} else {
		m["bucket"] = e.Bucket
		m["key_shape"] = e.KeyShape
	}
	return m
}

// decodeStr reads a MessagePack str (not bin, not nil).
func decodeStr(dec *msgpack.Decoder) (string, bool) {
	c, err := dec.PeekCode()
	if err != nil || !msgpcode.IsString(c) {
		return "", false
	}
	s, err := dec.DecodeString()
	return s, err == nil
}

// RegistryFields reads what a registry row answers from a stored value that is one MessagePack object:
// kind, module, bucket, key_shape and verb, each when the value's map holds it as a string (the first
// time, if repeated). Unlike DecodeRegistryEntry it skips what it does not know, so a value with a field
// more (a newer seat's table during a rolling upgrade, a hand edit) or a field of another type still
// answers the fields it has; a value that is not a map has none.
func RegistryFields(b []byte) RegistryEntry {
	var e RegistryEntry
	_ = mapFields(b, func(name string, dec *msgpack.Decoder) error { // what was read before an error stands
		var field *string
		switch name {
		case "kind":
			field = &e.Kind
		case "module":
			field = &e.Module
		case "bucket":
			field = &e.Bucket
		case "key_shape":
			field = &e.KeyShape
		case "verb":
			field = &e.Verb
		}
		if field != nil && *field == "" {
			if v, ok := decodeStr(dec); ok {
				*field = v
				return nil
			}
		}
		return dec.Skip()
	})
	return e
}

// DecodeRegistryEntry reads a registry value. Map order and encoding widths do not matter, so two
// values are the same entry when their decoded entries are equal; a field the entry does not know is an
// error, so a value with one is a different entry.
func DecodeRegistryEntry(b []byte) (RegistryEntry, error) {
	var e RegistryEntry
	if len(b) == 0 || b[0] == 0xc0 {
		return RegistryEntry{}, fmt.Errorf("decode registry entry: not a map")
	}
	rd := bytes.NewReader(b)
	dec := msgpack.NewDecoder(rd)
	dec.DisallowUnknownFields(true)
	if err := dec.Decode(&e); err != nil {
		return RegistryEntry{}, fmt.Errorf("decode registry entry: %w", err)
	}
	if rd.Len() > 0 {
		return RegistryEntry{}, fmt.Errorf("decode registry entry: %d bytes after the map", rd.Len())
	}
	return e, nil
}
