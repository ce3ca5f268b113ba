package progress

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestBar_LineAndLog(t *testing.T) {
	var logs bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	clock := time.Unix(1000, 0)
	b := New(&bytes.Buffer{}, log, "rebuild", "messages", 1000)
	b.now = func() time.Time { return clock }
	b.start, b.last = clock, clock

	clock = clock.Add(2 * time.Second)
	b.Set(250)
	require.Equal(t, "rebuild [######..................]  25% 250/1000 messages 125/s 6s left", b.Line())
	require.Empty(t, logs.String(), "not a terminal: a log line only every few seconds")

	clock = clock.Add(4 * time.Second)
	b.Set(500)
	require.Contains(t, logs.String(), "500/1000 messages")

	clock = clock.Add(2 * time.Second)
	b.Set(1000)
	b.Done()
	require.True(t, strings.HasSuffix(strings.TrimSpace(logs.String()), `in 8s"`), logs.String())
}

func TestBar_NoTotal(t *testing.T) {
	clock := time.Unix(0, 0)
	b := New(&bytes.Buffer{}, nil, "export", "records", 0)
	b.now = func() time.Time { return clock }
	b.start = clock
	clock = clock.Add(time.Second)
	b.Set(10)
	require.Equal(t, "export 10 records 10/s", b.Line())
	b.Done() // quiet: no terminal, no log
}
