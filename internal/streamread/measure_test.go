package streamread_test

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
)

// TestMeasurePulls compares what a read of large values holds in the client under each pull option
// (docs/performance.md, session 16). It runs against a server of its own, so that the heap sampled is
// the reader's alone: MESH_PULL_MEASURE=nats://127.0.0.1:4333 go test -run TestMeasurePulls -v.
func TestMeasurePulls(t *testing.T) {
	url := os.Getenv("MESH_PULL_MEASURE")
	if url == "" {
		t.Skip("MESH_PULL_MEASURE is not set")
	}
	const n, size = 1500, 512 << 10
	nc, err := nats.Connect(url)
	require.NoError(t, err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	ctx := context.Background()
	s, err := js.Stream(ctx, "M")
	if err != nil {
		s, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: "M", Subjects: []string{"m.>"}})
		require.NoError(t, err)
		data := make([]byte, size)
		for i := range n {
			_, err := js.Publish(ctx, fmt.Sprintf("m.%d", i), data)
			require.NoError(t, err)
		}
	}
	delay, _ := time.ParseDuration(os.Getenv("MESH_PULL_DELAY")) // the reader's work per message
	modes := []struct {
		name string
		opts []jetstream.PullMessagesOpt
	}{
		// PullMaxMessages(4096), the old option, is left out: the server pushes 2 GB at the reader,
		// cuts it off as a slow consumer (its max pending, 64 MiB), and it never reads to the end.
		{"PullMaxMessagesWithBytesLimit(4096, 32MiB)", []jetstream.PullMessagesOpt{jetstream.PullMaxMessagesWithBytesLimit(4096, 32<<20)}},
		{"PullMaxBytes(32MiB)", []jetstream.PullMessagesOpt{jetstream.PullMaxBytes(32 << 20)}},
	}
	rounds := 3
	if os.Getenv("MESH_PULL_ROUNDS") == "1" {
		rounds = 1
	}
	results := map[string][][3]float64{}
	for round := 0; round < rounds; round++ {
		for _, m := range modes {
			runtime.GC()
			var base runtime.MemStats
			runtime.ReadMemStats(&base)
			cons, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
			require.NoError(t, err)
			it, err := cons.Messages(append([]jetstream.PullMessagesOpt{jetstream.PullHeartbeat(time.Second)}, m.opts...)...)
			require.NoError(t, err)
			var read atomic.Int64
			var peakHeap, peakHeld uint64
			stop := make(chan struct{})
			var wg sync.WaitGroup
			wg.Add(1)
			go func() {
				defer wg.Done()
				tk := time.NewTicker(20 * time.Millisecond)
				defer tk.Stop()
				for {
					select {
					case <-stop:
						return
					case <-tk.C:
					}
					var ms runtime.MemStats
					runtime.ReadMemStats(&ms)
					peakHeap = max(peakHeap, ms.HeapInuse-min(ms.HeapInuse, base.HeapInuse))
					ci, err := cons.Info(ctx)
					if err == nil {
						peakHeld = max(peakHeld, (ci.Delivered.Consumer-uint64(read.Load()))*size)
					}
				}
			}()
			var ru0, ru1 syscall.Rusage
			_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru0)
			start := time.Now()
			got := 0
			for i := range n {
				msg, err := it.Next(jetstream.NextMaxWait(10 * time.Second))
				if err != nil {
					t.Logf("%s: message %d: %v", m.name, i+1, err)
					break
				}
				got++
				require.Len(t, msg.Data(), size)
				read.Add(1)
				_ = i
				if delay > 0 {
					time.Sleep(delay)
				}
			}
			took := time.Since(start)
			_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru1)
			it.Stop()
			close(stop)
			wg.Wait()
			cpu := time.Duration(ru1.Utime.Nano() + ru1.Stime.Nano() - ru0.Utime.Nano() - ru0.Stime.Nano())
			t.Logf("round %d %-45s read %d, peak heap %6.0f MiB, peak delivered and not read %6.0f MiB, took %v, cpu %v", round, m.name, got,
				float64(peakHeap)/(1<<20), float64(peakHeld)/(1<<20), took.Round(time.Millisecond), cpu.Round(time.Millisecond))
			results[m.name] = append(results[m.name], [3]float64{float64(peakHeap) / (1 << 20), float64(peakHeld) / (1 << 20), cpu.Seconds()})
		}
	}
	for _, m := range modes {
		var h, d, c []float64
		for _, r := range results[m.name] {
			h, d, c = append(h, r[0]), append(d, r[1]), append(c, r[2])
		}
		sort.Float64s(h)
		sort.Float64s(d)
		sort.Float64s(c)
		t.Logf("median %-45s peak heap %6.0f MiB, peak delivered and not read %6.0f MiB, cpu %.2fs", m.name, h[len(h)/2], d[len(d)/2], c[len(c)/2])
	}
}
