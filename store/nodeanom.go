package store

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
	"strings"

	"github.com/cockroachdb/pebble/v2"

	provisioner "github.com/novox/mesh-provisioner"
)

// Anomaly rows per node. An answer narrowed by node carries anomalies_total, how many anomaly rows of
// the node matched: counting them on every answer read every anomaly row of the node, on every page
// of a paged walk, so a node whose 100,000 needs ask a kind no registry entry answers cost 100,000
// rows a page whatever its limit. So each bucket keeps the count per node (the raw key's first token,
// the node an answer narrows anomalies by), under
//
//	0x0a <bucket> 00 01 <node>   -> uvarint anomaly rows of the node (absent: none)
//
// written in the batch that changes the anomaly rows, so a view reads the count of exactly the rows it
// sees. Opening a store counts the rows again (load reads every anomaly row anyway) and writes what
// differs, so a store written before the counts existed gets them at its first open.

// anomalyNode is the node an anomaly row of a raw key counts under: the key's first token.
func anomalyNode(key string) string {
	if i := strings.IndexByte(key, '.'); i >= 0 {
		return key[:i]
	}
	return key
}

func nodeAnomKey(dst []byte, bucket, node string) []byte {
	return appendEsc(bucketPrefix(dst, prefixNodeAnom, bucket), node)
}

// nodeAnomDeltas is how the anomaly rows of each node of each bucket change with this batch: the
// classes the batch leaves on each key it touched, against those committed.
func (a *applier) nodeAnomDeltas() map[string]map[string]int64 {
	var out map[string]map[string]int64
	for name, m := range a.anom {
		for key, c := range m {
			d := int64(bits.OnesCount8(c.now)) - int64(bits.OnesCount8(c.was))
			if d == 0 {
				continue
			}
			if out == nil {
				out = map[string]map[string]int64{}
			}
			nodes := out[name]
			if nodes == nil {
				nodes = map[string]int64{}
				out[name] = nodes
			}
			nodes[anomalyNode(key)] += d
		}
	}
	return out
}

// writeNodeAnom writes the new counts of the nodes deltas changes, and returns them for memory to
// follow once the batch commits.
func (a *applier) writeNodeAnom(deltas map[string]map[string]int64) map[string]map[string]int64 {
	for name, nodes := range deltas {
		b := a.state(name)
		for node, d := range nodes {
			n := b.nodeAnom[node] + d
			nodes[node] = n
			a.buf = nodeAnomKey(a.buf[:0], name, node)
			if n <= 0 {
				a.delete(a.buf)
				continue
			}
			a.set(a.buf, binary.AppendUvarint(nil, uint64(n)))
		}
	}
	return deltas
}

// nodeAnomalies is the committed count of a node's anomaly rows, as the view sees it.
func (v *rows) nodeAnomalies(bucket, node string) (int64, error) {
	b, ok, err := v.get(nodeAnomKey(nil, bucket, node))
	if err != nil || !ok {
		return 0, err
	}
	n, w := binary.Uvarint(b)
	if w <= 0 {
		return 0, fmt.Errorf("%w: node anomaly count", ErrCorrupt)
	}
	return int64(n), nil
}

// reconcileNodeAnomalies makes the stored counts equal to the anomaly rows load counted, writing what
// differs in one synced batch: nothing once the store has them.
func (db *DB) reconcileNodeAnomalies() error {
	want := map[string]int64{}
	for _, b := range db.buckets {
		for node, n := range b.nodeAnom {
			want[string(nodeAnomKey(nil, b.name, node))] = n
		}
	}
	batch := db.pdb.NewBatch()
	defer batch.Close()
	it, err := db.pdb.NewIter(&pebble.IterOptions{LowerBound: []byte{prefixNodeAnom}, UpperBound: []byte{prefixNodeAnom + 1}})
	if err != nil {
		return fmt.Errorf("%w: %v", ErrCorrupt, err)
	}
	for it.First(); it.Valid(); it.Next() {
		k := string(it.Key())
		n, ok := want[k]
		if ok {
			delete(want, k)
			if have, w := binary.Uvarint(it.Value()); w > 0 && int64(have) == n {
				continue
			}
		}
		if !ok {
			if err := batch.Delete(bytes.Clone(it.Key()), nil); err != nil {
				it.Close()
				return err
			}
			continue
		}
		if err := batch.Set(bytes.Clone(it.Key()), binary.AppendUvarint(nil, uint64(n)), nil); err != nil {
			it.Close()
			return err
		}
	}
	if err := it.Close(); err != nil {
		return fmt.Errorf("%w: %v", ErrCorrupt, err)
	}
	for k, n := range want {
		if err := batch.Set([]byte(k), binary.AppendUvarint(nil, uint64(n)), nil); err != nil {
			return err
		}
	}
	if batch.Empty() {
		return nil
	}
	if err := db.commit(batch, pebble.Sync); err != nil {
		return fmt.Errorf("write node anomaly counts: %w", err)
	}
	return nil
}

// The anomalies of plans across every node. A plans answer not narrowed by node carries the anomaly
// rows of every composed-<node> bucket, and their count: read from every such bucket's checkpoint, they
// cost each page one read per node (5 ms a page of 100 rows at 4,000 nodes, 1.7 ms at 1,000). So the
// store keeps their sum under one key, written in the batch that changes a composed-<node> bucket's
// anomaly rows (or forgets it), and the rows are listed from their own range, which holds them in the
// answer's order (bucket, then raw key): a page reads one count and the rows it lists.

func composedAnomKey() []byte { return metaKey("composed-anomalies") }

// composedAnomDelta is how this batch changes the anomaly rows of composed-<node> buckets together.
func (a *applier) composedAnomDelta() int64 {
	var d int64
	for name, c := range a.cps {
		if provisioner.IsComposedBucket(name) {
			d += c.AnomalyRows - a.state(name).cp.AnomalyRows
		}
	}
	return d
}

// writeComposedAnom writes the sum of composed-<node> anomaly rows changed by d, and returns it.
func (a *applier) writeComposedAnom(d int64) int64 {
	n := a.db.composedAnom + d
	if d != 0 {
		a.set(composedAnomKey(), binary.AppendUvarint(nil, uint64(max(n, 0))))
	}
	return n
}

// ComposedAnomalies calls fn for the anomaly rows of every composed-<node> bucket, in byte order of
// bucket then raw key, at most max of them, and returns how many there are in all.
func (v *rows) ComposedAnomalies(max int, fn func(provisioner.Anomaly)) (int64, error) {
	b, ok, err := v.get(composedAnomKey())
	if err != nil {
		return 0, err
	}
	var total int64
	if ok {
		n, w := binary.Uvarint(b)
		if w <= 0 {
			return 0, fmt.Errorf("%w: composed anomaly count", ErrCorrupt)
		}
		total = int64(n)
	}
	if max <= 0 || total == 0 {
		return total, nil
	}
	lo := append([]byte{prefixAnomaly}, provisioner.ComposedPrefix...)
	it, err := v.iter(lo, prefixEnd(lo))
	if err != nil {
		return 0, err
	}
	n := 0
	for valid := it.First(); valid && n < max; {
		bucket, key, _, ok := splitAnomalyKey(it.Key())
		if !ok {
			return 0, fmt.Errorf("%w: anomaly key", ErrCorrupt)
		}
		if !provisioner.IsComposedBucket(bucket) {
			valid = it.SeekGE(prefixEnd(bucketPrefix(nil, prefixAnomaly, bucket)))
			continue
		}
		val := it.Value()
		rev, w := binary.Uvarint(val)
		if w <= 0 {
			return 0, fmt.Errorf("%w: anomaly value", ErrCorrupt)
		}
		a := provisioner.Anomaly{Bucket: bucket, Key: key, Revision: rev}
		code, detail, _ := strings.Cut(string(val[w:]), ": ")
		a.Reason, a.Detail = provisioner.Reason(code), detail
		fn(a)
		n++
		valid = it.Next()
	}
	return total, it.Error()
}

// reconcileComposedAnomalies makes the stored sum equal to the checkpoints load read.
func (db *DB) reconcileComposedAnomalies() error {
	var n int64
	for _, b := range db.buckets {
		if provisioner.IsComposedBucket(b.name) {
			n += b.cp.AnomalyRows
		}
	}
	db.composedAnom = n
	v, closer, err := db.pdb.Get(composedAnomKey())
	switch {
	case err == nil:
		have, w := binary.Uvarint(v)
		closer.Close()
		if w > 0 && int64(have) == n {
			return nil
		}
	case !errors.Is(err, pebble.ErrNotFound):
		return fmt.Errorf("%w: read composed anomaly count: %v", ErrCorrupt, err)
	}
	if err := db.set(composedAnomKey(), binary.AppendUvarint(nil, uint64(n)), pebble.Sync); err != nil {
		return fmt.Errorf("write composed anomaly count: %w", err)
	}
	return nil
}
