package main

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
)

// TestNATSFlags_EveryCommand: every command that reaches NATS reads the NATS conventions alike:
// --nats before NATS_URL, and --user/--password (or NATS_USER/NATS_PASSWORD) for a server that lets
// no one in without them.
func TestNATSFlags_EveryCommand(t *testing.T) {
	ns := natstest.RunServerSeatDenied(t)
	url := ns.ClientURL()
	_, js := natstest.Connect(t, url, nats.UserInfo("admin", "admin"))
	mesh := fixtures.Mesh{Seed: 4, Nodes: 4, Modules: 2, NeedsPerModule: 2, Collections: 1}
	require.NoError(t, fixtures.Load(context.Background(), js, mesh.Ops(), 0, nil))
	s, err := startServe(t.TempDir(), "--nats", url, "--user", "seat", "--password", "seat")
	require.NoError(t, err)
	defer func() { require.NoError(t, s.stop()) }()

	dir := t.TempDir()
	commands := func() [][]string {
		return [][]string{
			{"query", "needs", "--timeout", "5s"},
			{"rebuild", "--state", filepath.Join(dir, "state")},
			{"replay", "state", "needs", "--at", "seq:3"},
			{"export", "--out", filepath.Join(dir, "x.mph"), "--force"},
		}
	}
	t.Setenv("NATS_URL", "nats://127.0.0.1:1") // nothing there: --nats must win
	for _, args := range commands() {
		code, _, stderr := run(t, append(args, "--nats", url)...)
		require.Equal(t, exitFailure, code, "%v without a user", args)
		require.Contains(t, stderr, "Authorization Violation", "%v", args)
		code, _, stderr = run(t, append(args, "--nats", url, "--password", "seat")...)
		require.Equal(t, exitUsage, code, "%v with a password and no user", args)
		require.Contains(t, stderr, "without --user", "%v", args)
		code, _, stderr = run(t, append(args, "--nats", url, "--user", "seat", "--password", "seat")...)
		require.Equal(t, exitOK, code, "%v: %s", args, stderr)
	}
	// serve too, and before it starts an embedded server.
	code, _, stderr := run(t, "serve", "--state", filepath.Join(dir, "serve"), "--nats", url, "--password", "seat")
	require.Equal(t, exitUsage, code, "serve with a password and no user: %s", stderr)
	require.Contains(t, stderr, "without --user")
	t.Setenv("NATS_URL", "")
	code, _, stderr = run(t, "serve", "--state", filepath.Join(dir, "serve"), "--embedded-store", filepath.Join(dir, "nats"),
		"--embedded-listen", "127.0.0.1:-1", "--password", "seat")
	require.Equal(t, exitUsage, code, "serve, embedded, with a password and no user: %s", stderr)
	require.NoDirExists(t, filepath.Join(dir, "nats"), "no embedded server started")

	t.Setenv("NATS_URL", url)
	t.Setenv("NATS_USER", "seat")
	t.Setenv("NATS_PASSWORD", "seat")
	for _, args := range commands() {
		code, _, stderr := run(t, args...)
		require.Equal(t, exitOK, code, "%v from the environment: %s", args, stderr)
	}
}
