package embedded_test

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/internal/embedded"
	"github.com/novox/mesh-provisioner/internal/natstest"
)

// The server's max_connections: MaxConn over the config file's, the file's over DefaultMaxConn, and
// nats-server's own default when none says.
func TestStart_MaxConn(t *testing.T) {
	dir := t.TempDir()
	conf := filepath.Join(dir, "nats.conf")
	require.NoError(t, os.WriteFile(conf, []byte("max_connections: 30\n"), 0o600))
	for _, tc := range []struct {
		name                string
		config              string
		maxConn, defaultMax int
		want                int
	}{
		{"nats-server's default", "", 0, 0, 65536},
		{"the default given", "", 0, 100, 100},
		{"asked", "", 7, 100, 7},
		{"the config file's", conf, 0, 100, 30},
		{"asked, over the config file's", conf, 7, 100, 7},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ns, err := embedded.Start(embedded.Config{Listen: "127.0.0.1:0", StoreDir: t.TempDir(), ConfigFile: tc.config, MaxConn: tc.maxConn, DefaultMaxConn: tc.defaultMax})
			require.NoError(t, err)
			defer ns.Shutdown()
			vz, err := ns.Varz(nil)
			require.NoError(t, err)
			require.Equal(t, tc.want, vz.MaxConn)
		})
	}
}

// Past MaxConn a client is refused, and one is taken again once another left.
func TestStart_ClientsPastMaxConnAreRefused(t *testing.T) {
	ns, err := embedded.Start(embedded.Config{Listen: "127.0.0.1:0", StoreDir: t.TempDir(), MaxConn: 2})
	require.NoError(t, err)
	defer ns.Shutdown()
	var held []*nats.Conn
	for range 2 {
		nc, err := nats.Connect(ns.ClientURL(), nats.NoReconnect())
		require.NoError(t, err)
		held = append(held, nc)
	}
	require.Contains(t, natstest.Greeting(t, ns.ClientURL()), "-ERR 'maximum connections exceeded'")
	held[0].Close()
	// The server lets the closed one go once it reads its end: asked until it has.
	require.Eventually(t, func() bool {
		nc, err := nats.Connect(ns.ClientURL(), nats.NoReconnect())
		if err == nil {
			held = append(held, nc)
		}
		return err == nil
	}, 10*time.Second, 10*time.Millisecond)
	for _, nc := range held {
		nc.Close()
	}
}
