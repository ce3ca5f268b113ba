package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/replay"
	"github.com/novox/mesh-provisioner/store"
)

// runCmd runs a command in-process and returns its output and exit code.
func runCmd(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	var out, errOut bytes.Buffer
	err := NewMain(&out, &errOut).Run(context.Background(), args)
	code := exitCode(err, &errOut)
	return out.String(), errOut.String(), code
}

func TestReplayCommand_SourcesAgree(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	url := ns.ClientURL()
	_, js := natstest.Connect(t, url)
	ctx := context.Background()
	mesh := fixtures.Mesh{Seed: 5, Nodes: 12, Modules: 3, NeedsPerModule: 2, Collections: 2, BadKeys: 1, BadValues: 1}
	ops := mesh.Ops()
	key := ops[0].Key
	for i := 0; i < 5; i++ {
		ops = append(ops, fixtures.Op{Bucket: provisioner.BucketNeeds, Key: key, Op: provisioner.OpPut, Value: []byte{byte(i)}}) // fixint i
	}
	ops = append(ops, fixtures.Op{Bucket: provisioner.BucketNeeds, Key: ops[1].Key, Op: provisioner.OpDelete})
	require.NoError(t, fixtures.Load(ctx, js, ops, 0, nil))
	st, err := js.Stream(ctx, provisioner.StreamName(provisioner.BucketNeeds))
	require.NoError(t, err)
	last := st.CachedInfo().State.LastSeq
	node := strings.SplitN(key, ".", 2)[0]

	dir := filepath.Join(t.TempDir(), "state")
	out, errOut, code := runCmd(t, "rebuild", "--nats", url, "--state", dir)
	require.Zero(t, code, errOut)
	require.Contains(t, out, "rebuilt")
	// Its start says the descriptors it may hold and its store's share of them.
	require.Contains(t, errOut, fmt.Sprintf(" nofile=%d pebble_max_open_files=%d", store.FileLimit(), store.MaxOpenFiles()))

	archive := filepath.Join(t.TempDir(), "h.mph")
	out, errOut, code = runCmd(t, "export", "--state", dir, "--out", archive)
	require.Zero(t, code, errOut)
	require.Contains(t, out, "mesh-provisioner_needs")

	// The same question from the three sources: the same answer.
	var answers []string
	for _, src := range [][]string{{"--state", dir}, {"--nats", url}, {"--archive", archive}} {
		args := append([]string{"replay", "state", "needs", "--node", node, "--at", fmt.Sprintf("seq:%d", last), "--json"}, src...)
		out, errOut, code := runCmd(t, args...)
		require.Zero(t, code, "%v: %s", src, errOut)
		answers = append(answers, out)
	}
	require.Equal(t, answers[0], answers[1], "--state and --nats")
	require.Equal(t, answers[0], answers[2], "--state and --archive")
	var a struct {
		Rows []map[string]any `json:"rows"`
		AsOf uint64           `json:"as_of"`
	}
	require.NoError(t, json.Unmarshal([]byte(answers[0]), &a))
	require.Equal(t, last, a.AsOf)
	require.NotEmpty(t, a.Rows)

	// history: all six revisions of the key written six times.
	out, errOut, code = runCmd(t, "replay", "history", "needs", key, "--state", dir, "--json")
	require.Zero(t, code, errOut)
	var h struct {
		Revisions []struct {
			Op    string          `json:"op"`
			Value json.RawMessage `json:"value"`
		} `json:"revisions"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &h))
	require.Len(t, h.Revisions, 6)
	require.JSONEq(t, "4", string(h.Revisions[5].Value))
	out, _, code = runCmd(t, "replay", "history", "mesh-provisioner_needs", key, "--state", dir)
	require.Zero(t, code)
	require.Contains(t, out, "TIME")
	require.Contains(t, out, "6 revisions of "+key)

	// diff: from before the rewrites to the end, the key changed and the deleted one is gone.
	from := last - 6
	out, errOut, code = runCmd(t, "replay", "diff", "needs", "--from", fmt.Sprintf("seq:%d", from), "--to", fmt.Sprintf("seq:%d", last), "--state", dir, "--json")
	require.Zero(t, code, errOut)
	var d struct {
		Changed []struct{ Key string } `json:"changed"`
		Removed []struct{ Key string } `json:"removed"`
		Added   []json.RawMessage      `json:"added"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &d))
	require.Len(t, d.Changed, 1)
	require.Equal(t, key, d.Changed[0].Key)
	require.Len(t, d.Removed, 1)
	require.Equal(t, ops[1].Key, d.Removed[0].Key)
	require.Empty(t, d.Added)
	out, _, code = runCmd(t, "replay", "diff", "needs", "--from", fmt.Sprintf("seq:%d", from), "--to", fmt.Sprintf("seq:%d", last), "--archive", archive)
	require.Zero(t, code)
	require.Contains(t, out, "0 added, 1 changed, 1 removed")

	// The table, as query prints it.
	out, _, code = runCmd(t, "replay", "state", "needs", "--node", node, "--at", fmt.Sprintf("seq:%d", last), "--state", dir)
	require.Zero(t, code)
	require.Contains(t, out, "NODE")
	require.Contains(t, out, fmt.Sprintf("as of sequence %d", last))
}

func TestReplayCommand_Errors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args []string
		code int
	}{
		{[]string{"replay"}, exitUsage},
		{[]string{"replay", "state", "needs"}, exitUsage},
		{[]string{"replay", "diff", "needs", "--from", "seq:1"}, exitUsage},
		{[]string{"replay", "history", "needs"}, exitUsage},
		{[]string{"replay", "history", "wants", "k", "--archive", "x"}, exitUsage},
		{[]string{"replay", "state", "needs", "--at", "seq:1", "--collection", "x"}, exitUsage},
		{[]string{"replay", "state", "needs", "--at", "seq:1", "--contributor", "x"}, exitUsage},
		{[]string{"replay", "state", "collect", "--at", "seq:1", "--module", "a", "--contributor", "b"}, exitUsage},
		{[]string{"replay", "state", "needs", "--at", "seq:1", "--state", "a", "--archive", "b"}, exitUsage},
		{[]string{"replay", "what"}, exitUsage},
		{[]string{"export"}, exitUsage},
		{[]string{"rebuild", "extra"}, exitUsage},
	} {
		_, _, code := runCmd(t, tc.args...)
		require.Equal(t, tc.code, code, "%v", tc.args)
	}
	// A --state that does not exist (a typo) is said as such, and not created; it said "holds no
	// projection yet", as if the directory were there, empty.
	dir := filepath.Join(t.TempDir(), "none")
	for _, args := range [][]string{
		{"replay", "state", "needs", "--at", "seq:1", "--state", dir},
		{"export", "--state", dir, "--out", filepath.Join(t.TempDir(), "x.mph")},
	} {
		_, errOut, code := runCmd(t, args...)
		require.Equal(t, exitFailure, code, errOut)
		require.Contains(t, errOut, dir+" does not exist", "%v", args)
		require.NoDirExists(t, dir)
	}
	require.NoError(t, os.Mkdir(dir, 0o755))
	_, errOut, code := runCmd(t, "replay", "state", "needs", "--at", "seq:1", "--state", dir)
	require.Equal(t, exitFailure, code, errOut)
	require.Contains(t, errOut, "no projection yet")

	// A first rebuild that was killed left a generation and no CURRENT: said, with what to do.
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "gen-000001"), 0o755))
	_, errOut, code = runCmd(t, "replay", "state", "needs", "--at", "seq:1", "--state", dir)
	require.Equal(t, exitFailure, code, errOut)
	require.Contains(t, errOut, "a rebuild that did not finish")
	require.Contains(t, errOut, "run mesh-provisioner rebuild again")
}

func TestReplayCommand_PointTheStreamsNoLongerHoldIs410(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	_, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.BucketNeeds, History: 1})
	require.NoError(t, err)
	k := "n1.m.config.a"
	require.NoError(t, fixtures.Load(ctx, js, []fixtures.Op{
		{Bucket: provisioner.BucketNeeds, Key: "n1.m.config.b", Op: provisioner.OpPut, Value: []byte{1}},
		{Bucket: provisioner.BucketNeeds, Key: k, Op: provisioner.OpPut, Value: []byte{1}},
		{Bucket: provisioner.BucketNeeds, Key: k, Op: provisioner.OpPut, Value: []byte{2}}, // removes seq 2
	}, 0, nil))
	_, errOut, code := runCmd(t, "replay", "state", "needs", "--at", "seq:2", "--nats", ns.ClientURL())
	require.Equal(t, exitAnswer, code, errOut)
	require.Contains(t, errOut, "410")
	require.Contains(t, errOut, "removed before they were read")
	require.Contains(t, errOut, "ask the seat's local event log", "says where the point may still be answered")
	require.Contains(t, errOut, "--state DIR")
	_, errOut, code = runCmd(t, "replay", "diff", "needs", "--from", "seq:1", "--to", "seq:2", "--nats", ns.ClientURL())
	require.Equal(t, exitAnswer, code, errOut)
	require.Contains(t, errOut, "--state DIR")
	out, errOut, code := runCmd(t, "replay", "state", "needs", "--at", "seq:1", "--nats", ns.ClientURL())
	require.Zero(t, code, errOut)
	require.Contains(t, out, "1 rows, as of sequence 1")
	out, errOut, code = runCmd(t, "replay", "state", "needs", "--at", "seq:3", "--nats", ns.ClientURL())
	require.Zero(t, code, errOut)
	require.Contains(t, out, "2 rows, as of sequence 3")
}

// replay and export --state on a broken state dir say so and what to do, and answer nothing: an empty
// answer from a generation that holds nothing would read as "the bucket was empty then".
func TestReplayCommand_BrokenStateSaysRebuild(t *testing.T) {
	t.Parallel()
	url, _ := smallMesh(t)
	for name, damage := range map[string]func(t *testing.T, dir string){
		"CURRENT names a generation that does not exist": func(t *testing.T, dir string) {
			require.NoError(t, os.WriteFile(filepath.Join(dir, "CURRENT"), []byte("gen-000042\n"), 0o644))
		},
		"CURRENT names an empty generation": func(t *testing.T, dir string) {
			require.NoError(t, os.Mkdir(filepath.Join(dir, "gen-000042"), 0o755))
			require.NoError(t, os.WriteFile(filepath.Join(dir, "CURRENT"), []byte("gen-000042\n"), 0o644))
		},
		"CURRENT is garbage": func(t *testing.T, dir string) {
			require.NoError(t, os.WriteFile(filepath.Join(dir, "CURRENT"), []byte("garbage\n"), 0o644))
		},
	} {
		t.Run(name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "state")
			_, errOut, code := runCmd(t, "rebuild", "--nats", url, "--state", dir)
			require.Zero(t, code, errOut)
			damage(t, dir)

			out, errOut, code := runCmd(t, "replay", "state", "needs", "--at", "seq:5", "--state", dir)
			require.Equal(t, exitFailure, code, "answered from a broken state dir:\n%s", out)
			require.Contains(t, errOut, "broken")
			require.Contains(t, errOut, "mesh-provisioner rebuild")

			archive := filepath.Join(t.TempDir(), "x.mph")
			_, errOut, code = runCmd(t, "export", "--state", dir, "--out", archive)
			require.Equal(t, exitFailure, code)
			require.Contains(t, errOut, "mesh-provisioner rebuild")
			require.NoFileExists(t, archive)

			left, err := filepath.Glob(filepath.Join(dir, ".replay-*"))
			require.NoError(t, err)
			require.Empty(t, left, "the private copies are removed")
		})
	}
}

// An archive holds every bucket a seat reads, each once, from either source: an archive of the seat's
// log (export --state, the one the docs say to keep before a schema change) answers plans as the log
// does, and an offline log holds all it ever will, so its plans answers are synced.
func TestExport_EveryBucketOnceFromEitherSource(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	url := ns.ClientURL()
	_, js := natstest.Connect(t, url)
	ctx := context.Background()
	sc := fixtures.Plans()
	mesh := fixtures.Mesh{Seed: 9, Nodes: 6, Modules: 2, NeedsPerModule: 2, Collections: 1}
	ops := append(append(mesh.Ops(), sc.Before...), sc.After...)
	require.NoError(t, fixtures.Load(ctx, js, ops, 0, nil))
	_, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.BucketRegistry}) // as serve would
	require.NoError(t, err)
	var streams []string
	for name := range js.StreamNames(ctx).Name() {
		streams = append(streams, strings.TrimPrefix(name, "KV_"))
	}
	sort.Strings(streams)

	dir := filepath.Join(t.TempDir(), "state")
	_, errOut, code := runCmd(t, "rebuild", "--nats", url, "--state", dir)
	require.Zero(t, code, errOut)
	fromState := filepath.Join(t.TempDir(), "state.mph")
	fromNATS := filepath.Join(t.TempDir(), "nats.mph")
	_, errOut, code = runCmd(t, "export", "--state", dir, "--out", fromState)
	require.Zero(t, code, errOut)
	out, errOut, code := runCmd(t, "export", "--nats", url, "--out", fromNATS)
	require.Zero(t, code, errOut)
	for _, b := range streams {
		require.Equal(t, 1, strings.Count(out, b+" "), "export lists %s once:\n%s", b, out)
	}
	for _, archive := range []string{fromState, fromNATS} {
		h, err := replay.ReadArchiveHeader(archive)
		require.NoError(t, err)
		var names []string
		for _, b := range h.Buckets {
			names = append(names, b.Name)
		}
		sort.Strings(names)
		require.Equal(t, streams, names, "%s holds every bucket once", archive)
	}

	at := time.Now().UTC().Format(time.RFC3339Nano)
	var answers []string
	for _, src := range [][]string{{"--state", dir}, {"--nats", url}, {"--archive", fromState}, {"--archive", fromNATS}} {
		out, errOut, code := runCmd(t, append([]string{"replay", "state", "plans", "--at", at, "--json"}, src...)...)
		require.Zero(t, code, "%v: %s", src, errOut)
		var a struct {
			Rows   []json.RawMessage `json:"rows"`
			Synced bool              `json:"synced"`
		}
		require.NoError(t, json.Unmarshal([]byte(out), &a))
		require.NotEmpty(t, a.Rows, "%v answers the plans", src)
		require.True(t, a.Synced, "%v: an offline log is not catching up", src)
		answers = append(answers, out)
	}
	for i := range answers[1:] {
		require.Equal(t, answers[0], answers[i+1], "source %d answers as --state", i+1)
	}
}

// A wrong point is a wrong command line: said at once, before a source is read (reading the streams
// or an archive of a large mesh takes minutes), with exit 2, alike for state and diff. The source here
// is a NATS server that is not there: reaching it would fail with exit 1.
func TestReplayCommand_PointsAreCheckedBeforeTheSourceIsRead(t *testing.T) {
	t.Parallel()
	gone := []string{"--nats", "nats://127.0.0.1:1"}
	for _, tc := range []struct {
		args []string
		says string
	}{
		{[]string{"replay", "state", "needs", "--at", "seq:"}, "--at"},
		{[]string{"replay", "state", "needs", "--at", "yesterday"}, "--at"},
		{[]string{"replay", "state", "needs", "--at", "seq:-1"}, "--at"},
		{[]string{"replay", "state", "plans", "--at", "seq:5"}, "RFC 3339 time"},
		{[]string{"replay", "diff", "needs", "--from", "seq:x", "--to", "seq:5"}, "--from"},
		{[]string{"replay", "diff", "needs", "--from", "seq:1", "--to", "2026-13-01T00:00:00Z"}, "--to"},
		{[]string{"replay", "diff", "needs", "--from", "seq:9", "--to", "seq:5"}, "--from seq:9 is after --to seq:5"},
		{[]string{"replay", "diff", "needs", "--from", "2026-11-02T10:00:00Z", "--to", "2026-11-02T09:00:00Z"}, "is after --to"},
	} {
		t.Run(strings.Join(tc.args[1:], " "), func(t *testing.T) {
			_, errOut, code := runCmd(t, append(tc.args, gone...)...)
			require.Equal(t, exitUsage, code, errOut)
			require.Contains(t, errOut, tc.says)
		})
	}
}

// diff with --from after --to would list every row added since as removed: refused, also when the two
// points are of different kinds and only the log can order them.
func TestReplayCommand_DiffFromAfterToIsRefused(t *testing.T) {
	t.Parallel()
	url, last := smallMesh(t)
	dir := filepath.Join(t.TempDir(), "state")
	_, errOut, code := runCmd(t, "rebuild", "--nats", url, "--state", dir)
	require.Zero(t, code, errOut)
	later := time.Now().UTC().Format(time.RFC3339Nano)
	out, errOut, code := runCmd(t, "replay", "diff", "needs", "--from", later, "--to", "seq:1", "--state", dir)
	require.Equal(t, exitUsage, code, out)
	require.Contains(t, errOut, fmt.Sprintf("as of sequence %d", last[provisioner.BucketNeeds]))
	require.Contains(t, errOut, "is after --to seq:1")
	// The same points the right way round, and a point with itself, are answered.
	out, errOut, code = runCmd(t, "replay", "diff", "needs", "--from", "seq:1", "--to", later, "--state", dir)
	require.Zero(t, code, errOut)
	require.NotContains(t, out, " removed\t")
	out, errOut, code = runCmd(t, "replay", "diff", "needs", "--from", later, "--to", later, "--state", dir)
	require.Zero(t, code, errOut)
	require.Contains(t, out, "no changes")
}

// A flag the question does not read is refused, not ignored: `history --at` would otherwise list every
// revision, past the point asked.
func TestReplayCommand_FlagsTheQuestionDoesNotRead(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "none")
	for _, tc := range []struct {
		args []string
		flag string
	}{
		{[]string{"replay", "history", "needs", "n1.m.config.a", "--at", "seq:3"}, "--at"},
		{[]string{"replay", "history", "needs", "n1.m.config.a", "--from", "seq:1", "--to", "seq:3"}, "--from, --to"},
		{[]string{"replay", "history", "needs", "n1.m.config.a", "--node", "n1"}, "--node"},
		{[]string{"replay", "state", "needs", "--at", "seq:1", "--to", "seq:3"}, "--to"},
		{[]string{"replay", "diff", "needs", "--from", "seq:1", "--to", "seq:3", "--at", "seq:2"}, "--at"},
	} {
		_, errOut, code := runCmd(t, append(tc.args, "--state", dir)...)
		require.Equal(t, exitUsage, code, "%v: %s", tc.args, errOut)
		require.Contains(t, errOut, "does not read "+tc.flag, tc.args)
	}
	// What each question reads is still taken: these reach the source (none here) and fail there.
	for _, args := range [][]string{
		{"replay", "history", "needs", "n1.m.config.a", "--json"},
		{"replay", "state", "needs", "--at", "seq:1", "--node", "n1", "--module", "m", "--kind", "config"},
		{"replay", "diff", "collect", "--from", "seq:1", "--to", "seq:3", "--collection", "c", "--contributor", "m"},
	} {
		_, errOut, code := runCmd(t, append(args, "--state", dir)...)
		require.Equal(t, exitFailure, code, "%v: %s", args, errOut)
		require.Contains(t, errOut, dir+" does not exist", args)
	}
}

// One source at a time: a --nats given on the command line beside --state or --archive is not
// dropped without a word (NATS_URL in the environment, as the runbook sets it, is no choice).
func TestReplayCommand_OneSource(t *testing.T) {
	dir := t.TempDir()
	for _, args := range [][]string{
		{"replay", "state", "needs", "--at", "seq:1", "--state", dir, "--nats", "nats://127.0.0.1:1"},
		{"replay", "history", "needs", "n1.m.config.a", "--archive", "x.mph", "--nats", "nats://127.0.0.1:1"},
		{"export", "--state", dir, "--nats", "nats://127.0.0.1:1", "--out", filepath.Join(dir, "x.mph")},
	} {
		_, errOut, code := runCmd(t, args...)
		require.Equal(t, exitUsage, code, "%v: %s", args, errOut)
		require.Contains(t, errOut, "one source", args)
	}
	t.Setenv("NATS_URL", "nats://127.0.0.1:1")
	_, errOut, code := runCmd(t, "replay", "state", "needs", "--at", "seq:1", "--state", filepath.Join(dir, "none"))
	require.Equal(t, exitFailure, code)
	require.Contains(t, errOut, filepath.Join(dir, "none")+" does not exist", "--state is read, NATS_URL is not a second source")
}

// export --out is checked before anything is read: an archive already there is evidence and is not
// replaced without --force, and a directory or a missing parent is said at once rather than after
// the whole export (a directory failed at the final rename, naming a temporary file in its parent).
func TestExport_OutIsCheckedFirstAndNeverReplacedUnasked(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	kept := filepath.Join(dir, "incident.mph")
	require.NoError(t, os.WriteFile(kept, []byte("evidence"), 0o600))
	gone := []string{"--nats", "nats://127.0.0.1:1"}
	// A state dir: everything in it is the program's, and a rebuild or an operator deleting it would
	// take the archive along.
	state := filepath.Join(t.TempDir(), "state")
	db, err := store.OpenState(state, store.Options{})
	require.NoError(t, err)
	require.NoError(t, db.Close())
	gens, err := filepath.Glob(filepath.Join(state, "gen-*"))
	require.NoError(t, err)
	require.NotEmpty(t, gens)
	for _, tc := range []struct {
		out, says string
	}{
		{kept, "exists"},
		{dir, "is a directory"},
		{filepath.Join(dir, "no", "such", "x.mph"), "does not exist"},
		{filepath.Join(state, "backup.mph"), "inside the state dir"},
		{filepath.Join(gens[0], "backup.mph"), "inside the state dir " + state},
	} {
		_, errOut, code := runCmd(t, append([]string{"export", "--out", tc.out}, gone...)...)
		require.Equal(t, exitUsage, code, "%s: %s", tc.out, errOut)
		require.Contains(t, errOut, tc.says)
	}
	b, err := os.ReadFile(kept)
	require.NoError(t, err)
	require.Equal(t, "evidence", string(b))
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Len(t, entries, 1, "nothing left beside the archive")

	url, _ := smallMesh(t)
	_, errOut, code := runCmd(t, "export", "--nats", url, "--out", kept)
	require.Equal(t, exitUsage, code, errOut)
	out, errOut, code := runCmd(t, "export", "--nats", url, "--out", kept, "--force")
	require.Zero(t, code, errOut)
	require.Contains(t, out, "wrote "+kept)
	h, err := replay.ReadArchiveHeader(kept)
	require.NoError(t, err)
	require.Equal(t, replay.ArchiveFormat, h.Format)
}

// replay history reads one raw key, as written; a collect key written with
// its decoded collection name, or with lower-case escapes, is not the raw key either: the answer is
// still that the log holds no revision of it, but it names the raw key that has them.
func TestReplayCommand_HistoryOfAKeyAsAnOperatorWritesIt(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	url := ns.ClientURL()
	_, js := natstest.Connect(t, url)
	ctx := context.Background()
	raw := "n1.shell=3Azsh=3Anormal.mod-a"
	require.NoError(t, fixtures.Load(ctx, js, []fixtures.Op{
		{Bucket: provisioner.BucketCollect, Key: raw, Op: provisioner.OpPut, Value: []byte{1}},
		{Bucket: provisioner.BucketCollect, Key: "n1.a=2Eb.mod-a", Op: provisioner.OpPut, Value: []byte{2}},
		{Bucket: provisioner.BucketNeeds, Key: "n1.m.config.a", Op: provisioner.OpPut, Value: []byte{3}},
	}, 0, nil))
	dir := filepath.Join(t.TempDir(), "state")
	_, errOut, code := runCmd(t, "rebuild", "--nats", url, "--state", dir)
	require.Zero(t, code, errOut)

	out, errOut, code := runCmd(t, "replay", "history", "collect", raw, "--state", dir)
	require.Zero(t, code, errOut)
	require.Contains(t, out, "1 revisions of "+raw)

	for key, want := range map[string]string{
		"n1.shell:zsh:normal.mod-a":     raw,
		"n1.shell=3azsh=3anormal.mod-a": raw,
		"n1.a.b.mod-a":                  "n1.a=2Eb.mod-a", // a collection with a dot
	} {
		out, errOut, code := runCmd(t, "replay", "history", "collect", key, "--state", dir)
		require.Equal(t, exitAnswer, code, "%s answered:\n%s", key, out)
		require.Contains(t, errOut, "404")
		require.Contains(t, errOut, "did you mean "+want, key)
	}
	// A key that is not there at all says so, with no suggestion.
	_, errOut, code = runCmd(t, "replay", "history", "collect", "n1.nothing.mod-a", "--state", dir)
	require.Equal(t, exitAnswer, code)
	require.NotContains(t, errOut, "did you mean")

	// A wildcard is read as written (TestReplayCommand_HistoryOfAKeyWithAWildcardToken); none was
	// published here, and the answer points at state --node.
	for _, key := range []string{"n1.>", "n1.*.config.a", "*"} {
		_, errOut, code := runCmd(t, "replay", "history", "needs", key, "--state", dir)
		require.Equal(t, exitAnswer, code, "%q: %s", key, errOut)
		require.Contains(t, errOut, "replay state needs --node")
	}
	_, errOut, code = runCmd(t, "replay", "history", "needs", "", "--state", dir)
	require.Equal(t, exitUsage, code, errOut)
}

// A message published by hand on a subject with a wildcard token is stored as published (NATS takes
// it, and its rollup removes the keys it matches): the seat answers it as an anomaly row whose key is
// `n1.>`, and replay history of that key lists it, as of every other key it names in an anomaly row.
// It was refused at once as "a wildcard", so the one message that wiped a node could not be looked at.
func TestReplayCommand_HistoryOfAKeyWithAWildcardToken(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	url := ns.ClientURL()
	_, js := natstest.Connect(t, url)
	ctx := context.Background()
	require.NoError(t, fixtures.Load(ctx, js, []fixtures.Op{
		{Bucket: provisioner.BucketNeeds, Key: "n1.m.config.a", Op: provisioner.OpPut, Value: []byte{1}},
		{Bucket: provisioner.BucketNeeds, Key: "n2.m.config.a", Op: provisioner.OpPut, Value: []byte{2}},
	}, 0, nil))
	wipe := nats.NewMsg(provisioner.SubjectPrefix(provisioner.BucketNeeds) + "n1.>")
	wipe.Header.Set("Nats-Rollup", "sub")
	wipe.Data = []byte{3}
	_, err := js.PublishMsg(ctx, wipe)
	require.NoError(t, err)
	dir := filepath.Join(t.TempDir(), "state")
	_, errOut, code := runCmd(t, "rebuild", "--nats", url, "--state", dir)
	require.Zero(t, code, errOut)

	// The anomaly row names the key.
	out, errOut, code := runCmd(t, "replay", "state", "needs", "--at", "seq:3", "--state", dir, "--json")
	require.Zero(t, code, errOut)
	require.Contains(t, out, `"key":"n1.>"`)
	for _, src := range [][]string{{"--state", dir}, {"--nats", url}} {
		out, errOut, code = runCmd(t, append([]string{"replay", "history", "needs", "n1.>", "--json"}, src...)...)
		require.Zero(t, code, "%v: %s", src, errOut)
		require.Contains(t, out, `"revision":3`, src)
	}
	// A wildcard key the log holds no revision of is a 404 that points at state --node.
	_, errOut, code = runCmd(t, "replay", "history", "needs", "n2.>", "--state", dir)
	require.Equal(t, exitAnswer, code, errOut)
	require.Contains(t, errOut, "replay state needs --node")
}

// TestReplay_ReadsOnlyTheBucketsItAsks: replay from the streams or an archive reads the buckets its
// question reads (a history its key's bucket; a state or diff its bucket, and the registry for
// needs), not every bucket of the mesh: a key's history cost every message of every bucket,
// thousands of composed-<node> streams included. A user denied the other buckets' consumers is
// answered; a question about those buckets still stops at the refusal.
func TestReplay_ReadsOnlyTheBucketsItAsks(t *testing.T) {
	for _, env := range []string{"NATS_URL", "NATS_USER", "NATS_PASSWORD", "NATS_CREDS", "NATS_INBOX_PREFIX"} {
		t.Setenv(env, "")
	}
	ns := natstest.RunServerSeatDenied(t, "$JS.API.CONSUMER.CREATE.KV_mesh-provisioner_applied.>",
		"$JS.API.CONSUMER.CREATE.KV_mesh-provisioner_collect.>", "$JS.API.CONSUMER.CREATE.KV_composed-n00000.>")
	url := ns.ClientURL()
	ctx := context.Background()
	_, admin := natstest.Connect(t, url, nats.UserInfo("admin", "admin"))
	var ops []fixtures.Op
	for _, e := range provisioner.Registry.Entries {
		ops = append(ops, fixtures.Op{Bucket: provisioner.BucketRegistry, Key: e.Kind, Op: provisioner.OpPut, Value: e.Value()})
	}
	mesh := fixtures.Mesh{Seed: 7, Nodes: 3, Modules: 2, NeedsPerModule: 2, Collections: 1}
	ops = append(ops, mesh.Ops()...)
	ops = append(ops, fixtures.Op{Bucket: provisioner.ComposedPrefix + "n00000", Key: "mod-000.7", Op: provisioner.OpPut, Value: []byte{0x81, 0xa6, 's', 't', 'a', 't', 'u', 's', 0xa7, 'p', 'e', 'n', 'd', 'i', 'n', 'g'}})
	require.NoError(t, fixtures.Load(ctx, admin, ops, 0, nil))
	needs := mesh.OpsOf(provisioner.BucketNeeds)
	key := needs[0].Key
	seat := []string{"--nats", url, "--user", "seat", "--password", "seat"}

	for _, args := range [][]string{
		{"replay", "history", "needs", key},
		{"replay", "state", "needs", "--at", "seq:1000"},
		{"replay", "diff", "needs", "--from", "seq:0", "--to", "seq:1000"},
	} {
		code, stdout, stderr := run(t, append(args, append(seat, "--json")...)...)
		require.Equal(t, 0, code, "%v: %s", args, stderr)
		require.Contains(t, stdout, `"key":"`+key+`"`, "%v", args)
		require.NotContains(t, stdout, "unanswered-kind", "%v: the registry is read for needs", args)
	}
	code, _, stderr := run(t, append([]string{"replay", "state", "applied", "--at", "seq:1000"}, seat...)...)
	require.Equal(t, exitFailure, code, stderr)
	require.Contains(t, stderr, "KV_mesh-provisioner_applied", "a question about a denied bucket stops at the refusal")

	// An archive: the records of the other buckets are read past, not applied.
	archive := filepath.Join(t.TempDir(), "a.mph")
	code, _, stderr = run(t, "export", "--nats", url, "--user", "admin", "--password", "admin", "--out", archive)
	require.Equal(t, 0, code, stderr)
	c := &ReplayCommand{Stdout: io.Discard, Stderr: io.Discard, archive: archive}
	l, err := c.open(ctx, questionBuckets("history", "", []string{provisioner.BucketNeeds, key}))
	require.NoError(t, err)
	defer l.Close()
	seq, _ := l.DB.Applied(provisioner.BucketNeeds)
	require.EqualValues(t, len(needs), seq)
	for _, b := range []string{provisioner.BucketApplied, provisioner.BucketCollect, provisioner.BucketRegistry, provisioner.ComposedPrefix + "n00000"} {
		seq, _ := l.DB.Applied(b)
		require.Zero(t, seq, "%s applied for a history of needs", b)
	}
	h, err := l.History(provisioner.BucketNeeds, key)
	require.NoError(t, err)
	require.Len(t, h.Revisions, 1)
}

// TestOneShot_ProgressWithoutATerminal: export and replay from the streams or an archive say how far
// they are on a stderr that is no terminal, as rebuild does: they drew their progress on a terminal
// only, so run by a script, through kubectl exec or with stderr redirected, they said nothing for
// the minutes a large mesh takes. (The lines come every 5 s; here at every report.)
func TestOneShot_ProgressWithoutATerminal(t *testing.T) {
	t.Setenv("NATS_URL", "")
	defer func(d time.Duration) { progressEvery = d }(progressEvery)
	progressEvery = time.Nanosecond
	ns := natstest.RunServer(t)
	url := ns.ClientURL()
	_, js := natstest.Connect(t, url)
	mesh := fixtures.Mesh{Seed: 3, Nodes: 100, Modules: 10, NeedsPerModule: 10}
	require.NoError(t, fixtures.Load(context.Background(), js, mesh.Ops(), 0, nil))
	archive := filepath.Join(t.TempDir(), "a.mph")
	for _, c := range []struct {
		args  []string
		label string
	}{
		{[]string{"export", "--nats", url, "--out", archive}, "export ["},
		{[]string{"replay", "state", "needs", "--at", "seq:1", "--archive", archive}, "reading archive ["},
		{[]string{"replay", "state", "needs", "--at", "seq:1", "--nats", url}, "reading streams ["},
	} {
		code, _, stderr := run(t, c.args...)
		require.Equal(t, 0, code, "%v: %s", c.args, stderr)
		var during int
		for _, line := range strings.Split(stderr, "\n") {
			if strings.Contains(line, c.label) && !strings.Contains(line, " in ") {
				during++ // a line before the last, which says how long it took
			}
		}
		require.Positive(t, during, "%v: no progress before the end:\n%s", c.args, stderr)
	}
}

// TestReplay_QuestionBucketsAnswerAsEveryBucket: a question asked of a log read with only the buckets
// questionBuckets names answers exactly as one read with every bucket: states of each bucket at
// sequences and times, narrowed by node, across unanswered kinds that a registry write clears, deletes
// and a rollup (purge), and every key's history.
func TestReplay_QuestionBucketsAnswerAsEveryBucket(t *testing.T) {
	t.Setenv("NATS_URL", "")
	ns := natstest.RunServer(t)
	url := ns.ClientURL()
	ctx := context.Background()
	_, js := natstest.Connect(t, url)
	var ops []fixtures.Op
	for _, e := range provisioner.Registry.Entries[1:] { // the first kind unanswered until later
		ops = append(ops, fixtures.Op{Bucket: provisioner.BucketRegistry, Key: e.Kind, Op: provisioner.OpPut, Value: e.Value()})
	}
	mesh := fixtures.Mesh{Seed: 5, Nodes: 6, Modules: 3, NeedsPerModule: 3, Collections: 2, BadKeys: 2, BadValues: 1}
	ops = append(ops, mesh.Ops()...)
	first := provisioner.Registry.Entries[0]
	ops = append(ops,
		fixtures.Op{Bucket: provisioner.BucketNeeds, Key: "n-x.mod." + first.Kind + ".a", Op: provisioner.OpPut, Value: []byte{0x01}},
		fixtures.Op{Bucket: provisioner.BucketNeeds, Key: "n-x.mod." + first.Kind + ".c", Op: provisioner.OpPut, Value: []byte{0x03}},
	)
	// Loaded one after the other: the registry's write comes after those needs and before the next.
	for _, batch := range [][]fixtures.Op{ops,
		{{Bucket: provisioner.BucketRegistry, Key: first.Kind, Op: provisioner.OpPut, Value: first.Value()}},
		{
			{Bucket: provisioner.BucketNeeds, Key: "n-x.mod." + first.Kind + ".b", Op: provisioner.OpPut, Value: []byte{0x02}},
			{Bucket: provisioner.BucketNeeds, Key: "n-x.mod." + first.Kind + ".a", Op: provisioner.OpDelete},
			{Bucket: provisioner.BucketApplied, Key: "n-x.mod", Op: provisioner.OpPut, Value: []byte{0x01}},
			{Bucket: provisioner.BucketApplied, Key: "n-x.mod", Op: provisioner.OpPurge},
		},
	} {
		require.NoError(t, fixtures.Load(ctx, js, batch, 0, nil))
	}
	archive := filepath.Join(t.TempDir(), "a.mph")
	code, _, stderr := run(t, "export", "--nats", url, "--out", archive)
	require.Equal(t, 0, code, stderr)

	unanswered := 0
	for _, src := range []struct {
		name string
		c    *ReplayCommand
	}{
		{"archive", &ReplayCommand{Stdout: io.Discard, Stderr: io.Discard, archive: archive}},
		{"nats", &ReplayCommand{Stdout: io.Discard, Stderr: io.Discard, nats: natsFlags{url: url}}},
	} {
		all, err := src.c.open(ctx, nil)
		require.NoError(t, err, src.name)
		defer all.Close()
		for _, what := range []string{"registry", "needs", "applied", "collect"} {
			shape, _ := provisioner.ShapeOfWhat(provisioner.What(what))
			some, err := src.c.open(ctx, questionBuckets("state", what, []string{what}))
			require.NoError(t, err, src.name)
			last, _ := all.DB.Applied(shape.Bucket)
			var points []string
			for seq := uint64(0); seq <= last+1; seq++ {
				points = append(points, fmt.Sprintf("seq:%d", seq))
			}
			for _, tm := range []time.Time{time.Now().Add(-time.Hour), time.Now().Add(time.Hour)} {
				points = append(points, tm.UTC().Format(time.RFC3339Nano))
			}
			for _, at := range points {
				for _, node := range []string{"", "n-x", "n00001"} {
					if what == "registry" && node != "" {
						continue
					}
					body := fmt.Sprintf(`{"what":%q,"at":%q,"node":%q}`, what, at, node)
					want, werr := all.Ask([]byte(body))
					got, gerr := some.Ask([]byte(body))
					require.Equal(t, werr, gerr, "%s %s", src.name, body)
					require.Equal(t, string(want), string(got), "%s %s", src.name, body)
					if what == "needs" && node == "n-x" && strings.Contains(string(want), "unanswered-kind") {
						unanswered++
					}
				}
			}
			require.NoError(t, some.Close())
		}
		for _, b := range []string{provisioner.BucketNeeds, provisioner.BucketRegistry, provisioner.BucketApplied} {
			some, err := src.c.open(ctx, questionBuckets("history", "", []string{b}))
			require.NoError(t, err, src.name)
			for _, key := range []string{"n-x.mod." + first.Kind + ".a", first.Kind, "n-x.mod"} {
				want, werr := all.History(b, key)
				got, gerr := some.History(b, key)
				require.Equal(t, werr, gerr, "%s %s %s", src.name, b, key)
				require.Equal(t, want, got, "%s %s %s", src.name, b, key)
			}
			require.NoError(t, some.Close())
		}
	}
	require.Positive(t, unanswered, "no state of n-x's needs carried the kind unanswered before the registry answered it")
}

// TestReplayCommand_KilledReadersCopyIsRemoved: the copy of the state dir a replay or export --state
// reads from (.replay-* in the state dir) is removed by the next replay, and by serve's start, once
// the reader that made it is gone (killed by a second Ctrl-C, a kill, an OOM, before it removed it),
// never while it runs. Left, each such copy kept hard links to tables the seat later compacted away,
// and copies of its WALs, on the state dir's disk for good.
func TestReplayCommand_KilledReadersCopyIsRemoved(t *testing.T) {
	t.Parallel()
	url, _ := smallMesh(t)
	dir := filepath.Join(t.TempDir(), "state")
	_, errOut, code := runCmd(t, "rebuild", "--nats", url, "--state", dir)
	require.Zero(t, code, errOut)
	killed := func() string {
		d, err := os.MkdirTemp(dir, ".replay-")
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(d, "000004.log"), []byte("a WAL copied"), 0o644))
		return d
	}
	// A reader still running holds its copy (another process's flock; here another descriptor's).
	running, err := os.MkdirTemp(dir, ".replay-")
	require.NoError(t, err)
	f, err := os.Open(running)
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB))

	stale := killed()
	out, errOut, code := runCmd(t, "replay", "state", "needs", "--at", "seq:1", "--state", dir)
	require.Zero(t, code, errOut)
	require.Contains(t, out, "as of sequence 1")
	require.NoDirExists(t, stale, "a killed reader's copy")
	require.DirExists(t, running, "a running reader's copy")
	copies, err := filepath.Glob(filepath.Join(dir, ".replay-*"))
	require.NoError(t, err)
	require.Equal(t, []string{running}, copies, "replay removed its own copy")

	stale = killed()
	code, stderr := serveOnce(t, "--state", dir, "--nats", url)
	require.Equal(t, exitOK, code, stderr)
	require.NoDirExists(t, stale, "serve's start removes it too")
	require.DirExists(t, running)
}

// TestReplayCommand_HistoryFromTheStreamsReadsTheKeyAlone: replay history --nats read the whole
// stream into a temporary store to print one key (16 s and 500 MB of temporary disk at a million
// needs keys, docs/performance.md "Session 12"). It now reads the key's own subject, and the stream's
// sequences (headers only) once some were removed, and answers what an archive of the streams does.
func TestReplayCommand_HistoryFromTheStreamsReadsTheKeyAlone(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	url := ns.ClientURL()
	nc, js := natstest.Connect(t, url)
	ctx := context.Background()
	mesh := fixtures.Mesh{Seed: 7, Nodes: 20, Modules: 3, NeedsPerModule: 3, Collections: 1}
	ops := mesh.OpsOf(provisioner.BucketNeeds)
	key := ops[len(ops)/2].Key
	for i := 0; i < 2; i++ {
		ops = append(ops, fixtures.Op{Bucket: provisioner.BucketNeeds, Key: key, Op: provisioner.OpPut, Value: []byte{byte(i)}})
	}
	require.NoError(t, fixtures.Load(ctx, js, ops, 0, nil))

	var mu sync.Mutex
	var creates []string
	sub, err := nc.Subscribe("$JS.API.CONSUMER.CREATE.>", func(m *nats.Msg) {
		mu.Lock()
		creates = append(creates, m.Subject)
		mu.Unlock()
	})
	require.NoError(t, err)
	require.NoError(t, nc.Flush())
	history := func(src ...string) string {
		t.Helper()
		out, errOut, code := runCmd(t, append([]string{"replay", "history", "needs", key, "--json"}, src...)...)
		require.Zero(t, code, errOut)
		return out
	}
	archive := func() string {
		t.Helper()
		path := filepath.Join(t.TempDir(), "nats.mph")
		_, errOut, code := runCmd(t, "export", "--nats", url, "--out", path)
		require.Zero(t, code, errOut)
		return path
	}

	// Nothing removed from the stream: one consumer, on the key's subject.
	out := history("--nats", url)
	var got []string
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		mu.Lock()
		defer mu.Unlock()
		if len(creates) == 0 {
			return fmt.Errorf("no consumer creation seen yet")
		}
		got = creates
		return nil
	})
	stream := provisioner.StreamName(provisioner.BucketNeeds)
	require.Len(t, got, 1, "%v", got)
	require.True(t, strings.HasPrefix(got[0], "$JS.API.CONSUMER.CREATE."+stream+".") &&
		strings.HasSuffix(got[0], "."+provisioner.SubjectPrefix(provisioner.BucketNeeds)+key), "a consumer of the key alone: %s", got[0])
	var h struct {
		Revisions []json.RawMessage `json:"revisions"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &h))
	require.Len(t, h.Revisions, 3)
	require.Equal(t, history("--archive", archive()), out)

	// The key's oldest revisions removed by the bucket's history limit (8): a gap, as the archive of
	// the streams says it, and the revisions the stream keeps.
	ops = nil
	for i := 0; i < 12; i++ {
		ops = append(ops, fixtures.Op{Bucket: provisioner.BucketNeeds, Key: key, Op: provisioner.OpPut, Value: []byte{byte(i)}})
	}
	ops = append(ops, fixtures.Op{Bucket: provisioner.BucketNeeds, Key: mesh.OpsOf(provisioner.BucketNeeds)[0].Key, Op: provisioner.OpPurge})
	require.NoError(t, fixtures.Load(ctx, js, ops, 0, nil))
	out = history("--nats", url)
	require.Contains(t, out, `"gaps":[{`)
	require.Equal(t, history("--archive", archive()), out)
	require.NoError(t, sub.Unsubscribe())
}

// TestReplayCommand_HistoryFromTheStreamsOfAKeyNoFilterNamesAlone: the server stores a message on a
// subject that nats.go or the server refuse as a consumer's filter (`n1.>.x`, a `>` inside a token), or
// that a filter reads as a pattern; the seat names each in an anomaly row. replay history --nats of
// such a key failed ("create consumer: nats: invalid subject name"), and one with an empty token, a
// typo, failed with "no responders": each now answers what the archive of the streams does.
func TestReplayCommand_HistoryFromTheStreamsOfAKeyNoFilterNamesAlone(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	url := ns.ClientURL()
	_, js := natstest.Connect(t, url)
	ctx := context.Background()
	b := provisioner.BucketNeeds
	require.NoError(t, fixtures.CreateBuckets(ctx, js, b))
	stored := []string{"n1.>.x", "n1.m>.config.a", "n1.m.config.a>", "n1.m.config.*", "n1.m.config.b"}
	for i := 0; i < 2; i++ {
		for _, k := range stored {
			_, err := js.Publish(ctx, provisioner.SubjectPrefix(b)+k, []byte{byte(i)})
			require.NoError(t, err, k)
		}
	}
	path := filepath.Join(t.TempDir(), "nats.mph")
	_, errOut, code := runCmd(t, "export", "--nats", url, "--out", path)
	require.Zero(t, code, errOut)
	for _, k := range append(stored, "n1..config.b", "n1.m.config.b.") {
		out, errOut, code := runCmd(t, "replay", "history", "needs", k, "--json", "--nats", url)
		wantOut, wantErr, wantCode := runCmd(t, "replay", "history", "needs", k, "--json", "--archive", path)
		require.Equal(t, wantCode, code, "%s: %s", k, errOut)
		require.Equal(t, wantOut, out, k)
		if slices.Contains(stored, k) {
			require.Zero(t, code, "%s: %s", k, errOut)
			require.Contains(t, out, `"revision":`, k)
		} else {
			require.Equal(t, exitAnswer, code, "%s: %s", k, errOut)
			require.Contains(t, wantErr, "404: the log holds no revision of "+k)
			require.Contains(t, errOut, "404: the log holds no revision of "+k)
		}
	}
}

// TestReplayCommand_HistoryFromTheStreamsWhoseLastMessageWasRemoved: the last message of a stream,
// removed before it was read (its subject purged), may have been a revision of the key asked: the
// archive of the streams says so with a gap open from there, and replay history --nats said nothing
// of it ("0 revisions", no gap). It now reads the stream's end as the archive does.
func TestReplayCommand_HistoryFromTheStreamsWhoseLastMessageWasRemoved(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	url := ns.ClientURL()
	_, js := natstest.Connect(t, url)
	ctx := context.Background()
	b := provisioner.BucketNeeds
	keys := []string{"n1.m.config.a", "n1.m.config.b", "n1.m.config.c"}
	var ops []fixtures.Op
	for _, k := range keys {
		ops = append(ops, fixtures.Op{Bucket: b, Key: k, Op: provisioner.OpPut, Value: []byte{1}})
	}
	require.NoError(t, fixtures.Load(ctx, js, ops, 0, nil))
	s, err := js.Stream(ctx, provisioner.StreamName(b))
	require.NoError(t, err)
	require.NoError(t, s.Purge(ctx, jetstream.WithPurgeSubject(provisioner.SubjectPrefix(b)+keys[2])))
	path := filepath.Join(t.TempDir(), "nats.mph")
	_, errOut, code := runCmd(t, "export", "--nats", url, "--out", path)
	require.Zero(t, code, errOut)
	for _, k := range keys {
		out, errOut, code := runCmd(t, "replay", "history", "needs", k, "--json", "--nats", url)
		wantOut, wantErr, wantCode := runCmd(t, "replay", "history", "needs", k, "--json", "--archive", path)
		require.Equal(t, wantCode, code, "%s: %s / %s", k, errOut, wantErr)
		require.Equal(t, wantOut, out, k)
		require.Contains(t, out, `"gaps":[{"from":3}]`, k)
	}
	out, _, _ := runCmd(t, "replay", "history", "needs", keys[2], "--nats", url)
	require.Contains(t, out, "messages from sequence 3 to 3 were removed from the stream before the seat read them")
}

// TestReplayCommand_HistoryFromTheStreamsSuggestsKeysNearIt: a history of a key the stream holds no
// revision of suggests the keys like it, asking the stream only for the subjects around the key (its
// node and module, its node, the same key on other nodes), never for every key of the bucket, so that a
// bucket of millions of keys answers as fast as a small one.
func TestReplayCommand_HistoryFromTheStreamsSuggestsKeysNearIt(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	url := ns.ClientURL()
	nc, js := natstest.Connect(t, url)
	ctx := context.Background()
	ops := []fixtures.Op{}
	for _, k := range []string{"n1.mod-web.config.port", "n1.mod-web.config.host", "n1.mod-db.config.port", "n2.mod-web.config.port"} {
		ops = append(ops, fixtures.Op{Bucket: provisioner.BucketNeeds, Key: k, Op: provisioner.OpPut, Value: []byte{1}})
	}
	for i := 0; i < 200; i++ {
		ops = append(ops, fixtures.Op{Bucket: provisioner.BucketNeeds, Key: fmt.Sprintf("m%d.mod-x.config.k%d", i%50, i), Op: provisioner.OpPut, Value: []byte{2}})
	}
	require.NoError(t, fixtures.Load(ctx, js, ops, 0, nil))

	stream := provisioner.StreamName(provisioner.BucketNeeds)
	prefix := provisioner.SubjectPrefix(provisioner.BucketNeeds)
	var mu sync.Mutex
	var filters []string
	sub, err := nc.Subscribe("$JS.API.STREAM.INFO."+stream, func(m *nats.Msg) {
		var req struct {
			Filter string `json:"subjects_filter"`
		}
		_ = json.Unmarshal(m.Data, &req)
		mu.Lock()
		filters = append(filters, req.Filter)
		mu.Unlock()
	})
	require.NoError(t, err)
	require.NoError(t, nc.Flush())

	for _, tc := range []struct {
		key     string
		want    []string // the suggestion, in order
		filters []string // the filters asked, without the prefix
	}{
		// A typo in the name: the keys of its node's module, closest first.
		{"n1.mod-web.config.prot", []string{"n1.mod-web.config.port", "n1.mod-web.config.host"}, []string{"n1.mod-web.>"}},
		// In the module: none under it, so its node's.
		{"n1.mod-wbe.config.port", []string{"n1.mod-web.config.port", "n1.mod-db.config.port", "n1.mod-web.config.host"}, []string{"n1.mod-wbe.>", "n1.>"}},
		// In the node: the same key on the nodes that have it.
		{"n9.mod-web.config.port", []string{"n1.mod-web.config.port", "n2.mod-web.config.port"}, []string{"n9.mod-web.>", "n9.>", "*.mod-web.config.port"}},
		// Nothing near: no suggestion.
		{"zz.q", nil, []string{"zz.>", "*.q"}},
	} {
		mu.Lock()
		filters = nil
		mu.Unlock()
		out, errOut, code := runCmd(t, "replay", "history", "needs", tc.key, "--nats", url)
		require.Equal(t, exitAnswer, code, "%s answered:\n%s", tc.key, out)
		require.Contains(t, errOut, "404", tc.key)
		if tc.want == nil {
			require.NotContains(t, errOut, "did you mean", tc.key)
		} else {
			require.Contains(t, errOut, "; did you mean "+strings.Join(tc.want, ", ")+"?", tc.key)
		}
		var want []string
		for _, f := range tc.filters {
			want = append(want, prefix+f)
		}
		natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
			mu.Lock()
			defer mu.Unlock()
			var asked []string
			for _, f := range filters {
				if f != "" { // the stream's own info, without subjects
					asked = append(asked, f)
				}
			}
			if !slices.Equal(asked, want) {
				return fmt.Errorf("%s: asked for subjects %q, want %q", tc.key, asked, want)
			}
			return nil
		})
	}
	require.NoError(t, sub.Unsubscribe())
}
