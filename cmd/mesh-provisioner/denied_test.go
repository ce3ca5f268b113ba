package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/metrics/metricstest"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/replay"
	"github.com/novox/mesh-provisioner/store"
)

// runUntil runs the binary's Main in this process under ctx, as main does under its signal context.
func runUntil(ctx context.Context, t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	err := NewMain(&out, &errb).Run(ctx, args)
	return exitCode(err, &errb), out.String(), errb.String()
}

// oneShotDeadline is the context the one-shot commands get in these tests: longer than any timeout of
// theirs (a JetStream request's 5 s, replay's and rebuild's minute without a message read, export's
// minute without a consumer read), so a command that waits one out ends with the context instead.
const oneShotDeadline = 90 * time.Second

// TestOneShot_StopAtAPermissionViolation: export, replay (state, history, diff) and rebuild from the
// streams, run as a user that lacks one permission docs/accounts.md grants the seat's user, stop at
// the first permissions violation the server reports, and say what NATS refused and what to grant, with
// nothing written that looks complete. They used to wait out a JetStream request's timeout and blame
// the stream ("context deadline exceeded"), or retry for a minute and say no message was read.
func TestOneShot_StopAtAPermissionViolation(t *testing.T) {
	for _, env := range []string{"NATS_URL", "NATS_USER", "NATS_PASSWORD", "NATS_CREDS", "NATS_INBOX_PREFIX"} {
		t.Setenv(env, "")
	}
	ns := natstest.RunServerSeatDenied(t)
	url := ns.ClientURL()
	ctx := context.Background()
	_, admin := natstest.Connect(t, url, nats.UserInfo("admin", "admin"))
	mesh := fixtures.Mesh{Seed: 5, Nodes: 3, Modules: 2, NeedsPerModule: 2, Collections: 1}
	require.NoError(t, fixtures.Load(ctx, admin, mesh.Ops(), 0, nil))
	require.NoError(t, fixtures.CreateBuckets(ctx, admin, provisioner.BucketRegistry, provisioner.BucketHostModules))
	conf, err := os.ReadFile(filepath.Join("..", "..", "docs", "nats-accounts.conf"))
	require.NoError(t, err)

	// A key with messages: history from the streams reads the key's own subject, and a key without
	// any is answered (404) with no pull to refuse.
	key := mesh.OpsOf(provisioner.BucketNeeds)[0].Key
	seat := []string{"--nats", url, "--user", "seat", "--password", "seat"}
	type check func(t *testing.T, dir, stdout string)
	noArchive := func(t *testing.T, dir, _ string) {
		entries, err := os.ReadDir(dir)
		require.NoError(t, err)
		require.Empty(t, entries, "neither the archive nor its temporary files are left")
	}
	noAnswer := func(t *testing.T, _, stdout string) {
		require.Empty(t, stdout, "no answer printed")
	}
	notSwapped := func(t *testing.T, dir, _ string) {
		sd, err := store.LockState(filepath.Join(dir, "state"))
		require.NoError(t, err)
		defer sd.Close()
		cur, err := sd.Current()
		require.NoError(t, err)
		require.Empty(t, cur, "no projection swapped in")
	}
	for _, c := range []struct {
		name  string
		deny  string // the one permission of the seat's user taken away, as docs/nats-accounts.conf grants it
		args  func(dir string) []string
		check check
	}{
		{"export, stream info", "$JS.API.STREAM.INFO.KV_mesh-provisioner_registry",
			func(dir string) []string { return []string{"export", "--out", filepath.Join(dir, "x.mph")} }, noArchive},
		{"export, stream names", "$JS.API.STREAM.NAMES",
			func(dir string) []string { return []string{"export", "--out", filepath.Join(dir, "x.mph")} }, noArchive},
		{"export, consumer create", "$JS.API.CONSUMER.CREATE.KV_mesh-provisioner_needs.>",
			func(dir string) []string { return []string{"export", "--out", filepath.Join(dir, "x.mph")} }, noArchive},
		{"export, consumer delete", "$JS.API.CONSUMER.DELETE.KV_mesh-provisioner_applied.*",
			func(dir string) []string { return []string{"export", "--out", filepath.Join(dir, "x.mph")} }, noArchive},
		{"replay state, consumer create", "$JS.API.CONSUMER.CREATE.KV_mesh-provisioner_needs.>",
			func(string) []string { return []string{"replay", "state", "needs", "--at", "seq:3"} }, noAnswer},
		{"replay history, pull", "$JS.API.CONSUMER.MSG.NEXT.KV_mesh-provisioner_needs.*",
			func(string) []string { return []string{"replay", "history", "needs", key} }, noAnswer},
		{"replay diff, stream info", "$JS.API.STREAM.INFO.KV_mesh-provisioner_needs",
			func(string) []string { return []string{"replay", "diff", "needs", "--from", "seq:1", "--to", "seq:5"} }, noAnswer},
		{"replay state, plans input", "$JS.API.CONSUMER.CREATE.KV_mesh-host_modules.>",
			func(string) []string { return []string{"replay", "state", "plans", "--at", "2026-01-01T00:00:00Z"} }, noAnswer},
		{"rebuild, consumer create", "$JS.API.CONSUMER.CREATE.KV_mesh-provisioner_applied.>",
			func(dir string) []string { return []string{"rebuild", "--state", filepath.Join(dir, "state")} }, notSwapped},
		{"rebuild, stream info", "$JS.API.STREAM.INFO.KV_mesh-provisioner_needs",
			func(dir string) []string { return []string{"rebuild", "--state", filepath.Join(dir, "state")} }, notSwapped},
		// The plans' fixed inputs stay strict: only a composed-<node> bucket is gone on without.
		{"rebuild, plans input", "$JS.API.CONSUMER.CREATE.KV_mesh-host_modules.>",
			func(dir string) []string { return []string{"rebuild", "--state", filepath.Join(dir, "state")} }, notSwapped},
		{"export, plans input", "$JS.API.STREAM.INFO.KV_mesh-host_modules",
			func(dir string) []string { return []string{"export", "--out", filepath.Join(dir, "x.mph")} }, noArchive},
		// Refused once every stream is read (the consumers are deleted as each tail ends): the
		// rebuild ended "context canceled", naming nothing.
		{"rebuild, consumer delete", "$JS.API.CONSUMER.DELETE.KV_mesh-provisioner_applied.*",
			func(dir string) []string { return []string{"rebuild", "--state", filepath.Join(dir, "state")} }, notSwapped},
	} {
		t.Run(c.name, func(t *testing.T) {
			require.Contains(t, string(conf), `"`+c.deny+`"`, "the seat's user is granted it in docs/nats-accounts.conf")
			natstest.DenySeat(t, ns, c.deny)
			dir := t.TempDir()
			cctx, cancel := context.WithTimeout(ctx, oneShotDeadline)
			defer cancel()
			code, stdout, stderr := runUntil(cctx, t, append(c.args(dir), seat...)...)
			require.NoError(t, cctx.Err(), "returned before its context ended: %s", stderr)
			require.Equal(t, exitFailure, code, stderr)
			prefix, _, _ := strings.Cut(c.deny, "KV_")
			require.Contains(t, stderr, `Permissions Violation for Publish to "`+strings.TrimSuffix(strings.TrimSuffix(prefix, ">"), "*"), "names what NATS refused")
			require.Contains(t, stderr, "grant this NATS user publish on "+c.deny, "names what to grant, as docs/nats-accounts.conf grants it")
			require.NotContains(t, stderr, "deadline exceeded")
			// The command's own error says it too, not only the connection's warn line before it.
			_, said, _ := strings.Cut("\n"+stderr, "\nmesh-provisioner: ")
			require.Contains(t, said, "grant this NATS user publish on "+c.deny, "the command's error names what to grant: %s", stderr)
			c.check(t, dir, stdout)
		})
	}
}

// TestOneShot_DocsUsersStopAtTheirInbox: a node's user running the forensics commands with the
// program's default inbox prefix is refused the inbox's subscription, and each command says so with
// the flag to give; with its own prefix it is refused the JetStream API, and says which grant.
func TestOneShot_DocsUsersStopAtTheirInbox(t *testing.T) {
	dir := t.TempDir()
	url := docsAccountsServer(t, dir)
	ctx := context.Background()
	_, admin := natstest.Connect(t, url, nats.UserInfo("mesh-admin", "admin-change-me"), nats.CustomInboxPrefix("_INBOX.admin"))
	require.NoError(t, fixtures.CreateBuckets(ctx, admin, provisioner.BucketRegistry, provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect))
	// The key history asks for has a message: of an empty stream, its info alone answers (404).
	_, err := admin.Publish(ctx, provisioner.SubjectPrefix(provisioner.BucketNeeds)+"n1.web.config.listen", []byte{1})
	require.NoError(t, err)

	node := []string{"--nats", url, "--user", "node-n1", "--password", "n1-change-me"}
	for _, args := range [][]string{
		{"export", "--out", filepath.Join(dir, "x.mph")},
		{"replay", "state", "needs", "--at", "seq:1"},
		{"replay", "history", "needs", "n1.web.config.listen"},
		{"replay", "diff", "needs", "--from", "seq:1", "--to", "seq:2"},
		{"rebuild", "--state", filepath.Join(dir, "state")},
	} {
		cctx, cancel := context.WithTimeout(ctx, oneShotDeadline)
		code, stdout, stderr := runUntil(cctx, t, append(args, node...)...)
		require.NoError(t, cctx.Err(), "%v returned before its context ended: %s", args, stderr)
		require.Equal(t, exitFailure, code, "%v: %s", args, stderr)
		require.Contains(t, stderr, `Permissions Violation for Subscription to "_INBOX.mesh-provisioner.`, "%v", args)
		require.Contains(t, stderr, "--inbox-prefix", "%v", args)
		require.Empty(t, stdout, "%v", args)

		code, stdout, stderr = runUntil(cctx, t, append(args, append(node, "--inbox-prefix", "_INBOX.node.n1")...)...)
		require.NoError(t, cctx.Err(), "%v returned before its context ended: %s", args, stderr)
		cancel()
		require.Equal(t, exitFailure, code, "%v: %s", args, stderr)
		require.Contains(t, stderr, `Permissions Violation for Publish to "$JS.API.`, "%v", args)
		require.Contains(t, stderr, "grant this NATS user publish on $JS.API.", "%v", args)
		require.Empty(t, stdout, "%v", args)
	}
	require.NoFileExists(t, filepath.Join(dir, "x.mph"))
}

// TestOneShot_DoWithoutWhatTheSeatDoesWithout: what docs/accounts.md says the seat does without, the
// listing of every stream's info ($JS.API.STREAM.LIST) and the stream-created advisories, does not stop
// the one-shot commands either: they ask each stream, and list the names.
func TestOneShot_DoWithoutWhatTheSeatDoesWithout(t *testing.T) {
	for _, env := range []string{"NATS_URL", "NATS_USER", "NATS_PASSWORD", "NATS_CREDS", "NATS_INBOX_PREFIX"} {
		t.Setenv(env, "")
	}
	for name, ns := range map[string]*server.Server{
		"listing denied":    natstest.RunServerSeatDenied(t, "$JS.API.STREAM.LIST"),
		"advisories denied": natstest.RunServerSeatNoAdvisories(t),
	} {
		t.Run(name, func(t *testing.T) {
			url := ns.ClientURL()
			_, admin := natstest.Connect(t, url, nats.UserInfo("admin", "admin"))
			mesh := fixtures.Mesh{Seed: 6, Nodes: 2, Modules: 2, NeedsPerModule: 1, Collections: 1}
			require.NoError(t, fixtures.Load(context.Background(), admin, mesh.Ops(), 0, nil))
			seat := []string{"--nats", url, "--user", "seat", "--password", "seat"}
			dir := t.TempDir()
			for _, args := range [][]string{
				{"export", "--out", filepath.Join(dir, "x.mph")},
				{"replay", "state", "needs", "--at", "seq:2"},
				{"rebuild", "--state", filepath.Join(dir, "state")},
			} {
				cctx, cancel := context.WithTimeout(context.Background(), oneShotDeadline)
				code, _, stderr := runUntil(cctx, t, append(args, seat...)...)
				cancel()
				require.Equal(t, exitOK, code, "%v: %s", args, stderr)
			}
		})
	}
}

// TestServe_KeepsServingAndLogsAViolationOnce: serve does not stop at a permissions violation (a seat
// keeps serving what it can read), and logs each refused grant once, not once per retry: a seat denied
// $JS.API.STREAM.LIST asks again and again, each time refused, and wrote a "NATS error" line each time.
func TestServe_KeepsServingAndLogsAViolationOnce(t *testing.T) {
	t.Setenv("NATS_URL", "")
	ns := natstest.RunServerSeatDenied(t, "$JS.API.STREAM.LIST")
	_, admin := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("admin", "admin"))
	mesh := fixtures.Mesh{Seed: 7, Nodes: 2, Modules: 2, NeedsPerModule: 1, Collections: 1}
	require.NoError(t, fixtures.Load(context.Background(), admin, mesh.Ops(), 0, nil))
	s, err := startServe(t.TempDir(), "--nats", ns.ClientURL(), "--user", "seat", "--password", "seat",
		"--metrics-addr", "127.0.0.1:0", "--metrics-poll", "50ms", "--log-format", "json")
	require.NoError(t, err)
	defer func() { require.NoError(t, s.stop()) }()

	// Each listing is refused: its retries grow from one interval to twelve (600 ms here).
	natstest.CheckFor(t, 30*time.Second, 50*time.Millisecond, func() error {
		fams, err := metricstest.Scrape(s.metricsAddr)
		if err != nil {
			return err
		}
		if n, _ := fams.Value("mesh_provisioner_stream_info_errors_total"); n < 5 {
			return fmt.Errorf("%v listings refused so far", n)
		}
		return nil
	})
	var said []string
	for _, l := range strings.Split(s.stderr.String(), "\n") {
		var m map[string]any
		if json.Unmarshal([]byte(l), &m) == nil && m["msg"] == "NATS error" {
			said = append(said, l)
			require.Equal(t, "WARN", m["level"])
			require.Equal(t, "$JS.API.STREAM.LIST", m["subject"])
			require.Contains(t, m["err"], "grant this NATS user publish on $JS.API.STREAM.LIST")
		}
	}
	require.Len(t, said, 1, "the refusal is logged once, not once per listing")
	select {
	case err := <-s.done:
		t.Fatalf("serve stopped: %v", err)
	default:
	}
	code, _, stderr := run(t, "query", "needs", "--nats", ns.ClientURL(), "--user", "seat", "--password", "seat", "--timeout", "10s")
	require.Equal(t, exitOK, code, "the seat answers: %s", stderr)
}

// TestServe_DeniedComposedBucketSaidAtOnce: serve whose user may not create a consumer on one node's
// composed-<node> bucket (its lines not yet written by the controller) waited out the JetStream API's
// 5 s timeout on each try: about 16 s before the bucket counted as failing and the seat said ready
// without it (docs/decisions.md, session 79), and its "tailing failed" line said "context deadline
// exceeded". Each try fails as soon as NATS reports the violation, the line names what to grant, the
// seat says ready without the bucket, and reads it once granted.
func TestServe_DeniedComposedBucketSaidAtOnce(t *testing.T) {
	t.Setenv("NATS_URL", "")
	ns := natstest.RunServerSeatDenied(t, "$JS.API.CONSUMER.CREATE.KV_composed-n2.>")
	_, admin := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("admin", "admin"))
	ctx := context.Background()
	mesh := fixtures.Mesh{Seed: 8, Nodes: 2, Modules: 2, NeedsPerModule: 1, Collections: 1}
	require.NoError(t, fixtures.Load(ctx, admin, mesh.Ops(), 0, nil))
	require.NoError(t, fixtures.CreateBuckets(ctx, admin, provisioner.BucketHostModules, provisioner.BucketIndexerBuilds, "composed-n1", "composed-n2"))
	for _, b := range []string{"composed-n1", "composed-n2"} {
		_, err := admin.Publish(ctx, provisioner.SubjectPrefix(b)+"web.1", []byte{0x81, 0xa6, 's', 't', 'a', 't', 'u', 's', 0xa7, 'p', 'e', 'n', 'd', 'i', 'n', 'g'})
		require.NoError(t, err)
	}
	// The grant below reloads the server's options while the seat's registry writer reads its bucket.
	_, err := admin.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.BucketRegistry, History: 8})
	require.NoError(t, err)
	natstest.NoDirectGets(t, admin, provisioner.StreamName(provisioner.BucketRegistry))
	start := time.Now()
	s, err := startServe(t.TempDir(), "--nats", ns.ClientURL(), "--user", "seat", "--password", "seat",
		"--metrics-addr", "127.0.0.1:0", "--log-format", "json")
	require.NoError(t, err)
	defer func() { require.NoError(t, s.stop()) }()
	natstest.CheckFor(t, 60*time.Second, 20*time.Millisecond, func() error {
		code, body, err := metricstest.Get("http://" + s.metricsAddr + "/readyz")
		if err != nil {
			return err
		}
		if code != 200 || !strings.Contains(body, "composed-n2") {
			return fmt.Errorf("readyz %d: %s", code, body)
		}
		return nil
	})
	t.Logf("ready without composed-n2 %v after the start", time.Since(start).Round(time.Millisecond))
	var tailing []map[string]any
	for _, l := range strings.Split(s.stderr.String(), "\n") {
		var m map[string]any
		if json.Unmarshal([]byte(l), &m) == nil && m["msg"] == "tailing failed; retrying with backoff" {
			tailing = append(tailing, m)
		}
	}
	require.Len(t, tailing, 1, s.stderr.String())
	require.Equal(t, "composed-n2", tailing[0]["bucket"])
	require.Contains(t, tailing[0]["err"], "grant this NATS user publish on $JS.API.CONSUMER.CREATE.KV_composed-n2.>")
	require.NotContains(t, tailing[0]["err"], "deadline exceeded")

	natstest.DenySeat(t, ns) // granted
	natstest.CheckFor(t, 60*time.Second, 20*time.Millisecond, func() error {
		code, body, err := metricstest.Get("http://" + s.metricsAddr + "/readyz")
		if err != nil {
			return err
		}
		if code != 200 || strings.Contains(body, "composed-n2") {
			return fmt.Errorf("readyz %d: %s", code, body)
		}
		return nil
	})
}

// TestServe_VerbSubscriptionDeniedFailsToStart: a seat's user granted everything docs/nats-accounts.conf
// grants but the subscription to the verb logged one "NATS error", said "answering", and /readyz said
// ready, while no request ever reached it ("no responders" for every client). serve fails to start,
// exit 1, naming the grant.
func TestServe_VerbSubscriptionDeniedFailsToStart(t *testing.T) {
	dir := t.TempDir()
	for _, env := range []string{"NATS_URL", "NATS_USER", "NATS_PASSWORD", "NATS_CREDS", "NATS_INBOX_PREFIX"} {
		t.Setenv(env, "")
	}
	conf, err := os.ReadFile(filepath.Join("..", "..", "docs", "nats-accounts.conf"))
	require.NoError(t, err)
	sub := strings.Index(string(conf), "subscribe: {")
	line := `"mesh-provisioner.provisioning"`
	at := sub + strings.Index(string(conf[sub:]), line)
	require.Greater(t, at, sub, "the seat's user may subscribe to the verb in docs/nats-accounts.conf")
	denied := string(conf[:at]) + string(conf[at+len(line):])
	cf := filepath.Join(dir, "nats.conf")
	require.NoError(t, os.WriteFile(cf, []byte(denied), 0o644))
	ns := natstest.RunServerAt(t, "127.0.0.1:-1", filepath.Join(dir, "nats"), cf)
	_, admin := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("mesh-admin", "admin-change-me"), nats.CustomInboxPrefix("_INBOX.admin"))
	require.NoError(t, fixtures.CreateBuckets(context.Background(), admin, provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect))

	cctx, cancel := context.WithTimeout(context.Background(), oneShotDeadline)
	defer cancel()
	code, _, stderr := runUntil(cctx, t, "serve", "--nats", ns.ClientURL(), "--user", "mesh-provisioner", "--password", "provisioner-change-me",
		"--state", filepath.Join(dir, "state"))
	require.NoError(t, cctx.Err(), "serve went on: %s", stderr)
	require.Equal(t, exitFailure, code, stderr)
	_, said, _ := strings.Cut("\n"+stderr, "\nmesh-provisioner: ")
	require.Contains(t, said, `Permissions Violation for Subscription to "mesh-provisioner.provisioning"`, stderr)
	require.Contains(t, said, "grant this NATS user subscribe on mesh-provisioner.provisioning", stderr)
	require.NotContains(t, stderr, "msg=answering", "never said it answered")
}

// composedMesh loads a small mesh whose nodes n1 and n2 each run module web at build 1, published in
// their composed-<node> buckets (plan "plan-n1", "plan-n2").
func composedMesh(t *testing.T, admin jetstream.JetStream) {
	t.Helper()
	ctx := context.Background()
	mesh := fixtures.Mesh{Seed: 9, Nodes: 2, Modules: 2, NeedsPerModule: 1, Collections: 1}
	ops := mesh.Ops()
	ops = append(ops, fixtures.Op{Bucket: provisioner.BucketRegistry, Key: "config", Op: provisioner.OpPut, Value: provisioner.Registry.Entries[0].Value()})
	for _, n := range []string{"n1", "n2"} {
		host, err := msgpack.Marshal(map[string]any{"want": 1})
		require.NoError(t, err)
		comp, err := msgpack.Marshal(map[string]any{"status": "published", "plan": "plan-" + n})
		require.NoError(t, err)
		ops = append(ops,
			fixtures.Op{Bucket: provisioner.BucketHostModules, Key: n + ".web", Op: provisioner.OpPut, Value: host},
			fixtures.Op{Bucket: provisioner.ComposedPrefix + n, Key: "web.1", Op: provisioner.OpPut, Value: comp})
	}
	require.NoError(t, fixtures.Load(ctx, admin, ops, 0, nil))
	require.NoError(t, fixtures.CreateBuckets(ctx, admin, provisioner.BucketIndexerBuilds))
}

// TestOneShot_GoOnWithoutAComposedBucketDenied: rebuild and replay plans from the streams, run as a
// user denied one node's composed-<node> stream, stopped at once (or, for a stream that did not answer,
// after a minute without a message read) and left the state dir as it was: one node among thousands
// kept an operator from rebuilding at all. They go on without that bucket, as a seat does: rebuild
// swaps the rest in, names the bucket and exits 4; serve on the rebuilt state dir reads the bucket
// once granted. replay plans answers the other nodes, exits 4 naming it, and refuses the node itself.
// A fixed bucket denied still fails the rebuild (TestOneShot_StopAtAPermissionViolation).
func TestOneShot_GoOnWithoutAComposedBucketDenied(t *testing.T) {
	for _, env := range []string{"NATS_URL", "NATS_USER", "NATS_PASSWORD", "NATS_CREDS", "NATS_INBOX_PREFIX"} {
		t.Setenv(env, "")
	}
	ns := natstest.RunServerSeatDenied(t, "$JS.API.CONSUMER.CREATE.KV_composed-n2.>")
	url := ns.ClientURL()
	_, admin := natstest.Connect(t, url, nats.UserInfo("admin", "admin"))
	composedMesh(t, admin)
	seat := []string{"--nats", url, "--user", "seat", "--password", "seat"}
	dir := t.TempDir()
	state := filepath.Join(dir, "state")

	cctx, cancel := context.WithTimeout(context.Background(), oneShotDeadline)
	defer cancel()
	code, stdout, stderr := runUntil(cctx, t, append([]string{"rebuild", "--state", state}, seat...)...)
	require.NoError(t, cctx.Err(), "returned before its context ended: %s", stderr)
	require.Equal(t, exitIncomplete, code, stderr)
	require.Contains(t, stdout, "rebuilt "+state)
	require.Contains(t, stderr, "rebuilt "+state+", incomplete: 1 composed-<node> bucket(s) could not be read: composed-n2;")
	require.Contains(t, stderr, "grant this NATS user publish on $JS.API.CONSUMER.CREATE.KV_composed-n2.>", "the log says why")
	db := openCurrent(t, state)
	n1, _ := db.Applied(provisioner.ComposedPrefix + "n1")
	require.EqualValues(t, 1, n1, "the other node's bucket is read")
	n2, _ := db.Applied(provisioner.ComposedPrefix + "n2")
	require.Zero(t, n2)
	hm, _ := db.Applied(provisioner.BucketHostModules)
	require.EqualValues(t, 2, hm)
	require.NoError(t, db.Close())

	for _, c := range []struct {
		node string
		code int
	}{{"", exitIncomplete}, {"n1", exitIncomplete}, {"n2", exitFailure}} {
		args := []string{"replay", "state", "plans", "--at", time.Now().Add(time.Hour).UTC().Format(time.RFC3339), "--json"}
		if c.node != "" {
			args = append(args, "--node", c.node)
		}
		code, stdout, stderr := runUntil(cctx, t, append(args, seat...)...)
		require.Equal(t, c.code, code, "%v: %s", args, stderr)
		require.Contains(t, stderr, "composed-n2", "%v", args)
		if c.node == "n2" {
			require.Empty(t, stdout)
			require.Contains(t, stderr, "plans of node n2 cannot be answered: its bucket composed-n2 could not be read")
			continue
		}
		require.Contains(t, stdout, "plan-n1", "%v", args)
		require.Contains(t, stderr, "answered, incomplete: 1 composed-<node> bucket(s) could not be read: composed-n2;", "%v", args)
	}

	// export writes the archive without composed-n2 and lists it; replay of the archive answers as
	// replay of the streams does.
	archive := filepath.Join(dir, "a.mph")
	code, stdout, stderr = runUntil(cctx, t, append([]string{"export", "--out", archive}, seat...)...)
	require.NoError(t, cctx.Err(), "returned before its context ended: %s", stderr)
	require.Equal(t, exitIncomplete, code, stderr)
	require.Contains(t, stdout, "wrote "+archive)
	require.Contains(t, stderr, "not read: composed-n2: read composed-n2: stopped at sequence 0 of 1: nats: permissions violation")
	require.Contains(t, stderr, "wrote "+archive+", incomplete: 1 composed-<node> bucket(s) could not be read: composed-n2;")
	h, err := replay.ReadArchiveHeader(archive)
	require.NoError(t, err)
	require.Equal(t, []string{provisioner.ComposedPrefix + "n2"}, h.Unread)
	require.Equal(t, 3, h.Version, "a reader of version 2 refuses it, rather than answer n2 as never composed")
	for _, c := range []struct {
		node string
		code int
	}{{"", exitIncomplete}, {"n2", exitFailure}} {
		args := []string{"replay", "state", "plans", "--at", time.Now().Add(time.Hour).UTC().Format(time.RFC3339), "--json", "--archive", archive}
		if c.node != "" {
			args = append(args, "--node", c.node)
		}
		code, stdout, stderr := runUntil(cctx, t, args...)
		require.Equal(t, c.code, code, "%v: %s", args, stderr)
		require.Contains(t, stderr, "composed-n2", "%v", args)
		if c.node == "" {
			require.Contains(t, stdout, "plan-n1", "%v", args)
		}
	}

	// Granted, serve on the rebuilt state dir reads composed-n2.
	natstest.DenySeat(t, ns)
	s, err := startServe(dir, append(seat, "--metrics-addr", "127.0.0.1:0")...)
	require.NoError(t, err)
	defer func() { require.NoError(t, s.stop()) }()
	natstest.CheckFor(t, 60*time.Second, 50*time.Millisecond, func() error {
		code, out, stderr := run(t, append([]string{"query", "plans", "--node", "n2", "--json"}, seat...)...)
		if code != exitOK || !strings.Contains(out, "plan-n2") || !strings.Contains(out, `"synced":true`) {
			return fmt.Errorf("exit %d: %s %s", code, out, stderr)
		}
		return nil
	})
}

// openCurrent opens the current generation of a state dir (its lock taken and given back).
func openCurrent(t *testing.T, state string) *store.DB {
	t.Helper()
	sd, err := store.LockState(state)
	require.NoError(t, err)
	defer sd.Close()
	cur, err := sd.Current()
	require.NoError(t, err)
	require.NotEmpty(t, cur, "a projection swapped in")
	db, err := store.Open(cur, store.Options{})
	require.NoError(t, err)
	return db
}

// TestRebuild_GoesOnWithoutAComposedBucketItCannotRead: not only a permission: a composed-<node>
// stream whose one consumer slot is taken made rebuild retry for a minute without a message read, then
// fail with the generation kept and nothing swapped in. It is swapped in without that bucket, exit 4.
func TestRebuild_GoesOnWithoutAComposedBucketItCannotRead(t *testing.T) {
	for _, env := range []string{"NATS_URL", "NATS_USER", "NATS_PASSWORD", "NATS_CREDS", "NATS_INBOX_PREFIX"} {
		t.Setenv(env, "")
	}
	ns := natstest.RunServerSeatDenied(t)
	url := ns.ClientURL()
	ctx := context.Background()
	_, admin := natstest.Connect(t, url, nats.UserInfo("admin", "admin"))
	// composed-n2's stream as a KV bucket's, but with room for one consumer, which someone holds.
	kv, err := admin.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "composed-tmp", History: 8})
	require.NoError(t, err)
	s, err := admin.Stream(ctx, provisioner.StreamName(kv.Bucket()))
	require.NoError(t, err)
	cfg := s.CachedInfo().Config
	require.NoError(t, admin.DeleteKeyValue(ctx, kv.Bucket()))
	cfg.Name, cfg.Subjects, cfg.MaxConsumers = provisioner.StreamName("composed-n2"), []string{provisioner.SubjectPrefix("composed-n2") + ">"}, 1
	s, err = admin.CreateStream(ctx, cfg)
	require.NoError(t, err)
	_, err = s.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: "holder"})
	require.NoError(t, err)
	composedMesh(t, admin)

	state := filepath.Join(t.TempDir(), "state")
	cctx, cancel := context.WithTimeout(ctx, oneShotDeadline)
	defer cancel()
	code, stdout, stderr := runUntil(cctx, t, "rebuild", "--state", state, "--nats", url, "--user", "seat", "--password", "seat")
	require.NoError(t, cctx.Err(), "returned before its context ended: %s", stderr)
	require.Equal(t, exitIncomplete, code, stderr)
	require.Contains(t, stdout, "rebuilt "+state)
	require.Contains(t, stderr, "could not be read: composed-n2;")
	require.Contains(t, stderr, "maximum consumers limit reached", "the log says why")
	db := openCurrent(t, state)
	defer db.Close()
	n1, _ := db.Applied(provisioner.ComposedPrefix + "n1")
	require.EqualValues(t, 1, n1)
}
