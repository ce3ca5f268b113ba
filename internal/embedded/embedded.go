// Package embedded runs an in-process nats-server with JetStream: the default NATS of `serve` when no
// --nats is given, and the real server every test runs against.
package embedded

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
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
		ns.SetLoggerV2(slogAdapter{cfg.Logger}, false, false, false)
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

type slogAdapter struct{ l *slog.Logger }

func (a slogAdapter) Noticef(format string, v ...any) {
	a.l.Debug(fmt.Sprintf(format, v...), "component", "nats-server")
}
func (a slogAdapter) Warnf(format string, v ...any) {
	a.l.Warn(fmt.Sprintf(format, v...), "component", "nats-server")
}
func (a slogAdapter) Fatalf(format string, v ...any) {
	a.l.Error(fmt.Sprintf(format, v...), "component", "nats-server")
}
func (a slogAdapter) Errorf(format string, v ...any) {
	a.l.Error(fmt.Sprintf(format, v...), "component", "nats-server")
}
func (a slogAdapter) Debugf(format string, v ...any) {}
func (a slogAdapter) Tracef(format string, v ...any) {}
