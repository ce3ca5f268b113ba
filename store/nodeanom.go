package store

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/bits"
	"strings"

	"github.com/cockroachdb/pebble/v2"
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
		b := a.state(name)
		for key, c := range m {
			d := int64(bits.OnesCount8(c)) - int64(bits.OnesCount8(b.anom[key]))
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
	if err := batch.Commit(pebble.Sync); err != nil {
		return fmt.Errorf("write node anomaly counts: %w", err)
	}
	return nil
}
