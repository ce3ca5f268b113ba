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

// TestCopyCurrent_StaleCopyInTMPDIRIsRemoved: a copy in $TMPDIR (the state dir's disk nearly full, or
// not writable) holds the whole store, its tables copied. A reader killed while reading left it there
// for good: the removers only looked beside the state dir. It is held like a copy beside the state
// dir, and the next reader (or serve's start) removes it when no reader holds it, while one a reader
// still holds (of any seat sharing $TMPDIR) is left alone.
func TestCopyCurrent_StaleCopyInTMPDIRIsRemoved(t *testing.T) {
	state := stateWithWAL(t)
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	fakeDisks(t, map[string]int64{state: SeatReserve - 1<<20, tmp: 1 << 30}, map[string]uint64{state: 7, tmp: 8})

	killed, err := CopyCurrent(state)
	require.NoError(t, err)
	require.Equal(t, tmp, filepath.Dir(killed))
	// The reader is killed: its flock goes with it, its copy stays.
	copyLocks.Lock()
	f := copyLocks.m[killed]
	delete(copyLocks.m, killed)
	copyLocks.Unlock()
	require.NotNil(t, f, "the copy in TMPDIR is not held while it is read")
	f.Close()

	reading, err := CopyCurrent(state) // the next reader
	require.NoError(t, err)
	defer RemoveCopy(reading)
	require.NoDirExists(t, killed, "the killed reader's copy in TMPDIR was left behind")

	removeStaleCopies(t.TempDir()) // serve's start, of another seat sharing TMPDIR
	require.DirExists(t, reading, "a copy being read was removed")
}
