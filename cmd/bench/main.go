// Command bench measures the seat against the raw stream and against reading NATS KV directly, every
// figure in one run, and prints one table (and writes it to -out as Markdown).
//
// Run using:
//
//	make bench        # about 1,000,000 needs keys, under 10 minutes on 2 cores
//	make bench-quick  # about 100,000 needs keys, under a minute
//
// It starts an embedded nats-server, loads a fixtures mesh, runs the real mesh-provisioner binary (-bin)
// as the seat in a process of its own (so its memory is its own), and measures:
//
//   - stream limit: a bare ordered consumer reading the whole needs stream, doing nothing, in a process
//     of its own (this binary, -child-limit)
//   - ingest: the projector on the same stream (and the registry, as serve) from an empty state dir,
//     in a process of its own too (this binary, -child-ingest), timed as the stream limit is
//   - node, module and collection lookups: the verb against a direct KV watch of the same keys
//   - scale: the node lookup at a tenth of the keys and at all of them
//   - rebuild: `mesh-provisioner rebuild` of every bucket against the stream limit's time for them (in
//     its child process, as above)
//   - memory: the seat's peak RSS while ingesting, while serving and walking every index once, and
//     after a restart walking every index and taking writes (BENCH_MEMORY_ONLY=1 skips ingest and
//     rebuild, to measure these alone)
//   - concurrency: verb answers per second from 8 clients while updates stream in
//
// BENCH_NODES_ONLY=1 stops after the node lookups, the reply floor and the scale row;
// BENCH_WIDE_ONLY=1 runs the module and collection lookups (and their floors) alone once the mesh is
// loaded and settled, and stops: old and new seats alternated in 1.5-2.5 minutes a run;
// BENCH_WIDE_ROUNDS=n measures each wide lookup n times instead of 3 (and walks the floors 5n times);
// BENCH_WIDE_TRACE=1 says each wide walk on stderr: each page's time from the first request to the
// page read, and what the seat's and the bench's threads did meanwhile (run and run-queue wait time
// and timeslices from schedstat, the bench's GC cycles);
// BENCH_NODE_ROUNDS=n asks the full-size node series n times (stderr says each);
// BENCH_CHILD_PROFILE=<prefix> has each measuring child write a CPU profile of each of its windows, to
// <prefix>.limit.<bucket> and <prefix>.ingest.<bucket> (the rebuild row's limit child writes over the
// ingest row's needs profile; the children inherit the environment, so GODEBUG=gctrace=1 traces their
// GC cycles too).
package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nats.go/micro"
	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	// As cmd/mesh-provisioner does, so the ingest child (-child-ingest) allocates Pebble's blocks as
	// the seat does: one malloc arena, set as the program loads (its doc says why).
	_ "github.com/novox/mesh-provisioner/internal/cheap/onearena"
	"github.com/novox/mesh-provisioner/internal/embedded"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/seat"
	"github.com/novox/mesh-provisioner/store"
)

type row struct{ figure, value, how string }

type bench struct {
	keys    int
	lookups int
	bin     string
	dir     string
	url     string
	nc      *nats.Conn
	js      jetstream.JetStream
	rows    []row
	nodes   int
	small   int
	mesh    fixtures.Mesh
	seat    *exec.Cmd
	seatErr syncBuffer
	// nodeBytes is the size of the last node answer, which the reply floor answers with.
	nodeBytes int
	// lookupCPU is the seat's CPU time a lookup over the last node lookups (not the direct watch's).
	lookupCPU time.Duration
	// pageTimes is, for the last walk, each page's time from the first request to the page read.
	pageTimes []time.Duration
}

// syncBuffer is the seat's stderr: written by the command's copier, read by the bench.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.buf.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.buf.String()
}

func (s *syncBuffer) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.buf.Len()
}

func main() {
	keys := flag.Int("keys", 1_000_000, "needs keys in the mesh (250 per node)")
	lookups := flag.Int("lookups", 500, "random node lookups per measurement")
	bin := flag.String("bin", "bin/mesh-provisioner", "the mesh-provisioner binary to run as the seat")
	out := flag.String("out", "", "write the table as Markdown to this file")
	floorURL := flag.String("floor-reply", "", "(internal) run as the bare replier of the reply floor, on this NATS URL")
	floorBytes := flag.Int("floor-bytes", 0, "(internal) the reply floor's body size")
	floorPages := flag.String("floor-pages", "", "(internal) answer these pages in turn instead (written by writePages)")
	childLimit := flag.String("child-limit", "", "(internal) run as the stream limit's bare consumer, on this NATS URL")
	childBuckets := flag.String("child-buckets", provisioner.BucketNeeds, "(internal) the buckets the stream limit reads in turn, comma-separated")
	childIngest := flag.String("child-ingest", "", "(internal) run as the ingest's projector, on this NATS URL")
	childState := flag.String("child-state", "", "(internal) the ingest's state dir, empty")
	flag.Parse()
	if *childLimit != "" || *childIngest != "" {
		var err error
		if *childLimit != "" {
			childRole = "limit"
			err = runChildLimit(*childLimit, strings.Split(*childBuckets, ","))
		} else {
			childRole = "ingest"
			err = runChildIngest(*childIngest, *childState)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "bench child:", err)
			os.Exit(1)
		}
		return
	}
	if *floorURL != "" {
		if err := serveFloor(*floorURL, *floorBytes, *floorPages); err != nil {
			fmt.Fprintln(os.Stderr, "bench floor:", err)
			os.Exit(1)
		}
		return
	}
	b := &bench{keys: *keys, lookups: *lookups, bin: *bin}
	if err := b.run(); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		if b.seatErr.Len() > 0 {
			fmt.Fprintln(os.Stderr, "seat stderr (tail):", tail(b.seatErr.String(), 2000))
		}
		os.Exit(1)
	}
	table := b.markdown()
	fmt.Println(table)
	if *out != "" {
		if err := os.WriteFile(*out, []byte(table), 0o644); err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			os.Exit(1)
		}
	}
}

func (b *bench) add(figure, value, how string) {
	b.rows = append(b.rows, row{figure, value, how})
	fmt.Fprintf(os.Stderr, "  %-28s %s\n", figure, value)
}

func (b *bench) run() error {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "mesh-provisioner-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	b.dir = dir
	ns, err := embedded.Start(embedded.Config{Listen: "127.0.0.1:-1", StoreDir: filepath.Join(dir, "nats")})
	if err != nil {
		return err
	}
	defer ns.Shutdown()
	b.url = ns.ClientURL()
	if b.nc, err = nats.Connect(b.url); err != nil {
		return err
	}
	defer b.nc.Close()
	if b.js, err = jetstream.New(b.nc); err != nil {
		return err
	}

	const perNode = 250
	b.nodes = max(b.keys/perNode, 10)
	b.small = max(b.nodes/10, 1)
	b.mesh = fixtures.Mesh{Seed: 42, Modules: 25, NeedsPerModule: 10, Collections: 4}
	partA := b.mesh
	partA.Nodes = b.small
	partB := b.mesh
	partB.FirstNode, partB.Nodes, partB.BadKeys, partB.BadValues = b.small, b.nodes-b.small, 5, 5

	fmt.Fprintf(os.Stderr, "bench: %d nodes, %d needs keys; loading the first %d nodes\n", b.nodes, b.nodes*perNode, b.small)
	opsA := partA.Ops()
	if err := b.load(ctx, opsA); err != nil {
		return err
	}
	if err := b.startSeat(filepath.Join(dir, "state")); err != nil {
		return err
	}
	defer b.stopSeat()
	if err := b.waitCaughtUp(ctx, 5*time.Minute); err != nil {
		return err
	}
	b.waitCompacted(1, 0, len(opsA), 3*time.Minute)
	smallMedian, _, err := b.nodeLookups(b.small, false)
	if err != nil {
		return err
	}
	smallCPU := b.lookupCPU

	fmt.Fprintf(os.Stderr, "bench: loading nodes %d..%d while 8 clients ask\n", b.small, b.nodes-1)
	opsB := partB.Ops()
	compactions := b.compactions()
	if err := b.concurrency(ctx, opsB); err != nil {
		return err
	}
	if err := b.waitCaughtUp(ctx, 8*time.Minute); err != nil {
		return err
	}
	ingestHWM := b.seatHWM()
	b.waitCompacted(2, compactions, len(opsB), 3*time.Minute)

	if os.Getenv("BENCH_WIDE_ONLY") != "" {
		if err := b.moduleLookups(ctx); err != nil {
			return err
		}
		return b.collectionLookups(ctx)
	}
	// Lookups at full size, sampling the seat's RSS meanwhile.
	stopSample := b.sampleRSS()
	median, p99, err := b.nodeLookups(b.nodes, false)
	if err != nil {
		return err
	}
	fullCPU := b.lookupCPU
	// BENCH_NODE_ROUNDS=n asks the series n-1 times more, each said on stderr (the table keeps the
	// first): more samples of the seat's CPU a lookup, or a window to profile the seat in.
	for r := 1; r < envInt("BENCH_NODE_ROUNDS", 1); r++ {
		m, _, err := b.nodeLookups(b.nodes, false)
		if err != nil {
			return err
		}
		fmt.Fprintf(os.Stderr, "bench: node round %d: median %s, seat CPU %.0f µs a lookup\n", r+1, ms(m), float64(b.lookupCPU)/1e3)
	}
	dMedian, dP99, err := b.nodeLookups(b.nodes, true)
	if err != nil {
		return err
	}
	b.add("node lookup", fmt.Sprintf("verb %s median, %s p99; direct watch %s median, %s p99; %.1f× faster (median)",
		ms(median), ms(p99), ms(dMedian), ms(dP99), float64(dMedian)/float64(median)),
		fmt.Sprintf("%d random nodes, ~250 rows each, MessagePack request; direct: KV watch of <node>.> until its initial values are done", b.lookups))
	fMedian, fP99, fCPU, err := b.replyFloor(b.nodeBytes)
	if err != nil {
		return err
	}
	b.add("reply floor", fmt.Sprintf("%s median, %s p99; so a node lookup can be at most %.1f× faster than the direct watch here; replier CPU %.0f µs a reply",
		ms(fMedian), ms(fP99), float64(dMedian)/float64(fMedian), float64(fCPU)/1e3),
		fmt.Sprintf("a bare micro endpoint in another process answering a fixed %d-byte body (a node answer's size), asked as the node lookups are: what NATS and two processes alone cost; replier CPU as the scale row's seat CPU", b.nodeBytes))
	b.add("scale", fmt.Sprintf("node lookup median %s at %d keys, %s at %d keys; ratio %.2f; seat CPU %.0f µs a lookup, then %.0f µs",
		ms(smallMedian), b.small*perNode, ms(median), b.nodes*perNode, float64(median)/float64(smallMedian),
		float64(smallCPU)/1e3, float64(fullCPU)/1e3),
		"the same node lookup before and after the mesh grew tenfold; seat CPU: its threads' run time (/proc/<pid>/task/*/schedstat) over the lookups")
	if os.Getenv("BENCH_NODES_ONLY") != "" {
		// The node lookups alone (BENCH_NODES_ONLY=1): old and new seats alternated in minutes. And what
		// the seat's background loops cost while nobody asks, beside its CPU a lookup.
		cpu0, idle := b.seatCPU(), 3*time.Second
		time.Sleep(idle)
		fmt.Fprintf(os.Stderr, "bench: idle seat: %.2f ms of CPU a second\n", float64(b.seatCPU()-cpu0)/1e6/idle.Seconds())
		return nil
	}
	if err := b.moduleLookups(ctx); err != nil {
		return err
	}
	if err := b.collectionLookups(ctx); err != nil {
		return err
	}
	servingPeak := stopSample()
	walk, err := b.walkEverything(ctx)
	if err != nil {
		return err
	}
	b.add("memory", fmt.Sprintf("seat peak RSS %s during ingest, %s while serving, %s walking every index once (then %s)",
		mib(ingestHWM), mib(servingPeak), mib(walk.peak), walk.split),
		fmt.Sprintf("VmHWM of the seat process after catching up with every key; highest VmRSS sampled every 50 ms during the lookups, then during one walk of every page of every module, kind, collection and contributor (%d rows, MessagePack); %s", walk.rows, splitHow))
	b.stopSeat()

	if os.Getenv("BENCH_MEMORY_ONLY") == "" {
		if err := b.ingest(); err != nil {
			return err
		}
		if err := b.rebuild(ctx); err != nil {
			return err
		}
	}
	return b.restarted(ctx, filepath.Join(dir, "state"), partB.Ops())
}

func (b *bench) load(ctx context.Context, ops []fixtures.Op) error {
	start := time.Now()
	if err := fixtures.Load(ctx, b.js, ops, 16384, nil); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "bench: loaded %d ops in %s (%.0f/s)\n", len(ops), time.Since(start).Round(time.Millisecond), float64(len(ops))/time.Since(start).Seconds())
	return nil
}

func (b *bench) startSeat(state string) error {
	args := []string{"serve", "--nats", b.url, "--state", state, "--log-format", "json", "--metrics-addr", "127.0.0.1:0"}
	// The memory rows read the seat's /metrics, at the address it logs. BENCH_SEAT_ARGS adds flags to
	// the seat's, e.g. "--metrics-addr 127.0.0.1:9465 --pprof" to profile it while the bench runs (go
	// tool pprof http://127.0.0.1:9465/debug/pprof/profile?seconds=10).
	args = append(args, strings.Fields(os.Getenv("BENCH_SEAT_ARGS"))...)
	cmd := exec.Command(b.bin, args...)
	cmd.Stdout = io.Discard
	cmd.Stderr = &b.seatErr
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start seat %s: %w (run `make build` first)", b.bin, err)
	}
	b.seat = cmd
	return nil
}

// waitCompacted waits, after burst n of messages, until the seat has logged a compaction more than the
// `before` it had logged before the burst, so lookups are measured on the settled store rather than
// beside the compaction; it reports how long it waited. A burst smaller than seat.CompactAfter is not
// followed by a compaction: nothing is waited for.
func (b *bench) waitCompacted(n, before, burst int, timeout time.Duration) {
	figure := fmt.Sprintf("settle %d", n)
	if int64(burst) < seat.CompactAfter {
		b.add(figure, fmt.Sprintf("no compaction after a burst of %d messages", burst),
			fmt.Sprintf("the seat compacts after a burst of %d messages or more; lookups are measured at once", seat.CompactAfter))
		return
	}
	start := time.Now()
	for time.Since(start) < timeout {
		if b.compactions() > before {
			waited := time.Since(start)
			idle := b.waitSeatIdle(2 * time.Minute)
			b.add(figure, fmt.Sprintf("%s until the seat's compaction after the catch-up ended, then %s until the seat was idle", waited.Round(time.Millisecond), idle.Round(time.Millisecond)),
				"the seat compacts once a burst of 50,000 messages or more is applied and it goes quiet; lookups are measured after, once the seat's threads ran under a tenth of a core for 3 s")
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	b.add(figure, "no compaction logged within "+timeout.String(), "lookups measured without waiting further")
}

// waitSeatIdle waits until the seat's threads have run under a tenth of a core in each half second for
// longer than the seat waits, quiet, before compacting after a catch-up (nothing applied for a second,
// looked at every second: up to 2 s), or timeout; it returns how long it waited. On a loaded machine
// the load can pause long enough for the seat to compact in the middle of a burst: the compaction
// waitCompacted sees is then not the last, and what the seat did after it ran in the timed lookups,
// its threads' CPU counted as theirs (docs/performance.md, Session 18: settle 0 s, seat CPU 280-620 µs
// a lookup for 13 rounds of node lookups, 144-190 after, the compaction 69% of the seat's CPU in a
// profile of those rounds).
func (b *bench) waitSeatIdle(timeout time.Duration) time.Duration {
	start := time.Now()
	const window, quiet = 500 * time.Millisecond, 3 * time.Second
	idleSince := time.Now()
	for time.Since(start) < timeout && time.Since(idleSince) < quiet {
		cpu0 := b.seatCPU()
		time.Sleep(window)
		if b.seatCPU()-cpu0 >= window/10 {
			idleSince = time.Now()
		}
	}
	return time.Since(start)
}

// compactions is how many compactions after a catch-up the seat has logged.
func (b *bench) compactions() int {
	return strings.Count(b.seatErr.String(), "compacted after catch-up")
}

func (b *bench) stopSeat() {
	if b.seat == nil {
		return
	}
	_ = b.seat.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { _ = b.seat.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		_ = b.seat.Process.Kill()
		<-done
	}
	b.seat = nil
}

// lastSeq is a stream's last sequence.
func (b *bench) lastSeq(ctx context.Context, bucket string) (uint64, uint64, error) {
	s, err := b.js.Stream(ctx, provisioner.StreamName(bucket))
	if err != nil {
		return 0, 0, err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return 0, 0, err
	}
	return info.State.LastSeq, info.State.Msgs, nil
}

// waitCaughtUp waits until the seat answers each bucket as of its stream's last sequence.
func (b *bench) waitCaughtUp(ctx context.Context, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for _, what := range []string{"needs", "applied", "collect"} {
		shape, _ := provisioner.ShapeOfWhat(provisioner.What(what))
		last, _, err := b.lastSeq(ctx, shape.Bucket)
		if err != nil {
			return err
		}
		for {
			a, err := b.ask(map[string]any{"what": what, "node": "none", "limit": 1})
			if err == nil && a.AsOf >= last && a.Synced {
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("seat did not catch up with %s within %s (as_of %d of %d, err %v)", what, timeout, a.AsOf, last, err)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	return nil
}

type answer struct {
	Rows   []msgpack.RawMessage `msgpack:"rows"`
	AsOf   uint64               `msgpack:"as_of"`
	Synced bool                 `msgpack:"synced"`
	Next   string               `msgpack:"next"`
}

func (b *bench) askRaw(nc *nats.Conn, req map[string]any) ([]byte, error) {
	body, err := msgpack.Marshal(req)
	if err != nil {
		return nil, err
	}
	msg, err := nc.Request(query.Subject, body, 10*time.Second)
	if err != nil {
		return nil, err
	}
	if code := msg.Header.Get(micro.ErrorCodeHeader); code != "" {
		return nil, fmt.Errorf("verb %s: %s", code, msg.Header.Get(micro.ErrorHeader))
	}
	return msg.Data, nil
}

func (b *bench) ask(req map[string]any) (answer, error) {
	data, err := b.askRaw(b.nc, req)
	if err != nil {
		return answer{}, err
	}
	var a answer
	return a, msgpack.Unmarshal(data, &a)
}

// nodeLookups asks (or watches directly) random nodes among the first n, and returns median and p99.
func (b *bench) nodeLookups(n int, direct bool) (time.Duration, time.Duration, error) {
	r := rand.New(rand.NewPCG(1, 2))
	var kv jetstream.KeyValue
	if direct {
		var err error
		if kv, err = b.js.KeyValue(context.Background(), provisioner.BucketNeeds); err != nil {
			return 0, 0, err
		}
	}
	times := make([]time.Duration, 0, b.lookups)
	// As testing.B does before a benchmark: the garbage of what ran before (the bench process hosts
	// the NATS server, whose heap nears 1 GB after a catch-up of a million keys) is collected first,
	// not by a GC cycle whose mark workers take both cores for 0.2-0.5 s of the timed lookups.
	runtime.GC()
	trace := os.Getenv("BENCH_NODE_TRACE") != "" && !direct
	var traced []lookupTrace
	var prev traceSample
	if trace {
		prev = b.traceSample()
		if f, err := os.Create(fmt.Sprintf("%s/bench-nodes-%d.pprof", os.TempDir(), n)); err == nil {
			if pprof.StartCPUProfile(f) == nil {
				defer func() { pprof.StopCPUProfile(); f.Close() }()
			}
		}
	}
	series := time.Now()
	if trace {
		fmt.Fprintf(os.Stderr, "trace %d nodes: series starts @%.3fs of the bench process\n", n, series.Sub(processStart).Seconds())
	}
	cpu0 := b.seatCPU()
	for i := 0; i < b.lookups; i++ {
		node := fixtures.NodeName(r.IntN(n))
		start := time.Now()
		var rows int
		if direct {
			got, err := watchCount(kv, node+".>")
			if err != nil {
				return 0, 0, err
			}
			rows = got
		} else {
			data, err := b.askRaw(b.nc, map[string]any{"what": "needs", "node": node, "limit": 10000})
			if err != nil {
				return 0, 0, err
			}
			times = append(times, time.Since(start))
			b.nodeBytes = len(data)
			// Stepped over, not built: building 250 rows' RawMessages made most of the bench
			// process's garbage, and so its GC cycles, during the timed lookups.
			got, _, err := countRows(data, false)
			if err != nil {
				return 0, 0, err
			}
			rows = got
		}
		if direct {
			times = append(times, time.Since(start))
		}
		if rows != 250 && rows < 240 {
			return 0, 0, fmt.Errorf("node %s: %d rows, want about 250", node, rows)
		}
		if trace {
			cur := b.traceSample()
			traced = append(traced, lookupTrace{i: i, at: start.Sub(series), took: times[len(times)-1], d: cur.minus(prev)})
			prev = b.traceSample()
		}
	}
	if !direct {
		b.lookupCPU = (b.seatCPU() - cpu0) / time.Duration(b.lookups)
	}
	what := "verb"
	if direct {
		what = "direct"
	}
	fmt.Fprintf(os.Stderr, "bench: %s lookups of %d nodes: p50 %s p90 %s p99 %s max %s\n", what, n,
		ms(percentile(times, 0.5)), ms(percentile(times, 0.9)), ms(percentile(times, 0.99)), ms(percentile(times, 1)))
	if trace {
		printTrace(n, traced)
	}
	return percentile(times, 0.5), percentile(times, 0.99), nil
}

// processStart is when the bench process started, to set a traced series beside GODEBUG=gctrace=1's
// times.
var processStart = time.Now()

// lookupTrace is one node lookup of a traced series (BENCH_NODE_TRACE=1): its place in the series,
// when it started after the series did, how long it took, and what the processes did meanwhile.
type lookupTrace struct {
	i    int
	at   time.Duration
	took time.Duration
	d    traceSample
}

// traceSample is what the seat's and the bench's threads had done at one moment: run time and time
// waiting on a run queue (schedstat), the seat's minor faults, and the bench's GC cycles (the bench
// process runs the NATS server too).
type traceSample struct {
	seatRun, seatWait, benchRun, benchWait time.Duration
	seatMinflt, benchGC                    int64
	seatSlices, benchSlices                int64
}

func (a traceSample) minus(b traceSample) traceSample {
	return traceSample{a.seatRun - b.seatRun, a.seatWait - b.seatWait, a.benchRun - b.benchRun, a.benchWait - b.benchWait,
		a.seatMinflt - b.seatMinflt, a.benchGC - b.benchGC, a.seatSlices - b.seatSlices, a.benchSlices - b.benchSlices}
}

func schedstat(pid string) (run, wait time.Duration) {
	run, wait, _ = schedstatSlices(pid)
	return run, wait
}

// schedstatSlices is schedstat and the threads' timeslices: how many times one was put on a CPU, each
// wakeup of a blocked thread among them.
func schedstatSlices(pid string) (run, wait time.Duration, slices int64) {
	tasks, _ := filepath.Glob("/proc/" + pid + "/task/*/schedstat")
	for _, t := range tasks {
		data, err := os.ReadFile(t)
		if err != nil {
			continue
		}
		if fs := strings.Fields(string(data)); len(fs) > 2 {
			r, _ := strconv.ParseInt(fs[0], 10, 64)
			w, _ := strconv.ParseInt(fs[1], 10, 64)
			n, _ := strconv.ParseInt(fs[2], 10, 64)
			run += time.Duration(r)
			wait += time.Duration(w)
			slices += n
		}
	}
	return run, wait, slices
}

func (b *bench) traceSample() traceSample {
	var s traceSample
	if b.seat != nil && b.seat.Process != nil {
		pid := strconv.Itoa(b.seat.Process.Pid)
		s.seatRun, s.seatWait, s.seatSlices = schedstatSlices(pid)
		if data, err := os.ReadFile("/proc/" + pid + "/stat"); err == nil {
			if j := bytes.LastIndexByte(data, ')'); j > 0 {
				if fs := strings.Fields(string(data[j+1:])); len(fs) > 7 {
					s.seatMinflt, _ = strconv.ParseInt(fs[7], 10, 64)
				}
			}
		}
	}
	s.benchRun, s.benchWait, s.benchSlices = schedstatSlices("self")
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	s.benchGC = int64(ms.NumGC)
	return s
}

// printTrace writes a traced series' 12 slowest lookups to stderr.
func printTrace(n int, ts []lookupTrace) {
	s := append([]lookupTrace(nil), ts...)
	sort.Slice(s, func(i, j int) bool { return s[i].took > s[j].took })
	for _, t := range s[:min(12, len(s))] {
		fmt.Fprintf(os.Stderr, "  #%d at %s took %s: seat run %s wait %s minflt %d; bench run %s wait %s gc %d\n",
			t.i, t.at.Round(time.Millisecond), ms(t.took), t.d.seatRun, t.d.seatWait, t.d.seatMinflt, t.d.benchRun, t.d.benchWait, t.d.benchGC)
	}
}

// seatCPU is the CPU time the seat's threads have run, from /proc/<pid>/task/*/schedstat (nanoseconds,
// finer than /proc/<pid>/stat's clock ticks): a few hundred lookups take tens of milliseconds of it.
// Threads that have ended are not counted; Go's threads rarely end. 0 without a seat.
func (b *bench) seatCPU() time.Duration {
	if b.seat == nil || b.seat.Process == nil {
		return 0
	}
	run, _ := schedstat(strconv.Itoa(b.seat.Process.Pid))
	return run
}

// watchCount reads a KV watch's initial values and counts them: what a client without the seat does.
func watchCount(kv jetstream.KeyValue, filter string) (int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	w, err := kv.Watch(ctx, filter, jetstream.IgnoreDeletes())
	if err != nil {
		return 0, err
	}
	defer w.Stop()
	n := 0
	for e := range w.Updates() {
		if e == nil {
			return n, nil
		}
		n++
	}
	return n, errors.New("watch ended before its initial values")
}

// allPages asks every page of a request, reading each answer as a client does (its rows and next),
// and returns the rows and the time from the first request to the last page read: the client's reading
// counts, as the direct watch's does.
func (b *bench) allPages(req map[string]any, asJSON bool) (int, time.Duration, error) {
	return b.walk(query.Subject, req, asJSON, nil)
}

// walk asks subject for every page of req, reading each page (rows and next) before asking the next,
// and returns the rows and the time from the first request to the last page read; keep, when set, is
// handed each page's bytes.
func (b *bench) walk(subject string, req map[string]any, asJSON bool, keep func([]byte)) (int, time.Duration, error) {
	r := map[string]any{}
	for k, v := range req {
		r[k] = v
	}
	r["limit"] = 10000
	rows := 0
	b.pageTimes = b.pageTimes[:0]
	start := time.Now()
	for {
		var body []byte
		var err error
		if asJSON {
			body, err = jsonBody(r)
		} else {
			body, err = msgpack.Marshal(r)
		}
		if err != nil {
			return 0, 0, err
		}
		msg, err := b.nc.Request(subject, body, 30*time.Second)
		if err != nil {
			return 0, 0, err
		}
		if code := msg.Header.Get(micro.ErrorCodeHeader); code != "" {
			return 0, 0, fmt.Errorf("verb %s: %s", code, msg.Header.Get(micro.ErrorHeader))
		}
		n, next, err := countRows(msg.Data, asJSON)
		if err != nil {
			return 0, 0, err
		}
		if keep != nil {
			keep(msg.Data)
		}
		rows += n
		b.pageTimes = append(b.pageTimes, time.Since(start))
		if next == "" {
			break
		}
		r["after"] = next
	}
	return rows, time.Since(start), nil
}

func (b *bench) moduleLookups(ctx context.Context) error {
	var cases []lookupCase
	for _, j := range []int{1, 7, 13, 19, 31} {
		mod := fixtures.ModuleName(j)
		cases = append(cases, lookupCase{req: map[string]any{"what": "needs", "module": mod}, filter: "*." + mod + ".>"})
	}
	direct, err := b.wideLookups(ctx, "module lookup", provisioner.BucketNeeds, cases,
		"one module across all nodes, about %d rows, every page at limit 10000, from the first request to the last page read (rows and next) by the client; median of 5 modules × %d rounds; direct: KV watch of *.<module>.> until its initial values are done")
	if err != nil {
		return err
	}
	return b.wideFloor("wide reply floor", "module", cases[0].req, direct)
}

func (b *bench) collectionLookups(ctx context.Context) error {
	var cases []lookupCase
	for _, c := range []string{"shell:zsh:normal", "environment", "path with space"} {
		cases = append(cases, lookupCase{req: map[string]any{"what": "collect", "collection": c}, filter: "*." + provisioner.EncodeCollection(c) + ".*"})
	}
	direct, err := b.wideLookups(ctx, "collection lookup", provisioner.BucketCollect, cases,
		"one collection across all nodes, about %d rows, timed as the module lookup; median of 3 collections × %d rounds; direct: KV watch of *.<escaped>.*")
	if err != nil {
		return err
	}
	return b.wideFloor("collection reply floor", "collection", cases[0].req, direct)
}

// lookupCase is one wide lookup: the verb's request, and the KV watch filter that reads the same keys.
type lookupCase struct {
	req    map[string]any
	filter string
}

// wideLookups asks each case through every page, in MessagePack and in JSON, and reads the same keys
// with a direct KV watch; it reports the medians and the ratios, and returns the direct watch's median.
func (b *bench) wideLookups(ctx context.Context, figure, bucket string, cases []lookupCase, how string) (time.Duration, error) {
	kv, err := b.js.KeyValue(ctx, bucket)
	if err != nil {
		return 0, err
	}
	var vm, vj, dw, cpu []time.Duration
	rows := 0
	// Each case is measured wideRounds times, verb and direct in turn: on a shared machine one sample
	// of each moved the ratio by a third from run to run.
	rounds := wideRoundsNow()
	for r := 0; r < rounds; r++ {
		for _, c := range cases {
			n, err := b.wideCase(kv, c, &vm, &vj, &dw, &cpu)
			if err != nil {
				return 0, err
			}
			rows += n
		}
	}
	m, j, d := percentile(vm, 0.5), percentile(vj, 0.5), percentile(dw, 0.5)
	b.add(figure, fmt.Sprintf("verb %s MessagePack, %s JSON; direct watch %s; %.1f× (MessagePack), %.1f× (JSON) faster; seat CPU %s a MessagePack walk",
		ms(m), ms(j), ms(d), float64(d)/float64(m), float64(d)/float64(j), ms(percentile(cpu, 0.5))),
		fmt.Sprintf(how, rows/len(cases)/rounds, rounds)+"; seat CPU: its threads' run time (/proc/<pid>/task/*/schedstat) over one MessagePack walk, median")
	return d, nil
}

// wideRounds is how many times each wide lookup is measured.
const wideRounds = 3

// wideRoundsNow is wideRounds, or BENCH_WIDE_ROUNDS: more samples, or a longer window to profile the
// seat in (BENCH_SEAT_ARGS).
func wideRoundsNow() int { return envInt("BENCH_WIDE_ROUNDS", wideRounds) }

// envInt is the environment variable name as a number above 0, else def.
func envInt(name string, def int) int {
	if n, err := strconv.Atoi(os.Getenv(name)); err == nil && n > 0 {
		return n
	}
	return def
}

// wideCase measures one wide lookup once: the verb in MessagePack and in JSON, and the direct watch; cpu
// is handed the seat's CPU time over the MessagePack walk (counters the machine's load skews little).
func (b *bench) wideCase(kv jetstream.KeyValue, c lookupCase, vm, vj, dw, cpu *[]time.Duration) (int, error) {
	// BENCH_WIDE_TRACE=1: each walk and watch said on stderr, with what the processes did meanwhile
	// (the samples' own reading of /proc falls partly inside the window, the walk's time does not).
	trace := os.Getenv("BENCH_WIDE_TRACE") != ""
	var t0 traceSample
	begin := func() {
		if trace {
			t0 = b.traceSample()
		}
	}
	end := func(what string, took time.Duration, pages []time.Duration) {
		if !trace {
			return
		}
		d := b.traceSample().minus(t0)
		fmt.Fprintf(os.Stderr, "  wide %v %s: %s, pages read at %s; seat run %s wait %s slices %d; bench run %s wait %s slices %d, gc %d\n",
			c.req, what, ms(took), msList(pages), ms(d.seatRun), ms(d.seatWait), d.seatSlices, ms(d.benchRun), ms(d.benchWait), d.benchSlices, d.benchGC)
	}
	begin()
	cpu0 := b.seatCPU()
	n, t, err := b.allPages(c.req, false)
	if err != nil {
		return 0, err
	}
	*cpu = append(*cpu, b.seatCPU()-cpu0)
	end("MessagePack", t, b.pageTimes)
	begin()
	_, tj, err := b.allPages(c.req, true)
	if err != nil {
		return 0, err
	}
	end("JSON", tj, b.pageTimes)
	begin()
	start := time.Now()
	dn, err := watchCount(kv, c.filter)
	if err != nil {
		return 0, err
	}
	*dw = append(*dw, time.Since(start))
	end("direct watch", (*dw)[len(*dw)-1], nil)
	if dn != n {
		return 0, fmt.Errorf("%v: verb %d rows, direct %d", c.req, n, dn)
	}
	*vm, *vj = append(*vm, t), append(*vj, tj)
	return n, nil
}

// concurrency loads ops while 8 clients ask random node lookups as fast as they can, and reports the
// rate, the errors and whether any client saw as_of go backwards.
func (b *bench) concurrency(ctx context.Context, ops []fixtures.Op) error {
	stopSample := b.sampleRSS()
	loadDone := make(chan error, 1)
	loadStart := time.Now()
	go func() { loadDone <- fixtures.Load(ctx, b.js, ops, 16384, nil) }()

	var answers, errs, backwards atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for c := 0; c < 8; c++ {
		nc, err := nats.Connect(b.url)
		if err != nil {
			return err
		}
		defer nc.Close()
		wg.Add(1)
		go func(c int) {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(c), 9))
			var last uint64
			for {
				select {
				case <-stop:
					return
				default:
				}
				data, err := b.askRaw(nc, map[string]any{"what": "needs", "node": fixtures.NodeName(r.IntN(b.nodes)), "limit": 10000})
				if err != nil {
					errs.Add(1)
					continue
				}
				var a answer
				if err := msgpack.Unmarshal(data, &a); err != nil {
					errs.Add(1)
					continue
				}
				if a.AsOf < last {
					backwards.Add(1)
				}
				last = a.AsOf
				answers.Add(1)
			}
		}(c)
	}
	measureStart := time.Now()
	err := <-loadDone
	loadTime := time.Since(loadStart)
	elapsed := time.Since(measureStart)
	close(stop)
	wg.Wait()
	stopSample()
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "bench: loaded %d ops in %s while asking\n", len(ops), loadTime.Round(time.Millisecond))
	b.add("concurrency", fmt.Sprintf("%.0f answers/s, %d errors, as_of backwards %d times", float64(answers.Load())/elapsed.Seconds(), errs.Load(), backwards.Load()),
		fmt.Sprintf("8 clients, each its own connection, random node lookups (MessagePack) for %s while %d updates streamed in", elapsed.Round(time.Millisecond), len(ops)))
	return nil
}

// sampleRSS samples the seat's VmRSS every 50 ms until the returned func is called; it returns the peak.
func (b *bench) sampleRSS() func() int64 {
	var peak atomic.Int64
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(50 * time.Millisecond)
		defer t.Stop()
		for {
			if v := b.seatStatus("VmRSS:"); v > peak.Load() {
				peak.Store(v)
			}
			select {
			case <-stop:
				return
			case <-t.C:
			}
		}
	}()
	return func() int64 { close(stop); <-done; return peak.Load() }
}

func (b *bench) seatHWM() int64 { return b.seatStatus("VmHWM:") }

// seatStatus reads a field of the seat's /proc/<pid>/status, in bytes.
func (b *bench) seatStatus(field string) int64 {
	if b.seat == nil || b.seat.Process == nil {
		return 0
	}
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", b.seat.Process.Pid))
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if strings.HasPrefix(sc.Text(), field) {
			fs := strings.Fields(sc.Text())
			if len(fs) >= 2 {
				kb, _ := strconv.ParseInt(fs[1], 10, 64)
				return kb * 1024
			}
		}
	}
	return 0
}

// streamLimit reads the whole streams of buckets, in turn, with a bare ordered consumer that does nothing
// with the messages, in a process of its own.
func (b *bench) streamLimit(buckets ...string) (measured, error) {
	return b.measureChild("-child-limit", b.url, "-child-buckets", strings.Join(buckets, ","))
}

// ingest projects the needs stream into an empty store, as serve does, in a process of its own, against
// the stream limit measured the same way.
func (b *bench) ingest() error {
	limit, err := b.streamLimit(provisioner.BucketNeeds)
	if err != nil {
		return err
	}
	limitRate := float64(limit.Msgs) / limit.Wall.Seconds()
	b.add("stream limit", fmt.Sprintf("%.0f msgs/s (%d messages in %s)", limitRate, limit.Msgs, limit.Wall.Round(time.Millisecond)),
		"a bare ordered consumer reading the whole needs stream, doing nothing, in a process of its own (the bench binary, -child-limit), timed inside it from the consumer's creation to the last message")
	in, err := b.measureChild("-child-ingest", b.url, "-child-state", filepath.Join(b.dir, "ingest"))
	if err != nil {
		return err
	}
	rate := float64(in.Msgs) / in.Wall.Seconds()
	b.add("ingest", fmt.Sprintf("%.0f msgs/s (%s); %.2f of the stream limit; CPU a message %.1f µs projecting + %.1f µs in the NATS server's process (the limit: %.1f + %.1f)",
		rate, in.Wall.Round(time.Millisecond), rate/limitRate, cpuMsg(in.CPU, in.Msgs), cpuMsg(in.ServerCPU, in.Msgs), cpuMsg(limit.CPU, limit.Msgs), cpuMsg(limit.ServerCPU, limit.Msgs)),
		"the projector on the same stream (and the registry's, as serve) from an empty state dir, in a process of its own (the bench binary, -child-ingest, linking the seat's malloc setting), timed inside it from the projector's start to the last sequence applied, after it connected and opened its store, as the stream limit")
	return nil
}

// rebuild runs `mesh-provisioner rebuild` on every bucket, against the stream limit's time for them.
func (b *bench) rebuild(ctx context.Context) error {
	var buckets []string
	for _, s := range provisioner.ProvisionerShapes {
		buckets = append(buckets, s.Bucket)
	}
	m, err := b.streamLimit(buckets...)
	if err != nil {
		return err
	}
	total, limit := m.Msgs, m.Wall
	state := filepath.Join(b.dir, "rebuild")
	cmd := exec.Command(b.bin, "rebuild", "--nats", b.url, "--state", state)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	runtime.GC() // as before the stream limit's child
	start := time.Now()
	how := "`mesh-provisioner rebuild` of all four buckets from scratch, from its process's start to its exit; the stream limit's time is its child's (above) for each bucket in turn, added up"
	if err := cmd.Run(); err != nil {
		// Without the rebuild command, a fresh projection of all four buckets in this process.
		how = "a fresh projection of all four buckets (no rebuild command in this binary: " + tail(strings.TrimSpace(stderr.String()), 80) + ")"
		start = time.Now()
		if err := b.freshProjection(ctx, filepath.Join(b.dir, "fresh")); err != nil {
			return err
		}
	}
	took := time.Since(start)
	b.add("rebuild", fmt.Sprintf("%s for %d messages; %.2f× the stream limit's %s", took.Round(time.Millisecond), total, took.Seconds()/limit.Seconds(), limit.Round(time.Millisecond)), how)
	return nil
}

func (b *bench) freshProjection(ctx context.Context, dir string) error {
	db, err := store.Open(dir, store.Options{})
	if err != nil {
		return err
	}
	defer db.Close()
	p := projector.New(b.js, db, projector.Options{})
	p.Start(ctx)
	defer p.Stop()
	for _, s := range provisioner.ProvisionerShapes {
		last, _, err := b.lastSeq(ctx, s.Bucket)
		if err != nil {
			return err
		}
		for {
			if seq, _ := db.Applied(s.Bucket); seq >= last {
				break
			}
			time.Sleep(time.Millisecond)
		}
	}
	return nil
}

func (b *bench) markdown() string {
	var s strings.Builder
	fmt.Fprintf(&s, "# Benchmarks\n\nThe last run of `make bench` (`go run ./cmd/bench`), every figure measured in the same run. How they are taken and what limits each: `docs/performance.md`.\n\n")
	fmt.Fprintf(&s, "- when: %s\n- machine: %s\n- mesh: %d nodes × 25 modules × 10 needs = %d needs keys, plus applied (%d) and collect (%d) keys, a few out of shape\n\n",
		time.Now().UTC().Format(time.RFC3339), machine(), b.nodes, b.nodes*250, b.nodes*25, b.nodes*4)
	s.WriteString("| figure | measured | how |\n| --- | --- | --- |\n")
	for _, r := range b.rows {
		fmt.Fprintf(&s, "| %s | %s | %s |\n", r.figure, r.value, r.how)
	}
	return s.String()
}

func machine() string {
	model := ""
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(l, "model name") {
				model = strings.TrimSpace(strings.SplitN(l, ":", 2)[1])
				break
			}
		}
	}
	mem := ""
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		if f := strings.Fields(strings.SplitN(string(b), "\n", 2)[0]); len(f) >= 2 {
			kb, _ := strconv.ParseInt(f[1], 10, 64)
			mem = fmt.Sprintf(", %.0f GiB", float64(kb)/(1<<20))
		}
	}
	return fmt.Sprintf("%d cores (%s)%s, %s %s/%s", runtime.NumCPU(), model, mem, runtime.Version(), runtime.GOOS, runtime.GOARCH)
}

func percentile(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	i := int(p * float64(len(s)-1))
	return s[i]
}

func ms(d time.Duration) string { return fmt.Sprintf("%.3f ms", float64(d)/1e6) }

// msList is durations in milliseconds, comma-separated, "-" for none.
func msList(ds []time.Duration) string {
	if len(ds) == 0 {
		return "-"
	}
	s := make([]string, len(ds))
	for i, d := range ds {
		s[i] = fmt.Sprintf("%.3f", float64(d)/1e6)
	}
	return strings.Join(s, ", ") + " ms"
}

func mib(n int64) string { return fmt.Sprintf("%.0f MiB", float64(n)/(1<<20)) }

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}
