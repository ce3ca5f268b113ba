package main

import (
	"context"
	"fmt"
	"io"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/store"
)

// TestServe_SignalDuringStartStopsIt: a SIGTERM that comes while serve opens its state dir stops it
// there: it returns the context's error (main says "stopped by SIGTERM before it finished", exit
// 143) without starting an embedded server or a seat. It used to go on through the whole start (an
// open of a large state dir takes tens of seconds, docs/decisions.md), start the seat, answer, and
// only then stop. The state dir is left as it was: the next serve answers from it.
func TestServe_SignalDuringStartStopsIt(t *testing.T) {
	t.Parallel()
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

// TestServe_SignalWhileTheDiskIsFull: a SIGTERM while the batch being committed waits for room in the
// state dir (store/space.go) would wait with it, for as long as the disk stays full: the seat's stop
// commits its last batch. It stops as a kill would instead, saying so, and the next start reads
// what was not written again from the streams.
func TestServe_SignalWhileTheDiskIsFull(t *testing.T) {
	t.Parallel()
	_, nc, js := smallMeshServer(t)

	db, full, logs, log, _ := stateOnAFailingDisk(t, syscall.ENOSPC)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := startSeat(ctx, nc, js, db, log, store.Options{})
	full.Store(true)
	more := fixtures.Mesh{Seed: 4, Nodes: 12, Modules: 3, NeedsPerModule: 2, Collections: 2}.Ops()
	require.NoError(t, fixtures.Load(context.Background(), js, more, 256, nil))
	natstest.CheckFor(t, 20*time.Second, 10*time.Millisecond, func() error {
		if !db.WritesHeld() {
			return fmt.Errorf("no write held for room yet")
		}
		return nil
	})

	cancel() // the first SIGTERM
	stopErr := awaitRun(t, done, "the seat waits for room to stop")
	require.ErrorIs(t, stopErr, context.Canceled, "main says: stopped by SIGTERM before it finished")
	require.Contains(t, stopErr.Error(), "out of room")
	require.Contains(t, logs.String(), "stopping without draining: the state dir is out of room")
	require.NotContains(t, logs.String(), "panic")
}

// TestServe_WriteFailsWithEIO: a write to the state dir that fails with an input/output error made
// Pebble panic and serve die with a stack trace. Now serve stops by itself, saying the state dir
// cannot be written and what to do, and returns store.ErrWriteFailed (exit 1).
func TestServe_WriteFailsWithEIO(t *testing.T) {
	t.Parallel()
	ns, _, js := smallMeshServer(t)

	db, broken, logs, log, _ := stateOnAFailingDisk(t, syscall.EIO)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	snc, sjs := natstest.Connect(t, ns.ClientURL()) // the seat's own: its stop drains it
	done := startSeat(ctx, snc, sjs, db, log, store.Options{})
	broken.Store(true)
	more := fixtures.Mesh{Seed: 4, Nodes: 12, Modules: 3, NeedsPerModule: 2, Collections: 2}.Ops()
	require.NoError(t, fixtures.Load(context.Background(), js, more, 256, nil))
	runErr := awaitRun(t, done, "serve goes on with a state dir it cannot write")
	require.ErrorIs(t, runErr, store.ErrWriteFailed)
	require.Equal(t, exitFailure, exitCode(runErr, io.Discard))
	require.Contains(t, runErr.Error(), "input/output error")
	require.Contains(t, logs.String(), "stopping: the state dir cannot be written")
	require.NoError(t, db.Close(), "the failure was said; Close does not call into Pebble again")
}
