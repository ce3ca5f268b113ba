package main

import (
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/internal/natstest"
)

// TestRebuild_ANATSWithoutTheBucketsChangesNothing: a rebuild against a NATS that holds none of the
// provisioner's buckets (--nats left out and another server on 127.0.0.1:4222, or a user of another
// account) is refused and leaves the state dir as it was: it swapped in an empty projection and lost
// the local event log. replay and export refuse it too. A state dir with nothing in it yet is rebuilt
// from such a NATS as before.
func TestRebuild_ANATSWithoutTheBucketsChangesNothing(t *testing.T) {
	t.Parallel()
	url, last := smallMesh(t)
	dir := filepath.Join(t.TempDir(), "state")
	_, errOut, code := runCmd(t, "rebuild", "--nats", url, "--state", dir)
	require.Zero(t, code, errOut)
	gens := globGens(t, dir)

	other := natstest.RunServer(t).ClientURL()
	out, errOut, code := runCmd(t, "rebuild", "--nats", other, "--state", dir)
	require.Equal(t, exitFailure, code, out)
	require.Contains(t, errOut, "has none of the provisioner's streams")
	require.Contains(t, errOut, "KV_mesh-provisioner_needs")
	require.Contains(t, errOut, "was not changed")
	require.Equal(t, gens, globGens(t, dir), "no generation made or swapped")
	checkState(t, dir, last)

	// replay and export from such a NATS would answer that the mesh is empty: refused alike.
	archive := filepath.Join(t.TempDir(), "x.mph")
	for _, args := range [][]string{
		{"replay", "state", "needs", "--at", "seq:5", "--nats", other},
		{"export", "--nats", other, "--out", archive},
	} {
		out, errOut, code := runCmd(t, args...)
		require.Equal(t, exitFailure, code, "%v: %s", args, out)
		require.Contains(t, errOut, "has none of the provisioner's streams", args)
	}
	require.NoFileExists(t, archive)

	fresh := filepath.Join(t.TempDir(), "state")
	out, errOut, code = runCmd(t, "rebuild", "--nats", other, "--state", fresh)
	require.Zero(t, code, errOut)
	require.Contains(t, out, "rebuilt")
}
