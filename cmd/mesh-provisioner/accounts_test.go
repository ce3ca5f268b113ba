package main

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
)

// TestAccounts_CommandsAsDocumented runs the binary as docs/accounts.md tells an operator to: a
// nats-server started from docs/nats-accounts.conf as it ships, the buckets created by mesh-admin,
// `serve` with the seat's user and password, node n1's client writing its own keys with its own inbox
// prefix (and refused another node's), and `query`, `export` and `replay` run with the seat's
// credentials, the node's too for `query`. No command may hit a permission the file does not grant.
// (seat/accounts_test.go proves each line of the permissions table with the seat in process.)
func TestAccounts_CommandsAsDocumented(t *testing.T) {
	dir := t.TempDir()
	url := docsAccountsServer(t, dir)
	ctx := context.Background()

	_, admin := natstest.Connect(t, url, nats.UserInfo("mesh-admin", "admin-change-me"), nats.CustomInboxPrefix("_INBOX.admin"))
	require.NoError(t, fixtures.CreateBuckets(ctx, admin, provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect))

	seatUser := []string{"--nats", url, "--user", "mesh-provisioner", "--password", "provisioner-change-me"}
	s, err := startServe(filepath.Join(dir, "seat"), append(seatUser, "--metrics-addr", "127.0.0.1:0", "--metrics-poll", "100ms")...)
	require.NoError(t, err)
	stopped := false
	defer func() {
		if !stopped {
			s.stop()
		}
	}()

	// Node n1's client, as the file's comment says it connects.
	violations := make(chan error, 16)
	_, n1 := natstest.Connect(t, url, nats.UserInfo("node-n1", "n1-change-me"), nats.CustomInboxPrefix("_INBOX.node.n1"),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			select {
			case violations <- err:
			default:
			}
		}))
	kv, err := n1.KeyValue(ctx, provisioner.BucketNeeds)
	require.NoError(t, err)
	seq, err := kv.Put(ctx, "n1.web.config.listen", []byte{0x80})
	require.NoError(t, err, "n1 writes its own key")
	// Refused on n2's: the server says so to the client, and the put never lands.
	pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	_, err = kv.Put(pctx, "n2.web.config.listen", []byte{0x80})
	cancel()
	require.Error(t, err, "n1 may not write n2's keys")
	select {
	case v := <-violations:
		require.ErrorIs(t, v, nats.ErrPermissionViolation)
		require.Contains(t, v.Error(), "$KV.mesh-provisioner_needs.n2.web.config.listen")
	case <-time.After(10 * time.Second):
		t.Fatal("no permissions violation reported for n2's key")
	}

	// query with the seat's credentials, and with the node's (its inbox prefix given as a flag).
	for _, who := range [][]string{seatUser, {"--nats", url, "--user", "node-n1", "--password", "n1-change-me", "--inbox-prefix", "_INBOX.node.n1"}} {
		args := append([]string{"query", "needs", "--node", "n1", "--min-seq", fmt.Sprint(seq), "--wait", "5s", "--timeout", "10s"}, who...)
		code, out, stderr := run(t, args...)
		require.Equal(t, 0, code, "%v: %s", who[2:4], stderr)
		require.Contains(t, out, "n1  ", "%v", who[2:4])
		require.Contains(t, out, "listen", "%v", who[2:4])
		require.Contains(t, out, "1 rows", "%v: n2's key was never written", who[2:4])
	}

	// The forensics commands with the seat's credentials: export and replay from the streams.
	archive := filepath.Join(dir, "incident.mph")
	code, _, stderr := run(t, append([]string{"export", "--out", archive}, seatUser...)...)
	require.Equal(t, 0, code, "export: %s", stderr)
	code, out, stderr := run(t, append([]string{"replay", "state", "needs", "--at", fmt.Sprintf("seq:%d", seq)}, seatUser...)...)
	require.Equal(t, 0, code, "replay: %s", stderr)
	require.Contains(t, out, "listen")
	// A node's, from its own subjects, at a time: the stream's messages' times are asked by sequence.
	for _, at := range []string{fmt.Sprintf("seq:%d", seq), time.Now().UTC().Format(time.RFC3339Nano)} {
		code, out, stderr = run(t, append([]string{"replay", "state", "needs", "--node", "n1", "--at", at}, seatUser...)...)
		require.Equal(t, 0, code, "replay --node --at %s: %s", at, stderr)
		require.Contains(t, out, "listen")
	}

	// rebuild, with the seat stopped, as the runbook says.
	require.NoError(t, s.stop())
	stopped = true
	code, out, stderr = run(t, append([]string{"rebuild", "--state", filepath.Join(dir, "seat", "state")}, seatUser...)...)
	require.Equal(t, 0, code, "rebuild: %s", stderr)
	require.Contains(t, out, "rebuilt")

	for _, l := range []string{s.stderr.String(), stderr} {
		require.NotContains(t, strings.ToLower(l), "permissions violation", "the file grants what the commands need")
	}
}

// A node's user that runs query without --inbox-prefix may not subscribe to the program's default
// inbox: NATS refuses the subscription at once, and query says so, with the flag to give, instead of
// waiting out --timeout and blaming the seat ("may be overloaded, or stopping").
func TestAccounts_QueryRefusedInboxSaysSo(t *testing.T) {
	dir := t.TempDir()
	url := docsAccountsServer(t, dir)
	s, err := startServe(filepath.Join(dir, "seat"), "--nats", url, "--user", "mesh-provisioner", "--password", "provisioner-change-me")
	require.NoError(t, err)
	defer func() { require.NoError(t, s.stop()) }()

	code, _, stderr := run(t, "query", "registry", "--nats", url, "--user", "node-n1", "--password", "n1-change-me", "--timeout", "10s")
	require.Equal(t, exitFailure, code, stderr)
	require.Contains(t, stderr, "Permissions Violation for Subscription to \"_INBOX.mesh-provisioner.")
	require.Contains(t, stderr, "--inbox-prefix")
	require.NotContains(t, stderr, "overloaded")
	// With the node's own prefix, as docs/accounts.md says, it answers.
	natstest.CheckFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		code, _, stderr := run(t, "query", "registry", "--nats", url, "--user", "node-n1", "--password", "n1-change-me", "--inbox-prefix", "_INBOX.node.n1", "--timeout", "10s")
		if code != 0 {
			return fmt.Errorf("exit %d: %s", code, stderr)
		}
		return nil
	})
}

// TestAccounts_RefusedCredentialsAreNamed: a NATS that refuses the connection says which credentials
// it refused, and where they came from, for every command. It said "nats: Authorization Violation"
// alone, whether none were given (the runbook's env file not loaded) or the password was wrong.
func TestAccounts_RefusedCredentialsAreNamed(t *testing.T) {
	dir := t.TempDir()
	url := docsAccountsServer(t, dir)
	for _, c := range []struct {
		creds []string
		says  string
	}{
		{nil, "no credentials were given"},
		{[]string{"--user", "mesh-provisioner", "--password", "wrong"}, "the server refused user mesh-provisioner with the password given"},
		// NATS_USER in the env file, NATS_PASSWORD missing from it: no password was given.
		{[]string{"--user", "mesh-provisioner"}, "the server refused user mesh-provisioner, given without a password"},
	} {
		for _, args := range [][]string{
			{"query", "registry"},
			{"export", "--out", filepath.Join(dir, "x.mph")},
			{"replay", "history", "needs", "n1.web.config.listen"},
			{"rebuild", "--state", filepath.Join(dir, "state")},
		} {
			code, _, stderr := run(t, append(append(args, "--nats", url), c.creds...)...)
			require.Equal(t, exitFailure, code, "%v: %s", args, stderr)
			require.Contains(t, stderr, "Authorization Violation", "%v", args)
			require.Contains(t, stderr, c.says, "%v", args)
		}
	}
}

// TestAccounts_URLCredentialsNeverPrinted: credentials written in the URL (NATS_URL of a cluster, a
// user and password in each server's URL, or a token) are never printed, and a NATS that refuses
// them is said to have refused the URL's, not that none were given. The URL was redacted up to its
// first "@" only, so a second server's password was printed whole, and a URL without a scheme was
// printed as it was; and the refusal said "no credentials were given" (the env file not loaded)
// for credentials that were.
func TestAccounts_URLCredentialsNeverPrinted(t *testing.T) {
	dir := t.TempDir()
	hostport := strings.TrimPrefix(docsAccountsServer(t, dir), "nats://")
	const secret = "s3cret-pw-not-printed"
	for _, c := range []struct{ url, says string }{
		{"nats://mesh-provisioner:" + secret + "@" + hostport + ",nats://mesh-provisioner:" + secret + "@" + hostport, "the server refused user mesh-provisioner given in the URL"},
		{"mesh-provisioner:" + secret + "@" + hostport, "the server refused user mesh-provisioner given in the URL"},
		{"nats://" + secret + "@" + hostport, "the server refused the token given in the URL"},
	} {
		for _, args := range [][]string{
			{"query", "registry"},
			{"rebuild", "--state", filepath.Join(dir, "state")},
		} {
			code, stdout, stderr := run(t, append(args, "--nats", c.url)...)
			require.Equal(t, exitFailure, code, "%v: %s", args, stderr)
			require.Contains(t, stderr, "Authorization Violation", "%v", args)
			require.NotContains(t, stderr+stdout, secret, "%v: a password or token printed", args)
			require.Contains(t, stderr, c.says, "%v", args)
		}
	}
}

// TestAccounts_UsageNeverPrintsSecrets: the usage every command prints, for --help and for a wrong
// flag (a typo in a unit file: the usage goes to the journal), never prints NATS_PASSWORD nor the
// credentials in NATS_URL. The flags took them as their defaults, and the usage said
// `(default "the-password")`.
func TestAccounts_UsageNeverPrintsSecrets(t *testing.T) {
	const pw, urlpw = "env-pw-not-printed", "url-pw-not-printed"
	t.Setenv("NATS_USER", "mesh-provisioner")
	t.Setenv("NATS_PASSWORD", pw)
	t.Setenv("NATS_URL", "nats://mesh-provisioner:"+urlpw+"@127.0.0.1:1,nats://mesh-provisioner:"+urlpw+"@127.0.0.1:2")
	for _, cmd := range []string{"serve", "query", "rebuild", "replay", "export"} {
		args := []string{cmd, "--no-such-flag"}
		if cmd == "replay" {
			args = []string{cmd, "state", "--no-such-flag"}
		}
		for _, a := range [][]string{args, append(args[:len(args)-1:len(args)-1], "--help")} {
			_, stdout, stderr := run(t, a...)
			require.Contains(t, stderr, "-password", "%v: the usage is printed", a)
			require.NotContains(t, stdout+stderr, pw, "%v", a)
			require.NotContains(t, stdout+stderr, urlpw, "%v", a)
			require.Contains(t, stderr, "nats://***@127.0.0.1:1,nats://***@127.0.0.1:2", "%v: the default URL said, redacted", a)
		}
	}
}
