package main

import (
	"bytes"
	"context"
	"fmt"
	"path/filepath"
	"regexp"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/faultfs"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/store"
)

// TestRebuild_FullDiskKeepsTheUnfinishedRebuild: `rebuild` run again after one that did not finish
// resumes its generation; on a disk without room for the open (below the reserve, or refusing the
// open's test write) it took the open's ErrNoSpace for a generation that does not open, removed the
// unfinished rebuild ("starting over", the fill of hours gone) and then failed on the new one. It
// fails saying the disk is full and keeps the generation, which the next rebuild, room back, resumes.
func TestRebuild_FullDiskKeepsTheUnfinishedRebuild(t *testing.T) {
	t.Parallel()
	url, last := smallMesh(t)
	dir := filepath.Join(t.TempDir(), "state")
	gen := rebuiltWithUnfinished(t, url, dir)
	var code int

	// The disk has less than the reserve free.
	var out, errBuf bytes.Buffer
	cmd := &RebuildCommand{Stdout: &out, Stderr: &errBuf, opts: store.Options{MinFreeBytes: 1 << 62}}
	code = exitCode(cmd.Run(context.Background(), []string{"--nats", url, "--state", dir}), &errBuf)
	require.Equal(t, exitFailure, code, errBuf.String())
	require.Contains(t, errBuf.String(), "no room to write in the state dir", "says the disk is full")
	require.Contains(t, errBuf.String(), "free space on that disk", "says what to do")
	require.NotContains(t, errBuf.String(), "starting over")
	require.Contains(t, globGens(t, dir), gen, "the unfinished rebuild is kept")
	db, err := store.Open(gen, store.Options{})
	require.NoError(t, err)
	require.Equal(t, uint64(1), db.Checkpoint(provisioner.BucketNeeds).Applied, "with what it applied")
	require.NoError(t, db.Close())

	// Room again: the next rebuild resumes it and finishes.
	stdout, errOut, code := runCmd(t, "rebuild", "--nats", url, "--state", dir)
	require.Zero(t, code, errOut)
	require.Contains(t, errOut+stdout, "resuming a rebuild that did not finish")
	checkState(t, dir, last)
}

// TestRebuild_SignalWhileAWriteWaitsForRoom: the disk fills in the middle of a rebuild's fill, and a
// write of the new generation waits for room (store/space.go), which no stop reaches. A first
// SIGINT did nothing then, for as long as the disk stayed full; only a second one stopped the
// rebuild (exit 130, "stopping now"). The first one stops it at once, says which generation is out
// of room, exits as stopped by the signal, and keeps the generation: the next rebuild, room back,
// resumes it and finishes.
func TestRebuild_SignalWhileAWriteWaitsForRoom(t *testing.T) {
	t.Parallel()
	requireHeldRebuildResumes(t, tablesGrown, inTheFill(bySignal))
}

// tablesGrown is "full" once the generation's tables hold 32 KiB: a flush of the fill's memtables
// (heldMemTable) has written them, and the next write of a flush waits for room while the fill goes
// on until both memtables are full. A rebuild's generation writes no log (store.Options.NoWAL), so
// its tables are the fill's only writes before its close.
func tablesGrown(state string, _ fmt.Stringer) fmt.Stringer {
	return faultfs.FilesGrown{Glob: filepath.Join(state, "gen-*", "*.sst"), Min: 32 << 10}
}

// heldMemTable is the memtable size of the rebuilds of requireHeldRebuildResumes: small, so that the
// fill of its mesh flushes tables many times over before it ends.
const heldMemTable = 64 << 10

// finalBarLogged is "full" once the rebuild's log holds the last line of its progress bar ("... in
// 1.2s"): the fill has caught up, and what is left is the generation's close, then the swap.
type finalBarLogged struct{ log fmt.Stringer }

var finalBarLine = regexp.MustCompile(`msg="rebuild \[#+\] 100% [^"]* in [0-9]`)

func (f finalBarLogged) String() string {
	if finalBarLine.MatchString(f.log.String()) {
		return "full"
	}
	return ""
}

// TestRebuild_SignalWhileTheCloseWaitsForRoom: the disk fills once the fill has caught up, and the
// close of the new generation waits for room. A signal stops the rebuild at once, saying the
// generation is kept, to resume; but once there was room, the fill left running closed the generation
// and swapped it in all the same, printing "rebuilt" after the command had returned (a library caller
// or a test reading the output raced it; a process exiting in that moment had swapped or not). A fill
// whose command has stopped swaps nothing: the next rebuild resumes the generation.
func TestRebuild_SignalWhileTheCloseWaitsForRoom(t *testing.T) {
	t.Parallel()
	requireHeldRebuildResumes(t, func(_ string, log fmt.Stringer) fmt.Stringer { return finalBarLogged{log: log} }, bySignal)
}

// bySignal stops a held rebuild with a first SIGINT, and requires it said so.
func bySignal(t *testing.T, _ *RebuildCommand, cancel context.CancelFunc) func(err error) {
	cancel()
	return func(err error) {
		require.ErrorIs(t, err, context.Canceled, "main says: stopped by SIGINT before it finished")
		require.Contains(t, err.Error(), "run rebuild again to resume")
	}
}

// TestRebuild_DeniedWhileAWriteWaitsForRoom: a permission NATS refuses ends a rebuild as a signal does
// (stopOnDenied), and while a write of its generation waited for room it ended "context canceled",
// neither naming what was refused nor what to grant. It says the refusal, and keeps the generation.
func TestRebuild_DeniedWhileAWriteWaitsForRoom(t *testing.T) {
	t.Parallel()
	requireHeldRebuildResumes(t, tablesGrown,
		inTheFill(func(t *testing.T, cmd *RebuildCommand, _ context.CancelFunc) func(err error) {
			// What the connection's error handler does on a violation (natsflags.go); cmd.nats.denied
			// was set before the fill started, whose held write the caller saw.
			cmd.nats.deny(cmd.nats.permissionError(fmt.Errorf("%w: Permissions Violation for Publish to \"$JS.API.CONSUMER.CREATE.KV_mesh-provisioner_needs\"", nats.ErrPermissionViolation)))
			return func(err error) {
				var pe *permissionError
				require.ErrorAs(t, err, &pe, "says what NATS refused")
				require.NotErrorIs(t, err, context.Canceled)
				require.Contains(t, err.Error(), "grant this NATS user")
				require.Contains(t, err.Error(), "run rebuild again to resume")
			}
		}))
}

// inTheFill is stop, once it has required that the write held is one of the fill's: its progress bar
// has not reached its end (not the generation's close, which TestRebuild_SignalWhileTheCloseWaitsForRoom
// holds).
func inTheFill(stop func(t *testing.T, cmd *RebuildCommand, cancel context.CancelFunc) func(err error)) func(t *testing.T, cmd *RebuildCommand, cancel context.CancelFunc) func(err error) {
	return func(t *testing.T, cmd *RebuildCommand, cancel context.CancelFunc) func(err error) {
		require.NotRegexp(t, finalBarLine, cmd.Stderr.(fmt.Stringer).String(), "the write held is the close's, not the fill's")
		return stop(t, cmd, cancel)
	}
}

// requireHeldRebuildResumes runs a rebuild whose disk fills once full (given the state dir and the
// rebuild's log) says "full", stops it with a first signal while a write of its generation waits for
// room, and requires it stopped at once, the generation kept once there is room, and the next rebuild
// resuming it.
func requireHeldRebuildResumes(t *testing.T, full func(state string, log fmt.Stringer) fmt.Stringer,
	stop func(t *testing.T, cmd *RebuildCommand, cancel context.CancelFunc) (check func(err error))) {
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	mesh := fixtures.Mesh{Seed: 5, Nodes: 60, Modules: 4, NeedsPerModule: 4, Collections: 3}
	require.NoError(t, fixtures.Load(context.Background(), js, mesh.Ops(), 256, nil))
	last := map[string]uint64{}
	for _, s := range provisioner.ProvisionerShapes[1:] {
		st, err := js.Stream(context.Background(), provisioner.StreamName(s.Bucket))
		require.NoError(t, err)
		last[s.Bucket] = st.CachedInfo().State.LastSeq
	}

	state := filepath.Join(t.TempDir(), "state")
	var out, errBuf natstest.LogBuffer
	fs, room := faultfs.FullOnceLogged(t, full(state, &errBuf), "full")
	cmd := &RebuildCommand{Stdout: &out, Stderr: &errBuf, opts: store.Options{FS: fs, MinFreeBytes: 1 << 20, MemTableSize: heldMemTable}}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- cmd.Run(ctx, []string{"--nats", ns.ClientURL(), "--state", state}) }()
	var gen string
	natstest.CheckFor(t, 30*time.Second, 10*time.Millisecond, func() error {
		gens, _ := filepath.Glob(filepath.Join(state, "gen-*"))
		for _, g := range gens {
			if store.WritesHeldIn(g) {
				gen = g
				return nil
			}
		}
		select {
		case err := <-done:
			t.Fatalf("the rebuild ended before the disk filled: %v\n%s", err, errBuf.String())
		default:
		}
		return fmt.Errorf("no write of the rebuild waits for room yet")
	})

	check := stop(t, cmd, cancel)
	err := awaitRun(t, done, "the rebuild waits for room to stop")
	check(err)
	require.Contains(t, err.Error(), gen, "names the generation out of room")
	require.Contains(t, errBuf.String(), "the state dir is out of room")
	require.NotContains(t, out.String(), "rebuilt")
	said, printed := errBuf.String(), out.String()

	// The process exits here; in the test room comes back, and the fill left running ends, stopped by
	// the signal, releasing the state dir. The generation is kept, and the next rebuild resumes it.
	room.Store(true)
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		sd, err := store.LockState(state)
		if err != nil {
			return err
		}
		return sd.Close()
	})
	// Run has returned: the fill left running writes nothing more to the caller's Stderr or Stdout (a
	// library caller reusing them, or a test reading them, raced its lines).
	require.Equal(t, said, errBuf.String(), "the fill left running wrote to Stderr after Run returned")
	require.Equal(t, printed, out.String(), "the fill left running wrote to Stdout after Run returned")
	require.NotContains(t, out.String(), "rebuilt", "the fill of a stopped rebuild swapped its generation in")
	require.NoFileExists(t, filepath.Join(state, "CURRENT"), "the fill of a stopped rebuild swapped its generation in")
	require.Equal(t, []string{gen}, globGens(t, state), "the generation is kept")
	stdout, errOut, code := runCmd(t, "rebuild", "--nats", ns.ClientURL(), "--state", state)
	require.Zero(t, code, errOut)
	require.Contains(t, errOut+stdout, "resuming a rebuild that did not finish")
	checkState(t, state, last)
}

// rebuiltWithUnfinished rebuilds dir from url, then leaves beside it a generation with a need applied,
// as a rebuild that did not finish leaves it (CURRENT names the first); it returns that generation.
func rebuiltWithUnfinished(t *testing.T, url, dir string) string {
	t.Helper()
	_, errOut, code := runCmd(t, "rebuild", "--nats", url, "--state", dir)
	require.Zero(t, code, errOut)
	sd, err := store.LockState(dir)
	require.NoError(t, err)
	gen, err := sd.NewGeneration()
	require.NoError(t, err)
	db, err := store.Open(gen, store.Options{})
	require.NoError(t, err)
	require.NoError(t, db.Apply(provisioner.BucketNeeds, []provisioner.Message{{Seq: 1, Key: "n1.m.config.a", Op: provisioner.OpPut, Value: []byte{0x01}}}, 0, true))
	require.NoError(t, db.Close())
	require.NoError(t, sd.Close())
	return gen
}
