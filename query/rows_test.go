package query

import (
	"bytes"
	"math/rand/v2"
	"strings"
	"testing"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/mpk"
)

// rowMsgpackPlain is rowMsgpack written with plain appends, as it was before its names were stored in
// blocks: the reference its output must equal byte for byte.
func rowMsgpackPlain(b []byte, row *provisioner.Row, parts []field) []byte {
	n := 4 + len(parts)
	if !row.Msgpack {
		n++
	}
	b = mpk.AppendMapHeader(b, n)
	b = append(b, mpNames[fKey]...)
	b = mpk.AppendStringBytes(b, row.Key)
	b = append(b, mpNames[fRevision]...)
	b = mpk.AppendUint(b, row.Revision)
	b = append(b, mpNames[fCreated]...)
	b = mpk.AppendUnixNano(b, row.Created)
	b = append(b, mpNames[fValue]...)
	if row.Msgpack {
		b = append(b, row.Value...)
	} else {
		b = mpk.AppendNil(b)
		b = append(b, mpNames[fValueRaw]...)
		b = mpk.AppendBin(b, row.Value)
	}
	for _, f := range parts {
		b = append(b, mpNames[f.name]...)
		b = mpk.AppendString(b, f.v)
	}
	return b
}

// TestRowMsgpackBytes writes rows of every what, with keys, values and parts of every string header's
// width, revisions of every integer width and times of every timestamp form, into buffers with and
// without room, and checks each against the plain reference: the row encoder's block stores must
// change no byte.
func TestRowMsgpackBytes(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 7))
	lengths := []int{0, 1, 5, 31, 32, 255, 256, 65535, 65536}
	str := func() string { return strings.Repeat("x", lengths[r.IntN(len(lengths))]) }
	revs := []uint64{0, 127, 128, 255, 256, 65535, 65536, 1<<32 - 1, 1 << 32, 1<<64 - 1}
	times := []int64{0, 1.7e18, 1.7e18 + 1, (1 << 33) * 1e9, 1 << 62, -1, -1.7e18 - 3}
	for i := range 3000 {
		row := provisioner.Row{Key: []byte(str()), Revision: revs[r.IntN(len(revs))], Created: times[r.IntN(len(times))],
			Msgpack: r.IntN(2) == 0, Value: []byte(str())}
		var parts []field
		for j := range r.IntN(6) {
			parts = append(parts, field{fNode + (j+r.IntN(nFields))%(nFields-fNode), str()})
		}
		var e Encoder
		e.Reset(FormatMsgpack)
		prefix := bytes.Repeat([]byte{0xee}, r.IntN(40))
		if i%2 == 0 {
			e.buf = append(make([]byte, 0, len(prefix)+r.IntN(64)), prefix...) // little or no room: grown
		} else {
			e.buf = append(make([]byte, 0, 1<<18), prefix...)
		}
		e.rowMsgpack(&row, parts)
		want := rowMsgpackPlain(append([]byte(nil), prefix...), &row, parts)
		if !bytes.Equal(e.buf, want) {
			t.Fatalf("row %d (key %d bytes, value %d bytes, msgpack %v, %d parts): wrote\n%x\nwant\n%x",
				i, len(row.Key), len(row.Value), row.Msgpack, len(parts), e.buf[:min(len(e.buf), 200)], want[:min(len(want), 200)])
		}
	}
}
