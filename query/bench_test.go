package query

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"syscall"
	"testing"

	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/mpk"
	"github.com/novox/mesh-provisioner/store"
)

// BenchmarkAnswer writes answers from a compacted store of 100,000 needs (400 nodes × 25 modules × 10;
// BENCH_NODES=4000: 1,000,000, as make bench) without NATS: the seat's own share of a lookup, per row,
// steadier than the end-to-end benches.
// Run using: go test ./query -run x -bench Answer -cpuprofile cpu.prof
func BenchmarkAnswer(b *testing.B) {
	s := benchServer(b)
	nodes := benchNodes()
	for _, tc := range []struct {
		name string
		req  func(r *rand.Rand) Request
	}{
		{"node-one-row", func(r *rand.Rand) Request {
			return Request{What: "needs", Node: fixtures.NodeName(r.IntN(nodes)), Limit: ptr(int64(1))}
		}},
		{"node-250", func(r *rand.Rand) Request { return Request{What: "needs", Node: fixtures.NodeName(r.IntN(nodes))} }},
		{"module", func(r *rand.Rand) Request { return Request{What: "needs", Module: fixtures.ModuleName(r.IntN(50))} }},
	} {
		for _, f := range []Format{FormatMsgpack, FormatJSON} {
			b.Run(tc.name+"/"+formatName(f), func(b *testing.B) {
				r := rand.New(rand.NewPCG(1, 1))
				var e Encoder
				e.SetMaxBytes(1 << 20)
				b.ReportAllocs()
				rows := 0
				cpu0 := processCPU()
				for b.Loop() {
					req := tc.req(r)
					if req.Limit == nil {
						req.Limit = ptr(int64(MaxLimit))
					}
					for {
						if err := s.Answer(context.Background(), &req, f, &e); err != nil {
							b.Fatal(err)
						}
						n, next := countAnswer(b, e.Bytes(), f)
						rows += n
						if next == "" || req.Limit != nil && *req.Limit < MaxLimit {
							break
						}
						req.After = next
					}
				}
				cpu := processCPU() - cpu0
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(rows), "ns/row")
				// CPU time of the process (GC and Pebble's own goroutines too) is steadier than wall time on a
				// shared machine.
				b.ReportMetric(float64(cpu)/float64(rows), "cpu-ns/row")
			})
		}
	}
}

// benchNodes is the nodes of the benchmarks' mesh: 400, or BENCH_NODES.
func benchNodes() int {
	if n, err := strconv.Atoi(os.Getenv("BENCH_NODES")); err == nil && n > 0 {
		return n
	}
	return 400
}

var (
	benchOnce sync.Once
	benchDB   *store.DB
)

// benchServer is a Server over a store of 100,000 needs, built once per process and compacted.
func benchServer(b *testing.B) *Server {
	benchOnce.Do(func() {
		db, err := store.Open(b.TempDir(), store.Options{})
		if err != nil {
			b.Fatal(err)
		}
		byBucket := map[string][]provisioner.Message{}
		for _, e := range provisioner.Registry.Entries {
			ms := byBucket[provisioner.BucketRegistry]
			byBucket[provisioner.BucketRegistry] = append(ms, provisioner.Message{Seq: uint64(len(ms) + 1), Key: e.Kind, Op: provisioner.OpPut, Value: e.Value(), Time: 1.7e18})
		}
		for _, op := range (fixtures.Mesh{Seed: 1, Nodes: benchNodes(), Modules: 25, NeedsPerModule: 10}).OpsOf(provisioner.BucketNeeds) {
			ms := byBucket[op.Bucket]
			byBucket[op.Bucket] = append(ms, provisioner.Message{Seq: uint64(len(ms) + 1), Key: op.Key, Op: op.Op, Value: op.Value, Time: 1.7e18 + int64(len(ms))*1237})
		}
		for _, bucket := range []string{provisioner.BucketRegistry, provisioner.BucketNeeds} {
			ms := byBucket[bucket]
			for i := 0; i < len(ms); i += 4096 {
				if err := db.Apply(bucket, ms[i:min(i+4096, len(ms))], 1, false); err != nil {
					b.Fatal(err)
				}
			}
			db.SetSynced(bucket, true)
		}
		if err := db.CompactAll(context.Background()); err != nil {
			b.Fatal(err)
		}
		benchDB = db // the process's: closed when it ends
	})
	return NewServer(StoreReader(benchDB), Options{})
}

// countAnswer counts an answer's rows and reads its next, from the bytes the encoder wrote (rows are
// an array of fixed-width header in MessagePack, objects starting {"key": in JSON; next is written
// last), without decoding the answer: the benchmark measures the writing.
func countAnswer(b *testing.B, data []byte, f Format) (int, string) {
	tail := data[max(0, len(data)-1024):] // next is written last; the fixtures' keys are short
	if f == FormatJSON {
		n := bytes.Count(data, []byte(`{"key":`))
		i := bytes.LastIndex(tail, []byte(`,"next":`))
		if i < 0 {
			return n, ""
		}
		var next string
		if err := json.Unmarshal(tail[i+len(`,"next":`):len(tail)-1], &next); err != nil {
			b.Fatal(err)
		}
		return n, next
	}
	i := bytes.Index(data, []byte("\xa4rows\xdd"))
	if i < 0 {
		b.Fatal("no rows")
	}
	n := int(binary.BigEndian.Uint32(data[i+6:]))
	j := bytes.LastIndex(tail, []byte("\xa4next"))
	if j < 0 {
		return n, ""
	}
	var next string
	if err := msgpack.Unmarshal(tail[j+5:], &next); err != nil {
		b.Fatal(err)
	}
	return n, next
}

// BenchmarkEncoder_Row writes one row of a need, of the fixtures' value, into a reused encoder: the
// row writer alone, without the store.
func BenchmarkEncoder_Row(b *testing.B) {
	value := (fixtures.Mesh{Seed: 1, Nodes: 1, Modules: 1, NeedsPerModule: 1}).OpsOf(provisioner.BucketNeeds)[0].Value
	row := provisioner.Row{Key: []byte("node-0001.module-01.config.name-0001"), Revision: 123456, Created: 1.7e18 + 123456789, Msgpack: true, Value: value}
	parts, ok := provisioner.PartsOfStored(provisioner.ShapeNeeds, string(row.Key))
	if !ok {
		b.Fatal("the key is out of shape")
	}
	for _, f := range []Format{FormatMsgpack, FormatJSON} {
		b.Run(formatName(f), func(b *testing.B) {
			var e Encoder
			b.ReportAllocs()
			cpu0 := processCPU()
			for b.Loop() {
				e.Reset(f)
				e.BeginAnswer("needs")
				for range 250 {
					if err := e.Row(provisioner.WhatNeeds, &row, &parts); err != nil {
						b.Fatal(err)
					}
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*250), "ns/row")
			b.ReportMetric(float64(processCPU()-cpu0)/float64(b.N*250), "cpu-ns/row")
		})
	}
}

// BenchmarkDecodeRequest decodes a node lookup's request, as a node client sends it.
func BenchmarkDecodeRequest(b *testing.B) {
	for _, tc := range []struct {
		name string
		body []byte
	}{
		{"json", []byte(`{"what":"needs","node":"node-0001","min_seq":12345,"wait_ms":500}`)},
		{"msgpack", func() []byte {
			m := mpk.AppendMapHeader(nil, 4)
			m = mpk.AppendString(mpk.AppendString(m, "what"), "needs")
			m = mpk.AppendString(mpk.AppendString(m, "node"), "node-0001")
			m = mpk.AppendUint(mpk.AppendString(m, "min_seq"), 12345)
			return mpk.AppendUint(mpk.AppendString(m, "wait_ms"), 500)
		}()},
	} {
		b.Run(tc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, _, err := DecodeRequest(tc.body); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// processCPU is the process's CPU time so far, in nanoseconds: steadier than wall time on a shared
// machine.
func processCPU() int64 {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return ru.Utime.Nano() + ru.Stime.Nano()
}

func formatName(f Format) string {
	if f == FormatJSON {
		return "json"
	}
	return "msgpack"
}
