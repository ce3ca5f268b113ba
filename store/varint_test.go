package store

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestUvarint_AgreesWithBinary reads every width of varint, at the end of a buffer and followed by other
// bytes, non-canonical and overflowing ones and buffers cut short, as encoding/binary does.
func TestUvarint_AgreesWithBinary(t *testing.T) {
	var bufs [][]byte
	for _, v := range []uint64{0, 1, 127, 128, 300, 1 << 20, 1<<56 - 1, 1 << 56, 1<<63 - 1, 1 << 63, math.MaxUint64} {
		bufs = append(bufs, binary.AppendUvarint(nil, v))
	}
	r := rand.New(rand.NewPCG(1, 2))
	for range 20000 {
		v := r.Uint64() >> r.IntN(64)
		b := binary.AppendUvarint(nil, v)
		for range r.IntN(12) {
			b = append(b, byte(r.Uint32()))
		}
		bufs = append(bufs, b)
		raw := make([]byte, r.IntN(14)) // any bytes: cut short, non-canonical, overflowing
		for i := range raw {
			raw[i] = byte(r.Uint32()) | 0x80*byte(r.IntN(2))
		}
		bufs = append(bufs, raw)
	}
	bufs = append(bufs, []byte{0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01}, []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02},
		[]byte{0x80, 0x00, 0, 0, 0, 0, 0, 0, 0}, []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f})
	for _, b := range bufs {
		for cut := 0; cut <= len(b); cut++ {
			wv, wn := binary.Uvarint(b[:cut])
			gv, gn := uvarint(b[:cut])
			require.Equal(t, wn, gn, "% x", b[:cut])
			require.Equal(t, wv, gv, "% x", b[:cut])
			sv, sn := binary.Varint(b[:cut])
			hv, hn := varint(b[:cut])
			require.Equal(t, sn, hn, "% x", b[:cut])
			require.Equal(t, sv, hv, "% x", b[:cut])
		}
	}
}
