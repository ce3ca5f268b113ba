package reliability_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/internal/verbcheck"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/seat"
	"github.com/novox/mesh-provisioner/store"
)

// full is set by `make chaos` (MESH_CHAOS=1): the long versions of the crash loop and the load test.
var full = os.Getenv("MESH_CHAOS") != ""

// The real binary, built once per package run on first use, removed by TestMain.
var bin struct {
	once sync.Once
	dir  string
	path string
	err  error
}

// TestMain runs four of the parallel tests at once: the faults', the broken state dirs' and the
// hostile requests' tests mostly wait on servers, child processes and retries (natstest.Parallel); the
// full disk is a tmpfs of its own. The crash loop, the graceful stop and the load test, which make
// their own load, and the soak run alone, before them.
func TestMain(m *testing.M) {
	natstest.Parallel(4)
	code := m.Run()
	if bin.dir != "" {
		os.RemoveAll(bin.dir)
	}
	os.Exit(code)
}

// binary returns the path of cmd/mesh-provisioner built from this tree.
func binary(tb testing.TB) string {
	tb.Helper()
	bin.once.Do(func() {
		bin.dir, bin.err = os.MkdirTemp("", "mesh-provisioner-bin-")
		if bin.err != nil {
			return
		}
		bin.path = filepath.Join(bin.dir, "mesh-provisioner")
		out, err := exec.Command("go", "build", "-o", bin.path, "github.com/novox/mesh-provisioner/cmd/mesh-provisioner").CombinedOutput()
		if err != nil {
			bin.err = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if bin.err != nil {
		tb.Fatal(bin.err)
	}
	return bin.path
}

// proc is one run of the binary. Its output goes to a log file (read it with logs); it is killed at the
// end of the test if it still runs.
type proc struct {
	cmd     *exec.Cmd
	logPath string
	done    chan struct{}
}

var procSeq struct {
	sync.Mutex
	n int
}

// start runs the binary with args.
func start(tb testing.TB, args ...string) *proc {
	tb.Helper()
	procSeq.Lock()
	procSeq.n++
	n := procSeq.n
	procSeq.Unlock()
	logPath := filepath.Join(tb.TempDir(), fmt.Sprintf("%s-%d.log", args[0], n))
	logf, err := os.Create(logPath)
	if err != nil {
		tb.Fatal(err)
	}
	cmd := exec.Command(binary(tb), args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	// Should the test binary die, its children die with it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logf.Close()
		tb.Fatal(err)
	}
	p := &proc{cmd: cmd, logPath: logPath, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		logf.Close()
		close(p.done)
	}()
	tb.Cleanup(p.kill)
	return p
}

// serve starts `serve` against a NATS URL on a state dir.
func serve(tb testing.TB, url, state string, extra ...string) *proc {
	return start(tb, append([]string{"serve", "--nats", url, "--state", state}, extra...)...)
}

// kill stops the process with SIGKILL and waits for it.
func (p *proc) kill() {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Kill()
	<-p.done
}

func (p *proc) signal(sig os.Signal) { _ = p.cmd.Process.Signal(sig) }

// wait waits up to timeout for the process to exit, and returns its exit code (-1 when a signal ended it).
func (p *proc) wait(timeout time.Duration) (int, error) {
	select {
	case <-p.done:
		return p.cmd.ProcessState.ExitCode(), nil
	case <-time.After(timeout):
		return 0, fmt.Errorf("still running after %v", timeout)
	}
}

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

func (p *proc) logs() string {
	b, _ := os.ReadFile(p.logPath)
	return string(b)
}

// tail is the end of the process's log, for failure messages.
func (p *proc) tail() string {
	s := p.logs()
	if len(s) > 4000 {
		s = "..." + s[len(s)-4000:]
	}
	return s
}

// runServer starts a nats-server with JetStream on a free loopback port; conf, when set, is the text of
// a config file (max_payload, ...).
func runServer(tb testing.TB, conf string) string {
	tb.Helper()
	file := ""
	if conf != "" {
		file = filepath.Join(tb.TempDir(), "nats.conf")
		if err := os.WriteFile(file, []byte(conf), 0o644); err != nil {
			tb.Fatal(err)
		}
	}
	return natstest.RunServerAt(tb, "127.0.0.1:-1", tb.TempDir(), file).ClientURL()
}

// inSeat is a seat running in the test process on its own connection and state dir.
type inSeat struct {
	*seat.Seat
	db   *store.DB
	nc   *nats.Conn
	stop func()
}

// startSeat opens dir and starts a seat on a connection of its own to url (comma-separated URLs are
// a cluster); stop, also run at cleanup, stops it and closes the store.
func startSeat(tb testing.TB, url, dir string, opts ...nats.Option) *inSeat {
	tb.Helper()
	return startSeatWith(tb, url, dir, seat.Config{WriteRegistry: true}, opts...)
}

// startSeatWith is startSeat with a seat config; a zero projector Poll is 50ms here.
func startSeatWith(tb testing.TB, url, dir string, cfg seat.Config, opts ...nats.Option) *inSeat {
	tb.Helper()
	nc, js := natstest.Connect(tb, url, opts...)
	db, err := store.OpenState(dir, store.Options{CacheSize: 8 << 20, MemTableSize: 8 << 20})
	if err != nil {
		tb.Fatal(err)
	}
	if cfg.Projector.Poll == 0 {
		cfg.Projector.Poll = 50 * time.Millisecond
	}
	st, err := seat.Start(context.Background(), nc, js, db, cfg)
	if err != nil {
		db.Close()
		tb.Fatal(err)
	}
	s := &inSeat{Seat: st, db: db, nc: nc}
	var once sync.Once
	s.stop = func() {
		once.Do(func() {
			if err := st.Stop(); err != nil {
				tb.Errorf("stop seat: %v", err)
			}
			if err := db.Close(); err != nil {
				tb.Errorf("close store: %v", err)
			}
			nc.Close()
		})
	}
	tb.Cleanup(s.stop)
	return s
}

// waitAnswering waits until the verb answers a registry request.
func waitAnswering(tb testing.TB, nc *nats.Conn, timeout time.Duration, p *proc) {
	tb.Helper()
	deadline := time.Now().Add(timeout)
	for {
		_, _, err := natstest.Ask(nc, query.Subject, []byte(`{"limit":1}`), false)
		if err == nil {
			return
		}
		if p != nil && p.exited() {
			tb.Fatalf("the seat exited before answering: %v\n%s", err, p.tail())
		}
		if time.Now().After(deadline) {
			if p != nil {
				tb.Fatalf("the verb does not answer within %v: %v\n%s", timeout, err, p.tail())
			}
			tb.Fatalf("the verb does not answer within %v: %v", timeout, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitSynced waits until a seat has logged that it caught up with each bucket's stream, one that
// existed when the seat started (a bucket not created yet is logged synced too, without applied_seq
// first): in a queue group the verb does not say which seat answers.
func waitSynced(tb testing.TB, p *proc, timeout time.Duration, buckets ...string) {
	tb.Helper()
	natstest.CheckFor(tb, timeout, 20*time.Millisecond, func() error {
		for _, b := range buckets {
			if !strings.Contains(p.logs(), `msg="bucket synced" bucket=`+b+" applied_seq=") {
				return fmt.Errorf("the seat has not caught up with %s\n%s", b, p.tail())
			}
		}
		return nil
	})
}

// waitRegistry waits until the registry bucket holds exactly the compiled table: the seat's registry
// writer is done, so the truth does not move under a comparison.
func waitRegistry(tb testing.TB, js jetstream.JetStream, timeout time.Duration) {
	tb.Helper()
	natstest.CheckFor(tb, timeout, 20*time.Millisecond, func() error {
		b, err := verbcheck.ReadBucket(context.Background(), js, provisioner.BucketRegistry)
		if err != nil {
			return err
		}
		if len(b) != len(provisioner.Registry.Entries) {
			return fmt.Errorf("registry holds %d kinds of %d", len(b), len(provisioner.Registry.Entries))
		}
		return nil
	})
}

// checkEqual waits until the verb has applied every bucket's last sequence, then compares every bucket
// whole with the KV API's view. Writers must be paused.
func checkEqual(tb testing.TB, nc *nats.Conn, js jetstream.JetStream, timeout time.Duration) {
	tb.Helper()
	if err := caughtUpAndEqual(nc, js, timeout); err != nil {
		tb.Fatal(err)
	}
}

// caughtUpAndEqual is checkEqual returning the difference instead of failing.
func caughtUpAndEqual(nc *nats.Conn, js jetstream.JetStream, timeout time.Duration) error {
	ctx := context.Background()
	last, err := verbcheck.LastSeqs(ctx, js)
	if err != nil {
		return err
	}
	deadline := time.Now().Add(timeout)
	for {
		err := verbcheck.CaughtUp(nc, last)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not caught up within %v: %w", timeout, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	truth, err := verbcheck.ReadTruth(ctx, js)
	if err != nil {
		return err
	}
	return truth.CheckAll(nc, last)
}

// mix makes a seeded random stream of writes over a bounded key space, as node clients would make
// them, with a share of deletes, purges, out-of-shape keys and values that are not MessagePack.
type mix struct {
	r     *rand.Rand
	nodes int
	n     int
}

func newMix(seed uint64, nodes int) *mix {
	return &mix{r: rand.New(rand.NewPCG(seed, seed^0x5eed)), nodes: nodes}
}

var mixKinds = []string{"config", "secret", "bound", "dir", "port", "shell", "wish"} // wish: no registry entry answers it

func (m *mix) key(bucket string) string {
	node := fixtures.NodeName(m.r.IntN(m.nodes))
	mod := fixtures.ModuleName(m.r.IntN(6))
	switch bucket {
	case provisioner.BucketNeeds:
		return fmt.Sprintf("%s.%s.%s.need-%d", node, mod, mixKinds[m.r.IntN(len(mixKinds))], m.r.IntN(4))
	case provisioner.BucketApplied:
		return node + "." + mod
	default:
		col := fixtures.CollectionPool[m.r.IntN(len(fixtures.CollectionPool))]
		return node + "." + provisioner.EncodeCollection(col) + "." + mod
	}
}

// badKey is an out-of-shape key of a bucket: a token too many or too few, a byte a token cannot
// hold, or a bad escape.
func (m *mix) badKey(bucket string) string {
	node := fixtures.NodeName(m.r.IntN(m.nodes))
	switch m.r.IntN(3) {
	case 0:
		return fmt.Sprintf("%s.mod-bad.x%d", node, m.r.IntN(3)) // 3 tokens: out of needs' 4 and applied's 2
	case 1:
		if bucket == provisioner.BucketNeeds {
			return fmt.Sprintf("%s.mod~%d.config.a", node, m.r.IntN(3))
		}
		return fmt.Sprintf("%s.mod~%d", node, m.r.IntN(3)) + map[bool]string{true: ".c", false: ""}[bucket == provisioner.BucketCollect]
	default:
		if bucket == provisioner.BucketCollect {
			return fmt.Sprintf("%s.bad=Z%d.mod-bad", node, m.r.IntN(3))
		}
		return fmt.Sprintf("%s.a.b.c.d%d", node, m.r.IntN(3))
	}
}

var mixBuckets = []string{provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect}

// next is the next write.
func (m *mix) next() fixtures.Op {
	m.n++
	bucket := mixBuckets[m.r.IntN(len(mixBuckets))]
	p := m.r.IntN(100)
	switch {
	case p < 8:
		return fixtures.Op{Bucket: bucket, Key: m.badKey(bucket), Op: provisioner.OpPut, Value: []byte{0x01}}
	case p < 12:
		return fixtures.Op{Bucket: bucket, Key: m.badKey(bucket), Op: provisioner.OpDelete}
	case p < 24:
		return fixtures.Op{Bucket: bucket, Key: m.key(bucket), Op: provisioner.OpDelete}
	case p < 29:
		return fixtures.Op{Bucket: bucket, Key: m.key(bucket), Op: provisioner.OpPurge}
	case p < 33:
		return fixtures.Op{Bucket: bucket, Key: m.key(bucket), Op: provisioner.OpPut, Value: []byte{0xc1, byte(m.n)}}
	default:
		v, _ := msgpack.Marshal(map[string]any{"n": m.n, "pad": strings.Repeat("x", m.r.IntN(40))})
		return fixtures.Op{Bucket: bucket, Key: m.key(bucket), Op: provisioner.OpPut, Value: v}
	}
}

func (m *mix) ops(n int) []fixtures.Op {
	out := make([]fixtures.Op, n)
	for i := range out {
		out[i] = m.next()
	}
	return out
}

// writer streams a mix into the buckets in chunks from a goroutine of its own, until stop or total
// writes. pause parks it between chunks (every write acknowledged), resume lets it go on.
type writer struct {
	pauseCh  chan chan struct{}
	resumeCh chan struct{}
	written  atomic.Int64
	retries  atomic.Int64          // chunks sent again after an error
	err      atomic.Pointer[error] // the last error a chunk met
	cancel   context.CancelFunc
	done     chan struct{}
}

func startWriter(tb testing.TB, js jetstream.JetStream, m *mix, chunk, total int) *writer {
	ctx, cancel := context.WithCancel(context.Background())
	w := &writer{pauseCh: make(chan chan struct{}), resumeCh: make(chan struct{}), cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(w.done)
		for {
			select {
			case ack := <-w.pauseCh:
				close(ack)
				select {
				case <-w.resumeCh:
				case <-ctx.Done():
					return
				}
			case <-ctx.Done():
				return
			default:
			}
			n := int(w.written.Load())
			if total > 0 && n >= total {
				return
			}
			size := chunk
			if total > 0 && n+size > total {
				size = total - n
			}
			// A chunk that fails (the server restarting, a leader moving) is sent again whole: every
			// key ends as the last write of it in the chunk, as if it had been sent once.
			ops := m.ops(size)
			// An attempt is bounded: a JetStream API call to a meta leader that just died waits for
			// its own 5 s timeout otherwise. The bound doubles with each attempt of the same chunk,
			// up to 30 s: a chunk of 1000 under the race detector on a loaded machine took longer
			// than 2 s each time, and every attempt was cut short and sent again (session 16:
			// TestLoad_ClientsWhileUpdatesStream wrote 12 of 20 chunks in 4 minutes).
			bound := 2 * time.Second
			for {
				actx, cancel := context.WithTimeout(ctx, bound)
				err := fixtures.Load(actx, js, ops, 512, nil)
				cancel()
				if err == nil {
					break
				}
				if ctx.Err() != nil {
					return
				}
				w.err.Store(&err)
				w.retries.Add(1)
				bound = min(2*bound, 30*time.Second)
				select {
				case <-time.After(100 * time.Millisecond):
				case <-ctx.Done():
					return
				}
			}
			w.written.Add(int64(size))
		}
	}()
	tb.Cleanup(w.stop)
	return w
}

// pause returns once the writer is parked with every write acknowledged (or has finished).
func (w *writer) pause() {
	ack := make(chan struct{})
	select {
	case w.pauseCh <- ack:
		<-ack
	case <-w.done:
	}
}

func (w *writer) resume() {
	select {
	case w.resumeCh <- struct{}{}:
	case <-w.done:
	}
}

// stop ends the writer and waits for it.
func (w *writer) stop() {
	w.cancel()
	<-w.done
}

// wait waits until the writer has written its total.
func (w *writer) wait(tb testing.TB, timeout time.Duration) {
	tb.Helper()
	select {
	case <-w.done:
	case <-time.After(timeout):
		tb.Fatalf("writer: %d written after %v (last error: %v)", w.written.Load(), timeout, w.lastErr())
	}
}

func (w *writer) lastErr() error {
	if p := w.err.Load(); p != nil {
		return *p
	}
	return nil
}
