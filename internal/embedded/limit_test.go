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
		if l.line(t0.Add(time.Duration(i)*100*time.Millisecond), slog.LevelError, refused(i)) {
			logged++
			require.Less(t, i, linesPerWindow, "the first ones are logged")
		}
	}
	require.Equal(t, linesPerWindow, logged)
	// A line said once passes, and so does the same text at another level.
	require.True(t, l.line(t0.Add(10*time.Second), slog.LevelError, "JetStream store error"))
	require.True(t, l.line(t0.Add(10*time.Second), slog.LevelWarn, refused(0)))

	// The summary: 90 not logged, from the 11th (at 1s) to the flush.
	require.Equal(t, []summary{{summaryMsg, slog.LevelError, "<addr> - cid:<n> - maximum connections exceeded", 1, 90, 9 * time.Second}}, l.flush(t0.Add(10*time.Second)))
	require.Empty(t, l.flush(t0.Add(20*time.Second)), "said once")

	// Within the minute, the next ones are counted again; after it, 10 more are logged.
	require.False(t, l.line(t0.Add(30*time.Second), slog.LevelError, refused(1)))
	for i := range 15 {
		ok := l.line(t0.Add(time.Minute+time.Duration(i)*time.Millisecond), slog.LevelError, refused(i))
		require.Equal(t, i < linesPerWindow, ok, i)
	}
	require.Equal(t, []summary{{summaryMsg, slog.LevelError, "<addr> - cid:<n> - maximum connections exceeded", 1, 6, 40 * time.Second}}, l.flush(t0.Add(70*time.Second)))

	// A pattern whose window ended and owes nothing is forgotten at a flush.
	require.Empty(t, l.flush(t0.Add(3*time.Minute)))
	require.Empty(t, l.patterns)
}

// Past maxPatterns, a new pattern's lines share its level's "other" budget, counted in its summary;
// a pattern idle for a window is forgotten to make room.
func TestLimiter_TableFull(t *testing.T) {
	t0 := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	l := newLimiter()
	for i := range maxPatterns {
		l.line(t0, slog.LevelDebug, fmt.Sprintf("stream 's%d' restored", i))
	}
	require.Len(t, l.patterns, maxPatterns)
	// Within the minute, warnings all different: none is tracked, 10 pass, the others are counted.
	logged := 0
	for i := range 50 {
		if l.line(t0.Add(time.Second+time.Duration(i)*time.Millisecond), slog.LevelWarn, fmt.Sprintf("subject 'x%d' failed", i)) {
			logged++
		}
	}
	require.Equal(t, linesPerWindow, logged)
	require.Len(t, l.patterns, maxPatterns)
	owed := l.flush(t0.Add(2 * time.Second))
	require.Contains(t, owed, summary{summaryMsg, slog.LevelWarn, otherPattern, 1, 40, 990 * time.Millisecond})
	// A minute later every tracked pattern's window has ended: a new one is tracked again, the idle
	// ones forgotten.
	require.True(t, l.line(t0.Add(time.Minute), slog.LevelWarn, "subject 'y' failed"))
	require.Len(t, l.patterns, 1)
}

// A level logs at most levelLinesPerWindow lines a minute, all its patterns together; the others are
// counted in its budget's summary, and the other levels are not held back.
func TestLimiter_LevelBudget(t *testing.T) {
	t0 := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	l := newLimiter()
	logged := 0
	for i := range 200 {
		if l.line(t0.Add(time.Duration(i)*time.Millisecond), slog.LevelError, fmt.Sprintf("stream 's%d' failed", i)) {
			logged++
		}
	}
	require.Equal(t, levelLinesPerWindow, logged)
	require.True(t, l.line(t0.Add(time.Second), slog.LevelWarn, "a warning"))
	require.Equal(t, []summary{{msg: budgetMsg, level: slog.LevelError, suppressed: 200 - levelLinesPerWindow, in: 10*time.Second - levelLinesPerWindow*time.Millisecond}},
		l.flush(t0.Add(10*time.Second)))
	// The next minute, the budget is whole again.
	require.True(t, l.line(t0.Add(time.Minute), slog.LevelError, "stream 's0' failed"))
}

// The critical lines have a budget of their own, per kind: no flood holds them back, and a flood of
// them is bounded whatever their streams' names.
func TestLimiter_Criticals(t *testing.T) {
	t0 := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	l := newLimiter()
	for i := range 200 {
		l.line(t0, slog.LevelError, fmt.Sprintf("stream 's%d' failed", i))
	}
	require.True(t, l.line(t0, slog.LevelError, "JetStream out of space, will be DISABLED"))
	require.True(t, l.line(t0, slog.LevelError, "accept tcp 127.0.0.1:4222: accept4: too many open files; sleeping 10ms"))
	logged := 0
	for i := range 100 {
		if l.line(t0, slog.LevelError, fmt.Sprintf("Error storing message to 's%d': no space left on device", i)) {
			logged++
		}
	}
	require.Equal(t, linesPerWindow, logged)
	require.True(t, l.line(t0, slog.LevelError, "JetStream out of file resources, will be DISABLED"), "9 more of its kind")
	owed := l.flush(t0.Add(time.Second))
	require.Contains(t, owed, summary{summaryMsg, slog.LevelError, "no space left on device", 1, 90, time.Second})
	require.Contains(t, owed, summary{msg: budgetMsg, level: slog.LevelError, suppressed: 200 - levelLinesPerWindow, in: time.Second})
	// A minute on, once more.
	require.True(t, l.line(t0.Add(time.Minute), slog.LevelError, "JetStream out of space, will be DISABLED"))
}

// A flush names the critical groups and the patterns that held back most, and says the others in one
// line.
func TestLimiter_FoldsSummaries(t *testing.T) {
	t0 := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	l := newLimiter()
	for i := range 8 {
		for range linesPerWindow + 1 + i {
			l.line(t0, slog.LevelDebug, fmt.Sprintf("stream 's%d' restored", i))
		}
	}
	// A critical group that held back the fewest is named all the same, first.
	for range linesPerWindow + 1 {
		l.line(t0, slog.LevelError, "JetStream out of space, will be DISABLED")
	}
	owed := l.flush(t0.Add(time.Second))
	require.Len(t, owed, 1+maxNamedSummaries+2)
	require.Equal(t, summary{summaryMsg, slog.LevelError, "JetStream out of", 1, 1, time.Second}, owed[0])
	owed = owed[1:]
	for i, s := range owed[:maxNamedSummaries] {
		require.Equal(t, summary{summaryMsg, slog.LevelDebug, fmt.Sprintf("stream 's%d' restored", 7-i), 1, 8 - i, time.Second}, s)
	}
	require.Equal(t, summary{msg: foldedMsg, level: slog.LevelDebug, patterns: 3, suppressed: 3 + 2 + 1, in: time.Second}, owed[maxNamedSummaries])
	require.Equal(t, budgetMsg, owed[maxNamedSummaries+1].msg, "8 patterns' 10 lines are past the level's 60")
	require.Equal(t, 8*linesPerWindow-levelLinesPerWindow, owed[maxNamedSummaries+1].suppressed)
	require.Empty(t, l.flush(t0.Add(2*time.Second)))
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

// A flood of lines all different, through the adapter as the server calls it, for 10 minutes of the
// test's clock with the timer's ticks every 10 s: the log is bounded, each line is logged or counted
// once, and a critical line said each minute inside the flood comes through each minute.
func TestSlogAdapter_FloodOfDistinctLines(t *testing.T) {
	var buf bytes.Buffer
	a := newSlogAdapter(slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug})))
	now := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	a.now = func() time.Time { return now }
	const minutes, perTick = 10, 2000
	sent := 0
	for tick := range minutes * 6 {
		for i := range perTick {
			// Names normalise does not take out: every line is a pattern of its own.
			a.Errorf("JetStream stream '$G > composed-n%d-%d' failed: error on subject %s", tick, i, fmt.Sprintf("mesh.node%dx%d.state", tick, i))
			if i%50 == 0 {
				a.Noticef("Restored 1 messages for stream '$G > composed-n%d-%d' in 2ms", tick, i)
				sent++
			}
			if i%500 == 0 {
				a.Warnf("Filestore [n%d-%d] slow", tick, i)
				sent++
			}
			sent++
		}
		if tick%6 == 3 {
			a.Errorf("JetStream out of space, will be DISABLED")
			sent++
		}
		now = now.Add(summaryEvery)
		a.mu.Lock()
		if a.timer != nil {
			a.timer.Stop()
		}
		a.mu.Unlock()
		a.tick()
	}
	a.Noticef(serverExiting)
	sent++

	logged, counted, summaries, critical := 0, 0, 0, 0
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	for _, l := range lines {
		var m map[string]any
		require.NoError(t, json.Unmarshal([]byte(l), &m))
		switch m["msg"] {
		case summaryMsg, foldedMsg, budgetMsg:
			summaries++
			counted += int(m["suppressed"].(float64))
		case "JetStream out of space, will be DISABLED":
			critical++
			logged++
		default:
			logged++
		}
	}
	require.Equal(t, sent, logged+counted, "each line logged or counted once")
	require.Equal(t, minutes, critical, "the critical line each minute")
	// Each minute: 60 lines a level (notices, warnings, errors) and the critical; summaries at most
	// 5 named, 1 folded and 3 budgets a tick; and the exit's notice and its summaries.
	bound := minutes*(3*levelLinesPerWindow+1+6*(maxNamedSummaries+1+3)) + 1 + maxNamedSummaries + 1 + 3
	require.LessOrEqual(t, len(lines), bound)
	t.Logf("%d lines sent in %d minutes: %d logged, %d summaries", sent, minutes, logged, summaries)
}
