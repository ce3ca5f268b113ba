package store

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strings"

	"github.com/cockroachdb/pebble/v2"

	provisioner "github.com/novox/mesh-provisioner"
)

// ErrNotFound is returned when a cursor names a row that no longer exists.
var ErrNotFound = errors.New("store: not found")

// View is a consistent read of the store: every scan through it sees the same committed state, and
// AsOf is the applied sequence of exactly that state. Close it when done.
type View struct {
	rows
	snap   *pebble.Snapshot
	pinned *pinnedState // set when snap is the pinned state's (pin.go), which Close releases
	key    []byte
	// rewrites is DB.Rewrites as the view opened (read before its snapshot: a rewrite the snapshot
	// misses is never counted in it).
	rewrites uint64
}

// rows reads rows, anomalies and checkpoints through one iterator, moved between ranges with SetBounds:
// cheaper than a new iterator per scan, which seeks into every level again. An iterator reads one point
// in time whatever its bounds, so every read through it is consistent with the others.
type rows struct {
	db  *DB
	src interface {
		NewIter(*pebble.IterOptions) (*pebble.Iterator, error)
	}
	it *pebble.Iterator
}

// iter returns the view's iterator bounded to [lo, hi), unpositioned.
func (v *rows) iter(lo, hi []byte) (*pebble.Iterator, error) {
	if v.it == nil {
		it, err := v.src.NewIter(&pebble.IterOptions{LowerBound: lo, UpperBound: hi})
		if err != nil {
			return nil, err
		}
		v.it = it
		return it, nil
	}
	v.it.SetBounds(lo, hi)
	return v.it, nil
}

// View opens a consistent read of the store.
func (db *DB) View() (*View, error) {
	if db.closed.Load() {
		return nil, ErrClosed
	}
	rewrites := db.rewrites.Load()
	snap, p := db.viewSnapshot()
	return &View{rows: rows{db: db, src: snap}, snap: snap, pinned: p, rewrites: rewrites}, nil
}

// Close releases the view.
func (v *View) Close() error {
	v.closeIter()
	if v.pinned != nil {
		v.db.release(v.pinned)
		return nil
	}
	return v.snap.Close()
}

func (v *rows) closeIter() {
	if v.it != nil {
		// Its error, if any, is the last scan's, which that scan returned already.
		_ = v.it.Close()
	}
}

// RowsView is a consistent read of rows, anomalies and checkpoints only (the verb's answers): the
// reads of a View but for the event log and plans, without a snapshot. Its one iterator, opened at
// once, is the point in time; a snapshot would cost its opening and, at its close, Pebble's look for
// a compaction to schedule, on every answer. Close it when done; do not keep it open long, since an
// open iterator keeps the files and memtables it reads.
type RowsView struct {
	rows
}

// RowsView opens a consistent read of rows, anomalies and checkpoints.
func (db *DB) RowsView() (*RowsView, error) {
	if db.closed.Load() {
		return nil, ErrClosed
	}
	it, err := db.newRowsIter()
	if err != nil {
		return nil, err
	}
	return &RowsView{rows: rows{db: db, it: it}}, nil
}

// Close releases the view.
func (v *RowsView) Close() error {
	v.closeIter()
	return nil
}

// get reads one key through the view's iterator.
func (v *rows) get(key []byte) ([]byte, bool, error) {
	it, err := v.iter(key, append(key[:len(key):len(key)], 0x00))
	if err != nil {
		return nil, false, err
	}
	if !it.First() {
		return nil, false, it.Error()
	}
	return it.Value(), true, nil
}

// Checkpoint is a bucket's checkpoint as this view sees it.
func (v *rows) Checkpoint(bucket string) (Checkpoint, error) {
	b, ok, err := v.get(checkpointKey(bucket))
	if err != nil || !ok {
		return Checkpoint{}, err
	}
	return decodeCheckpoint(b)
}

func (v *rows) rangeBounds(r provisioner.Range) (base, lo, hi []byte) {
	if r.Index == provisioner.IndexPrimary {
		base = bucketPrefix(nil, prefixRow, r.Bucket)
	} else {
		base = indexPrefix(nil, r.Bucket, r.Index, r.Value)
	}
	lo = appendEsc(append([]byte(nil), base...), r.Prefix)
	hi = prefixEnd(lo)
	if r.After != "" {
		after := appendEsc(append([]byte(nil), base...), r.After)
		after = append(after, 0x00) // strictly after the cursor's own key
		if string(after) > string(lo) {
			lo = after
		}
	}
	return base, lo, hi
}

// HasRow reports whether a range holds the row of a raw key: a cursor that names a row no longer there
// cannot be paged on.
func (v *rows) HasRow(r provisioner.Range, key string) (bool, error) {
	if !strings.HasPrefix(key, r.Prefix) {
		return false, nil
	}
	base, _, _ := v.rangeBounds(provisioner.Range{Bucket: r.Bucket, Index: r.Index, Value: r.Value})
	_, ok, err := v.get(appendEsc(append([]byte(nil), base...), key))
	return ok, err
}

// Rows calls fn for each row of a range in byte order of raw keys until fn returns false. The Row and
// its slices are valid only during the call.
func (v *rows) Rows(r provisioner.Range, fn func(*provisioner.Row) bool) error {
	base, lo, hi := v.rangeBounds(r)
	it, err := v.iter(lo, hi)
	if err != nil {
		return err
	}
	var row provisioner.Row
	var kbuf []byte
	for it.First(); it.Valid(); it.Next() {
		k := it.Key()[len(base):]
		if hasZero(k) {
			kbuf = unesc(kbuf[:0], k)
			k = kbuf
		}
		row.Key = k
		if err := decodeRowValue(it.Value(), &row); err != nil {
			return err
		}
		if !fn(&row) {
			break
		}
	}
	return it.Error()
}

// Anomalies calls fn for the anomaly rows of a bucket in byte order of raw keys, those of one node only
// when node is set (the raw key's first token), at most max of them, and returns how many rows matched
// in all.
func (v *rows) Anomalies(bucket, node string, max int, fn func(provisioner.Anomaly)) (total int64, err error) {
	base := bucketPrefix(nil, prefixAnomaly, bucket)
	var ranges [][2][]byte
	if node == "" {
		ranges = [][2][]byte{{base, prefixEnd(base)}}
		cp, err := v.Checkpoint(bucket)
		if err != nil {
			return 0, err
		}
		total = cp.AnomalyRows
	} else {
		exact := append(appendEsc(append([]byte(nil), base...), node), 0x00, 0x01)
		sub := appendEsc(append([]byte(nil), base...), node+".")
		ranges = [][2][]byte{{exact, prefixEnd(exact)}, {sub, prefixEnd(sub)}}
		// The node's count, kept with its rows (nodeanom.go): reading the rows past max to count them
		// would cost every page of a node's answer all of the node's anomaly rows.
		if total, err = v.nodeAnomalies(bucket, node); err != nil {
			return 0, err
		}
		if total == 0 {
			// Most nodes have none: the two seeks into the anomaly rows would find nothing, and read
			// blocks of a range no other lookup keeps in the block cache.
			return 0, nil
		}
	}
	n := 0
	for _, rg := range ranges {
		if n >= max {
			break
		}
		it, err := v.iter(rg[0], rg[1])
		if err != nil {
			return 0, err
		}
		for it.First(); it.Valid(); it.Next() {
			if n >= max {
				break
			}
			b, key, _, ok := splitAnomalyKey(it.Key())
			if !ok {
				return 0, fmt.Errorf("%w: anomaly key", ErrCorrupt)
			}
			val := it.Value()
			rev, w := binary.Uvarint(val)
			if w <= 0 {
				return 0, fmt.Errorf("%w: anomaly value", ErrCorrupt)
			}
			a := provisioner.Anomaly{Bucket: b, Key: key, Revision: rev}
			text := string(val[w:])
			code, detail, _ := strings.Cut(text, ": ")
			a.Reason, a.Detail = provisioner.Reason(code), detail
			fn(a)
			n++
		}
		if err := it.Error(); err != nil {
			return 0, err
		}
	}
	return total, nil
}

// Buckets lists the buckets the store holds a checkpoint or anomalies for.
func (v *View) Buckets() []string { return v.db.Buckets() }

// StoreID is the ID of the store the view reads.
func (v *View) StoreID() uint64 { return v.db.id }

// Rewrites is DB.Rewrites as the view opened: a state the log rebuilds as of a point changes only
// when it moves (an expired put's event leaves the log, store/expiry.go), so whatever keeps answers
// derived from the log keys them by it too.
func (v *View) Rewrites() uint64 { return v.rewrites }

// warmRanges are what a node lookup reads besides its rows' index entries: the checkpoints, every
// bucket's rows (0x02 and 0x03, adjacent) and the per-node anomaly counts.
var warmRanges = [][2]byte{{prefixCheckpoint, prefixRow + 1}, {prefixNodeAnom, prefixNodeAnom + 1}}

// WarmRows reads at most n keys of the checkpoints, rows and per-node anomaly counts, in key order from
// the store key from on (nil: the first), so that Pebble's block cache holds their blocks; it returns
// how many it read and the store key to go on from, nil once it has read them all. A compaction writes new tables whose
// blocks no cache holds: without this, each of the next lookups reads and decompresses its blocks
// (docs/performance.md, "Session 11: node lookups at 1,000,000 keys").
func (v *RowsView) WarmRows(from []byte, n int) (read int, next []byte, err error) {
	for _, rg := range warmRanges {
		lo, hi := []byte{rg[0]}, []byte{rg[1]}
		if string(from) >= string(hi) {
			continue
		}
		if string(from) > string(lo) {
			lo = from
		}
		it, err := v.iter(lo, hi)
		if err != nil {
			return read, nil, err
		}
		for it.First(); it.Valid(); it.Next() {
			if read == n {
				return read, append([]byte(nil), it.Key()...), nil
			}
			_ = it.Value()
			read++
		}
		if err := it.Error(); err != nil {
			return read, nil, err
		}
	}
	return read, nil, nil
}
