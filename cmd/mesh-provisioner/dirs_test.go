package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
)

// serveOnce runs serve with args until it returns, stopping it (as a first SIGTERM does) as soon as it
// answers: a serve that wrongly starts stops at once, and the test fails on its exit code rather than
// waiting for it. (A context ended before the start stops serve right after it opens the state dir.)
func serveOnce(t *testing.T, args ...string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var out, errb bytes.Buffer
	cmd := &ServeCommand{Stdout: &out, Stderr: &errb, started: func(string, string) { cancel() }}
	err := cmd.Run(ctx, append([]string{"--embedded-listen", "127.0.0.1:-1"}, args...))
	return exitCode(err, &errb), errb.String()
}

// TestServe_StateNeverInsideEmbeddedStore: --state inside --embedded-store is refused as the converse
// is (exit 2), before anything starts. At <store>/jetstream the state dir was where the embedded server
// keeps its streams: deleting the state dir, which loses nothing a rebuild cannot bring back, deleted
// the streams a rebuild reads.
func TestServe_StateNeverInsideEmbeddedStore(t *testing.T) {
	t.Setenv("NATS_URL", "")
	dir := t.TempDir()
	nats := filepath.Join(dir, "nats")
	for _, state := range []string{filepath.Join(nats, "jetstream"), filepath.Join(nats, "state"), nats + "/./state"} {
		code, stderr := serveOnce(t, "--state", state, "--embedded-store", nats)
		require.Equal(t, exitUsage, code, "--state %s: %s", state, stderr)
		require.Contains(t, stderr, "is inside --embedded-store", state)
		require.NoDirExists(t, nats, "--state %s: nothing started, nothing written", state)
	}
	// Side by side, as the defaults are: served.
	code, stderr := serveOnce(t, "--state", filepath.Join(dir, "state"), "--embedded-store", nats)
	require.Equal(t, exitOK, code, stderr)
}

// TestServe_StateThatIsNotAStateDir: serve refuses a --state that is a file, or a directory of other
// files without a state dir (the parent of the seat's, most likely), as rebuild does: it wrote a new
// state dir among them, rebuilt it from the streams, and answered from it, beside the real one. replay
// and export say what a file given as --state is too.
func TestServe_StateThatIsNotAStateDir(t *testing.T) {
	t.Setenv("NATS_URL", "")
	dir := t.TempDir()
	parent := filepath.Join(dir, "lib")
	state := filepath.Join(parent, "state")
	code, stderr := serveOnce(t, "--state", state, "--embedded-store", filepath.Join(dir, "nats"))
	require.Equal(t, exitOK, code, stderr)
	require.NoError(t, os.WriteFile(filepath.Join(parent, "notes.txt"), []byte("mine\n"), 0o644))
	file := filepath.Join(dir, "file")
	require.NoError(t, os.WriteFile(file, []byte("x\n"), 0o644))

	store := filepath.Join(dir, "nats2")
	code, stderr = serveOnce(t, "--state", parent, "--embedded-store", store)
	require.Equal(t, exitUsage, code, stderr)
	require.Contains(t, stderr, "did you mean --state "+state)
	entries, err := os.ReadDir(parent)
	require.NoError(t, err)
	require.Len(t, entries, 2, "nothing written beside the state dir")
	require.NoDirExists(t, store, "no embedded server started")

	code, stderr = serveOnce(t, "--state", file, "--embedded-store", store)
	require.Equal(t, exitUsage, code, stderr)
	require.Contains(t, stderr, file+" is a file, not a directory")
	for _, args := range [][]string{
		{"rebuild", "--nats", "nats://127.0.0.1:1", "--state", file},
		{"replay", "state", "needs", "--at", "seq:1", "--state", file},
		{"export", "--state", file, "--out", filepath.Join(dir, "x.mph")},
	} {
		code, _, stderr := run(t, args...)
		require.NotEqual(t, exitOK, code, "%v", args)
		require.Contains(t, stderr, file+" is a file, not a directory", "%v", args)
	}
}

// TestServe_SecondServeNeverSharesTheEmbeddedStore: a second serve started by mistake beside a running
// one (another --embedded-listen, the same dirs; or another --state and the same --embedded-store)
// stops before it starts an embedded server: nats-server locks nothing in its store, and two servers
// on one store write the same streams' files. The first one answers on.
func TestServe_SecondServeNeverSharesTheEmbeddedStore(t *testing.T) {
	t.Setenv("NATS_URL", "")
	dir := t.TempDir()
	first, err := startServe(dir)
	require.NoError(t, err)
	defer func() { require.NoError(t, first.stop()) }()
	nats := filepath.Join(dir, "nats")

	for name, c := range map[string]struct{ state, says string }{
		"same state dir":    {filepath.Join(dir, "state"), "in use by another process"},
		"another state dir": {filepath.Join(t.TempDir(), "state"), "--embedded-store " + nats + " is in use by another embedded server"},
	} {
		t.Run(name, func(t *testing.T) {
			var errb natstest.LogBuffer
			started := make(chan struct{})
			cmd := &ServeCommand{Stdout: &natstest.LogBuffer{}, Stderr: &errb, started: func(string, string) { close(started) }}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan error, 1)
			go func() {
				done <- cmd.Run(ctx, []string{"--state", c.state, "--embedded-store", nats, "--embedded-listen", "127.0.0.1:-1"})
			}()
			select {
			case err := <-done:
				require.Error(t, err)
				require.Contains(t, err.Error(), c.says)
			case <-started:
				cancel()
				<-done
				t.Fatalf("a second serve ran on the first one's embedded store:\n%s", errb.String())
			case <-time.After(30 * time.Second):
				t.Fatal("the second serve neither stopped nor answered")
			}
			require.NotContains(t, errb.String(), "embedded NATS server started")
		})
	}

	// The first serve still serves, its registry whole once its writer's first pass is done.
	t.Setenv("NATS_URL", first.natsURL)
	natstest.CheckFor(t, 10*time.Second, 50*time.Millisecond, func() error {
		code, out, stderr := run(t, "query", "registry")
		if code != exitOK {
			return fmt.Errorf("query registry: exit %d: %s", code, stderr)
		}
		if want := fmt.Sprintf("%d rows", len(provisioner.Registry.Entries)); !strings.Contains(out, want) {
			return fmt.Errorf("want %s:\n%s", want, out)
		}
		return nil
	})
}

// TestServe_EmbeddedListenTaken: a taken --embedded-listen is said at once, with what to do; it was
// found out after 10 s as "did not start within 10s (is the port taken?)".
func TestServe_EmbeddedListenTaken(t *testing.T) {
	taken, stderr := serveOnATakenAddress(t, func(taken string) []string { return []string{"--embedded-listen", taken} })
	require.Contains(t, stderr, "--nats nats://"+taken)
}

// TestServe_MetricsAddrTaken: a taken --metrics-addr is said with the flag that moves it, as a taken
// --embedded-listen is (a second make run said only "address already in use").
func TestServe_MetricsAddrTaken(t *testing.T) {
	_, stderr := serveOnATakenAddress(t, func(taken string) []string {
		return []string{"--embedded-listen", "127.0.0.1:0", "--metrics-addr", taken}
	})
	require.Contains(t, stderr, "give --metrics-addr another address")
}

// serveOnATakenAddress runs serve with the flags flags gives for an address another listener holds,
// requires that it fails saying the address is in use, and returns that address and serve's stderr.
func serveOnATakenAddress(t *testing.T, flags func(taken string) []string) (string, string) {
	t.Helper()
	t.Setenv("NATS_URL", "")
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	dir := t.TempDir()
	var out, errb bytes.Buffer
	args := append([]string{"serve", "--state", filepath.Join(dir, "state"), "--embedded-store", filepath.Join(dir, "nats")},
		flags(l.Addr().String())...)
	err = NewMain(&out, &errb).Run(context.Background(), args)
	require.Equal(t, exitFailure, exitCode(err, &errb), errb.String())
	require.Contains(t, errb.String(), "address already in use")
	return l.Addr().String(), errb.String()
}

// TestServe_BrokenStateDirWaitsForNATS: the state dir is opened before the embedded server starts
// (above), but one this binary cannot read is started over only once NATS is reached: a serve that
// cannot reach it leaves the state dir as it was, for replay, export or another try.
func TestServe_BrokenStateDirWaitsForNATS(t *testing.T) {
	t.Parallel()
	state := filepath.Join(t.TempDir(), "state")
	code, stderr := serveOnce(t, "--state", state, "--embedded-store", filepath.Join(t.TempDir(), "nats"))
	require.Equal(t, exitOK, code, stderr)
	current := filepath.Join(state, "CURRENT")
	require.NoError(t, os.WriteFile(current, []byte("garbage\n"), 0o644))
	code, stderr = serveOnce(t, "--state", state, "--nats", "nats://127.0.0.1:1")
	require.Equal(t, exitFailure, code, stderr)
	require.Contains(t, stderr, "connect to NATS")
	b, err := os.ReadFile(current)
	require.NoError(t, err)
	require.Equal(t, "garbage\n", string(b), "the state dir is as it was")
}

// TestServe_DemoOnlyIntoAnEmptyEmbeddedServer: --demo loads the synthetic mesh into an empty embedded
// server only. A store holding data of its own (here a node's composition, and nothing in the
// provisioner's buckets, which was all the demo looked at) is served as it is, with no synthetic key
// mixed into it, as a store holding the demo from an earlier start is.
func TestServe_DemoOnlyIntoAnEmptyEmbeddedServer(t *testing.T) {
	t.Setenv("NATS_URL", "")
	dir := t.TempDir()
	ns := natstest.RunServerAt(t, "127.0.0.1:-1", filepath.Join(dir, "nats"), "")
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.ComposedPrefix + "real-1"})
	require.NoError(t, err)
	_, err = kv.Put(ctx, "mod-a.7", []byte{0x80})
	require.NoError(t, err)
	ns.Shutdown()
	ns.WaitForShutdown()

	s, err := startServe(dir, "--demo")
	require.NoError(t, err)
	defer func() { require.NoError(t, s.stop()) }()
	require.Contains(t, s.stderr.String(), "already holds data")
	_, js = natstest.Connect(t, s.natsURL)
	for _, b := range []string{provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect, provisioner.BucketHostModules} {
		_, err := js.Stream(ctx, provisioner.StreamName(b))
		require.ErrorIs(t, err, jetstream.ErrStreamNotFound, "%s: no demo data in a server of its own", b)
	}
}

// TestServe_EmbeddedFlagsWithNATSAreSaidIgnored: with --nats, or NATS_URL from an env file, the
// embedded server's flags do nothing; serve says so rather than serve the mesh's NATS silently to an
// operator who asked for an embedded server.
func TestServe_EmbeddedFlagsWithNATSAreSaidIgnored(t *testing.T) {
	t.Setenv("NATS_URL", "nats://127.0.0.1:1")
	_, stderr := serveOnce(t, "--state", filepath.Join(t.TempDir(), "state"), "--embedded-store", filepath.Join(t.TempDir(), "nats"))
	require.Contains(t, stderr, "its flags are ignored")
	require.Contains(t, stderr, "--embedded-listen --embedded-store")
}

// TestServe_StateOfAnotherProgram: a --state that is another program's database directory (LevelDB,
// RocksDB and older Pebble keep a CURRENT and a LOCK too, CURRENT naming a MANIFEST) is refused before
// anything is written in it, by every command. The CURRENT and LOCK made it pass for a state dir:
// serve took it for a broken one and started it over, rewriting CURRENT to a generation of its own
// (the other program's database no longer opened), rebuild did the same, and replay and export told
// the operator to run rebuild there.
func TestServe_StateOfAnotherProgram(t *testing.T) {
	t.Setenv("NATS_URL", "")
	dir := t.TempDir()
	other := filepath.Join(dir, "leveldb")
	files := map[string]string{"CURRENT": "MANIFEST-000005\n", "LOCK": "", "MANIFEST-000005": "manifest", "000003.ldb": "table", "LOG": "log"}
	require.NoError(t, os.Mkdir(other, 0o755))
	for name, body := range files {
		require.NoError(t, os.WriteFile(filepath.Join(other, name), []byte(body), 0o644))
	}
	unchanged := func(what string) {
		t.Helper()
		entries, err := os.ReadDir(other)
		require.NoError(t, err)
		require.Len(t, entries, len(files), "%s: nothing written in the other program's directory", what)
		for name, body := range files {
			b, err := os.ReadFile(filepath.Join(other, name))
			require.NoError(t, err)
			require.Equal(t, body, string(b), "%s: %s as it was", what, name)
		}
	}

	store := filepath.Join(dir, "nats")
	code, stderr := serveOnce(t, "--state", other, "--embedded-store", store)
	require.Equal(t, exitUsage, code, stderr)
	require.Contains(t, stderr, "another program's directory")
	unchanged("serve")
	require.NoDirExists(t, store, "no embedded server started")

	for _, args := range [][]string{
		{"rebuild", "--nats", "nats://127.0.0.1:1", "--state", other},
		{"replay", "state", "needs", "--at", "seq:1", "--state", other},
		{"export", "--state", other, "--out", filepath.Join(dir, "x.mph")},
	} {
		code, _, stderr := run(t, args...)
		require.NotEqual(t, exitOK, code, "%v", args)
		require.Contains(t, stderr, "another program's directory", "%v", args)
		require.NotContains(t, stderr, "run `mesh-provisioner rebuild`", "%v: rebuild would break it", args)
		unchanged(args[0])
	}

	// A state dir of this program's whose CURRENT is broken is still one: serve opens its only
	// generation and writes CURRENT anew (store.Resolve).
	state := filepath.Join(dir, "state")
	code, stderr = serveOnce(t, "--state", state, "--embedded-store", store)
	require.Equal(t, exitOK, code, stderr)
	// One generation: the first fill's, or the checkpoint with a log the seat made of it once caught
	// up (seat/relog.go).
	gens, err := filepath.Glob(filepath.Join(state, "gen-*"))
	require.NoError(t, err)
	require.Len(t, gens, 1)
	require.NoError(t, os.WriteFile(filepath.Join(state, "CURRENT"), []byte("MANIFEST-000005\n"), 0o644))
	code, stderr = serveOnce(t, "--state", state, "--embedded-store", store)
	require.Equal(t, exitOK, code, stderr)
	require.Contains(t, stderr, "the state dir's CURRENT is lost")
	cur, err := os.ReadFile(filepath.Join(state, "CURRENT"))
	require.NoError(t, err)
	require.Equal(t, filepath.Base(gens[0])+"\n", string(cur))
}

// TestServe_DemoStoppedPartWayLoadsWholeNextTime: a serve --demo stopped while it loads the demo
// (Ctrl-C during the start) removes what it wrote, and the next start loads the demo whole. The part
// was left: the next start found a server that holds data and served that part for good.
func TestServe_DemoStoppedPartWayLoadsWholeNextTime(t *testing.T) {
	t.Setenv("NATS_URL", "")
	dir := t.TempDir()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	demoLoaded = func(done int) { cancel() } // after its first window of publishes
	t.Cleanup(func() { demoLoaded = nil })
	var errb natstest.LogBuffer
	cmd := &ServeCommand{Stdout: &natstest.LogBuffer{}, Stderr: &errb, started: func(string, string) { t.Error("served a demo stopped part way") }}
	err := cmd.Run(ctx, []string{"--demo", "--state", filepath.Join(dir, "state"), "--embedded-listen", "127.0.0.1:-1", "--embedded-store", filepath.Join(dir, "nats")})
	require.ErrorIs(t, err, context.Canceled, errb.String())
	require.Contains(t, errb.String(), "what it wrote is removed")
	demoLoaded = nil

	requireDemoLoadsWhole(t, dir)
}

// requireDemoLoadsWhole starts serve --demo on dir, as TestServe_DemoStoppedPartWayLoadsWholeNextTime
// left it, and requires the demo loaded whole: each of its needs once, in a stream made anew.
func requireDemoLoadsWhole(t *testing.T, dir string) {
	t.Helper()
	s, err := startServe(dir, "--demo")
	require.NoError(t, err)
	defer func() { require.NoError(t, s.stop()) }()
	require.Contains(t, s.stderr.String(), "demo mesh loaded")
	require.NotContains(t, s.stderr.String(), "already holds data")
	_, js := natstest.Connect(t, s.natsURL)
	want := 0
	for _, op := range fixtures.Demo().Ops() {
		if op.Bucket == provisioner.BucketNeeds {
			want++
		}
	}
	st, err := js.Stream(context.Background(), provisioner.StreamName(provisioner.BucketNeeds))
	require.NoError(t, err)
	info := st.CachedInfo().State
	require.Equal(t, uint64(1), info.FirstSeq)
	require.Equal(t, uint64(want), info.LastSeq, "the demo's needs, each once")
}

// TestServe_EmbeddedListenPortZeroIsAFreePort: --embedded-listen host:0 listens on a free port, as
// :0 does for any Go or Unix listener. nats-server reads port 0 as its default, so the embedded
// server listened on 4222, the port of the NATS the operator gave :0 to keep clear of (or waited 10 s
// to say it did not start, when that one ran).
func TestServe_EmbeddedListenPortZeroIsAFreePort(t *testing.T) {
	t.Setenv("NATS_URL", "")
	s, err := startServe(t.TempDir(), "--embedded-listen", "127.0.0.1:0")
	require.NoError(t, err)
	defer func() { require.NoError(t, s.stop()) }()
	require.True(t, strings.HasPrefix(s.natsURL, "nats://127.0.0.1:"), s.natsURL)
	require.NotEqual(t, "nats://127.0.0.1:4222", s.natsURL, "not nats-server's default port")
	require.Contains(t, s.stderr.String(), `msg="embedded NATS server started" url=`+s.natsURL)
}

// TestCommands_UnreachableNATSLeavesTheStateDirAsItWas: a mistyped --nats (nothing listens there)
// leaves --state exactly as it was, absent or a seat's: rebuild locked it first (making the directory
// and its LOCK), and serve --nats opened it (a new state dir made whole, Pebble's files and all).
func TestCommands_UnreachableNATSLeavesTheStateDirAsItWas(t *testing.T) {
	t.Setenv("NATS_URL", "")
	dir := t.TempDir()
	seat := filepath.Join(dir, "seat")
	code, stderr := serveOnce(t, "--state", seat, "--embedded-store", filepath.Join(dir, "nats"))
	require.Equal(t, exitOK, code, stderr)
	snapshot := func(root string) map[string]string { // path -> size and mtime, or "" for no such dir
		files := map[string]string{}
		err := filepath.Walk(root, func(p string, fi os.FileInfo, err error) error {
			if err != nil {
				return err
			}
			files[p] = fmt.Sprint(fi.Size(), fi.ModTime().UnixNano(), fi.Mode())
			return nil
		})
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		require.NoError(t, err)
		return files
	}
	for _, state := range []string{filepath.Join(dir, "new"), seat} {
		before := snapshot(state)
		for _, cmd := range []string{"rebuild", "serve"} {
			code, _, stderr := run(t, cmd, "--nats", "nats://127.0.0.1:1", "--state", state)
			require.Equal(t, exitFailure, code, "%s %s: %s", cmd, state, stderr)
			require.Contains(t, stderr, "connect to NATS", cmd)
			require.Equal(t, before, snapshot(state), "%s --state %s: left as it was", cmd, state)
		}
	}
}

// TestServe_DemoStoppedHardPartWayLoadsWholeNextTime: a second Ctrl-C during serve --demo's load (it
// stops at once, 130) left part of the demo in the embedded server, and every later start found a
// server that holds data and served that part for good. The load marks itself under way in
// --embedded-store until it has finished; the next start finds the mark, removes the part and loads
// the demo whole.
func TestServe_DemoStoppedHardPartWayLoadsWholeNextTime(t *testing.T) {
	t.Setenv("NATS_URL", "")
	bin := buildBinary(t)
	for attempt := 1; ; attempt++ {
		dir := t.TempDir()
		listen := fmt.Sprintf("127.0.0.1:%d", natstest.FreePort(t))
		cmd := exec.Command(bin, "serve", "--demo", "--state", filepath.Join(dir, "state"), "--embedded-listen", listen,
			"--embedded-store", filepath.Join(dir, "nats"))
		var stderr natstest.LogBuffer
		cmd.Stderr = &stderr
		require.NoError(t, cmd.Start())
		exited := make(chan error, 1)
		go func() { exited <- cmd.Wait() }()
		t.Cleanup(func() { _ = cmd.Process.Kill() })
		// Part of the demo is in: the needs stream holds messages.
		natstest.CheckFor(t, 60*time.Second, 5*time.Millisecond, func() error {
			nc, err := nats.Connect("nats://" + listen)
			if err != nil {
				return err
			}
			defer nc.Close()
			js, err := jetstream.New(nc)
			if err != nil {
				return err
			}
			st, err := js.Stream(context.Background(), provisioner.StreamName(provisioner.BucketNeeds))
			if err != nil {
				return err
			}
			if st.CachedInfo().State.Msgs == 0 {
				return fmt.Errorf("no need loaded yet")
			}
			return nil
		})
		// Two signals: a SIGINT and a SIGTERM, since a second SIGINT sent at once merges with the first
		// while that one is pending (main takes any second signal for "stop now").
		require.NoError(t, cmd.Process.Signal(syscall.SIGINT))
		require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
		err := natstest.Receive(t, exited, 30*time.Second, "serve stops")
		var ee *exec.ExitError
		require.True(t, errors.As(err, &ee), "%v: %s", err, stderr.String())
		require.Equal(t, 130, ee.ExitCode(), stderr.String())
		out := stderr.String()
		if strings.Contains(out, "demo mesh loaded") || strings.Contains(out, "what it wrote is removed") || !strings.Contains(out, "second signal") {
			// The load ended, or its removal did, before the second signal: no part left to find.
			require.Less(t, attempt, 10, "the load never stopped part way:\n%s", out)
			continue
		}
		requireDemoLoadsWhole(t, dir)
		return
	}
}

// TestServe_DemoMarkerNeverRemovesOthersData: a serve --demo killed part way leaves its marker; a
// plain serve on that store (it only warns) has clients write data of their own into the streams the
// demo created. The next serve --demo deleted those streams, the data with them, since they were not
// there before the load. It removes what the load left only when the streams hold the demo's messages
// alone: here it removes nothing, serves the store as it is, and the marker is gone.
func TestServe_DemoMarkerNeverRemovesOthersData(t *testing.T) {
	t.Setenv("NATS_URL", "")
	dir := t.TempDir()
	s, err := startServe(dir, "--demo")
	require.NoError(t, err)
	require.NoError(t, s.stop())
	// As a kill between the load's last publish and the marker's removal leaves it: the streams hold
	// the demo whole, and the marker says none was there before.
	marker := filepath.Join(dir, "nats", demoMarker)
	require.NoError(t, writeDemoMarker(marker, map[string]bool{}))

	s, err = startServe(dir)
	require.NoError(t, err)
	require.Contains(t, s.stderr.String(), "holds part of a demo load that did not finish")
	_, js := natstest.Connect(t, s.natsURL)
	ours := provisioner.SubjectPrefix(provisioner.BucketNeeds) + "realnode.mod.config.x"
	_, err = js.Publish(context.Background(), ours, []byte{0x80})
	require.NoError(t, err)
	require.NoError(t, s.stop())

	s, err = startServe(dir, "--demo")
	require.NoError(t, err)
	defer func() { require.NoError(t, s.stop()) }()
	require.Contains(t, s.stderr.String(), "the embedded server holds data the demo does not write since; removing nothing")
	require.NotContains(t, s.stderr.String(), "what it wrote is removed")
	_, js = natstest.Connect(t, s.natsURL)
	st, err := js.Stream(context.Background(), provisioner.StreamName(provisioner.BucketNeeds))
	require.NoError(t, err)
	_, err = st.GetLastMsgForSubject(context.Background(), ours)
	require.NoError(t, err, "the need a client wrote is kept")
	require.NoFileExists(t, marker)
}

// TestServe_DemoMarkerKeepsAClientsRepeatOfTheDemo: as above, but the client's write is one the demo
// writes too: a need put again with the value it holds (a client republishing its node's needs at
// start). A message was taken for the demo's by its subject, operation and value alone, so the next
// serve --demo deleted the streams and loaded the demo again, and the client's write was lost. The
// streams hold the demo's alone only when their messages are its ops in order: this one follows the
// demo's last, and the store is served as it is.
func TestServe_DemoMarkerKeepsAClientsRepeatOfTheDemo(t *testing.T) {
	t.Setenv("NATS_URL", "")
	dir := t.TempDir()
	s, err := startServe(dir, "--demo")
	require.NoError(t, err)
	require.NoError(t, s.stop())
	marker := filepath.Join(dir, "nats", demoMarker)
	require.NoError(t, writeDemoMarker(marker, map[string]bool{}))

	s, err = startServe(dir)
	require.NoError(t, err)
	_, js := natstest.Connect(t, s.natsURL)
	ctx := context.Background()
	st, err := js.Stream(ctx, provisioner.StreamName(provisioner.BucketNeeds))
	require.NoError(t, err)
	last, err := st.GetMsg(ctx, st.CachedInfo().State.LastSeq)
	require.NoError(t, err)
	require.Empty(t, last.Header.Get("KV-Operation"), "the demo's last need is a put")
	ack, err := js.Publish(ctx, last.Subject, last.Data) // the same need, the same value, again
	require.NoError(t, err)
	require.NoError(t, s.stop())

	s, err = startServe(dir, "--demo")
	require.NoError(t, err)
	defer func() { require.NoError(t, s.stop()) }()
	require.Contains(t, s.stderr.String(), "the embedded server holds data the demo does not write since; removing nothing")
	require.NotContains(t, s.stderr.String(), "what it wrote is removed")
	_, js = natstest.Connect(t, s.natsURL)
	st, err = js.Stream(ctx, provisioner.StreamName(provisioner.BucketNeeds))
	require.NoError(t, err)
	got, err := st.GetLastMsgForSubject(ctx, last.Subject)
	require.NoError(t, err)
	require.Equal(t, ack.Sequence, got.Sequence, "the client's write is kept, at its revision")
	require.NoFileExists(t, marker)
}
