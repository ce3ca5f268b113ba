package store

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestCheckStateDir_EveryLayoutThisBinaryLeaves: every state dir any version of this binary can have
// left, at any point a process was killed, is accepted, so an upgrade never refuses an operator's
// state dir; another program's database directory, a generation given as --state, and a directory of
// other files are refused before anything is written in them. A file's content is given after "=";
// a name ending in "/" is a directory.
func TestCheckStateDir_EveryLayoutThisBinaryLeaves(t *testing.T) {
	gen := []string{"gen-000001/", "gen-000001/MANIFEST-000001=m", "gen-000001/000002.log=w", "gen-000001/LOCK="}
	with := func(files ...string) []string { return append(append([]string{}, gen...), files...) }
	for _, c := range []struct {
		name  string
		files []string
		ok    bool
	}{
		{"empty", nil, true},
		{"a volume's root", []string{"lost+found/"}, true},
		{"a first start killed after its lock", []string{"LOCK=123\n"}, true},
		{"a first start killed before its swap", with("LOCK=123\n"), true},
		{"a first start killed in its swap", with("LOCK=123\n", "CURRENT.tmp=gen-000001\n"), true},
		{"a state dir", with("LOCK=123\n", "CURRENT=gen-000001\n"), true},
		{"a rebuild killed before its swap", with("LOCK=123\n", "CURRENT=gen-000001\n", "gen-000002/", "gen-000002/MANIFEST-000001=m"), true},
		{"a swap killed before the old generation was removed", with("LOCK=123\n", "CURRENT=gen-000002\n", "gen-000002/"), true},
		{"its generations removed by hand", []string{"LOCK=123\n", "CURRENT=gen-000003\n"}, true},
		{"a broken CURRENT", with("LOCK=123\n", "CURRENT=\x00\x00\x00"), true},
		{"an empty CURRENT and nothing else", []string{"LOCK=123\n", "CURRENT="}, true},
		{"killed readers' copies", with("LOCK=123\n", "CURRENT=gen-000001\n", ".replay-1/", ".replay-1/000007.sst=t", ".replay-2/"), true},
		{"only killed readers' copies", []string{".replay-1/", ".replay-1/MANIFEST-000001=m"}, true},
		{"an archive exported into it before that was refused", with("LOCK=123\n", "CURRENT=gen-000001\n", "incident.mph=x", ".incident.mph.spool-1=x"), true},
		{"another program's LevelDB", []string{"CURRENT=MANIFEST-000005\n", "LOCK=", "LOG=l", "MANIFEST-000005=m", "000003.ldb=t"}, false},
		{"a generation given as --state", []string{"LOCK=", "MANIFEST-000001=m", "marker.manifest.000001.MANIFEST-000001=", "OPTIONS-000003=o", "000002.log=w", "ROOM-PROBE="}, false},
		{"the parent of a state dir with files of its own", []string{"notes.txt=n", "state/", "state/CURRENT=gen-000001\n"}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "state")
			require.NoError(t, os.Mkdir(dir, 0o755))
			for _, f := range c.files {
				name, body, isFile := strings.Cut(f, "=")
				p := filepath.Join(dir, name)
				if !isFile {
					require.NoError(t, os.MkdirAll(p, 0o755))
					continue
				}
				require.NoError(t, os.WriteFile(p, []byte(body), 0o644))
			}
			err := CheckStateDir(dir)
			if c.ok {
				require.NoError(t, err)
				return
			}
			require.ErrorIs(t, err, ErrNotStateDir)
		})
	}
	require.NoError(t, CheckStateDir(filepath.Join(t.TempDir(), "missing")))
	file := filepath.Join(t.TempDir(), "file")
	require.NoError(t, os.WriteFile(file, nil, 0o644))
	require.ErrorIs(t, CheckStateDir(file), ErrNotStateDir)
}

// TestCheckStateDir_GenerationSaysItsStateDir: a generation given as --state (the directory an
// operator finds on the disk) is refused with the state dir to give instead.
func TestCheckStateDir_GenerationSaysItsStateDir(t *testing.T) {
	state := filepath.Join(t.TempDir(), "state")
	db, err := OpenState(state, Options{})
	require.NoError(t, err)
	require.NoError(t, db.Close())
	gens, err := filepath.Glob(filepath.Join(state, "gen-*"))
	require.NoError(t, err)
	require.Len(t, gens, 1)
	err = CheckStateDir(gens[0])
	require.ErrorIs(t, err, ErrNotStateDir)
	require.Contains(t, err.Error(), "did you mean --state "+state+"?")
}
