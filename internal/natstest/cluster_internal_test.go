package natstest

import (
	"net"
	"testing"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/stretchr/testify/require"
)

// TestCluster_PortTakenBeforeTheFirstStart: a port FreePort found free and taken before the server
// listens on it makes the server's first start take another, rather than wait and fail the test.
func TestCluster_PortTakenBeforeTheFirstStart(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	taken := l.Addr().(*net.TCPAddr).Port
	c := &Cluster{tb: t, Servers: make([]*server.Server, 1), started: make([]bool, 1)}
	c.opts = []*server.Options{{ServerName: "S-1", Host: "127.0.0.1", Port: taken, NoSigs: true, NoLog: true,
		Cluster: server.ClusterOpts{Name: "mesh", Host: "127.0.0.1", Port: FreePort(t)}}}
	t.Cleanup(func() { c.Stop(0) })
	c.Start(0)
	require.NotNil(t, c.Servers[0])
	require.NotEqual(t, taken, c.opts[0].Port)
	require.Equal(t, c.URL(0), c.Servers[0].ClientURL())
}
