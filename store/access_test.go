package store_test

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/store"
)

// flushedState makes a state dir with one generation whose need is in an sstable, so that an open
// reads files of every kind (lock, CURRENT, manifest, log, table); it returns the state dir's listing.
func flushedState(t *testing.T, dir string) []string {
	t.Helper()
	withGenerations(t, dir, 1)
	db, err := store.OpenState(dir, store.Options{})
	require.NoError(t, err)
	require.NoError(t, db.Pebble().Flush())
	require.NoError(t, db.Close())
	return listing(t, dir)
}

// listing is every path under dir but the LOCK's content, sorted (Walk's order).
func listing(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	require.NoError(t, filepath.Walk(dir, func(p string, _ os.FileInfo, err error) error {
		out = append(out, strings.TrimPrefix(p, dir))
		return err
	}))
	return out
}

// canDeny reports whether a chmod 000 denies this process a directory (not as root): it chmods dir,
// tries it, and restores it.
func canDeny(t *testing.T, dir string) bool {
	t.Helper()
	require.NoError(t, os.Chmod(dir, 0))
	defer os.Chmod(dir, 0o755)
	_, err := os.ReadDir(dir)
	return err != nil
}

// A state dir, or a generation, the process may not read is ErrAccess naming the path, EACCES and what
// to fix; never a broken state dir to start over: the state dir is left as it was, and opens once the
// permission is back.
func TestOpenState_PermissionDeniedIsAccess(t *testing.T) {
	dir := t.TempDir()
	before := flushedState(t, dir)
	gen := filepath.Join(dir, "gen-000001")
	if !canDeny(t, gen) {
		t.Skip("chmod cannot deny this process a directory (root): EACCES cannot be made")
	}
	for _, denied := range []string{dir, gen} {
		require.NoError(t, os.Chmod(denied, 0))
		_, err := store.OpenState(dir, store.Options{})
		require.NoError(t, os.Chmod(denied, 0o755))
		require.ErrorIs(t, err, store.ErrAccess, "%s denied", denied)
		require.False(t, store.NeedsRebuild(err))
		for _, want := range []string{denied, "EACCES", "chmod"} {
			require.Contains(t, err.Error(), want)
		}
		require.Equal(t, before, listing(t, dir), "the state dir is as it was")
	}
	db, err := store.OpenState(dir, store.Options{})
	require.NoError(t, err)
	defer db.Close()
	require.Equal(t, uint64(1), db.Checkpoint(provisioner.BucketNeeds).Applied)
}

const emfileEnv = "STORE_TEST_EMFILE_STATE"

// An open that runs out of file descriptors, at whichever of its steps, is ErrAccess saying EMFILE and
// the limit to raise, never a broken state dir. A child process lowers its RLIMIT_NOFILE and takes every
// descriptor but n, for n = 0, 1, ... until the open succeeds; the state dir is then as it was.
func TestOpenState_OutOfFileDescriptorsIsAccess(t *testing.T) {
	if dir := os.Getenv(emfileEnv); dir != "" {
		emfileChild(dir)
		return
	}
	dir := t.TempDir()
	flushedState(t, dir)
	cmd := exec.Command(os.Args[0], "-test.run=^TestOpenState_OutOfFileDescriptorsIsAccess$", "-test.count=1")
	cmd.Env = append(os.Environ(), emfileEnv+"="+dir)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.Contains(t, string(out), "EMFILE seen", "some open ran out of descriptors:\n%s", out)
	require.Contains(t, string(out), "opened with", "%s", out)
	require.NotContains(t, string(out), "WRONG", "%s", out)
	// The open that succeeded in the end wrote Pebble's files anew: the generation, and what it
	// holds, are the same.
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	require.Equal(t, []string{"CURRENT", "LOCK", "gen-000001"}, names)
	db, err := store.OpenState(dir, store.Options{})
	require.NoError(t, err)
	defer db.Close()
	require.Equal(t, uint64(1), db.Checkpoint(provisioner.BucketNeeds).Applied)
}

func emfileChild(dir string) {
	lim := syscall.Rlimit{Cur: 128, Max: 128}
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		fmt.Println("WRONG: setrlimit:", err)
		return
	}
	for spare := 0; spare < 100; spare++ {
		var held []*os.File
		for {
			f, err := os.Open(os.DevNull)
			if err != nil {
				break
			}
			held = append(held, f)
		}
		for _, f := range held[:min(spare, len(held))] {
			f.Close()
		}
		db, err := store.OpenState(dir, store.Options{MinFreeBytes: -1})
		for _, f := range held[min(spare, len(held)):] {
			f.Close()
		}
		switch {
		case err == nil:
			db.Close()
			fmt.Println("opened with", spare, "descriptors spare")
			return
		case errors.Is(err, store.ErrAccess) && strings.Contains(err.Error(), "EMFILE") && strings.Contains(err.Error(), "LimitNOFILE") && !store.NeedsRebuild(err):
			fmt.Println("EMFILE seen:", err)
		default:
			fmt.Printf("WRONG: with %d spare: %v (needs rebuild: %v)\n", spare, err, store.NeedsRebuild(err))
		}
	}
	fmt.Println("WRONG: never opened")
}
