package store

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"syscall"
	"testing"
)

// TestAppendEsc_EveryZeroByte: the escape writes every 0x00 as 0x00 0xff and nothing else changes, for
// strings and byte slices alike, and unesc reverses it.
func TestAppendEsc_EveryZeroByte(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for n := 0; n < 2000; n++ {
		b := make([]byte, r.IntN(12))
		for i := range b {
			b[i] = []byte{0, 0xff, 1, 'a'}[r.IntN(4)]
		}
		var want []byte
		for _, c := range b {
			want = append(want, c)
			if c == 0 {
				want = append(want, 0xff)
			}
		}
		prefix := []byte{0x03}
		if got := appendEsc(bytes.Clone(prefix), string(b)); !bytes.Equal(got, append(prefix, want...)) {
			t.Fatalf("appendEsc(%x) = %x, want %x", b, got[1:], want)
		}
		if got := unesc(nil, want); !bytes.Equal(got, b) {
			t.Fatalf("unesc(%x) = %x, want %x", want, got, b)
		}
	}
}

// A read that failed for want of a descriptor is not said to be a broken state dir (an operator told
// so would rebuild for nothing), though it stays an ErrCorrupt beneath for the callers that tell the
// two apart by isAccess.
func TestReadErr_OutOfDescriptorsIsNotBroken(t *testing.T) {
	err := readErr(fmt.Errorf("pebble: backing file 000020 error: open x.sst: %w", syscall.EMFILE))
	if msg := err.Error(); strings.Contains(msg, "broken") || !strings.Contains(msg, "EMFILE") || !strings.Contains(msg, "LimitNOFILE") {
		t.Fatalf("out of descriptors said as %q", msg)
	}
	if !isAccess(err) || !errors.Is(err, syscall.EMFILE) {
		t.Fatalf("%v: not an access error carrying EMFILE", err)
	}
	if msg := readErr(errors.New("pebble: checksum mismatch")).Error(); !strings.Contains(msg, "broken") {
		t.Fatalf("a damaged read said as %q", msg)
	}
}
