package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/store"
)

// built is the command built once per package run, on first use (three tests run it as a child
// process; each built it, about 6 s of CPU a link), and removed by TestMain.
var built struct {
	once sync.Once
	dir  string
	path string
	err  error
}

// buildBinary returns the path of the command built from this tree.
func buildBinary(t *testing.T) string {
	t.Helper()
	built.once.Do(func() {
		built.dir, built.err = os.MkdirTemp("", "mesh-provisioner-bin-")
		if built.err != nil {
			return
		}
		built.path = filepath.Join(built.dir, "mesh-provisioner")
		if out, err := exec.Command("go", "build", "-o", built.path, ".").CombinedOutput(); err != nil {
			built.err = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	require.NoError(t, built.err)
	return built.path
}

// pendingBytes is how much the newest generation, when CURRENT does not name it, has written to its
// tables (and logs: a rebuild's generation writes none, store.Options.NoWAL, so what a kill at
// killAt leaves is its memtables flushed before).
func pendingBytes(dir string) int64 {
	gens, _ := filepath.Glob(filepath.Join(dir, "gen-*"))
	var newest string
	for _, g := range gens {
		if g > newest {
			newest = g
		}
	}
	if newest == "" {
		return 0
	}
	cur, _ := os.ReadFile(filepath.Join(dir, "CURRENT"))
	if strings.TrimSpace(string(cur)) == filepath.Base(newest) {
		return 0
	}
	var n int64
	files, _ := os.ReadDir(newest)
	for _, f := range files {
		if strings.HasSuffix(f.Name(), ".log") || strings.HasSuffix(f.Name(), ".sst") {
			if info, err := f.Info(); err == nil {
				n += info.Size()
			}
		}
	}
	return n
}

// startKilled starts `rebuild` and SIGKILLs it once it has written killAt bytes into its generation.
// It reports whether the rebuild was killed before it finished.
func startKilled(t *testing.T, bin, url, dir string, killAt int64) bool {
	t.Helper()
	cmd := exec.Command(bin, "rebuild", "--nats", url, "--state", dir)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	require.NoError(t, cmd.Start())
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	for {
		select {
		case err := <-done:
			require.NoError(t, err, "%s", out.String())
			return false // finished before it could be killed
		case <-time.After(2 * time.Millisecond):
		}
		if pendingBytes(dir) >= killAt {
			require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
			<-done
			return true
		}
	}
}

func TestRebuild_KilledMidwayTheNextStartOpensAndFinishes(t *testing.T) {
	t.Parallel()
	bin := buildBinary(t)
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	mesh := fixtures.Mesh{Seed: 11, Nodes: 500, Modules: 8, NeedsPerModule: 4, Collections: 3, BadKeys: 2, BadValues: 2}
	ops := mesh.Ops()
	require.NoError(t, fixtures.Load(ctx, js, ops, 0, nil))
	last := map[string]uint64{}
	for _, s := range provisioner.ProvisionerShapes[1:] {
		st, err := js.Stream(ctx, provisioner.StreamName(s.Bucket))
		require.NoError(t, err)
		last[s.Bucket] = st.CachedInfo().State.LastSeq
	}
	dir := t.TempDir()

	// Killed after it started writing: no CURRENT yet, a partial generation.
	killed := startKilled(t, bin, ns.ClientURL(), dir, 64<<10)
	require.True(t, killed, "the rebuild of %d messages finished before 64 KiB were written", len(ops))
	_, err := os.Stat(filepath.Join(dir, "CURRENT"))
	require.ErrorIs(t, err, os.ErrNotExist, "nothing was swapped in")

	// The next rebuild resumes the generation and finishes.
	out, err := exec.Command(bin, "rebuild", "--nats", ns.ClientURL(), "--state", dir).CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.Contains(t, string(out), "resuming a rebuild that did not finish")
	checkState(t, dir, last)

	// Killed again, now with a current generation: the state dir opens on the old one, and the
	// leftover is removed.
	killed = startKilled(t, bin, ns.ClientURL(), dir, 64<<10)
	require.True(t, killed)
	require.Len(t, globGens(t, dir), 2)
	checkState(t, dir, last)
	require.Len(t, globGens(t, dir), 1, "opening removed the unfinished generation")
}

func globGens(t *testing.T, dir string) []string {
	gens, err := filepath.Glob(filepath.Join(dir, "gen-*"))
	require.NoError(t, err)
	return gens
}

// checkState opens the state dir as serve does and checks every bucket was applied to its end.
func checkState(t *testing.T, dir string, last map[string]uint64) {
	t.Helper()
	db, err := store.OpenState(dir, store.Options{})
	require.NoError(t, err)
	defer db.Close()
	for b, seq := range last {
		require.Equal(t, seq, db.Checkpoint(b).Applied, fmt.Sprintf("%s applied", b))
	}
}

// smallMesh loads a small mesh into a fresh server and returns its URL and each provisioner bucket's
// last sequence.
func smallMesh(t *testing.T) (string, map[string]uint64) {
	t.Helper()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	mesh := fixtures.Mesh{Seed: 3, Nodes: 10, Modules: 2, NeedsPerModule: 2, Collections: 2, BadKeys: 1, BadValues: 1}
	require.NoError(t, fixtures.Load(ctx, js, mesh.Ops(), 0, nil))
	last := map[string]uint64{}
	for _, s := range provisioner.ProvisionerShapes[1:] { // the registry is serve's to write
		st, err := js.Stream(ctx, provisioner.StreamName(s.Bucket))
		require.NoError(t, err)
		last[s.Bucket] = st.CachedInfo().State.LastSeq
	}
	return ns.ClientURL(), last
}

// A state dir whose CURRENT cannot be read is what rebuild is for: replay says "run mesh-provisioner
// rebuild" (serve opens the only generation and writes CURRENT anew, store.Resolve), so rebuild must
// not refuse it.
func TestRebuild_BrokenCurrentIsRebuilt(t *testing.T) {
	t.Parallel()
	url, last := smallMesh(t)
	for name, current := range map[string]string{
		"garbage":        "garbage\n",
		"path traversal": "../../etc\n",
		"empty":          "",
	} {
		t.Run(name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "state")
			out, errOut, code := runCmd(t, "rebuild", "--nats", url, "--state", dir)
			require.Zero(t, code, errOut)
			require.NoError(t, os.WriteFile(filepath.Join(dir, "CURRENT"), []byte(current), 0o644))

			out, errOut, code = runCmd(t, "rebuild", "--nats", url, "--state", dir)
			require.Zero(t, code, "rebuild refused the state dir it is the answer to: %s", errOut)
			require.Contains(t, out, "rebuilt")
			checkState(t, dir, last)
			require.Len(t, globGens(t, dir), 1, "the generations CURRENT no longer named are gone")
		})
	}
}

// The seat's state dir is /var/lib/mesh-provisioner/state (the systemd unit, the Kubernetes
// manifest); an operator who gives its parent, as the commands' own examples did, is told which
// one was meant. rebuild writes nothing there (it filled a second state dir beside the seat's and
// said "rebuilt"), and replay does not answer "no projection yet" alone.
func TestRebuild_TheParentOfAStateDirIsNotOne(t *testing.T) {
	t.Parallel()
	url, last := smallMesh(t)
	parent := t.TempDir()
	dir := filepath.Join(parent, "state")
	_, errOut, code := runCmd(t, "rebuild", "--nats", url, "--state", dir)
	require.Zero(t, code, errOut)
	require.NoError(t, os.Mkdir(filepath.Join(parent, "lost+found"), 0o700))

	_, errOut, code = runCmd(t, "rebuild", "--nats", url, "--state", parent)
	require.Equal(t, exitUsage, code, errOut)
	require.Contains(t, errOut, "did you mean --state "+dir)
	entries, err := os.ReadDir(parent)
	require.NoError(t, err)
	require.Len(t, entries, 2, "nothing written beside the state dir")

	for _, args := range [][]string{
		{"replay", "state", "needs", "--at", "seq:1", "--state", parent},
		{"export", "--state", parent, "--out", filepath.Join(t.TempDir(), "x.mph")},
	} {
		_, errOut, code = runCmd(t, args...)
		require.Equal(t, exitFailure, code, errOut)
		require.Contains(t, errOut, "did you mean --state "+dir, args)
	}

	// A state dir on a volume of its own has lost+found beside its files: still a state dir.
	vol := t.TempDir()
	require.NoError(t, os.Mkdir(filepath.Join(vol, "lost+found"), 0o700))
	_, errOut, code = runCmd(t, "rebuild", "--nats", url, "--state", vol)
	require.Zero(t, code, errOut)
	checkState(t, vol, last)
}
