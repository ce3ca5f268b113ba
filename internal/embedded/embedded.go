// Package embedded runs an in-process nats-server with JetStream: the default NATS of `serve` when no
// --nats is given, and the real server every test runs against.
package embedded

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// ErrListen says the embedded server cannot listen where it was asked to (the port is taken).
var ErrListen = errors.New("embedded nats-server cannot listen")

// Config of an embedded server.
type Config struct {
	// Listen is host:port; port 0 or -1 picks a free one.
	Listen string
	// StoreDir is JetStream's storage directory.
	StoreDir string
	// ConfigFile, when set, is a nats-server configuration file read first (accounts, users); Listen and
	// StoreDir override its listen and store_dir.
	ConfigFile string
	// Logger, when set, receives the server's notices and errors.
	Logger *slog.Logger
	// MaxConn, when above 0, is the most client connections the server holds at once (nats-server's
	// max_connections), over the config file's: past it a client is refused with "maximum
	// connections exceeded".
	MaxConn int
	// DefaultMaxConn, when above 0, is the most client connections when neither MaxConn nor the
	// config file says (nats-server's own default is 65536).
	DefaultMaxConn int
}

// Start starts a server and waits until it takes connections.
func Start(cfg Config) (*server.Server, error) {
	opts := &server.Options{}
	if cfg.ConfigFile != "" {
		o, err := server.ProcessConfigFile(cfg.ConfigFile)
		if err != nil {
			return nil, fmt.Errorf("nats-server config %s: %w", cfg.ConfigFile, err)
		}
		opts = o
	}
	host, port, err := splitListen(cfg.Listen)
	if err != nil {
		return nil, err
	}
	if port > 0 {
		// nats-server logs a taken port and never becomes ready: said at once rather than after the
		// 10 s wait below.
		l, err := net.Listen("tcp", net.JoinHostPort(host, strconv.Itoa(port)))
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrListen, err)
		}
		l.Close()
	}
	opts.Host, opts.Port = host, port
	switch {
	case cfg.MaxConn > 0:
		opts.MaxConn = cfg.MaxConn
	case opts.MaxConn == 0 && cfg.DefaultMaxConn > 0:
		opts.MaxConn = cfg.DefaultMaxConn
	}
	opts.JetStream = true
	opts.StoreDir = cfg.StoreDir
	opts.NoSigs = true
	opts.ServerName = "mesh-provisioner-embedded"
	ns, err := server.NewServer(opts)
	if err != nil {
		return nil, fmt.Errorf("embedded nats-server: %w", err)
	}
	if cfg.Logger != nil {
		ns.SetLoggerV2(newSlogAdapter(cfg.Logger), false, false, false)
	}
	go ns.Start()
	if !ns.ReadyForConnections(10 * time.Second) {
		ns.Shutdown()
		return nil, fmt.Errorf("embedded nats-server on %s did not start within 10s (is the port taken?)", cfg.Listen)
	}
	return ns, nil
}

func splitListen(listen string) (string, int, error) {
	if listen == "" {
		return "127.0.0.1", -1, nil
	}
	host, p, err := net.SplitHostPort(listen)
	if err != nil {
		return "", 0, fmt.Errorf("listen %q: %w", listen, err)
	}
	port, err := strconv.Atoi(p)
	if err != nil {
		return "", 0, fmt.Errorf("listen %q: port: %w", listen, err)
	}
	if port == 0 {
		// A free port, as net.Listen reads :0. nats-server reads 0 as its default, 4222: the
		// embedded server took the port of the NATS an operator asked to stay clear of, or waited
		// 10 s to say it could not start when that one ran.
		port = -1
	}
	return host, port, nil
}

// slogAdapter writes the server's lines to the seat's logger, with component nats-server: its notices
// at debug, its warnings at warn, its errors at error. Repeated lines are rate-limited (limit.go): the
// summary lines are written on a timer armed while lines are held back, stopped, and the summaries
// owed written, when the server says it exits.
type slogAdapter struct {
	l   *slog.Logger
	now func() time.Time

	mu     sync.Mutex
	lim    *limiter
	timer  *time.Timer // armed while a summary is owed
	closed bool        // the server exited: lines pass unlimited, no timer is armed
}

func newSlogAdapter(l *slog.Logger) *slogAdapter {
	return &slogAdapter{l: l, now: time.Now, lim: newLimiter()}
}

// serverExiting is the last line nats-server's Shutdown writes (as a notice), before Shutdown returns.
const serverExiting = "Server Exiting.."

func (a *slogAdapter) Noticef(format string, v ...any) {
	if format == serverExiting {
		defer a.close()
	}
	a.log(slog.LevelDebug, false, format, v)
}
func (a *slogAdapter) Warnf(format string, v ...any) { a.log(slog.LevelWarn, false, format, v) }

// Fatalf's lines always pass: the server stops after one.
func (a *slogAdapter) Fatalf(format string, v ...any) { a.log(slog.LevelError, true, format, v) }
func (a *slogAdapter) Errorf(format string, v ...any) { a.log(slog.LevelError, false, format, v) }
func (a *slogAdapter) Debugf(format string, v ...any) {}
func (a *slogAdapter) Tracef(format string, v ...any) {}

func (a *slogAdapter) log(level slog.Level, fatal bool, format string, v []any) {
	ctx := context.Background()
	if !a.l.Enabled(ctx, level) {
		return
	}
	msg := fmt.Sprintf(format, v...)
	a.mu.Lock()
	ok := true
	if !a.closed && !fatal {
		ok = a.lim.line(a.now(), level, msg)
		if !ok && a.timer == nil {
			a.timer = time.AfterFunc(summaryEvery, a.tick)
		}
	}
	a.mu.Unlock()
	if ok {
		a.l.Log(ctx, level, msg, "component", "nats-server")
	}
}

// tick writes the summaries owed; the next line held back arms the timer again.
func (a *slogAdapter) tick() {
	a.mu.Lock()
	a.timer = nil
	owed := a.lim.flush(a.now())
	a.mu.Unlock()
	a.summarise(owed)
}

// close stops the timer and writes the summaries owed: nothing held back goes unsaid.
func (a *slogAdapter) close() {
	a.mu.Lock()
	a.closed = true
	if a.timer != nil {
		a.timer.Stop()
		a.timer = nil
	}
	owed := a.lim.flush(a.now())
	a.mu.Unlock()
	a.summarise(owed)
}

func (a *slogAdapter) summarise(owed []summary) {
	for _, s := range owed {
		attrs := []any{"component", "nats-server"}
		switch s.msg {
		case summaryMsg:
			attrs = append(attrs, "pattern", s.pattern)
		case foldedMsg:
			attrs = append(attrs, "patterns", s.patterns)
		}
		attrs = append(attrs, "suppressed", s.suppressed, "in", s.in.Round(time.Millisecond))
		a.l.Log(context.Background(), s.level, s.msg, attrs...)
	}
}
