package store

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestCopyCurrent_CopyIsHeldFromItsStart: the copy CopyCurrent hands out is held against removers
// for as long as it is read, even when another process's remover (a replay starting, serve's start)
// took the new directory's flock in the moment between its mkdir and the reader's flock. The reader
// went on without the lock, so the copy it read was unheld: the next replay or serve start removed
// it under the reader (its tables unlinked mid-read), or the remover that held it removed files as
// they were copied, and a copy without its MANIFEST opens as an empty projection.
func TestCopyCurrent_CopyIsHeldFromItsStart(t *testing.T) {
	state := t.TempDir()
	db, err := OpenState(state, Options{})
	require.NoError(t, err)
	require.NoError(t, db.Close())

	var remover *os.File // another process's remover, holding the directory it found
	copyDirMade = func(dir string) {
		if remover != nil {
			return
		}
		f, err := os.Open(dir)
		require.NoError(t, err)
		require.NoError(t, syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB))
		remover = f
	}
	t.Cleanup(func() { copyDirMade = nil })

	cp, err := CopyCurrent(state)
	require.NoError(t, err)
	defer RemoveCopy(cp)
	require.NotNil(t, remover)
	require.NoError(t, remover.Close())

	removeStaleCopies(state) // the next replay, or serve's start
	require.DirExists(t, cp, "the copy being read was removed")
	manifests, err := filepath.Glob(filepath.Join(cp, "MANIFEST-*"))
	require.NoError(t, err)
	require.NotEmpty(t, manifests)
	copies, err := filepath.Glob(filepath.Join(state, ".replay-*"))
	require.NoError(t, err)
	require.Equal(t, []string{cp}, copies, "the directory the remover held is left to it, and removed as stale")
}
