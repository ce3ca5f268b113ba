package metrics

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/novox/mesh-provisioner/store"
)

// Server is the HTTP listener of /metrics, /healthz and /readyz. Listen binds before it returns, so a
// taken port is an error at start, not a log line later; Close shuts it down and waits for its
// goroutines.
//
// Its descriptors are bounded: it serves at most store.MetricsConns connections at once (the share
// of the process's descriptors store/fds.go keeps for it) and holds one more waiting for a place; a
// client past them waits in the kernel's accept queue, which costs the process no descriptor. Go's
// server alone accepts every connection it is offered, so a scraper storm or a slowloris could take
// every descriptor of the process and, with them, the state dir's (Pebble stops when it cannot
// create its log). When a client comes at the cap, the idle keep-alive connections are closed and
// keep-alives stay off until a connection closes leaving half the places free (the closing of the
// idle ones does not count: it would end the shed as it began), so that idle scrapers do not keep
// /healthz from its prober; a connection that sends its headers slowly holds its place for at most
// ReadHeaderTimeout.
//
// The server's keep-alive setting is set by one goroutine only (keepAlives), to the shed state as
// it reads it after each change: however full and freed interleave, the setting ends as the state
// says. Turning keep-alives off closes the idle connections on the goroutine that does it, whose
// Close calls freed there (with http.Server's lock held), so freed neither locks nor waits: it only
// swaps the state and wakes keepAlives. full, called on the accepting goroutine, waits for keepAlives
// to have turned keep-alives off.
type Server struct {
	srv   *http.Server
	ln    *limitListener
	log   *slog.Logger
	state atomic.Int32 // keepAlivesOn, shedding or shed
	done  chan error
	hook  hooks

	wake    chan struct{}      // cap 1: the state changed (freed)
	apply   chan chan struct{} // apply the state, then close the channel sent (full, tests)
	stop    chan struct{}      // closed by Close once Serve returned: keepAlives returns
	stopped chan struct{}      // closed by keepAlives when it returns
}

// The shed states. full swaps keepAlivesOn for shedding, keepAlives shedding for shed once it has
// turned keep-alives off, and freed shed for keepAlivesOn: no connection closed while the shed was
// being applied (the idle ones it closes among them) ends it.
const (
	keepAlivesOn int32 = iota
	shedding           // the cap was reached: keep-alives are being turned off
	shed               // keep-alives are off
)

// hooks are points where a test runs something of its own (export_test.go); all nil in production.
type hooks struct {
	swapped   func()                         // in full, after it swapped the shed state, before it is applied
	freed     func(open int)                 // after freed returned, on the goroutine that closed the connection
	connState func(net.Conn, http.ConnState) // http.Server.ConnState
}

// limits are a Server's bounds; Listen's are defaultLimits.
type limits struct {
	maxConns          int
	readHeaderTimeout time.Duration // a request's headers, from the connection's accept or last request
	readTimeout       time.Duration // the whole request
	writeTimeout      time.Duration // an answer (pprof's profile and trace must fit in it)
	idleTimeout       time.Duration // a keep-alive connection between requests
}

var defaultLimits = limits{
	maxConns:          store.MetricsConns,
	readHeaderTimeout: 5 * time.Second,
	readTimeout:       10 * time.Second,
	writeTimeout:      time.Minute,
	idleTimeout:       30 * time.Second,
}

// Listen binds addr (host:port; port 0 picks a free one) and serves h on it.
func Listen(addr string, h http.Handler, log *slog.Logger) (*Server, error) {
	return listen(addr, h, log, defaultLimits, hooks{})
}

func listen(addr string, h http.Handler, log *slog.Logger, lim limits, hk hooks) (*Server, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics listener: %w", err)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Server{
		srv: &http.Server{
			Handler:           h,
			ReadHeaderTimeout: lim.readHeaderTimeout,
			ReadTimeout:       lim.readTimeout,
			WriteTimeout:      lim.writeTimeout,
			IdleTimeout:       lim.idleTimeout,
			ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
			ConnState:         hk.connState,
		},
		log:     log,
		done:    make(chan error, 1),
		hook:    hk,
		wake:    make(chan struct{}, 1),
		apply:   make(chan chan struct{}),
		stop:    make(chan struct{}),
		stopped: make(chan struct{}),
	}
	freed := s.freed
	if hk.freed != nil {
		freed = func(open int) { s.freed(open); hk.freed(open) }
	}
	s.ln = &limitListener{Listener: ln, slots: make(chan struct{}, lim.maxConns), closed: make(chan struct{}), full: s.full, freed: freed}
	go s.keepAlives()
	go func() {
		err := s.srv.Serve(s.ln)
		if errors.Is(err, http.ErrServerClosed) {
			err = nil
		}
		s.done <- err
	}()
	return s, nil
}

// full is called when a client comes and every place is taken: idle connections are closed, and
// keep-alives stay off until a connection closing after that leaves half the places free (freed). It
// returns once keep-alives are off (so that the idle connections have closed), unless the Server was
// closed.
func (s *Server) full() {
	if s.state.CompareAndSwap(keepAlivesOn, shedding) {
		if s.hook.swapped != nil {
			s.hook.swapped()
		}
		s.log.Warn("metrics listener full: idle connections closed, new ones wait", "max_conns", cap(s.ln.slots))
		s.settle()
	}
}

// freed is called when a connection closed, with how many are still open. It may be called by
// keepAlives itself, in SetKeepAlivesEnabled(false) (the state is then shedding): it neither waits
// nor sets keep-alives.
func (s *Server) freed(open int) {
	if open <= cap(s.ln.slots)/2 && s.state.CompareAndSwap(shed, keepAlivesOn) {
		s.log.Info("metrics listener full: recovered", "open", open)
		select {
		case s.wake <- struct{}{}:
		default: // keepAlives is woken already, and reads the state after this swap
		}
	}
}

// settle returns once keepAlives applied the state as it was at the call, or once it stopped.
func (s *Server) settle() {
	done := make(chan struct{})
	select {
	case s.apply <- done:
		<-done
	case <-s.stop:
	}
}

// keepAlives sets the server's keep-alives to the state each time it changed (or settle asks), until
// Close. It is their only setter, and reads the state after each change, so the setting ends as the
// last state says.
func (s *Server) keepAlives() {
	defer close(s.stopped)
	off := false // keep-alives as last set
	for {
		var done chan struct{}
		select {
		case <-s.wake:
		case done = <-s.apply:
		case <-s.stop:
			return
		}
		switch s.state.Load() {
		case shedding:
			// Closes the idle connections, here: their freed find shedding and leave it.
			s.srv.SetKeepAlivesEnabled(false)
			off = true
			s.state.Store(shed) // nothing but keepAlives leaves shedding
		case keepAlivesOn:
			if off {
				s.srv.SetKeepAlivesEnabled(true)
				off = false
			}
		}
		if done != nil {
			close(done)
		}
	}
}

// Addr is the address the listener is bound to.
func (s *Server) Addr() string { return s.ln.Addr().String() }

// Conns is how many connections the Server holds open.
func (s *Server) Conns() int { return int(s.ln.open.Load()) }

// Close stops taking connections, lets requests in flight finish for up to five seconds, and waits
// for the serving goroutine, then stops keepAlives (which full may wait for until Serve returns).
func (s *Server) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := s.srv.Shutdown(ctx)
	if errors.Is(err, context.DeadlineExceeded) {
		err = s.srv.Close()
	}
	if serr := <-s.done; err == nil {
		err = serr
	}
	close(s.stop)
	<-s.stopped
	return err
}

// limitListener holds at most cap(slots) connections open, and one more in hand: a connection
// accepted while every slot is taken waits for one (after full is called) before Accept returns it.
// Taking it from the kernel's queue first is what tells a client waiting from a server merely at its
// cap, so that idle keep-alive connections are closed only for someone (golang.org/x/net/netutil's
// LimitListener waits for a slot before it accepts instead, and cannot tell).
type limitListener struct {
	net.Listener
	slots     chan struct{}
	open      atomic.Int64
	closed    chan struct{}
	closeOnce sync.Once
	full      func()
	freed     func(open int)
}

func (l *limitListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	select {
	case l.slots <- struct{}{}:
	default:
		l.full()
		select {
		case l.slots <- struct{}{}:
		case <-l.closed:
			c.Close()
			return nil, net.ErrClosed
		}
	}
	l.open.Add(1)
	return &limitConn{Conn: c, l: l}, nil
}

// Close closes the listener, and an Accept waiting for a place returns (http.Server.Shutdown calls it).
func (l *limitListener) Close() error {
	l.closeOnce.Do(func() { close(l.closed) })
	return l.Listener.Close()
}

type limitConn struct {
	net.Conn
	l        *limitListener
	released atomic.Bool
}

func (c *limitConn) Close() error {
	err := c.Conn.Close()
	if c.released.CompareAndSwap(false, true) {
		n := c.l.open.Add(-1)
		<-c.l.slots
		c.l.freed(int(n))
	}
	return err
}
