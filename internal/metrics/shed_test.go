package metrics_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/novox/mesh-provisioner/internal/metrics"
)

const keepAliveGet = "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"

// get writes req (whole or the rest of one) on c and reads its answer: whether the server keeps
// the connection is !resp.Close.
func get(t *testing.T, c net.Conn, req string) *http.Response {
	t.Helper()
	if _, err := fmt.Fprint(c, req); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("/healthz: %s", resp.Status)
	}
	return resp
}

func dial(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// logged keeps the level and message of every record.
type logged struct {
	mu   sync.Mutex
	recs []string
}

func (l *logged) Enabled(context.Context, slog.Level) bool { return true }
func (l *logged) Handle(_ context.Context, r slog.Record) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.recs = append(l.recs, r.Level.String()+" "+r.Message)
	return nil
}
func (l *logged) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *logged) WithGroup(string) slog.Handler      { return l }

// counts is how many warnings and infos were logged, and every record.
func (l *logged) counts() (warn, info int, recs []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, r := range l.recs {
		switch {
		case strings.HasPrefix(r, "WARN "):
			warn++
		case strings.HasPrefix(r, "INFO "):
			info++
		}
	}
	return warn, info, append([]string(nil), l.recs...)
}

// A connection closes, leaving half the cap open, between full's swap of the shed state and its
// applying it: keep-alives end as the shed state says (they stayed off, with the listener recovered,
// until the cap was reached again).
func TestServer_FreedInFullsSwapLeavesKeepAlivesAsTheShedSays(t *testing.T) {
	const maxConns = 2
	toClose := make(chan net.Conn, 1)
	freed := make(chan int, 64)
	accepted := make(chan struct{}, 64)
	srv, err := metrics.ListenHooked("127.0.0.1:0", metrics.New(metrics.Options{}).Handler(), maxConns, nil, metrics.Hooks{
		Swapped: func() {
			select {
			case c := <-toClose:
				c.Close()
				<-freed // the server closed its side: one connection is left, half the cap
			default:
			}
		},
		Freed: func(open int) { freed <- open },
		ConnState: func(_ net.Conn, st http.ConnState) {
			if st == http.StateNew {
				accepted <- struct{}{}
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	addr := srv.Addr()

	c1, c2 := dial(t, addr), dial(t, addr)
	for _, c := range []net.Conn{c1, c2} {
		fmt.Fprint(c, "GET /healthz HTTP/1.1\r\nHost: x\r\n") // the blank line later
	}
	<-accepted
	<-accepted

	toClose <- c1
	c3 := dial(t, addr) // at the cap: full, and c1 closes in its swap
	if resp := get(t, c3, keepAliveGet); !resp.Close {
		t.Errorf("the client that came at the cap was answered with keep-alives on")
	}
	if open := <-freed; open != 1 { // the server closed c3 (keep-alives were off)
		t.Fatalf("c3's close left %d connections open, want 1", open)
	}
	srv.Settle()
	shedding := srv.Shedding()
	kept := !get(t, c2, "\r\n").Close
	if kept == shedding {
		t.Fatalf("keep-alives on: %v, with the listener shedding: %v", kept, shedding)
	}
	if shedding {
		t.Errorf("still shedding with one connection of %d open, closed after the shed", maxConns)
	}
}

// Every place is taken by an idle keep-alive connection when a client comes: the shed closes them,
// and lasts past their closing (which frees more than half the places) until a connection closes
// after it: the client that came is answered with keep-alives off, and the next one, once that
// closed, with them on again; one warning when shedding, one line when recovered.
func TestServer_ShedOutlastsTheClosingOfTheIdle(t *testing.T) {
	const maxConns = 4
	idle := make(chan struct{}, 64)
	freed := make(chan int, 64)
	logs := &logged{}
	srv, err := metrics.ListenHooked("127.0.0.1:0", metrics.New(metrics.Options{}).Handler(), maxConns, slog.New(logs), metrics.Hooks{
		Freed: func(open int) { freed <- open },
		ConnState: func(_ net.Conn, st http.ConnState) {
			if st == http.StateIdle {
				idle <- struct{}{}
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	addr := srv.Addr()

	for range maxConns {
		if get(t, dial(t, addr), keepAliveGet).Close {
			t.Fatal("the server closes a keep-alive connection below its cap")
		}
		<-idle
	}
	if get(t, dial(t, addr), keepAliveGet).Close == false {
		t.Fatal("the client that came at the cap was answered with keep-alives on: the shed ended with the closing of the idle connections")
	}
	for range maxConns + 1 { // the idle ones, then the one answered with keep-alives off
		<-freed
	}
	srv.Settle()
	if srv.Shedding() {
		t.Error("still shedding with every connection closed")
	}
	if get(t, dial(t, addr), keepAliveGet).Close {
		t.Error("a client after the recovery was answered with keep-alives off")
	}
	if w, i, recs := logs.counts(); w != 1 || i != 1 {
		t.Errorf("logged %d warnings and %d infos, want 1 and 1: %q", w, i, recs)
	}
}
