package main

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/internal/natstest"
)

// TestServe_SignalDuringStartStopsIt: a SIGTERM that comes while serve opens its state dir stops it
// there: it returns the context's error (main says "stopped by SIGTERM before it finished", exit
// 143) without starting an embedded server or a seat. It used to go on through the whole start (an
// open of a large state dir takes tens of seconds, docs/decisions.md), start the seat, answer, and
// only then stop. The state dir is left as it was: the next serve answers from it.
func TestServe_SignalDuringStartStopsIt(t *testing.T) {
	dir := t.TempDir()
	s, err := startServe(dir)
	require.NoError(t, err)
	require.NoError(t, s.stop())

	// The signal has come by the time the open returns.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	var stderr natstest.LogBuffer
	cmd := &ServeCommand{Stdout: &natstest.LogBuffer{}, Stderr: &stderr}
	err = cmd.Run(ctx, []string{"--state", filepath.Join(dir, "state"), "--embedded-listen", "127.0.0.1:-1",
		"--embedded-store", filepath.Join(dir, "nats")})
	require.ErrorIs(t, err, context.Canceled)
	require.NotContains(t, stderr.String(), "embedded NATS server started", "it went on with the start")
	require.NotContains(t, stderr.String(), "answering", "it went on with the start")

	s, err = startServe(dir)
	require.NoError(t, err, "the state dir is free and whole")
	require.NoError(t, s.stop())
}
