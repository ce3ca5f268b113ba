package store_test

import (
	"bytes"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/store"
)

// logTo returns store options whose logger writes text lines to the returned buffer.
func logTo() (store.Options, *bytes.Buffer) {
	var buf bytes.Buffer
	return store.Options{Logger: slog.New(slog.NewTextHandler(&buf, nil))}, &buf
}

// Every generation removed is logged with its path and why: the old one a rebuild's swap replaces,
// and one left beside CURRENT (a rebuild killed before its swap) that the next open removes.
func TestStateDir_RemovalsAreLogged(t *testing.T) {
	dir := t.TempDir()
	opts, buf := logTo()
	old, err := store.OpenState(dir, opts)
	require.NoError(t, err)
	oldGen := old.Dir()
	gen, err := old.State().NewGeneration()
	require.NoError(t, err)
	rebuilt, err := store.Open(gen, opts)
	require.NoError(t, err)
	require.NoError(t, store.SwapIn(old, rebuilt))
	require.NoDirExists(t, oldGen)
	require.Contains(t, buf.String(), `msg="removed a generation of the state dir" generation=`+oldGen+` why="replaced by `+filepath.Base(gen))
	require.NoError(t, rebuilt.Close())

	// A rebuild killed before its swap leaves a generation CURRENT does not name.
	left := filepath.Join(dir, "gen-000009")
	require.NoError(t, os.Mkdir(left, 0o755))
	buf.Reset()
	db, err := store.OpenState(dir, opts)
	require.NoError(t, err)
	defer db.Close()
	require.Equal(t, gen, db.Dir())
	require.NoDirExists(t, left)
	require.Contains(t, buf.String(), `msg="removed a generation of the state dir" generation=`+left+` why="not named by CURRENT`)
}

// withGenerations makes a state dir whose generations each hold a store with a need at sequence 1, 2,
// ... (so each is told by its checkpoint), CURRENT naming the last; it returns their directories.
func withGenerations(t *testing.T, dir string, n int) []string {
	t.Helper()
	var gens []string
	db, err := store.OpenState(dir, store.Options{})
	require.NoError(t, err)
	for i := 1; ; i++ {
		require.NoError(t, db.Apply(provisioner.BucketNeeds, []provisioner.Message{put(uint64(i), "n1.m.config.a", []byte{0x01})}, 0, true))
		gens = append(gens, db.Dir())
		if i == n {
			break
		}
		// The next generation is filled and closed beside this one, as a rebuild killed before its
		// swap leaves it; CURRENT keeps naming this one.
		require.NoError(t, db.Close())
		sd, err := store.LockState(dir)
		require.NoError(t, err)
		gen, err := sd.NewGeneration()
		require.NoError(t, err)
		require.NoError(t, sd.Close())
		if db, err = store.Open(gen, store.Options{}); err != nil {
			t.Fatal(err)
		}
	}
	require.NoError(t, db.Close())
	return gens
}

// A CURRENT lost (missing, garbage, or naming a generation that is gone) beside exactly one
// complete generation opens that one, with what it holds, and writes CURRENT anew, logged; an empty
// generation beside it (made, never opened) is no candidate and is removed, logged.
func TestOpenState_LostCurrentOneGeneration(t *testing.T) {
	for name, damage := range map[string]func(current string) error{
		"missing": os.Remove,
		"garbage": func(current string) error { return os.WriteFile(current, []byte("\x00\x17zz"), 0o644) },
		"empty":   func(current string) error { return os.WriteFile(current, nil, 0o644) },
		"dangles": func(current string) error { return os.WriteFile(current, []byte("gen-000042\n"), 0o644) },
	} {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			gen := withGenerations(t, dir, 1)[0]
			empty := filepath.Join(dir, "gen-000002")
			require.NoError(t, os.Mkdir(empty, 0o755))
			require.NoError(t, damage(filepath.Join(dir, "CURRENT")))

			opts, buf := logTo()
			db, err := store.OpenState(dir, opts)
			require.NoError(t, err)
			require.Equal(t, gen, db.Dir())
			require.Equal(t, uint64(1), db.Checkpoint(provisioner.BucketNeeds).Applied, "the generation's store, not a new one")
			require.Contains(t, buf.String(), "the state dir's CURRENT is lost")
			cur, err := os.ReadFile(filepath.Join(dir, "CURRENT"))
			require.NoError(t, err)
			require.Equal(t, "gen-000001\n", string(cur))
			require.NoDirExists(t, empty)
			require.Contains(t, buf.String(), "generation="+empty)
			require.NoError(t, db.Close())
		})
	}
}

// With two complete generations and no CURRENT, which was in use cannot be told: the open is refused
// with ErrNoCurrent naming both and the way out, and nothing is opened, removed or written.
func TestOpenState_LostCurrentTwoGenerations(t *testing.T) {
	dir := t.TempDir()
	gens := withGenerations(t, dir, 2)
	require.NoError(t, os.Remove(filepath.Join(dir, "CURRENT")))

	_, err := store.OpenState(dir, store.Options{})
	require.ErrorIs(t, err, store.ErrNoCurrent)
	require.False(t, store.NeedsRebuild(err), "serve must not start it over: that removes both")
	for _, want := range []string{"gen-000001", "gen-000002", "mesh-provisioner rebuild", "CURRENT is missing"} {
		require.Contains(t, err.Error(), want)
	}
	for _, g := range gens {
		require.DirExists(t, g)
	}
	require.NoFileExists(t, filepath.Join(dir, "CURRENT"))

	// Named by hand, as the error says, the one chosen opens with what it holds.
	require.NoError(t, os.WriteFile(filepath.Join(dir, "CURRENT"), []byte("gen-000001\n"), 0o644))
	db, err := store.OpenState(dir, store.Options{})
	require.NoError(t, err)
	defer db.Close()
	require.Equal(t, uint64(1), db.Checkpoint(provisioner.BucketNeeds).Applied)
}

// TestLockState_WaitsOutABriefHold: a lock held a moment longer, as a child this process forks holds
// it from its fork to its exec, is waited for; one held past the grace is another process's.
func TestLockState_WaitsOutABriefHold(t *testing.T) {
	dir := t.TempDir()
	// A second open of the lock file is a second open file, whose flock excludes the first's as
	// another process's would.
	hold := func() *os.File {
		f, err := os.OpenFile(filepath.Join(dir, "LOCK"), os.O_RDWR|os.O_CREATE, 0o644)
		require.NoError(t, err)
		require.NoError(t, store.Flock(f))
		return f
	}
	f := hold()
	released := make(chan struct{})
	go func() {
		defer close(released)
		time.Sleep(50 * time.Millisecond)
		f.Close()
	}()
	s, err := store.LockState(dir)
	require.NoError(t, err, "a lock released within the grace")
	<-released
	require.NoError(t, s.Close())

	f = hold()
	defer f.Close()
	_, err = store.LockState(dir)
	require.ErrorIs(t, err, store.ErrLocked, "a lock held past the grace")
}
