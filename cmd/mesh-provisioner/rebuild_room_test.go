package main

import (
	"bytes"
	"context"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/store"
)

// TestRebuild_FullDiskKeepsTheUnfinishedRebuild: `rebuild` run again after one that did not finish
// resumes its generation; on a disk without room for the open (below the reserve, or refusing the
// open's test write) it took the open's ErrNoSpace for a generation that does not open, removed the
// unfinished rebuild ("starting over", the fill of hours gone) and then failed on the new one. It
// fails saying the disk is full and keeps the generation, which the next rebuild, room back, resumes.
func TestRebuild_FullDiskKeepsTheUnfinishedRebuild(t *testing.T) {
	url, last := smallMesh(t)
	dir := filepath.Join(t.TempDir(), "state")
	_, errOut, code := runCmd(t, "rebuild", "--nats", url, "--state", dir)
	require.Zero(t, code, errOut)

	// A rebuild that did not finish: a generation beside the current one, with what it applied.
	sd, err := store.LockState(dir)
	require.NoError(t, err)
	gen, err := sd.NewGeneration()
	require.NoError(t, err)
	db, err := store.Open(gen, store.Options{})
	require.NoError(t, err)
	require.NoError(t, db.Apply(provisioner.BucketNeeds, []provisioner.Message{{Seq: 1, Key: "n1.m.config.a", Op: provisioner.OpPut, Value: []byte{0x01}}}, 0, true))
	require.NoError(t, db.Close())
	require.NoError(t, sd.Close())

	// The disk has less than the reserve free.
	var out, errBuf bytes.Buffer
	cmd := &RebuildCommand{Stdout: &out, Stderr: &errBuf, opts: store.Options{MinFreeBytes: 1 << 62}}
	code = exitCode(cmd.Run(context.Background(), []string{"--nats", url, "--state", dir}), &errBuf)
	require.Equal(t, exitFailure, code, errBuf.String())
	require.Contains(t, errBuf.String(), "no room to write in the state dir", "says the disk is full")
	require.Contains(t, errBuf.String(), "free space on that disk", "says what to do")
	require.NotContains(t, errBuf.String(), "starting over")
	require.Contains(t, globGens(t, dir), gen, "the unfinished rebuild is kept")
	db, err = store.Open(gen, store.Options{})
	require.NoError(t, err)
	require.Equal(t, uint64(1), db.Checkpoint(provisioner.BucketNeeds).Applied, "with what it applied")
	require.NoError(t, db.Close())

	// Room again: the next rebuild resumes it and finishes.
	stdout, errOut, code := runCmd(t, "rebuild", "--nats", url, "--state", dir)
	require.Zero(t, code, errOut)
	require.Contains(t, errOut+stdout, "resuming a rebuild that did not finish")
	checkState(t, dir, last)
}
