package mpk

import (
	"testing"
	"time"
)

// benchValue returns a realistic stored value: a map of about 100 bytes.
func benchValue() []byte {
	b := AppendMapHeader(nil, 8)
	b = AppendString(b, "id")
	b = AppendUint(b, 918273645)
	b = AppendString(b, "name")
	b = AppendString(b, "edge-router-07")
	b = AppendString(b, "online")
	b = AppendBool(b, true)
	b = AppendString(b, "load")
	b = AppendFloat64(b, 0.731)
	b = AppendString(b, "peers")
	b = AppendArrayHeader(b, 3)
	b = AppendInt(b, 12)
	b = AppendInt(b, -4)
	b = AppendInt(b, 300)
	b = AppendString(b, "region")
	b = AppendString(b, "eu-west \"2\"")
	b = AppendString(b, "seen")
	b = AppendTime(b, time.Unix(1700000000, 250000000))
	b = AppendString(b, "meta")
	b = AppendMapHeader(b, 1)
	b = AppendString(b, "ver")
	b = AppendNil(b)
	return b
}

func BenchmarkSkip(b *testing.B) {
	v := benchValue()
	b.SetBytes(int64(len(v)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Skip(v); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkAppendJSON(b *testing.B) {
	v := benchValue()
	dst := make([]byte, 0, 512)
	b.SetBytes(int64(len(v)))
	b.ReportAllocs()
	for b.Loop() {
		var err error
		if dst, _, err = AppendJSON(dst[:0], v); err != nil {
			b.Fatal(err)
		}
	}
}
