package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"runtime/metrics"
	"runtime/pprof"
	"strings"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// The stream limit and the ingest are each measured in a child process of its own, the bench's own
// binary run with -child-limit or -child-ingest, against the NATS server in the bench process: alike,
// and neither inside the bench process, whose heap (the NATS server's subject trees, about 250 MB at a
// million keys) makes a GC cycle cost both cores for half a second whenever something allocating in it
// brings one on. Each child times itself, after it connected (and, ingesting, opened its store), so
// process start-up is not counted: it prints "start" as its window opens and a childWindow as JSON on
// "done " as it closes, so the bench can count its own CPU and GC cycles over the same window.

// childWindow is one timed window of a child: what it read or applied, how long it took, and the
// child's own CPU time (user and system), completed GC cycles and bytes allocated on its heap over it.
type childWindow struct {
	Bucket string        `json:"bucket"`
	Msgs   int           `json:"msgs"`
	Wall   time.Duration `json:"wall_ns"`
	CPU    time.Duration `json:"cpu_ns"`
	GC     uint64        `json:"gc"`
	Alloc  uint64        `json:"alloc_bytes"`
}

// measured is a child's windows added up, with the bench process's CPU time and GC cycles over them
// (the NATS server's delivery, mostly).
type measured struct {
	childWindow
	ServerCPU time.Duration
	ServerGC  uint64
}

// cpuMsg is CPU time a message, in µs.
func cpuMsg(d time.Duration, n int) float64 {
	if n == 0 {
		return 0
	}
	return float64(d) / 1e3 / float64(n)
}

// processCPU is this process's user and system CPU time, its ended threads included.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// gcCycles is how many GC cycles this process has completed (runtime/metrics: no stop of the world).
func gcCycles() uint64 { return readMetric("/gc/cycles/total:gc-cycles") }

// heapAllocs is how many bytes this process has allocated on its heap.
func heapAllocs() uint64 { return readMetric("/gc/heap/allocs:bytes") }

func readMetric(name string) uint64 {
	s := []metrics.Sample{{Name: name}}
	metrics.Read(s)
	if s[0].Value.Kind() != metrics.KindUint64 {
		return 0
	}
	return s[0].Value.Uint64()
}

// childRole is what a child measures, "limit" or "ingest" (main sets it), naming its profiles.
var childRole string

// window times one part of a child: it prints "start", runs f, and prints "done" and the window. With
// BENCH_CHILD_PROFILE=<prefix> it writes a CPU profile of the window to <prefix>.<role>.<bucket>.
func window(bucket string, f func() (int, error)) error {
	stopProfile, err := startProfile(bucket)
	if err != nil {
		return err
	}
	fmt.Println("start")
	cpu0, gc0, alloc0 := processCPU(), gcCycles(), heapAllocs()
	start := time.Now()
	n, err := f()
	w := childWindow{Bucket: bucket, Msgs: n, Wall: time.Since(start), CPU: processCPU() - cpu0, GC: gcCycles() - gc0, Alloc: heapAllocs() - alloc0}
	stopProfile()
	if err != nil {
		return err
	}
	line, err := json.Marshal(w)
	if err != nil {
		return err
	}
	fmt.Printf("done %s\n", line)
	return nil
}

// startProfile starts the CPU profile of a window when BENCH_CHILD_PROFILE asks for one; the function
// it returns stops it. The profiler's own cost (100 samples a second) is in the window's CPU.
func startProfile(bucket string) (func(), error) {
	prefix := os.Getenv("BENCH_CHILD_PROFILE")
	if prefix == "" {
		return func() {}, nil
	}
	f, err := os.Create(prefix + "." + childRole + "." + bucket)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, err
	}
	return func() {
		pprof.StopCPUProfile()
		f.Close()
	}, nil
}

// childConnect connects a child to the bench's NATS server.
func childConnect(url string) (*nats.Conn, jetstream.JetStream, error) {
	nc, err := nats.Connect(url)
	if err != nil {
		return nil, nil, err
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, nil, err
	}
	return nc, js, nil
}

// runChildLimit is the bench run as the stream limit (-child-limit): a bare ordered consumer reading
// each bucket's whole stream in turn, doing nothing with the messages, one window a bucket.
func runChildLimit(url string, buckets []string) error {
	nc, js, err := childConnect(url)
	if err != nil {
		return err
	}
	defer nc.Close()
	ctx := context.Background()
	for _, bucket := range buckets {
		s, err := js.Stream(ctx, provisioner.StreamName(bucket))
		if err != nil {
			return err
		}
		info, err := s.Info(ctx)
		if err != nil {
			return err
		}
		msgs := int(info.State.Msgs)
		runtime.GC() // the start-up's garbage, not the window's
		if err := window(bucket, func() (int, error) { return readStream(ctx, s, msgs) }); err != nil {
			return err
		}
	}
	return nil
}

// readStream reads msgs messages of a stream with a bare ordered consumer.
func readStream(ctx context.Context, s jetstream.Stream, msgs int) (int, error) {
	cons, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		return 0, err
	}
	it, err := cons.Messages(jetstream.PullMaxMessages(8192))
	if err != nil {
		return 0, err
	}
	defer it.Stop()
	n := 0
	for n < msgs {
		if _, err := it.Next(); err != nil {
			return n, err
		}
		n++
	}
	return n, nil
}

// runChildIngest is the bench run as the ingest (-child-ingest): the projector on the registry's and
// the needs' streams, as serve tails them, into an empty store at state, until the needs stream's last
// sequence (as it was when the child started) is applied. The window opens after the store is open.
// The store is opened as serve opens an empty state dir (store.OpenState with FirstFillNoWAL: no log,
// compactions held for the first fill's longer hold, a bucket's synced batch made durable by a flush):
// until Session 21 it was opened with NoWAL alone, whose hold ends after 16 flushes, about the end of a
// million needs, so the window could include compactions serve's first fill does not run (h153). The
// seat's checkpoint into a generation with a log and its swap, once caught up (seat/relog.go), come
// after that catch-up and are outside the window; so is the Close that flushes the last memtables.
func runChildIngest(url, state string) error {
	nc, js, err := childConnect(url)
	if err != nil {
		return err
	}
	defer nc.Close()
	ctx := context.Background()
	db, err := store.OpenState(state, store.Options{FirstFillNoWAL: true})
	if err != nil {
		return err
	}
	defer db.Close()
	s, err := js.Stream(ctx, provisioner.StreamName(provisioner.BucketNeeds))
	if err != nil {
		return err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return err
	}
	last, msgs := info.State.LastSeq, int(info.State.Msgs)
	runtime.GC()
	var p *projector.Projector
	defer func() {
		if p != nil {
			p.Stop() // after the window, as the bench stopped it before
		}
	}()
	return window(provisioner.BucketNeeds, func() (int, error) {
		// With the registry, as serve tails it: needs wait for it, and a need whose kind it answers
		// raises no unanswered-kind anomaly. Without it every need would write one.
		p = projector.New(js, db, projector.Options{Buckets: []string{provisioner.BucketRegistry, provisioner.BucketNeeds}})
		p.Start(ctx)
		for {
			if seq, _ := db.Applied(provisioner.BucketNeeds); seq >= last {
				return msgs, nil
			}
			time.Sleep(time.Millisecond)
		}
	})
}

// measureChild runs the bench's own binary with args as a measuring child and adds up its windows,
// counting the bench process's CPU time and GC cycles over each. The bench's garbage is collected
// first, as before the node lookups.
func (b *bench) measureChild(args ...string) (measured, error) {
	self, err := os.Executable()
	if err != nil {
		return measured{}, err
	}
	cmd := exec.Command(self, args...)
	cmd.Stderr = os.Stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return measured{}, err
	}
	runtime.GC()
	if err := cmd.Start(); err != nil {
		return measured{}, err
	}
	var m measured
	var cpu0 time.Duration
	var gc0 uint64
	sc := bufio.NewScanner(stdout)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == "start":
			cpu0, gc0 = processCPU(), gcCycles()
		case strings.HasPrefix(line, "done "):
			cpu, gc := processCPU()-cpu0, gcCycles()-gc0
			m.ServerCPU += cpu
			m.ServerGC += gc
			var w childWindow
			if err := json.Unmarshal([]byte(strings.TrimPrefix(line, "done ")), &w); err != nil {
				_ = cmd.Process.Kill()
				_ = cmd.Wait()
				return measured{}, fmt.Errorf("child %v: %q: %w", args, line, err)
			}
			m.Msgs += w.Msgs
			m.Wall += w.Wall
			m.CPU += w.CPU
			m.GC += w.GC
			fmt.Fprintf(os.Stderr, "bench: %s %s: %d messages in %s; cpu-µs a message %.2f in the child, %.2f in the bench process (NATS server); GC cycles %d in the child (%d heap bytes allocated a message), %d in the bench process\n",
				args[0], w.Bucket, w.Msgs, w.Wall.Round(time.Millisecond), cpuMsg(w.CPU, w.Msgs), cpuMsg(cpu, w.Msgs), w.GC, w.Alloc/uint64(max(w.Msgs, 1)), gc)
		}
	}
	if err := cmd.Wait(); err != nil {
		return measured{}, fmt.Errorf("child %v: %w", args, err)
	}
	if m.Msgs == 0 {
		return measured{}, fmt.Errorf("child %v measured nothing", args)
	}
	return m, nil
}
