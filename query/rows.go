package query

import (
	provisioner "github.com/novox/mesh-provisioner"
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
	total, err := v.Anomalies(bucket, node, MaxAnomalies, e.Anomaly)
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
// value_raw when it is not MessagePack), then the key's parts.
func (e *Encoder) Row(w provisioner.What, row *provisioner.Row, p *provisioner.Parts) error {
	var reg provisioner.RegistryEntry
	n := 4
	if !row.Msgpack {
		n++
	}
	switch w {
	case provisioner.WhatRegistry:
		n++ // kind
		if row.Msgpack {
			if r, err := provisioner.DecodeRegistryEntry(row.Value); err == nil {
				reg = r
			}
		}
		for _, s := range []string{reg.Module, reg.Bucket, reg.KeyShape, reg.Verb} {
			if s != "" {
				n++
			}
		}
	case provisioner.WhatNeeds:
		n += 4
	case provisioner.WhatApplied:
		n += 2
	case provisioner.WhatCollect:
		n += 4
	}
	e.openMap(n)
	e.key("key")
	e.strBytes(row.Key)
	e.key("revision")
	e.uint(row.Revision)
	e.key("created")
	e.time(row.Created)
	e.key("value")
	// MessagePack passes through and never fails; JSON falls back to value_raw for the rare valid
	// MessagePack it cannot render (keys nested too deep), and only JSON has no count to keep.
	if !row.Msgpack || !e.msgpack(row.Value) {
		e.null()
		e.key("value_raw")
		e.bin(row.Value)
	}
	switch w {
	case provisioner.WhatRegistry:
		e.key("kind")
		e.str(p.Kind)
		for _, f := range []struct{ k, v string }{{"module", reg.Module}, {"bucket", reg.Bucket}, {"key_shape", reg.KeyShape}, {"verb", reg.Verb}} {
			if f.v != "" {
				e.key(f.k)
				e.str(f.v)
			}
		}
	case provisioner.WhatNeeds:
		e.key("node")
		e.str(p.Node)
		e.key("module")
		e.str(p.Module)
		e.key("kind")
		e.str(p.Kind)
		e.key("name")
		e.str(p.Name)
	case provisioner.WhatApplied:
		e.key("node")
		e.str(p.Node)
		e.key("module")
		e.str(p.Module)
	case provisioner.WhatCollect:
		e.key("node")
		e.str(p.Node)
		e.key("collection")
		e.str(p.Collection)
		e.key("collection_key")
		e.str(p.CollectionKey)
		e.key("contributor")
		e.str(p.Contributor)
	}
	e.closeMap()
	return nil
}
