package store

import (
	"encoding/binary"
	"math/bits"
)

// uvarint is binary.Uvarint, the same value and width for every input, reading the first eight bytes
// at once when b holds them: a row's created time is a varint of nine bytes, and a byte-by-byte loop
// over it and the revision was a twelfth of a module walk's CPU (docs/performance.md, "Session 17").
func uvarint(b []byte) (uint64, int) {
	if len(b) < 9 {
		return binary.Uvarint(b)
	}
	w := binary.LittleEndian.Uint64(b)
	if ends := ^w & 0x8080808080808080; ends != 0 {
		// The first byte whose continuation bit is clear ends it: n bytes, n <= 8.
		n := bits.TrailingZeros64(ends)>>3 + 1
		return packed7(w & (^uint64(0) >> (64 - 8*n))), n
	}
	if b[8] < 0x80 { // nine bytes: 56 bits from the first eight, 7 more from the ninth (63 in all)
		return packed7(w) | uint64(b[8])<<56, 9
	}
	return binary.Uvarint(b) // ten bytes, or more: binary.Uvarint says whether it overflows
}

// varint is binary.Varint, by uvarint.
func varint(b []byte) (int64, int) {
	ux, n := uvarint(b)
	x := int64(ux >> 1)
	if ux&1 != 0 {
		x = ^x
	}
	return x, n
}

// packed7 is the 56 bits of the low seven bits of each of w's eight bytes, the first byte lowest.
func packed7(w uint64) uint64 {
	x := w & 0x7f7f7f7f7f7f7f7f
	x = x&0x007f007f007f007f | x&0x7f007f007f007f00>>1
	x = x&0x00003fff00003fff | x&0x3fff00003fff0000>>2
	return x&0x000000000fffffff | x&0x0fffffff00000000>>4
}
