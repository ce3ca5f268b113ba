package natstest

import (
	"bytes"
	"net"
	"sync"
	"testing"
)

// Proxy forwards TCP connections to a server, and can hold back what the server sends to its clients
// (Hold, Release): a client then hears nothing, not even heartbeats, while its requests still reach the
// server, as on a loaded client or a congested link. Nothing is dropped: what is held back is delivered,
// in order, on Release.
type Proxy struct {
	ln     net.Listener
	mu     sync.Mutex
	gate   *sync.Cond // on mu: held is false, or the Proxy closed
	held   bool       // the server-to-client copiers wait before they write
	mark   []byte     // HoldWhere: only the connections whose client sent it are held
	closed bool
	cons   []net.Conn
	wg     sync.WaitGroup
}

// proxyHead is how much of what a client sends first HoldWhere looks at.
const proxyHead = 16 << 10

// proxyConn is what a forwarded connection's client sent first (up to proxyHead), under Proxy.mu.
type proxyConn struct{ head []byte }

// RunProxy starts a Proxy to the server at addr (host:port) and closes it when the test ends.
func RunProxy(tb testing.TB, addr string) *Proxy {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("proxy listen: %v", err)
	}
	p := &Proxy{ln: ln}
	p.gate = sync.NewCond(&p.mu)
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", addr)
			if err != nil {
				_ = c.Close()
				continue
			}
			p.mu.Lock()
			p.cons = append(p.cons, c, s)
			p.mu.Unlock()
			pc := &proxyConn{}
			p.wg.Add(2)
			go func() {
				defer p.wg.Done()
				p.toServer(c, s, pc)
				_ = s.Close()
			}()
			go func() {
				defer p.wg.Done()
				p.toClient(c, s, pc)
				_ = c.Close()
			}()
		}
	}()
	tb.Cleanup(p.close)
	return p
}

// URL is the client URL of the Proxy.
func (p *Proxy) URL() string { return "nats://" + p.ln.Addr().String() }

// Hold holds back what the server sends until Release.
func (p *Proxy) Hold() { p.HoldWhere("") }

// HoldWhere holds back what the server sends until Release, on the connections whose client sent mark
// among the first bytes it sent (16 KiB), or on every one when mark is empty: a route's handshake
// names the account a pinned route is for, so one account's route traffic can be held alone.
func (p *Proxy) HoldWhere(mark string) {
	p.mu.Lock()
	p.held = true
	p.mark = []byte(mark)
	p.mu.Unlock()
}

// Release delivers what was held back, and forwards again.
func (p *Proxy) Release() {
	p.mu.Lock()
	p.held = false
	p.gate.Broadcast()
	p.mu.Unlock()
}

// toServer forwards what the client sends, keeping the first of it for HoldWhere.
func (p *Proxy) toServer(c, s net.Conn, pc *proxyConn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := c.Read(buf)
		if n > 0 {
			p.mu.Lock()
			if room := proxyHead - len(pc.head); room > 0 {
				pc.head = append(pc.head, buf[:min(n, room)]...)
			}
			p.mu.Unlock()
			if _, werr := s.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func (p *Proxy) toClient(c, s net.Conn, pc *proxyConn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := s.Read(buf)
		if n > 0 {
			p.mu.Lock()
			for p.held && !p.closed && bytes.Contains(pc.head, p.mark) {
				p.gate.Wait()
			}
			p.mu.Unlock()
			_, werr := c.Write(buf[:n])
			if werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// Cut closes every connection the Proxy forwards, as a server's restart or a broken link would: what
// it held back for them is lost with them. It still takes new connections.
func (p *Proxy) Cut() {
	p.mu.Lock()
	cons := p.cons
	p.cons = nil
	p.mu.Unlock()
	for _, c := range cons {
		_ = c.Close()
	}
}

func (p *Proxy) close() {
	_ = p.ln.Close()
	p.mu.Lock()
	p.closed = true
	p.gate.Broadcast()
	for _, c := range p.cons {
		_ = c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}
