package store

import (
	"bytes"
	"slices"

	"github.com/cockroachdb/pebble/v2"
)

// sortedWrites gathers one Apply's point writes and hands them to a Pebble batch in key order.
//
// A batch's entries are inserted into the memtable's skiplist one by one at commit. In stream order
// they land all over it (a need's row, its module and kind index entries and its event log entries are
// far apart), and each insert walks the skiplist from the top through cold cache lines; that walk was
// the largest single cost of ingest. In key order each insert starts from where the last one ended,
// and the flush that follows reads the arena in nearly sequential order too. Writes to the same key
// keep their order (the sort breaks ties by arrival), so the last one still wins.
type sortedWrites struct {
	arena []byte
	ops   []sortedOp
	order []int32
}

type sortedOp struct {
	key, val uint32 // offsets in arena
	klen     uint32
	vlen     uint32
	del      bool
}

func (w *sortedWrites) reset() {
	w.arena, w.ops, w.order = w.arena[:0], w.ops[:0], w.order[:0]
}

func (w *sortedWrites) set(key, val []byte) {
	k := uint32(len(w.arena))
	w.arena = append(w.arena, key...)
	v := uint32(len(w.arena))
	w.arena = append(w.arena, val...)
	w.ops = append(w.ops, sortedOp{key: k, klen: uint32(len(key)), val: v, vlen: uint32(len(val))})
}

func (w *sortedWrites) delete(key []byte) {
	k := uint32(len(w.arena))
	w.arena = append(w.arena, key...)
	w.ops = append(w.ops, sortedOp{key: k, klen: uint32(len(key)), del: true})
}

func (w *sortedWrites) keyOf(i int32) []byte {
	o := &w.ops[i]
	return w.arena[o.key : o.key+o.klen : o.key+o.klen]
}

// writeTo writes the gathered writes into b in key order.
//
// Every store key starts with its family byte (store/doc.go), so the writes are first spread by it in
// one counting pass, then each family is sorted on its own: a family that arrives in order (the event
// log's sequences; rows and history when a stream holds each node's keys together) is sorted in one
// pass, and the others sort fewer entries each.
func (w *sortedWrites) writeTo(b *pebble.Batch) error {
	var start [257]int32
	for i := range w.ops {
		start[w.arena[w.ops[i].key]+1]++
	}
	for f := 1; f < len(start); f++ {
		start[f] += start[f-1]
	}
	next := start
	w.order = slices.Grow(w.order[:0], len(w.ops))[:len(w.ops)]
	for i := range w.ops {
		f := w.arena[w.ops[i].key]
		w.order[next[f]] = int32(i)
		next[f]++
	}
	cmp := func(x, y int32) int {
		if c := bytes.Compare(w.keyOf(x), w.keyOf(y)); c != 0 {
			return c
		}
		return int(x - y)
	}
	for f := 0; f < 256; f++ {
		if fam := w.order[start[f]:start[f+1]]; len(fam) > 1 {
			slices.SortFunc(fam, cmp)
		}
	}
	for _, i := range w.order {
		o := &w.ops[i]
		var err error
		if o.del {
			err = b.Delete(w.keyOf(i), nil)
		} else {
			err = b.Set(w.keyOf(i), w.arena[o.val:o.val+o.vlen], nil)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// writesCache keeps one sortedWrites between Applies (they are serialised), unless a catch-up batch
// grew it beyond what is worth keeping.
type writesCache struct{ w *sortedWrites }

func (c *writesCache) take() *sortedWrites {
	if c.w == nil {
		return &sortedWrites{}
	}
	w := c.w
	c.w = nil
	w.reset()
	return w
}

func (c *writesCache) give(w *sortedWrites) {
	if cap(w.arena) <= 16<<20 {
		c.w = w
	}
}
