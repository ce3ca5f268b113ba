package natstest

import (
	"io"
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
	closed bool
	cons   []net.Conn
	wg     sync.WaitGroup
}

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
			p.wg.Add(2)
			go func() {
				defer p.wg.Done()
				_, _ = io.Copy(s, c)
				_ = s.Close()
			}()
			go func() {
				defer p.wg.Done()
				p.toClient(c, s)
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
func (p *Proxy) Hold() {
	p.mu.Lock()
	p.held = true
	p.mu.Unlock()
}

// Release delivers what was held back, and forwards again.
func (p *Proxy) Release() {
	p.mu.Lock()
	p.held = false
	p.gate.Broadcast()
	p.mu.Unlock()
}

func (p *Proxy) toClient(c, s net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := s.Read(buf)
		if n > 0 {
			p.mu.Lock()
			for p.held && !p.closed {
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
