package store

import (
	"encoding/binary"
	"fmt"
	"strings"

	"github.com/cockroachdb/pebble/v2"

	provisioner "github.com/novox/mesh-provisioner"
)

// A rollup that removes other keys has them removed in parts, each committed before the message's
// own batch (removeInParts). A process stopped between two parts leaves a state dir holding part of
// the removal under the checkpoint before the rollup: a state the stream never had, answered from
// the open until the projector read the message again. So the first part's batch writes a marker
// holding the message, the message's own batch deletes it, and Open finishes a rollup it finds
// marked before anything reads the store (finishRollups): the remaining parts and the message's own
// batch, the code Apply runs, so the store ends as an Apply that was never stopped leaves it.
//
// The marker is a key under the meta prefix, which every binary since the first reads only by name:
// an older one ignores it, reads the message again from the stream and removes the rest, as it always
// did, and leaves the marker behind with the checkpoint at or past its sequence, which finishRollups
// then deletes as done. So it needs no schema version of its own.

const rollupMarkerName = "rollup "

// rollupMarkerKey is the marker of an unfinished rollup of bucket: 0x01 "rollup " <bucket>.
func rollupMarkerKey(bucket string) []byte { return metaKey(rollupMarkerName + bucket) }

// appendRollupMarker encodes a rollup message and the stream's creation time its Apply was given:
// uvarint seq, varint time, op byte, rollup byte, varint stream created, uvarint key length, key, value.
// A foreign rollup is marked in its log form (foreign.go).
func appendRollupMarker(dst []byte, m *provisioner.Message, streamCreated int64) []byte {
	key, op := logForm(m)
	dst = binary.AppendUvarint(dst, m.Seq)
	dst = binary.AppendVarint(dst, m.Time)
	dst = append(dst, byte(op), byte(m.Rollup))
	dst = binary.AppendVarint(dst, streamCreated)
	dst = binary.AppendUvarint(dst, uint64(len(key)))
	dst = append(dst, key...)
	return append(dst, m.Value...)
}

func decodeRollupMarker(b []byte) (m provisioner.Message, streamCreated int64, err error) {
	bad := fmt.Errorf("%w: rollup marker", ErrCorrupt)
	var n int
	if m.Seq, n = binary.Uvarint(b); n <= 0 {
		return m, 0, bad
	}
	b = b[n:]
	if m.Time, n = binary.Varint(b); n <= 0 || len(b) < n+2 {
		return m, 0, bad
	}
	m.Op, m.Rollup = provisioner.Op(b[n]), provisioner.Rollup(b[n+1])
	b = b[n+2:]
	if streamCreated, n = binary.Varint(b); n <= 0 {
		return m, 0, bad
	}
	b = b[n:]
	l, n := binary.Uvarint(b)
	if n <= 0 || uint64(len(b)-n) < l {
		return m, 0, bad
	}
	m.Key = string(b[n : n+int(l)])
	if v := b[n+int(l):]; len(v) > 0 {
		m.Value = append([]byte(nil), v...)
	}
	if m = fromLogForm(m); !m.RemovesOthers() {
		return m, 0, bad
	}
	return m, streamCreated, nil
}

// finishRollups finishes every rollup a stopped process left marked, at open, once the checkpoints,
// anomalies, kinds and gaps are loaded and before the store is handed to anyone. A marker at or below
// its bucket's applied sequence was finished by an older binary reading the message again: it is
// deleted.
func (db *DB) finishRollups() error {
	lo := metaKey(rollupMarkerName)
	it, err := db.pdb.NewIter(&pebble.IterOptions{LowerBound: lo, UpperBound: prefixEnd(lo)})
	if err != nil {
		return readErr(err)
	}
	type marked struct {
		bucket        string
		m             provisioner.Message
		streamCreated int64
	}
	var todo []marked
	for it.First(); it.Valid(); it.Next() {
		bucket := strings.TrimPrefix(string(it.Key()), string(lo))
		m, created, err := decodeRollupMarker(it.Value())
		if err != nil {
			it.Close()
			return fmt.Errorf("%w (bucket %s)", err, bucket)
		}
		todo = append(todo, marked{bucket, m, created})
	}
	if err := it.Close(); err != nil {
		return readErr(err)
	}
	db.applyMu.Lock()
	defer db.applyMu.Unlock()
	for _, r := range todo {
		if r.m.Seq <= db.known(r.bucket).cp.Applied {
			if err := db.del(rollupMarkerKey(r.bucket), pebble.Sync); err != nil {
				return fmt.Errorf("delete the finished rollup marker of %s: %w", r.bucket, err)
			}
			continue
		}
		shape, ok := provisioner.ShapeOf(r.bucket)
		if !ok {
			return fmt.Errorf("%w: rollup marker of %s, a bucket with no shape", ErrCorrupt, r.bucket)
		}
		if err := db.applyLocked(shape, []provisioner.Message{r.m}, r.streamCreated, true); err != nil {
			return fmt.Errorf("finish the rollup of %s seq %d: %w", r.bucket, r.m.Seq, err)
		}
	}
	return nil
}
