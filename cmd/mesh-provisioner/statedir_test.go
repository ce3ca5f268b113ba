package main

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// A state dir whose CURRENT is lost beside two generations: serve refuses it (exit 1), naming both and
// saying to run rebuild, and leaves both; rebuild then builds it anew, each removal logged.
func TestServe_LostCurrentTwoGenerationsSaysRebuild(t *testing.T) {
	t.Parallel()
	url, last := smallMesh(t)
	dir := filepath.Join(t.TempDir(), "state")
	rebuiltWithUnfinished(t, url, dir)
	require.NoError(t, os.Remove(filepath.Join(dir, "CURRENT")))
	gens := globGens(t, dir)
	require.Len(t, gens, 2)

	_, errOut, code := runCmd(t, "serve", "--nats", url, "--state", dir)
	require.Equal(t, exitFailure, code, errOut)
	for _, want := range []string{"store: state dir has no CURRENT", "gen-000001", "gen-000002", "mesh-provisioner rebuild"} {
		require.Contains(t, errOut, want)
	}
	require.Equal(t, gens, globGens(t, dir), "serve guessed or removed nothing")

	out, errOut, code := runCmd(t, "rebuild", "--nats", url, "--state", dir)
	require.Zero(t, code, errOut)
	require.Contains(t, out, "rebuilt")
	require.Contains(t, errOut, "removed a generation of the state dir")
	checkState(t, dir, last)
	require.Len(t, globGens(t, dir), 1)
}
