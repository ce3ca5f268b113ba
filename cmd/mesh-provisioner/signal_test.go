package main

import (
	"bytes"
	"errors"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/query"
)

// A command stopped by Ctrl-C (or SIGTERM) before it finished says so and exits with the shell's code
// for the signal (130, 143), not as a failure with "context canceled" (exit 1), which a script could
// not tell from a command that failed.
func TestMain_StoppedBySignal(t *testing.T) {
	t.Parallel()
	bin := buildBinary(t)
	ns := natstest.RunServer(t)
	nc, _ := natstest.Connect(t, ns.ClientURL())
	asked := make(chan struct{}, 4)
	sub, err := nc.Subscribe(query.Subject, func(*nats.Msg) { asked <- struct{}{} }) // never answers
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	require.NoError(t, nc.Flush())

	for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGTERM} {
		cmd := exec.Command(bin, "query", "needs", "--nats", ns.ClientURL(), "--timeout", "30s")
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		require.NoError(t, cmd.Start())
		select {
		case <-asked:
		case <-time.After(20 * time.Second):
			_ = cmd.Process.Kill()
			t.Fatalf("query did not ask: %s", stderr.String())
		}
		require.NoError(t, cmd.Process.Signal(sig))
		err := cmd.Wait()
		var ee *exec.ExitError
		require.True(t, errors.As(err, &ee), "%v: %s", err, stderr.String())
		require.Equal(t, 128+int(sig), ee.ExitCode(), "%s", stderr.String())
		require.Contains(t, stderr.String(), "stopped by")
		require.NotContains(t, stderr.String(), "context canceled")
	}
}
