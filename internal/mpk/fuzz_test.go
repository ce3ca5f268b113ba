package mpk

import (
	"encoding/json"
	"testing"
	"time"
)

func fuzzSeeds(f *testing.F) {
	f.Add(benchValue())
	f.Add([]byte{0xc1})
	f.Add([]byte{0x92, 0x01, 0xa1, 'x'})
	f.Add([]byte{0x81, 0x92, 0x01, 0xc3, 0xcb, 0x7f, 0xf8, 0, 0, 0, 0, 0, 1})
	f.Add([]byte{0xdb, 0xff, 0xff, 0xff, 0xff, 'a'})
	f.Add([]byte{0xdf, 0, 0, 0, 1, 0x80, 0xc4, 1, 0xff})
	f.Add(AppendTime(nil, time.Unix(-1, 5)))
	f.Add([]byte{0xd7, 0xff, 0xee, 0x6b, 0x28, 0x00, 0, 0, 0, 0})
	f.Add([]byte{0xc7, 3, 7, 'a', 'b', 'c'})
	f.Add(AppendString(nil, "\xff\u2028\"\\\x01"))
	b, _ := keyNest(3)
	f.Add(b)
	f.Add(nest([]byte{0x91}, MaxDepth+1, 0xc0))
}

func FuzzSkip(f *testing.F) {
	fuzzSeeds(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		n, err := Skip(b)
		if err != nil {
			if n != 0 {
				t.Fatalf("n=%d with err=%v", n, err)
			}
			if Valid(b) {
				t.Fatal("Valid accepts what Skip rejects")
			}
			return
		}
		if n <= 0 || n > len(b) {
			t.Fatalf("n=%d out of range for %d bytes", n, len(b))
		}
		if !Valid(b[:n]) || Valid(b) != (n == len(b)) {
			t.Fatal("Valid disagrees with Skip")
		}
		// Skip succeeded, so every declared length fits in b: safe to hand
		// to vmihailenco, which must agree.
		want, err := vmSkip(b)
		if err != nil || want != n {
			t.Fatalf("vmihailenco consumed %d (%v), Skip %d", want, err, n)
		}
	})
}

func FuzzAppendJSON(f *testing.F) {
	fuzzSeeds(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		out, n, err := AppendJSON([]byte("x"), b)
		if len(out) == 0 || out[0] != 'x' {
			t.Fatal("dst prefix lost")
		}
		sn, serr := Skip(b)
		if err != nil {
			if n != 0 {
				t.Fatalf("n=%d with err=%v", n, err)
			}
			if serr == nil && err != ErrInvalid && err != ErrTooDeep && err != ErrNoJSON {
				t.Fatalf("AppendJSON: %v, but Skip succeeded", err)
			}
			return
		}
		if serr != nil || sn != n {
			t.Fatalf("AppendJSON consumed %d, Skip %d (%v)", n, sn, serr)
		}
		if !json.Valid(out[1:]) {
			t.Fatalf("invalid JSON %q", out[1:])
		}
	})
}
