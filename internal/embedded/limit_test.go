package embedded

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestNormalise(t *testing.T) {
	for _, tc := range []struct{ line, want string }{
		{"127.0.0.1:54321 - cid:17 - maximum connections exceeded", "<addr> - cid:<n> - maximum connections exceeded"},
		{"10.2.3.4:1 - cid:9 - maximum connections exceeded", "<addr> - cid:<n> - maximum connections exceeded"},
		{"[::1]:40000 - cid:3 - maximum connections exceeded", "<addr> - cid:<n> - maximum connections exceeded"},
		{"[fe80::1%eth0]:4 - wid:3 - x", "<addr> - wid:<n> - x"},
		{"1.2.3.4/127.0.0.1:5 - mid_ws:8 - x", "<addr>/<addr> - mid_ws:<n> - x"},
		{`127.0.0.1:5 - cid:8 - "v1.41.0:go:node-17" - "$G/alice" - authentication error - User "alice"`,
			`<addr> - cid:<n> - "..." - "..." - authentication error - User "..."`},
		{`127.0.0.1:5 - cid:8 - Slow Consumer Detected: WriteDeadline of 10s exceeded with 5123 chars pending`,
			`<addr> - cid:<n> - Slow Consumer Detected: WriteDeadline of <n>s exceeded with <n> chars pending`},
		{"127.0.0.1:5 - cid:8 - Readloop processing time: 2.513s", "<addr> - cid:<n> - Readloop processing time: <n>s"},
		{"127.0.0.1:5 - cid:8 - TLS handshake error: read tcp 127.0.0.1:4222->10.0.0.5:5555: read: connection reset by peer",
			"<addr> - cid:<n> - TLS handshake error: read tcp <addr>-><addr>: read: connection reset by peer"},
		// Words keep their digits: lines about different streams stay apart.
		{"Restored 12 messages for stream '$G > composed-17' in 3ms", "Restored <n> messages for stream '$G > composed-17' in <n>ms"},
		{"Starting nats-server version 2.15.3", "Starting nats-server version <n>"},
		{"accept tcp 127.0.0.1:4222: accept4: too many open files; sleeping 10ms", "accept tcp <addr>: accept4: too many open files; sleeping <n>ms"},
		{"[1] not an address", "[<n>] not an address"},
		{`an "unclosed quote`, `an "unclosed quote`},
		{"", ""},
	} {
		require.Equal(t, tc.want, normalise(tc.line), tc.line)
	}
	require.Len(t, normalise(strings.Repeat("x ", 2000)), maxPatternLen)
}

func TestLimiter(t *testing.T) {
	t0 := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	l := newLimiter()
	refused := func(i int) string {
		return fmt.Sprintf("127.0.0.1:%d - cid:%d - maximum connections exceeded", 40000+i, i)
	}
	logged := 0
	for i := range 100 {
		ok, owed := l.line(t0.Add(time.Duration(i)*100*time.Millisecond), slog.LevelError, refused(i))
		require.Empty(t, owed)
		if ok {
			logged++
			require.Less(t, i, linesPerWindow, "the first ones are logged")
		}
	}
	require.Equal(t, linesPerWindow, logged)
	// A line said once passes, and so does the same text at another level.
	ok, _ := l.line(t0.Add(10*time.Second), slog.LevelError, "JetStream store error")
	require.True(t, ok)
	ok, _ = l.line(t0.Add(10*time.Second), slog.LevelWarn, refused(0))
	require.True(t, ok)

	// The summary: 90 not logged, from the 11th (at 1s) to the flush.
	require.Equal(t, []summary{{slog.LevelError, "<addr> - cid:<n> - maximum connections exceeded", 90, 9 * time.Second}}, l.flush(t0.Add(10*time.Second)))
	require.Empty(t, l.flush(t0.Add(20*time.Second)), "said once")

	// Within the minute, the next ones are counted again; after it, 10 more are logged.
	ok, _ = l.line(t0.Add(30*time.Second), slog.LevelError, refused(1))
	require.False(t, ok)
	for i := range 15 {
		ok, _ := l.line(t0.Add(time.Minute+time.Duration(i)*time.Millisecond), slog.LevelError, refused(i))
		require.Equal(t, i < linesPerWindow, ok, i)
	}
	require.Equal(t, []summary{{slog.LevelError, "<addr> - cid:<n> - maximum connections exceeded", 6, 40 * time.Second}}, l.flush(t0.Add(70*time.Second)))

	// A pattern whose window ended and owes nothing is forgotten at a flush.
	require.Empty(t, l.flush(t0.Add(3*time.Minute)))
	require.Empty(t, l.patterns)
}

// The patterns tracked are bounded: the one seen longest ago is forgotten, saying what it owes.
func TestLimiter_Evicts(t *testing.T) {
	t0 := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	l := newLimiter()
	for range linesPerWindow + 3 {
		l.line(t0, slog.LevelError, "store error on stream 'first'")
	}
	for i := range maxPatterns - 1 {
		ok, owed := l.line(t0.Add(time.Second), slog.LevelError, fmt.Sprintf("stream 's%d' failed", i))
		require.True(t, ok)
		require.Empty(t, owed)
	}
	require.Len(t, l.patterns, maxPatterns)
	ok, owed := l.line(t0.Add(2*time.Second), slog.LevelError, "one more")
	require.True(t, ok)
	require.Equal(t, []summary{{slog.LevelError, "store error on stream 'first'", 3, 2 * time.Second}}, owed)
	require.Len(t, l.patterns, maxPatterns)
	_, owed = l.line(t0.Add(3*time.Second), slog.LevelError, "and another")
	require.Empty(t, owed, "the one forgotten owed nothing")
	require.Len(t, l.patterns, maxPatterns)
}

// The adapter, on a clock of the test's: lines past the first are held back, the timer's tick says
// how many, and the server's exit says the rest and stops the timer.
func TestSlogAdapter(t *testing.T) {
	var buf bytes.Buffer
	a := newSlogAdapter(slog.New(slog.NewJSONHandler(&buf, nil)))
	now := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	a.now = func() time.Time { return now }
	for i := range 25 {
		a.Errorf("%s - cid:%d - maximum connections exceeded", fmt.Sprintf("127.0.0.1:%d", 5000+i), i)
	}
	a.Noticef("a notice below the logger's level")
	// The timer fires: stopped here and its function called, at the test's time.
	a.mu.Lock()
	require.NotNil(t, a.timer, "armed")
	a.timer.Stop()
	a.mu.Unlock()
	now = now.Add(summaryEvery)
	a.tick()
	for range 5 {
		a.Errorf("127.0.0.1:1 - cid:1 - maximum connections exceeded")
	}
	now = now.Add(time.Second)
	a.Noticef(serverExiting)
	a.mu.Lock()
	require.Nil(t, a.timer, "stopped")
	a.mu.Unlock()
	a.Errorf("127.0.0.1:1 - cid:1 - maximum connections exceeded")

	var lines []map[string]any
	for _, l := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
		var m map[string]any
		require.NoError(t, json.Unmarshal([]byte(l), &m))
		require.Equal(t, "nats-server", m["component"])
		require.Equal(t, "ERROR", m["level"])
		lines = append(lines, m)
	}
	require.Len(t, lines, 10+1+1+1)
	require.Equal(t, "127.0.0.1:5000 - cid:0 - maximum connections exceeded", lines[0]["msg"])
	require.Equal(t, "127.0.0.1:5009 - cid:9 - maximum connections exceeded", lines[9]["msg"])
	for i, want := range []float64{15, 5} {
		s := lines[10+i]
		require.Equal(t, summaryMsg, s["msg"])
		require.Equal(t, "<addr> - cid:<n> - maximum connections exceeded", s["pattern"])
		require.Equal(t, want, s["suppressed"])
	}
	require.Equal(t, "127.0.0.1:1 - cid:1 - maximum connections exceeded", lines[12]["msg"], "after the exit, lines pass")
}
