package natstest

import (
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// FreePort returns a loopback TCP port that was free a moment ago.
func FreePort(tb testing.TB) int {
	tb.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("free port: %v", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// Cluster is a JetStream cluster of in-process nats-servers on loopback, each with a store dir of
// its own, routed to each other. A server can be stopped and started again on the same ports and
// store, as a crashed and restarted node would be.
type Cluster struct {
	tb      testing.TB
	opts    []*server.Options
	Servers []*server.Server // nil while a server is stopped
	started []bool           // whether server i ever started: its URL may be known, so its ports stay
	held    []*Proxy         // RunClusterHeld: the proxies the held server's routes go through
}

// RunCluster starts n servers named S-1..S-n in a cluster named "mesh" and waits until JetStream has
// a meta leader. They are shut down when the test ends.
func RunCluster(tb testing.TB, n int) *Cluster {
	tb.Helper()
	return runCluster(tb, n, -1)
}

// RunClusterHeld is RunCluster with server held (an index) routed to the others only through
// proxies of its own, whose traffic to it HoldSystemRoutes holds back: the server keeps running and
// answering its clients from what it holds (its direct gets among them), while the others' raft
// appends, heartbeats and answers no longer reach it, as over a congested link from the rest of the
// cluster. It dials them (it is their proxies' client); they learn of it at an address where nothing
// listens, so they do not dial it past the proxies.
func RunClusterHeld(tb testing.TB, n, held int) *Cluster {
	tb.Helper()
	return runCluster(tb, n, held)
}

// HoldSystemRoutes holds back, until ReleaseRoutes, what the other servers send to RunClusterHeld's
// held server on the route each keeps for the system account alone (nats-server pins it by default):
// its raft groups' appends and heartbeats (the meta group's and its streams', which fall behind), and
// the JetStream API's answers from other servers to its clients (a stream leader's message get).
// What its clients' account sends on the other routes still flows: messages, direct gets answered by
// other servers, and the interest of the other servers' subscriptions (a stream's direct get
// subscriptions that went away).
func (c *Cluster) HoldSystemRoutes() {
	for _, p := range c.held {
		p.HoldWhere(`"route_account":"$SYS"`)
	}
}

// ReleaseRoutes delivers what HoldSystemRoutes held back, and forwards again.
func (c *Cluster) ReleaseRoutes() {
	for _, p := range c.held {
		p.Release()
	}
}

func runCluster(tb testing.TB, n, held int) *Cluster {
	tb.Helper()
	c := &Cluster{tb: tb, Servers: make([]*server.Server, n), started: make([]bool, n)}
	routes := make([]string, n)
	clusterPorts := make([]int, n)
	for i := range routes {
		clusterPorts[i] = FreePort(tb)
		routes[i] = fmt.Sprintf("nats://127.0.0.1:%d", clusterPorts[i])
	}
	for i := 0; i < n; i++ {
		c.opts = append(c.opts, &server.Options{
			ServerName: fmt.Sprintf("S-%d", i+1),
			Host:       "127.0.0.1",
			Port:       FreePort(tb),
			JetStream:  true,
			StoreDir:   tb.TempDir(),
			Cluster:    server.ClusterOpts{Name: "mesh", Host: "127.0.0.1", Port: clusterPorts[i]},
			Routes:     server.RoutesFromStr(strings.Join(routes, ",")),
			NoSigs:     true,
			NoLog:      true,
		})
	}
	tb.Cleanup(func() {
		for i := range c.Servers {
			c.Stop(i)
		}
	})
	if held >= 0 {
		// The others route to each other alone; the held server, started last, routes to each of them
		// through a proxy to the cluster port it listens on.
		var rest []string
		for i := range routes {
			if i != held {
				rest = append(rest, routes[i])
			}
		}
		for i, o := range c.opts {
			o.Routes = server.RoutesFromStr(strings.Join(rest, ","))
			if i == held {
				o.Routes = nil
				o.Cluster.Advertise = fmt.Sprintf("127.0.0.1:%d", FreePort(tb))
			}
		}
	}
	for i := range c.opts {
		if i != held {
			c.Start(i)
		}
	}
	if held >= 0 {
		// The meta leader among the others: the held server, once held, would lose it.
		c.WaitMetaLeader(30 * time.Second)
		var via []string
		for i, o := range c.opts {
			if i != held {
				p := RunProxy(tb, fmt.Sprintf("127.0.0.1:%d", o.Cluster.Port))
				c.held = append(c.held, p)
				via = append(via, p.URL())
			}
		}
		c.opts[held].Routes = server.RoutesFromStr(strings.Join(via, ","))
		c.Start(held)
	}
	c.WaitMetaLeader(30 * time.Second)
	return c
}

// Start starts server i (again), on its ports and store dir.
func (c *Cluster) Start(i int) {
	c.tb.Helper()
	if c.Servers[i] != nil {
		return
	}
	for attempt := 1; ; attempt++ {
		o := *c.opts[i]
		ns, err := server.NewServer(&o)
		if err != nil {
			c.tb.Fatalf("server %s: %v", o.ServerName, err)
		}
		errs := &errorLog{}
		ns.SetLoggerV2(errs, false, false, false)
		go ns.Start()
		ready := false
		for end := time.Now().Add(30 * time.Second); !ready && time.Now().Before(end) && !errs.contains("address already in use"); {
			ready = ns.ReadyForConnections(100 * time.Millisecond)
		}
		if ready {
			c.Servers[i], c.started[i] = ns, true
			return
		}
		ns.Shutdown()
		ns.WaitForShutdown()
		// A port FreePort found free can be taken before the server listens on it (another test's
		// connection given it as its local port): the server's first start takes two others.
		if attempt == 1 && !c.started[i] && errs.contains("address already in use") {
			c.opts[i].Port, c.opts[i].Cluster.Port = FreePort(c.tb), FreePort(c.tb)
			continue
		}
		c.tb.Fatalf("server %s did not start within 30 s: %s", o.ServerName, errs)
	}
}

// errorLog keeps the errors a server logs, so a server that does not start says why.
type errorLog struct {
	mu    sync.Mutex
	lines []string
}

func (l *errorLog) add(format string, v ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.lines) < 20 {
		l.lines = append(l.lines, fmt.Sprintf(format, v...))
	}
}

func (l *errorLog) contains(s string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, line := range l.lines {
		if strings.Contains(line, s) {
			return true
		}
	}
	return false
}

func (l *errorLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.lines) == 0 {
		return "no error logged"
	}
	return strings.Join(l.lines, "; ")
}

func (l *errorLog) Noticef(string, ...any)         {}
func (l *errorLog) Debugf(string, ...any)          {}
func (l *errorLog) Tracef(string, ...any)          {}
func (l *errorLog) Warnf(format string, v ...any)  { l.add("warning: "+format, v...) }
func (l *errorLog) Errorf(format string, v ...any) { l.add(format, v...) }
func (l *errorLog) Fatalf(format string, v ...any) { l.add("fatal: "+format, v...) }

// Stop shuts server i down, as a crash would take it away (its clients see the connection drop).
func (c *Cluster) Stop(i int) {
	if ns := c.Servers[i]; ns != nil {
		ns.Shutdown()
		ns.WaitForShutdown()
		c.Servers[i] = nil
	}
}

// URL is server i's client URL.
func (c *Cluster) URL(i int) string { return fmt.Sprintf("nats://127.0.0.1:%d", c.opts[i].Port) }

// URLs are the client URLs of the servers listed (all of them when none is), comma separated.
func (c *Cluster) URLs(idx ...int) string {
	if len(idx) == 0 {
		for i := range c.opts {
			idx = append(idx, i)
		}
	}
	var urls []string
	for _, i := range idx {
		urls = append(urls, c.URL(i))
	}
	return strings.Join(urls, ",")
}

// Index returns the index of the server named name, or -1.
func (c *Cluster) Index(name string) int {
	for i, o := range c.opts {
		if o.ServerName == name {
			return i
		}
	}
	return -1
}

// WaitMetaLeader waits until a running server knows the JetStream meta leader.
func (c *Cluster) WaitMetaLeader(timeout time.Duration) {
	c.tb.Helper()
	CheckFor(c.tb, timeout, 50*time.Millisecond, func() error {
		for _, ns := range c.Servers {
			if ns != nil && ns.JetStreamIsLeader() {
				return nil
			}
		}
		return fmt.Errorf("no JetStream meta leader yet")
	})
}

// WaitCurrent waits until every running server reports JetStream healthy: its streams and consumers
// caught up with their leaders.
func (c *Cluster) WaitCurrent(timeout time.Duration) {
	c.tb.Helper()
	CheckFor(c.tb, timeout, 100*time.Millisecond, func() error {
		for i, ns := range c.Servers {
			if ns == nil {
				continue
			}
			if st := ns.Healthz(&server.HealthzOptions{}); st.Status != "ok" {
				return fmt.Errorf("%s: %s %s", c.opts[i].ServerName, st.Status, st.Error)
			}
		}
		return nil
	})
}
