package embedded_test

import (
	"bufio"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
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

// A flood of refused clients is not a flood of lines: nats-server logs each client refused for its
// password (unlike one past max_connections, next test), and the seat logs the first ten, then their
// count, at the server's stop at the latest.
func TestStart_RefusalsAreRateLimited(t *testing.T) {
	conf := filepath.Join(t.TempDir(), "nats.conf")
	require.NoError(t, os.WriteFile(conf, []byte("authorization { user: seat, password: right }\n"), 0o600))
	var log natstest.LogBuffer
	ns, err := embedded.Start(embedded.Config{Listen: "127.0.0.1:0", StoreDir: t.TempDir(), ConfigFile: conf,
		Logger: slog.New(slog.NewJSONHandler(&log, nil))})
	require.NoError(t, err)
	defer ns.Shutdown()
	const refused = 500
	for range refused {
		_, err := nats.Connect(ns.ClientURL(), nats.UserInfo("seat", "wrong"), nats.NoReconnect())
		require.ErrorIs(t, err, nats.ErrAuthorization)
	}
	ns.Shutdown()

	lines := jsonLines(t, log.String())
	logged, suppressed := 0, 0
	for _, m := range lines {
		msg, _ := m["msg"].(string)
		switch {
		case strings.Contains(msg, "authentication error"):
			require.Regexp(t, `^127\.0\.0\.1:\d+ - cid:\d+ - authentication error - User "seat"$`, msg)
			require.Equal(t, "ERROR", m["level"])
			require.Zero(t, suppressed, "the first ones are logged before any summary")
			logged++
		case msg == "embedded server: more lines like this were not logged":
			require.Equal(t, "ERROR", m["level"])
			require.Equal(t, "nats-server", m["component"])
			require.Equal(t, `<addr> - cid:<n> - authentication error - User "..."`, m["pattern"])
			require.NotEmpty(t, m["in"])
			suppressed += int(m["suppressed"].(float64))
		}
	}
	require.Equal(t, 10, logged)
	require.Equal(t, refused-logged, suppressed, "each refusal is logged or counted")
	require.Less(t, len(lines), 30, "far fewer lines than refusals")
}

// Clients past max_connections: nats-server itself logs at most one refusal a second (and drops the
// others without a count), and so does the seat.
func TestStart_RefusalsPastMaxConnAreFewLines(t *testing.T) {
	var log natstest.LogBuffer
	ns, err := embedded.Start(embedded.Config{Listen: "127.0.0.1:0", StoreDir: t.TempDir(), MaxConn: 2,
		Logger: slog.New(slog.NewJSONHandler(&log, nil))})
	require.NoError(t, err)
	defer ns.Shutdown()
	for range 2 {
		nc, err := nats.Connect(ns.ClientURL(), nats.NoReconnect())
		require.NoError(t, err)
		defer nc.Close()
	}
	start := time.Now()
	for range 500 {
		require.Contains(t, natstest.Greeting(t, ns.ClientURL()), "-ERR 'maximum connections exceeded'")
	}
	took := time.Since(start)
	ns.Shutdown()
	lines := jsonLines(t, log.String())
	refusals := 0
	for _, m := range lines {
		if m["msg"] != nil && strings.HasSuffix(m["msg"].(string), " - maximum connections exceeded") {
			refusals++
		}
	}
	require.NotZero(t, refusals)
	require.LessOrEqual(t, refusals, int(took/time.Second)+2, "at most one a second")
	require.Less(t, len(lines), 30)
}

// A client that floods the server with lines all different (its subscriptions' ids, which the
// server logs as they came, each a pattern of its own): the seat logs at most a minute's budget of
// them and counts the others, each once.
func TestStart_DistinctLinesAreBounded(t *testing.T) {
	conf := filepath.Join(t.TempDir(), "nats.conf")
	require.NoError(t, os.WriteFile(conf, []byte(`authorization { users: [ {user: seat, password: pw, permissions: { subscribe: { deny: "secret.>" } } } ] }`+"\n"), 0o600))
	var log natstest.LogBuffer
	ns, err := embedded.Start(embedded.Config{Listen: "127.0.0.1:0", StoreDir: t.TempDir(), ConfigFile: conf,
		Logger: slog.New(slog.NewJSONHandler(&log, nil))})
	require.NoError(t, err)
	defer ns.Shutdown()
	c, err := net.Dial("tcp", strings.TrimPrefix(ns.ClientURL(), "nats://"))
	require.NoError(t, err)
	defer c.Close()
	require.NoError(t, c.SetDeadline(time.Now().Add(30*time.Second)))
	const subs = 3000
	pong := make(chan error, 1)
	go func() {
		// Read the server's -ERRs as they come, up to the PONG after the last SUB.
		r := bufio.NewReader(c)
		for {
			l, err := r.ReadString('\n')
			if err != nil || l == "PONG\r\n" {
				pong <- err
				return
			}
		}
	}()
	var b strings.Builder
	b.WriteString(`CONNECT {"user":"seat","pass":"pw","verbose":false,"pedantic":false}` + "\r\n")
	for i := range subs {
		fmt.Fprintf(&b, "SUB secret.x sid%dx\r\n", i)
	}
	b.WriteString("PING\r\n")
	_, err = c.Write([]byte(b.String()))
	require.NoError(t, err)
	require.NoError(t, <-pong)
	ns.Shutdown()

	logged, counted := 0, 0
	for _, m := range jsonLines(t, log.String()) {
		msg, _ := m["msg"].(string)
		switch {
		case strings.Contains(msg, "Subscription Violation"):
			require.Regexp(t, `Subscription Violation - Subject "secret.x", SID sid\d+x$`, msg)
			logged++
		case strings.HasPrefix(msg, "embedded server: ") && strings.Contains(msg, " not logged"):
			require.Equal(t, "ERROR", m["level"])
			counted += int(m["suppressed"].(float64))
		}
	}
	require.Equal(t, 60, logged, "a level's lines of a minute")
	require.Equal(t, subs, logged+counted, "each line logged or counted once")
}

func jsonLines(t *testing.T, log string) []map[string]any {
	t.Helper()
	var lines []map[string]any
	for _, l := range strings.Split(strings.TrimSpace(log), "\n") {
		var m map[string]any
		require.NoError(t, json.Unmarshal([]byte(l), &m), l)
		lines = append(lines, m)
	}
	return lines
}
