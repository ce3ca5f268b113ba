package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/novox/mesh-provisioner/internal/natstest"
)

// servedSeat is `mesh-provisioner serve` running in this process, as a user runs it.
type servedSeat struct {
	natsURL     string
	metricsAddr string
	dir         string // holds state/ and nats/
	stdout      *natstest.LogBuffer
	stderr      *natstest.LogBuffer
	cancel      context.CancelFunc
	done        chan error
}

// startServe runs serve with args (plus --state and, without --nats, an embedded server on a free port
// under dir) until stop, and waits until the seat answers.
func startServe(dir string, args ...string) (*servedSeat, error) {
	s := &servedSeat{dir: dir, stdout: &natstest.LogBuffer{}, stderr: &natstest.LogBuffer{}, done: make(chan error, 1)}
	full := append([]string{"--state", filepath.Join(dir, "state"), "--embedded-listen", "127.0.0.1:-1",
		"--embedded-store", filepath.Join(dir, "nats")}, args...)
	started := make(chan struct{})
	cmd := &ServeCommand{Stdout: s.stdout, Stderr: s.stderr, started: func(url, addr string) {
		s.natsURL, s.metricsAddr = url, addr
		close(started)
	}}
	ctx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	go func() { s.done <- cmd.Run(ctx, full) }()
	select {
	case <-started:
		return s, nil
	case err := <-s.done:
		cancel()
		return nil, fmt.Errorf("serve stopped before it answered: %v\n%s", err, s.stderr.String())
	case <-time.After(60 * time.Second):
		cancel()
		<-s.done
		return nil, fmt.Errorf("serve did not answer within 60s\n%s", s.stderr.String())
	}
}

// stop cancels serve, as a first SIGTERM does, and returns what Run returned.
func (s *servedSeat) stop() error {
	s.cancel()
	return <-s.done
}

// The demo seat: one `serve --demo` shared by the tests of this package that only read, started on
// first use and stopped in TestMain.
var demo struct {
	once sync.Once
	seat *servedSeat
	err  error
	dir  string
}

func demoSeat(tb testing.TB) *servedSeat {
	tb.Helper()
	demo.once.Do(func() {
		demo.dir, demo.err = os.MkdirTemp("", "mesh-provisioner-demo-")
		if demo.err != nil {
			return
		}
		demo.seat, demo.err = startServe(demo.dir, "--demo", "--metrics-addr", "127.0.0.1:0", "--metrics-poll", "50ms", "--log-format", "json")
	})
	if demo.err != nil {
		tb.Fatalf("demo seat: %v", demo.err)
	}
	return demo.seat
}

// TestMain runs four of the parallel tests at once: most of this package's tests wait on servers,
// child processes and signals rather than compute (natstest.Parallel). Those that set the environment
// (NATS_*, TMPDIR) or a package variable, fill a disk, or read the shared demo seat's counters stay
// sequential.
func TestMain(m *testing.M) {
	natstest.Parallel(4)
	code := m.Run()
	if demo.seat != nil {
		if err := demo.seat.stop(); err != nil {
			fmt.Fprintln(os.Stderr, "demo seat stopped with:", err)
			code = 1
		}
	}
	if demo.dir != "" {
		os.RemoveAll(demo.dir)
	}
	if built.dir != "" {
		os.RemoveAll(built.dir)
	}
	os.Exit(code)
}

// docsAccountsServer starts a nats-server with docs/nats-accounts.conf's accounts, storing under
// dir/nats, for a test that runs commands as the docs' users, and clears the NATS_* environment
// the commands would read instead of their flags. It returns the server's URL.
func docsAccountsServer(t *testing.T, dir string) string {
	t.Helper()
	for _, env := range []string{"NATS_URL", "NATS_USER", "NATS_PASSWORD", "NATS_CREDS", "NATS_INBOX_PREFIX"} {
		t.Setenv(env, "")
	}
	ns := natstest.RunServerAt(t, "127.0.0.1:-1", filepath.Join(dir, "nats"), filepath.Join("..", "..", "docs", "nats-accounts.conf"))
	return ns.ClientURL()
}
