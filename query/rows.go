package query

import (
	"encoding/base64"
	"slices"
	"strconv"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/mpk"
)

// BeginAnswer opens an answer and its rows: {"what": ..., "rows": [.
func (e *Encoder) BeginAnswer(what string) {
	e.openMap(-1)
	e.key("what")
	e.str(what)
	e.key("rows")
	e.openArray(-1)
}

// EndRows closes the rows.
func (e *Encoder) EndRows() { e.closeArray() }

// AnomaliesFrom writes the anomalies and anomalies_total of a bucket from a view, narrowed by node.
func (e *Encoder) AnomaliesFrom(v View, bucket, node string) error {
	e.key("anomalies")
	e.openArray(-1)
	total, err := v.Anomalies(bucket, node, MaxAnomalies, e.boundedAnomaly())
	if err != nil {
		return err
	}
	e.closeArray()
	e.key("anomalies_total")
	e.int(total)
	return nil
}

// Anomaly writes one anomaly row: bucket, key, revision, reason.
func (e *Encoder) Anomaly(a provisioner.Anomaly) {
	e.openMap(4)
	e.key("bucket")
	e.str(a.Bucket)
	e.key("key")
	e.str(a.Key)
	e.key("revision")
	e.uint(a.Revision)
	e.key("reason")
	e.str(a.Text())
	e.closeMap()
}

// EndAnswer writes as_of, synced and, when more rows follow, next; and closes the answer.
func (e *Encoder) EndAnswer(asOf uint64, synced bool, next string) {
	e.next = next
	e.key("as_of")
	e.uint(asOf)
	e.key("synced")
	e.bool(synced)
	if next != "" {
		e.key("next")
		e.str(next)
	}
	e.closeMap()
}

// Row writes one row of registry, needs, applied or collect: key, revision, created, value (or null and
// value_raw when it is not MessagePack), then the key's parts. It is the hot path of every answer: the
// row is written in one go, with the field names pre-encoded, rather than through the generic calls.
func (e *Encoder) Row(w provisioner.What, row *provisioner.Row, p *provisioner.Parts) error {
	var reg provisioner.RegistryEntry
	if w == provisioner.WhatRegistry && row.Msgpack {
		reg = provisioner.RegistryFields(row.Value) // each field the value holds as a string
	}
	var parts [5]field
	np := 0
	switch w {
	case provisioner.WhatRegistry:
		parts[0] = field{fKind, p.Kind}
		np = 1
		for _, f := range [4]field{{fModule, reg.Module}, {fBucket, reg.Bucket}, {fKeyShape, reg.KeyShape}, {fVerb, reg.Verb}} {
			if f.v != "" {
				parts[np] = f
				np++
			}
		}
	case provisioner.WhatNeeds:
		parts = [5]field{{fNode, p.Node}, {fModule, p.Module}, {fKind, p.Kind}, {fName, p.Name}}
		np = 4
	case provisioner.WhatApplied:
		parts[0], parts[1] = field{fNode, p.Node}, field{fModule, p.Module}
		np = 2
	case provisioner.WhatCollect:
		parts = [5]field{{fNode, p.Node}, {fCollection, p.Collection}, {fCollectionKey, p.CollectionKey}, {fContributor, p.Contributor}}
		np = 4
	}
	e.sep()
	if e.f == FormatMsgpack {
		e.rowMsgpack(row, parts[:np])
	} else {
		e.rowJSON(row, parts[:np])
	}
	return nil
}

// field is a row's part: its name (an index into the pre-encoded names) and value.
type field struct {
	name int
	v    string
}

const (
	fKey = iota
	fRevision
	fCreated
	fValue
	fValueRaw
	fNode
	fModule
	fKind
	fName
	fCollection
	fCollectionKey
	fContributor
	fBucket
	fKeyShape
	fVerb
	nFields
)

var fieldNames = [nFields]string{"key", "revision", "created", "value", "value_raw", "node", "module", "kind", "name",
	"collection", "collection_key", "contributor", "bucket", "key_shape", "verb"}

// Pre-encoded field names: MessagePack strings, and JSON `"name":` (with a leading comma but for the first).
var mpNames, jsonNames [nFields][]byte

// mpNameBlocks are mpNames in blocks of 16 bytes, for rowMsgpack to store each in one move rather
// than a call of memmove (a fifth of a row's writing, with the rows' bytes).
var mpNameBlocks [nFields][16]byte

func init() {
	for i, n := range fieldNames {
		mpNames[i] = mpk.AppendString(nil, n)
		if copy(mpNameBlocks[i][:], mpNames[i]) != len(mpNames[i]) {
			panic("query: field name " + n + " longer than its block")
		}
		jsonNames[i] = append(mpk.AppendJSONString([]byte{','}, n), ':')
	}
}

func (e *Encoder) rowMsgpack(row *provisioner.Row, parts []field) {
	n := 4 + len(parts)
	if !row.Msgpack {
		n++
	}
	// Room for the whole row at once, with a name block's slack past each name: the appends below
	// then never grow the buffer, and a name is stored whole, its block's tail overwritten by what
	// follows.
	room := (n+1)*(16+16) + len(row.Key) + len(row.Value)
	for _, f := range parts {
		room += len(f.v)
	}
	b := slices.Grow(e.buf, room)
	b = mpk.AppendMapHeader(b, n)
	b = appendName(b, fKey)
	b = mpk.AppendStringBytes(b, row.Key)
	b = appendName(b, fRevision)
	b = mpk.AppendUint(b, row.Revision)
	b = appendName(b, fCreated)
	b = mpk.AppendUnixNano(b, row.Created)
	b = appendName(b, fValue)
	if row.Msgpack {
		b = append(b, row.Value...) // stored MessagePack passes through
	} else {
		b = mpk.AppendNil(b)
		b = appendName(b, fValueRaw)
		b = mpk.AppendBin(b, row.Value)
	}
	for _, f := range parts {
		b = appendName(b, f.name)
		b = mpk.AppendString(b, f.v)
	}
	e.buf = b
}

// appendName appends a field's MessagePack name, with 16 bytes of room past len(b) (rowMsgpack
// grows the buffer for them).
func appendName(b []byte, i int) []byte {
	n := len(b)
	*(*[16]byte)(b[n : n+16]) = mpNameBlocks[i]
	return b[:n+len(mpNames[i])]
}

func (e *Encoder) rowJSON(row *provisioner.Row, parts []field) {
	b := append(e.buf, '{')
	b = append(b, jsonNames[fKey][1:]...)
	b = mpk.AppendJSONStringBytes(b, row.Key)
	b = append(b, jsonNames[fRevision]...)
	b = strconv.AppendUint(b, row.Revision, 10)
	b = append(b, jsonNames[fCreated]...)
	b = append(b, '"')
	b = mpk.AppendRFC3339Nano(b, row.Created)
	b = append(b, '"')
	b = append(b, jsonNames[fValue]...)
	raw := !row.Msgpack
	if row.Msgpack {
		mark := len(b)
		out, _, err := mpk.AppendJSON(b, row.Value)
		if err != nil {
			// Valid MessagePack that JSON cannot render (keys nested too deep, a NaN or infinite
			// float): say it as raw bytes, not as a value it is not.
			b, raw = b[:mark], true
		} else {
			b = out
		}
	}
	if raw {
		b = append(b, "null"...)
		b = append(b, jsonNames[fValueRaw]...)
		b = append(b, '"')
		b = base64.StdEncoding.AppendEncode(b, row.Value)
		b = append(b, '"')
	}
	for _, f := range parts {
		b = append(b, jsonNames[f.name]...)
		b = mpk.AppendJSONString(b, f.v)
	}
	e.buf = append(b, '}')
}
