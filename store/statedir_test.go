package store_test

import (
	"bytes"
	"log/slog"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

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
