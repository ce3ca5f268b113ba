package store

import (
	"bytes"
	"encoding/binary"
	"math/bits"
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
	order []sortKey
	tmp   []sortKey // radixSort's other buffer
}

// sortKey is a write's place in the sort: the 16 bytes of its key that follow the prefix every key of
// its family shares in this batch, as two big-endian words (zeros past the key's end), and the write's
// index. Two words decide almost every comparison without reading the arena; equal words (keys that
// agree on those 16 bytes, or are shorter) are decided by the keys themselves.
type sortKey struct {
	hi, lo uint64
	i      int32
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
// one counting pass, then each family is sorted on its own, with fewer entries each. The keys of a
// family share a long prefix in a batch (the family byte, the bucket, often the first characters of
// the node), so each is sorted by the 16 bytes after that prefix held beside its index (sortKey):
// comparing keys in the arena, each through two indirections and cold cache lines, was a fifth of the
// store's CPU at a million needs. Those 16 bytes are sorted by a radix sort (radixSort), and only the
// runs of keys equal on them are compared in the arena.
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
		w.order[next[f]] = sortKey{i: int32(i)}
		next[f]++
	}
	var shared int // the prefix the family being sorted shares
	cmp := func(x, y sortKey) int {
		switch {
		case x.hi != y.hi:
			return cmpUint64(x.hi, y.hi)
		case x.lo != y.lo:
			return cmpUint64(x.lo, y.lo)
		}
		if c := bytes.Compare(w.keyOf(x.i)[shared:], w.keyOf(y.i)[shared:]); c != 0 {
			return c
		}
		return int(x.i - y.i)
	}
	for f := 0; f < 256; f++ {
		fam := w.order[start[f]:start[f+1]]
		if len(fam) <= 1 {
			continue
		}
		first := w.keyOf(fam[0].i)
		shared = len(first)
		for _, s := range fam[1:] {
			shared = commonPrefix(first[:shared], w.keyOf(s.i))
		}
		for j := range fam {
			fam[j].hi, fam[j].lo = words(w.keyOf(fam[j].i)[shared:])
		}
		// By the words first, a byte at a time, keeping arrival order among equal words; then each
		// run of equal words (keys that agree on them: a node's needs of one module and kind, say)
		// by the keys themselves.
		w.tmp = slices.Grow(w.tmp[:0], len(fam))[:len(fam)]
		radixSort(fam, w.tmp)
		for j := 0; j < len(fam); {
			k := j + 1
			for k < len(fam) && fam[k].hi == fam[j].hi && fam[k].lo == fam[j].lo {
				k++
			}
			if k-j > 1 {
				slices.SortFunc(fam[j:k], cmp)
			}
			j = k
		}
	}
	for _, s := range w.order {
		o := &w.ops[s.i]
		var err error
		if o.del {
			err = b.Delete(w.keyOf(s.i), nil)
		} else {
			err = b.Set(w.keyOf(s.i), w.arena[o.val:o.val+o.vlen], nil)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// radixSort sorts keys by their words, hi then lo, stably (keys with equal words keep their order): a
// least-significant-digit radix sort a byte at a time, through tmp (as long as keys), passing over the
// bytes every key shares. It replaced a comparison sort that called the comparison through a
// function value some 12 times a key: 9.5% of the ingest child's CPU at 1,000,000 keys
// (docs/performance.md, session 19).
func radixSort(keys, tmp []sortKey) {
	var counts [16][256]int32
	for _, k := range keys {
		for b := range 8 {
			counts[b][byte(k.lo>>(8*b))]++
			counts[8+b][byte(k.hi>>(8*b))]++
		}
	}
	src, dst := keys, tmp
	for d := range 16 {
		c := &counts[d]
		shift := uint(8 * (d % 8))
		first := src[0].lo
		if d >= 8 {
			first = src[0].hi
		}
		if c[byte(first>>shift)] == int32(len(src)) {
			continue // every key has this byte
		}
		var next [256]int32
		var sum int32
		for v := range c {
			next[v] = sum
			sum += c[v]
		}
		for _, k := range src {
			word := k.lo
			if d >= 8 {
				word = k.hi
			}
			v := byte(word >> shift)
			dst[next[v]] = k
			next[v]++
		}
		src, dst = dst, src
	}
	if &src[0] != &keys[0] {
		copy(keys, src)
	}
}

func cmpUint64(x, y uint64) int {
	if x < y {
		return -1
	}
	return 1
}

// commonPrefix is the length of the longest prefix a and b share, compared eight bytes at a time.
func commonPrefix(a, b []byte) int {
	n := min(len(a), len(b))
	i := 0
	for ; i+8 <= n; i += 8 {
		if x := binary.BigEndian.Uint64(a[i:]) ^ binary.BigEndian.Uint64(b[i:]); x != 0 {
			return i + bits.LeadingZeros64(x)/8
		}
	}
	for ; i < n && a[i] == b[i]; i++ {
	}
	return i
}

// words is the first 16 bytes of k as two big-endian words, zeros past its end: ordered as the keys
// are, but for keys that agree on them.
func words(k []byte) (hi, lo uint64) {
	if len(k) >= 16 {
		return binary.BigEndian.Uint64(k), binary.BigEndian.Uint64(k[8:])
	}
	var pad [16]byte
	copy(pad[:], k)
	return binary.BigEndian.Uint64(pad[:]), binary.BigEndian.Uint64(pad[8:])
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
