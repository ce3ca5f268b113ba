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

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/query"
)

// TestServe_FlagDefaults: CONTRACT section 5 names serve's defaults.
func TestServe_FlagDefaults(t *testing.T) {
	t.Setenv("NATS_URL", "")
	fs := (&ServeCommand{Stderr: os.Stderr}).flags()
	for name, def := range map[string]string{
		"state":             "./data/state",
		"embedded-listen":   "127.0.0.1:4222",
		"embedded-store":    "./data/nats",
		"nats":              "", // no --nats: the embedded server
		"demo":              "false",
		"registry-interval": "1h0m0s",
		"registry-replicas": "1",
	} {
		f := fs.Lookup(name)
		require.NotNil(t, f, "--%s", name)
		require.Equal(t, def, f.DefValue, "--%s", name)
	}
	for _, name := range []string{"creds", "user", "password"} {
		require.NotNil(t, fs.Lookup(name), "--%s", name)
	}
	// NATS_URL is --nats' default.
	t.Setenv("NATS_URL", "nats://10.0.0.1:4222")
	fs = (&ServeCommand{Stderr: os.Stderr}).flags()
	require.Equal(t, "nats://10.0.0.1:4222", fs.Lookup("nats").DefValue)
	// So --demo, which loads the embedded server, says which of the two to leave out.
	code, _, stderr := run(t, "serve", "--demo")
	require.Equal(t, exitUsage, code)
	require.Contains(t, stderr, "NATS_URL")
}

// TestServe_EmbeddedStoreNeverInsideState: --embedded-store inside --state is a wrong command line
// (exit 2), refused before anything starts, also when --state reaches it through a symbolic link.
func TestServe_EmbeddedStoreNeverInsideState(t *testing.T) {
	t.Setenv("NATS_URL", "")
	dir := t.TempDir()
	real := filepath.Join(dir, "real")
	require.NoError(t, os.Mkdir(real, 0o755))
	link := filepath.Join(dir, "link")
	require.NoError(t, os.Symlink(real, link))
	for _, c := range []struct{ state, store string }{
		{filepath.Join(dir, "state"), filepath.Join(dir, "state", "nats")},
		{filepath.Join(dir, "state"), filepath.Join(dir, "state")},
		{filepath.Join(dir, "state"), filepath.Join(dir, "other", "..", "state", "nats")},
		{link, filepath.Join(real, "nats")},                                  // --state is a link to the store's parent
		{real, filepath.Join(link, "nats")},                                  // the store is reached through a link
		{filepath.Join(link, "state"), filepath.Join(real, "state", "nats")}, // neither exists yet
	} {
		// A context already ended: a serve that wrongly starts stops at once, and the test fails on
		// its exit code rather than waiting for it.
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		var out, errb bytes.Buffer
		err := NewMain(&out, &errb).Run(ctx, []string{"serve", "--state", c.state, "--embedded-store", c.store, "--embedded-listen", "127.0.0.1:-1"})
		require.Equal(t, exitUsage, exitCode(err, &errb), "%+v: %s", c, errb.String())
		require.Contains(t, errb.String(), "is inside --state", "%+v", c)
		_, err = os.Stat(filepath.Join(c.store, "jetstream"))
		require.True(t, os.IsNotExist(err), "%+v: no server started", c)
	}
	require.False(t, inside(filepath.Join(dir, "nats"), filepath.Join(dir, "state")))
	require.False(t, inside(filepath.Join(dir, "state-nats"), filepath.Join(dir, "state")), "a sibling whose name starts alike")
}

// TestQuery_FlagsAreTheRequestFields: query WHAT with --node, --module, --contributor, --collection,
// --kind, --at (and --limit, --after, --min-seq, --wait) asks exactly those fields.
func TestQuery_FlagsAreTheRequestFields(t *testing.T) {
	s := demoSeat(t)
	s.waitReady(t)
	t.Setenv("NATS_URL", s.natsURL)
	nc, _ := natstest.Connect(t, s.natsURL)
	// A plain subscriber beside the seat's queue group sees a copy of every request.
	sub, err := nc.SubscribeSync(query.Subject)
	require.NoError(t, err)
	require.NoError(t, nc.Flush())
	at := time.Now().UTC().Format(time.RFC3339)
	cases := []struct {
		args []string
		want map[string]any
	}{
		{[]string{"query"}, map[string]any{"what": "registry"}},
		{[]string{"query", "registry", "--kind", "config", "--module", "mesh-config"}, map[string]any{"what": "registry", "kind": "config", "module": "mesh-config"}},
		{[]string{"query", "needs", "--node", "n00007", "--module", "mod-003", "--kind", "secret", "--limit", "5"},
			map[string]any{"what": "needs", "node": "n00007", "module": "mod-003", "kind": "secret", "limit": 5.0}},
		{[]string{"query", "collect", "--collection", "shell:zsh:normal", "--contributor", "mod-001", "--node", "n00007"},
			map[string]any{"what": "collect", "collection": "shell:zsh:normal", "contributor": "mod-001", "node": "n00007"}},
		{[]string{"query", "applied", "--node", "n00007", "--at", at, "--json"}, map[string]any{"what": "applied", "node": "n00007", "at": at}},
		{[]string{"query", "needs", "--node", "n00007", "--min-seq", "1", "--wait", "2s", "--one-page"},
			map[string]any{"what": "needs", "node": "n00007", "min_seq": 1.0, "wait_ms": 2000.0}},
		{[]string{"query", "plans", "--node", "edge-1"}, map[string]any{"what": "plans", "node": "edge-1"}},
	}
	for _, c := range cases {
		code, out, stderr := run(t, c.args...)
		require.Equal(t, 0, code, "%v: %s", c.args, stderr)
		msg, err := sub.NextMsg(10 * time.Second)
		require.NoError(t, err, "%v", c.args)
		var got map[string]any
		require.NoError(t, json.Unmarshal(msg.Data, &got), "%v: the CLI asks in JSON", c.args)
		require.Equal(t, c.want, got, "%v", c.args)
		if strings.Contains(strings.Join(c.args, " "), "--json") {
			var a natstest.Answer
			require.NoError(t, json.Unmarshal([]byte(strings.SplitN(out, "\n", 2)[0]), &a), "--json prints the answer")
			require.Equal(t, "applied", a.What)
		}
		// Drain the pages that followed.
		for {
			if _, err := sub.NextMsg(50 * time.Millisecond); err != nil {
				break
			}
		}
	}
}

// TestCreds_ServeAndQuery: --creds is a NATS credentials file, read by serve and query alike. The
// server runs in operator mode, where only a user JWT signed by the account gets in.
func TestCreds_ServeAndQuery(t *testing.T) {
	dir := t.TempDir()
	okp, err := nkeys.CreateOperator()
	require.NoError(t, err)
	opub, _ := okp.PublicKey()
	skp, err := nkeys.CreateAccount() // the system account JetStream needs
	require.NoError(t, err)
	spub, _ := skp.PublicKey()
	oc := jwt.NewOperatorClaims(opub)
	oc.SystemAccount = spub
	ojwt, err := oc.Encode(okp)
	require.NoError(t, err)
	sjwt, err := jwt.NewAccountClaims(spub).Encode(okp)
	require.NoError(t, err)
	akp, err := nkeys.CreateAccount()
	require.NoError(t, err)
	apub, _ := akp.PublicKey()
	ac := jwt.NewAccountClaims(apub)
	ac.Limits.JetStreamLimits = jwt.JetStreamLimits{MemoryStorage: -1, DiskStorage: -1, Streams: -1, Consumer: -1}
	ajwt, err := ac.Encode(okp)
	require.NoError(t, err)
	ukp, err := nkeys.CreateUser()
	require.NoError(t, err)
	upub, _ := ukp.PublicKey()
	ujwt, err := jwt.NewUserClaims(upub).Encode(akp)
	require.NoError(t, err)
	seed, _ := ukp.Seed()
	creds, err := jwt.FormatUserConfig(ujwt, seed)
	require.NoError(t, err)
	credsFile := filepath.Join(dir, "seat.creds")
	require.NoError(t, os.WriteFile(credsFile, creds, 0o600))
	conf := filepath.Join(dir, "nats.conf")
	require.NoError(t, os.WriteFile(conf, []byte(fmt.Sprintf("operator: %s\nsystem_account: %s\nresolver: MEMORY\nresolver_preload: {\n  %s: %s\n  %s: %s\n}\n",
		ojwt, spub, spub, sjwt, apub, ajwt)), 0o600))
	ns := natstest.RunServerAt(t, "127.0.0.1:-1", filepath.Join(dir, "nats"), conf)
	t.Setenv("NATS_URL", ns.ClientURL())

	// Without the credentials the server lets nobody in.
	_, err = nats.Connect(ns.ClientURL())
	require.Error(t, err)
	code, _, stderr := run(t, "query", "registry", "--timeout", "2s")
	require.Equal(t, exitFailure, code, stderr)

	s, err := startServe(dir, "--creds", credsFile)
	require.NoError(t, err)
	defer func() { require.NoError(t, s.stop()) }()
	natstest.CheckFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		code, out, stderr := run(t, "query", "registry", "--creds", credsFile, "--timeout", "2s")
		if code != 0 {
			return fmt.Errorf("exit %d: %s", code, stderr)
		}
		if !strings.Contains(out, fmt.Sprintf("%d rows", len(provisioner.Registry.Entries))) {
			return fmt.Errorf("registry not projected yet:\n%s", out)
		}
		return nil
	})
	// A credentials file that cannot be read is said as such.
	code, _, stderr = run(t, "query", "registry", "--creds", filepath.Join(dir, "missing.creds"), "--timeout", "2s")
	require.Equal(t, exitFailure, code)
	require.Contains(t, stderr, "missing.creds")
}

// TestQuery_BoundsAreUsageErrors: a --limit outside 1..10000, a --wait above 10s or below 0, or a
// negative --min-seq is the command line's fault: exit 2 with a message naming the flag, and no
// request sent (the seat would answer 400, exit 3).
func TestQuery_BoundsAreUsageErrors(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	nc, _ := natstest.Connect(t, ns.ClientURL())
	sub, err := nc.SubscribeSync(query.Subject)
	require.NoError(t, err)
	require.NoError(t, nc.Flush())
	for _, args := range [][]string{
		{"--limit", "0"}, {"--limit", "-1"}, {"--limit", "10001"},
		{"--min-seq", "1", "--wait", "10001ms"}, {"--min-seq", "1", "--wait", "-1s"}, {"--min-seq", "-1"},
	} {
		code, _, stderr := run(t, append([]string{"query", "needs", "--nats", ns.ClientURL(), "--timeout", "1s"}, args...)...)
		require.Equal(t, exitUsage, code, "%v: %s", args, stderr)
		require.Contains(t, stderr, args[len(args)-2], "%v: names the flag", args)
	}
	// The bounds themselves are sent: the first request the subscriber sees is this one.
	code, _, stderr := run(t, "query", "needs", "--nats", ns.ClientURL(), "--limit", "10000", "--min-seq", "1", "--wait", "10s", "--timeout", "50ms")
	require.Equal(t, exitFailure, code, "no seat answers: %s", stderr)
	msg, err := sub.NextMsg(10 * time.Second)
	require.NoError(t, err)
	var got map[string]any
	require.NoError(t, json.Unmarshal(msg.Data, &got))
	require.Equal(t, map[string]any{"what": "needs", "limit": 10000.0, "min_seq": 1.0, "wait_ms": 10000.0}, got)
}
