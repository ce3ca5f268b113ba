// Package natstest runs real in-process nats-servers with JetStream for tests, and asks the verb the
// way a client does. Nothing here stands in for NATS: every test talks to a real server.
package natstest

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nats.go/micro"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/novox/mesh-provisioner/internal/embedded"
	"github.com/novox/mesh-provisioner/internal/streaminfo"
)

// RunServer starts a nats-server with JetStream on a free loopback port, storing under a temporary
// directory, and shuts it down when the test ends.
func RunServer(tb testing.TB) *server.Server {
	tb.Helper()
	return RunServerAt(tb, "127.0.0.1:-1", tb.TempDir(), "")
}

// RunServerDeniedStreamList runs a server with JetStream whose account has two users: admin (password
// admin) may do everything, seat (password seat) everything but list the streams' infos
// ($JS.API.STREAM.LIST), as a seat whose NATS user was set up before the seat listed them.
func RunServerDeniedStreamList(tb testing.TB) *server.Server {
	tb.Helper()
	return RunServerSeatDenied(tb, "$JS.API.STREAM.LIST")
}

// RunServerSeatDenied runs a server with JetStream whose account has two users: admin (password admin)
// may do everything, seat (password seat) everything but publish to the subjects deny lists. A request
// to a denied subject is dropped by the server (the client's error callback hears of it): it gets no
// answer. DenySeat changes the list on the running server.
func RunServerSeatDenied(tb testing.TB, deny ...string) *server.Server {
	tb.Helper()
	return runServerSeat(tb, seatDeniedConf(deny, nil))
}

// RunServerSeatRefused is RunServerSeatDenied with subscriptions refused too: seat may not publish to
// publish, nor subscribe to subscribe.
func RunServerSeatRefused(tb testing.TB, publish, subscribe []string) *server.Server {
	tb.Helper()
	return runServerSeat(tb, seatDeniedConf(publish, subscribe))
}

// RunServerSeatNoAdvisories runs a server with JetStream whose account has two users: admin (password
// admin) may do everything, seat (password seat) everything but subscribe to JetStream's advisories
// ($JS.EVENT.>), as a seat whose account does not export them: it finds new streams by listing alone.
func RunServerSeatNoAdvisories(tb testing.TB) *server.Server {
	tb.Helper()
	return runServerSeat(tb, seatDeniedConf(nil, []string{"$JS.EVENT.>"}))
}

func runServerSeat(tb testing.TB, config string) *server.Server {
	tb.Helper()
	conf := filepath.Join(tb.TempDir(), "nats.conf")
	if err := os.WriteFile(conf, []byte(config), 0o644); err != nil {
		tb.Fatal(err)
	}
	dir := tb.TempDir()
	ns := RunServerAt(tb, "127.0.0.1:-1", dir, conf)
	seatDeniedConfs.Store(ns, [2]string{conf, dir})
	tb.Cleanup(func() { seatDeniedConfs.Delete(ns) })
	return ns
}

// seatDeniedConfs holds the config file and store dir of each RunServerSeatDenied server: a reload
// must name those the server started with.
var seatDeniedConfs sync.Map

// NoDirectGets makes a stream answer no direct gets, so that a KV's reads of it go through the
// JetStream API: DenySeat's reload of the server's options, while a direct get of the stream is
// answered, is a data race inside nats-server 2.15.3 (stream.go getDirectRequest reads the options
// without their lock), which make race reports (docs/reliability.md).
func NoDirectGets(tb testing.TB, js jetstream.JetStream, stream string) {
	tb.Helper()
	ctx := context.Background()
	s, err := js.Stream(ctx, stream)
	if err != nil {
		tb.Fatalf("stream %s: %v", stream, err)
	}
	cfg := s.CachedInfo().Config
	cfg.AllowDirect = false
	if _, err := js.UpdateStream(ctx, cfg); err != nil {
		tb.Fatalf("stream %s without direct gets: %v", stream, err)
	}
}

// DenySeat reloads the permissions of a RunServerSeatDenied server: from now on seat may publish to
// everything but deny, on the connections it has already as well as on new ones.
func DenySeat(tb testing.TB, ns *server.Server, deny ...string) {
	tb.Helper()
	started, ok := seatDeniedConfs.Load(ns)
	if !ok {
		tb.Fatal("DenySeat: not a RunServerSeatDenied server")
	}
	conf, storeDir := started.([2]string)[0], started.([2]string)[1]
	if err := os.WriteFile(conf, []byte(seatDeniedConf(deny, nil)), 0o644); err != nil {
		tb.Fatal(err)
	}
	opts, err := server.ProcessConfigFile(conf)
	if err != nil {
		tb.Fatalf("nats-server config: %v", err)
	}
	// As embedded.Start sets them: the reload changes the permissions and nothing else.
	addr := ns.Addr().(*net.TCPAddr)
	opts.Host, opts.Port = addr.IP.String(), addr.Port
	opts.JetStream, opts.StoreDir, opts.NoSigs, opts.ServerName = true, storeDir, true, ns.Name()
	if err := ns.ReloadOptions(opts); err != nil {
		tb.Fatalf("reload nats-server permissions: %v", err)
	}
}

func seatDeniedConf(publish, subscribe []string) string {
	quote := func(subjects []string) string {
		quoted := make([]string, len(subjects))
		for i, d := range subjects {
			quoted[i] = strconv.Quote(d)
		}
		return strings.Join(quoted, ", ")
	}
	return fmt.Sprintf(`
accounts {
  MESH {
    jetstream: enabled
    users: [
      {user: admin, password: admin}
      {user: seat, password: seat, permissions: {
        publish: {allow: [">"], deny: [%s]}
        subscribe: {allow: [">"], deny: [%s]}
      }}
    ]
  }
}
`, quote(publish), quote(subscribe))
}

// RunServerAt starts a nats-server on listen with a given store dir and optional config file.
func RunServerAt(tb testing.TB, listen, storeDir, configFile string) *server.Server {
	tb.Helper()
	ns, err := embedded.Start(embedded.Config{Listen: listen, StoreDir: storeDir, ConfigFile: configFile})
	if err != nil {
		tb.Fatalf("start nats-server: %v", err)
	}
	tb.Cleanup(func() {
		ns.Shutdown()
		ns.WaitForShutdown()
	})
	return ns
}

// Connect connects to a server and returns the connection and its JetStream context.
func Connect(tb testing.TB, url string, opts ...nats.Option) (*nats.Conn, jetstream.JetStream) {
	tb.Helper()
	opts = append([]nats.Option{nats.MaxReconnects(-1), nats.ReconnectWait(50 * time.Millisecond)}, opts...)
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		tb.Fatalf("connect %s: %v", url, err)
	}
	tb.Cleanup(nc.Close)
	// A JetStream API request the test makes without a deadline of its own (a bucket created with
	// context.Background) waits up to 30 s, not nats.go's 5: a stream's creation syncs to disk, and on a
	// shared machine beside other tests' fsyncs it took longer than 5 s now and then, failing the test
	// before it began.
	js, err := jetstream.New(nc, jetstream.WithDefaultTimeout(30*time.Second))
	if err != nil {
		tb.Fatalf("jetstream: %v", err)
	}
	return nc, js
}

// CheckFor polls fn every interval until it returns nil, and fails the test with its last error when
// timeout passes first.
func CheckFor(tb testing.TB, timeout, interval time.Duration, fn func() error) {
	tb.Helper()
	deadline := time.Now().Add(timeout)
	var err error
	for time.Now().Before(deadline) {
		if err = fn(); err == nil {
			return
		}
		time.Sleep(interval)
	}
	tb.Fatalf("condition not met within %v: %v", timeout, err)
}

// Receive waits up to timeout for a value on ch and returns it, and fails the test saying waiting when
// none comes: what a test waits for from a goroutine that may hang (a stop, an open, a held write).
func Receive[T any](tb testing.TB, ch <-chan T, timeout time.Duration, waiting string) T {
	tb.Helper()
	var v T
	CheckFor(tb, timeout, 5*time.Millisecond, func() error {
		select {
		case v = <-ch:
			return nil
		default:
			return errors.New(waiting)
		}
	})
	return v
}

// Answer is a decoded answer of the verb.
type Answer struct {
	What           string           `json:"what" msgpack:"what"`
	Rows           []map[string]any `json:"rows" msgpack:"rows"`
	Anomalies      []map[string]any `json:"anomalies" msgpack:"anomalies"`
	AnomaliesTotal int64            `json:"anomalies_total" msgpack:"anomalies_total"`
	AsOf           uint64           `json:"as_of" msgpack:"as_of"`
	Synced         bool             `json:"synced" msgpack:"synced"`
	Next           string           `json:"next" msgpack:"next"`
}

// VerbError is an error answer: the micro headers and the body's error.
type VerbError struct {
	Code        int
	Description string
	Body        string
}

func (e *VerbError) Error() string { return fmt.Sprintf("verb error %d: %s", e.Code, e.Description) }

// Asked is what a request sent by AskLater got.
type Asked struct {
	A   Answer
	Err error
}

// AskLater sends a JSON request (Ask) from a goroutine of its own, for a test that must act while the
// request waits (a min_seq), and delivers what it got on the channel it returns, which holds it.
func AskLater(nc *nats.Conn, subject string, body []byte) <-chan Asked {
	out := make(chan Asked, 1)
	go func() {
		a, _, err := Ask(nc, subject, body, false)
		out <- Asked{a, err}
	}()
	return out
}

// Ask sends a raw request body to the verb and decodes the answer; asMsgpack says how. An error answer
// is a *VerbError.
func Ask(nc *nats.Conn, subject string, body []byte, asMsgpack bool) (Answer, []byte, error) {
	msg, err := nc.Request(subject, body, 10*time.Second)
	if err != nil {
		return Answer{}, nil, err
	}
	if code := msg.Header.Get(micro.ErrorCodeHeader); code != "" {
		n, _ := strconv.Atoi(code)
		ve := &VerbError{Code: n, Description: msg.Header.Get(micro.ErrorHeader)}
		var b map[string]any
		if asMsgpack {
			if err := msgpack.Unmarshal(msg.Data, &b); err != nil {
				return Answer{}, msg.Data, fmt.Errorf("error body is not MessagePack: %w", err)
			}
		} else if err := json.Unmarshal(msg.Data, &b); err != nil {
			return Answer{}, msg.Data, fmt.Errorf("error body is not JSON: %w (%q)", err, msg.Data)
		}
		ve.Body, _ = b["error"].(string)
		return Answer{}, msg.Data, ve
	}
	var a Answer
	if asMsgpack {
		err = msgpack.Unmarshal(msg.Data, &a)
	} else {
		dec := json.NewDecoder(bytes.NewReader(msg.Data))
		dec.UseNumber()
		err = dec.Decode(&a)
	}
	if err != nil {
		return Answer{}, msg.Data, fmt.Errorf("decode answer: %w", err)
	}
	return a, msg.Data, nil
}

// AskAll sends a request (a map, encoded as JSON or MessagePack) and follows next through every page.
// It returns every row and the last page's answer.
func AskAll(nc *nats.Conn, subject string, req map[string]any, asMsgpack bool) ([]map[string]any, Answer, error) {
	var rows []map[string]any
	r := map[string]any{}
	for k, v := range req {
		r[k] = v
	}
	for page := 0; ; page++ {
		if page > 100000 {
			return nil, Answer{}, fmt.Errorf("more than 100000 pages")
		}
		body, err := Body(r, asMsgpack)
		if err != nil {
			return nil, Answer{}, err
		}
		a, _, err := Ask(nc, subject, body, asMsgpack)
		if err != nil {
			return nil, Answer{}, err
		}
		rows = append(rows, a.Rows...)
		if a.Next == "" {
			return rows, a, nil
		}
		r["after"] = a.Next
	}
}

// RunPoller runs p's listing every `every`, as a seat does, until the test ends.
func RunPoller(tb testing.TB, p *streaminfo.Poller, every time.Duration) {
	tb.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	p.Go(ctx, &wg, every, nil) // running as RunPoller returns, as a seat's
	tb.Cleanup(func() {
		cancel()
		wg.Wait()
	})
}

// Body encodes a request as the verb's clients send it: JSON, or MessagePack when asMsgpack.
func Body(req any, asMsgpack bool) ([]byte, error) {
	if asMsgpack {
		return msgpack.Marshal(req)
	}
	return json.Marshal(req)
}

// Parallel sets how many parallel tests of the package run at once (-test.parallel) to n, unless the
// command line sets it. For a package whose tests mostly wait (on servers, polls, backoffs and
// timeouts) rather than compute: Go's default, GOMAXPROCS, is 2 on the 2-core machine make test runs
// on, which kept its cores idle for most of such a package's run (docs/reliability.md, session 17).
// Call it from TestMain, before m.Run. A test that sets process-wide state (an environment variable,
// a package variable, GOMAXPROCS, rlimits) or counts the process's goroutines or heap does not call
// t.Parallel: it runs before the parallel ones start, alone.
func Parallel(n int) {
	if !flag.Parsed() {
		flag.Parse()
	}
	set := false
	flag.Visit(func(f *flag.Flag) { set = set || f.Name == "test.parallel" })
	if !set {
		if err := flag.Set("test.parallel", strconv.Itoa(n)); err != nil {
			panic(err)
		}
	}
}

// Greeting is what the NATS server at url says to a client it refuses: its INFO and its -ERR (such as
// "-ERR 'maximum connections exceeded'"), read until it closes the connection. The client sends
// nothing: nats.go sends its CONNECT at once, and the server's close of a connection with that unread
// resets it, often before the -ERR is read (nats.go then says "broken pipe"). A client the server
// takes is not closed: it is read for 10 s at most.
func Greeting(tb testing.TB, url string) string {
	tb.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(url, "nats://"))
	if err != nil {
		tb.Fatalf("dial %s: %v", url, err)
	}
	defer c.Close()
	if err := c.SetReadDeadline(time.Now().Add(10 * time.Second)); err != nil {
		tb.Fatalf("%v", err)
	}
	b, _ := io.ReadAll(c)
	return string(b)
}
