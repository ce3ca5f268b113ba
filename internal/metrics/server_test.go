package metrics_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/novox/mesh-provisioner/internal/metrics"
)

// serverFDs counts the descriptors of this process that are TCP connections accepted on port (the
// server's side; not its listening socket, nor the clients' side), read from /proc/self/fd and
// /proc/self/net/tcp: what the listener costs the process, whatever else the tests hold open.
func serverFDs(tb testing.TB, port int) int {
	tb.Helper()
	inodes := map[string]bool{}
	for _, f := range []string{"/proc/self/net/tcp", "/proc/self/net/tcp6"} {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n")[1:] {
			fs := strings.Fields(line)
			if len(fs) < 10 || fs[3] == "0A" { // 0A: LISTEN
				continue
			}
			_, hexPort, _ := strings.Cut(fs[1], ":")
			if p, err := strconv.ParseInt(hexPort, 16, 32); err == nil && int(p) == port {
				inodes[fs[9]] = true
			}
		}
	}
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		tb.Skipf("no /proc/self/fd: %v", err)
	}
	n := 0
	for _, e := range ents {
		l, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name()))
		if err == nil && strings.HasPrefix(l, "socket:[") && inodes[strings.TrimSuffix(strings.TrimPrefix(l, "socket:["), "]")] {
			n++
		}
	}
	return n
}

func listenCapped(t *testing.T, maxConns int) (*metrics.Server, int) {
	t.Helper()
	m := metrics.New(metrics.Options{})
	srv, err := metrics.ListenCapped("127.0.0.1:0", m.Handler(), maxConns)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	_, p, _ := net.SplitHostPort(srv.Addr())
	port, _ := strconv.Atoi(p)
	return srv, port
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(time.Minute); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("gave up waiting for %s", what)
		}
	}
}

func healthz(t *testing.T, addr string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/healthz", nil)
	req.Close = true
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("/healthz: %v", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("/healthz: %s", resp.Status)
	}
}

// More clients than the cap, the first ones sending their headers slowly (a slowloris): the server
// holds no more connections than the cap, the others wait unanswered until places free, and /healthz
// answers once they did.
func TestServer_ConnectionsPastTheCapWait(t *testing.T) {
	const maxConns, extra = 8, 24
	srv, port := listenCapped(t, maxConns)
	addr := srv.Addr()

	var slow []net.Conn
	for range maxConns {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		fmt.Fprint(c, "GET /healthz HTTP/1.1\r\nHost: x\r\n") // and never the blank line
		slow = append(slow, c)
	}
	waitFor(t, "the slow clients accepted", func() bool { return srv.Conns() == maxConns })

	var released atomic.Bool // the slow clients are gone
	answered := make(chan error, extra)
	for range extra {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		fmt.Fprint(c, "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
		go func() {
			resp, err := http.ReadResponse(bufio.NewReader(c), nil)
			switch {
			case err != nil:
			case !released.Load():
				err = fmt.Errorf("answered %s while the cap's %d connections were held", resp.Status, maxConns)
			case resp.StatusCode != 200:
				err = fmt.Errorf("answered %s", resp.Status)
			}
			if resp != nil {
				io.Copy(io.Discard, resp.Body)
			}
			answered <- err
		}()
	}
	if n := serverFDs(t, port); n > maxConns+1 {
		t.Errorf("the server holds %d connections' descriptors, past its cap of %d and the one waiting", n, maxConns)
	}
	if n := srv.Conns(); n != maxConns {
		t.Errorf("Conns = %d with %d clients, want the cap %d", n, maxConns+extra, maxConns)
	}

	released.Store(true)
	for _, c := range slow {
		c.Close()
	}
	for range extra {
		if err := <-answered; err != nil {
			t.Error(err)
		}
	}
	healthz(t, addr)
	waitFor(t, "every connection closed", func() bool { return srv.Conns() == 0 && serverFDs(t, port) == 0 })
}

// Keep-alive clients idle at the cap are closed for a new one: a prober's /healthz is answered while
// idle scrapers held every place.
func TestServer_IdleConnectionsGiveWayAtTheCap(t *testing.T) {
	const maxConns = 4
	srv, port := listenCapped(t, maxConns)
	addr := srv.Addr()
	var clients []net.Conn
	for range maxConns {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		clients = append(clients, c)
		fmt.Fprint(c, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.Close {
			t.Fatal("the server closes a keep-alive connection below its cap")
		}
	}
	if n := srv.Conns(); n != maxConns {
		t.Fatalf("Conns = %d with %d keep-alive clients, want %d", n, maxConns, maxConns)
	}
	healthz(t, addr) // waits for IdleTimeout (10 minutes here) unless the idle ones give way
	// A client whose connection the server had not yet marked idle keeps it: it is not closed, and
	// is one of the cap.
	if n := serverFDs(t, port); n > maxConns+1 {
		t.Errorf("the server holds %d connections' descriptors, past its cap of %d and the one waiting", n, maxConns)
	}
	for _, c := range clients {
		c.Close()
	}
	waitFor(t, "every connection closed", func() bool { return srv.Conns() == 0 && serverFDs(t, port) == 0 })
}
