package provisioner

import (
	"bytes"
	"fmt"
	"sort"

	"github.com/vmihailenco/msgpack/v5"
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
var Registry = buildRegistry(
	// config: a module's configuration values are kept by mesh-config, per node and module, in its own
	// bucket, so a client reads them directly.
	RegistryEntry{Kind: "config", Module: "mesh-config", Bucket: "mesh-config_values", KeyShape: "<node>.<module>.<name>"},

	// secret: a secret is never in a bucket. The client asks the vault's verb on request and reply, and
	// the vault answers only the node that may have it.
	RegistryEntry{Kind: "secret", Module: "mesh-vault", Verb: "mesh-vault.secret"},

	// bound: what a provider bound for a consumer lives in the provider's own bucket (mesh-sdkgo/provider),
	// so the module is whichever provider the need names.
	RegistryEntry{Kind: "bound", Module: "<provider-module>", Bucket: "<provider-module>_bound", KeyShape: "<node>.<module>.<provision>[.<local>]"},

	// consumers: a provider's consumers' credentials are secrets too, asked of the vault by the provider
	// machine's client (novox/hq ADR 0373).
	RegistryEntry{Kind: "consumers", Module: "mesh-vault", Verb: "mesh-vault.consumers"},

	// collected, shell, environment, contribution: collections are the provisioner's own, written by each
	// node's client into mesh-provisioner_collect. For shell, environment and contribution the collection is
	// the kind's own name (design 57 L1); collected names it in the need.
	RegistryEntry{Kind: "collected", Module: "mesh-provisioner", Bucket: BucketCollect, KeyShape: ShapeCollect.String()},
	RegistryEntry{Kind: "shell", Module: "mesh-provisioner", Bucket: BucketCollect, KeyShape: ShapeCollect.String()},
	RegistryEntry{Kind: "environment", Module: "mesh-provisioner", Bucket: BucketCollect, KeyShape: ShapeCollect.String()},
	RegistryEntry{Kind: "contribution", Module: "mesh-provisioner", Bucket: BucketCollect, KeyShape: ShapeCollect.String()},

	// dir, access, port, seat, machine: placement belongs to the controller. Its assignments mirror holds,
	// per node and module, the placement and the provisioner's plan of the module handed to it.
	RegistryEntry{Kind: "dir", Module: "mesh-controller", Bucket: "mesh-controller_assignments", KeyShape: "<node>.<module>"},
	RegistryEntry{Kind: "access", Module: "mesh-controller", Bucket: "mesh-controller_assignments", KeyShape: "<node>.<module>"},
	RegistryEntry{Kind: "port", Module: "mesh-controller", Bucket: "mesh-controller_assignments", KeyShape: "<node>.<module>"},
	RegistryEntry{Kind: "seat", Module: "mesh-controller", Bucket: "mesh-controller_assignments", KeyShape: "<node>.<module>"},
	RegistryEntry{Kind: "machine", Module: "mesh-controller", Bucket: "mesh-controller_assignments", KeyShape: "<node>.<module>"},
)

// RegistryTable is the compiled table: entries in key order and an index by kind.
type RegistryTable struct {
	Entries []RegistryEntry
	byKind  map[string]int
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
