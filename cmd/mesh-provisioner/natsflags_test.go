package main

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
)

// TestNATSFlags_EveryCommand: every command that reaches NATS reads the NATS conventions alike:
// --nats before NATS_URL, and --user/--password (or NATS_USER/NATS_PASSWORD) for a server that lets
// no one in without them.
func TestNATSFlags_EveryCommand(t *testing.T) {
	ns := natstest.RunServerSeatDenied(t)
	url := ns.ClientURL()
	_, js := natstest.Connect(t, url, nats.UserInfo("admin", "admin"))
	mesh := fixtures.Mesh{Seed: 4, Nodes: 4, Modules: 2, NeedsPerModule: 2, Collections: 1}
	require.NoError(t, fixtures.Load(context.Background(), js, mesh.Ops(), 0, nil))
	s, err := startServe(t.TempDir(), "--nats", url, "--user", "seat", "--password", "seat")
	require.NoError(t, err)
	defer func() { require.NoError(t, s.stop()) }()

	dir := t.TempDir()
	commands := func() [][]string {
		return [][]string{
			{"query", "needs", "--timeout", "5s"},
			{"rebuild", "--state", filepath.Join(dir, "state")},
			{"replay", "state", "needs", "--at", "seq:3"},
			{"export", "--out", filepath.Join(dir, "x.mph"), "--force"},
		}
	}
	t.Setenv("NATS_URL", "nats://127.0.0.1:1") // nothing there: --nats must win
	for _, args := range commands() {
		code, _, stderr := run(t, append(args, "--nats", url)...)
		require.Equal(t, exitFailure, code, "%v without a user", args)
		require.Contains(t, stderr, "Authorization Violation", "%v", args)
		code, _, stderr = run(t, append(args, "--nats", url, "--password", "seat")...)
		require.Equal(t, exitUsage, code, "%v with a password and no user", args)
		require.Contains(t, stderr, "without --user", "%v", args)
		code, _, stderr = run(t, append(args, "--nats", url, "--user", "seat", "--password", "seat")...)
		require.Equal(t, exitOK, code, "%v: %s", args, stderr)
	}
	// serve too, and before it starts an embedded server.
	code, _, stderr := run(t, "serve", "--state", filepath.Join(dir, "serve"), "--nats", url, "--password", "seat")
	require.Equal(t, exitUsage, code, "serve with a password and no user: %s", stderr)
	require.Contains(t, stderr, "without --user")
	t.Setenv("NATS_URL", "")
	code, _, stderr = run(t, "serve", "--state", filepath.Join(dir, "serve"), "--embedded-store", filepath.Join(dir, "nats"),
		"--embedded-listen", "127.0.0.1:-1", "--password", "seat")
	require.Equal(t, exitUsage, code, "serve, embedded, with a password and no user: %s", stderr)
	require.NoDirExists(t, filepath.Join(dir, "nats"), "no embedded server started")

	t.Setenv("NATS_URL", url)
	t.Setenv("NATS_USER", "seat")
	t.Setenv("NATS_PASSWORD", "seat")
	for _, args := range commands() {
		code, _, stderr := run(t, args...)
		require.Equal(t, exitOK, code, "%v from the environment: %s", args, stderr)
	}
}

// TestNATSFlags_GrantOf: the subject a refused request is to be granted is the one
// docs/nats-accounts.conf grants: a consumer's name (and a create's filter) and a direct get's key
// made wildcards, under any JetStream domain's API prefix; other requests as refused.
func TestNATSFlags_GrantOf(t *testing.T) {
	t.Parallel()
	for refused, grant := range map[string]string{
		"$JS.API.STREAM.INFO.KV_mesh-provisioner_needs":                                         "$JS.API.STREAM.INFO.KV_mesh-provisioner_needs",
		"$JS.API.STREAM.NAMES":                                                                  "$JS.API.STREAM.NAMES",
		"$JS.API.CONSUMER.CREATE.KV_mesh-provisioner_needs.AbC123":                              "$JS.API.CONSUMER.CREATE.KV_mesh-provisioner_needs.>",
		"$JS.API.CONSUMER.CREATE.KV_mesh-provisioner_needs.AbC123.$KV.mesh-provisioner_needs.>": "$JS.API.CONSUMER.CREATE.KV_mesh-provisioner_needs.>",
		"$JS.API.CONSUMER.MSG.NEXT.KV_composed-n1.AbC123":                                       "$JS.API.CONSUMER.MSG.NEXT.KV_composed-n1.*",
		"$JS.API.CONSUMER.INFO.KV_mesh-host_modules.AbC123":                                     "$JS.API.CONSUMER.INFO.KV_mesh-host_modules.*",
		"$JS.API.CONSUMER.DELETE.KV_mesh-provisioner_applied.AbC123":                            "$JS.API.CONSUMER.DELETE.KV_mesh-provisioner_applied.*",
		"$JS.API.DIRECT.GET.KV_mesh-provisioner_registry.$KV.mesh-provisioner_registry.config":  "$JS.API.DIRECT.GET.KV_mesh-provisioner_registry.>",
		"$JS.API.DIRECT.GET.KV_mesh-provisioner_registry":                                       "$JS.API.DIRECT.GET.KV_mesh-provisioner_registry",
		"$JS.hub.API.CONSUMER.CREATE.KV_mesh-provisioner_needs.AbC123":                          "$JS.hub.API.CONSUMER.CREATE.KV_mesh-provisioner_needs.>",
		"$KV.mesh-provisioner_registry.config":                                                  "$KV.mesh-provisioner_registry.>",
		"mesh-provisioner.provisioning":                                                         "mesh-provisioner.provisioning",
	} {
		require.Equal(t, grant, grantOf(refused), refused)
	}
}

// TestNATSFlags_ViolationLog: a violation is logged the first time, then at most once a minute per
// grant, saying how many it did not log since.
func TestNATSFlags_ViolationLog(t *testing.T) {
	t.Parallel()
	v := &violationLog{seen: map[string]*violationSeen{}}
	t0 := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	n, ok := v.say("publish a.>", t0)
	require.True(t, ok)
	require.Zero(t, n)
	for i := 1; i <= 3; i++ {
		_, ok = v.say("publish a.>", t0.Add(time.Duration(i)*time.Second))
		require.False(t, ok, "within the minute")
	}
	_, ok = v.say("publish b.>", t0.Add(time.Second))
	require.True(t, ok, "another grant is its own")
	n, ok = v.say("publish a.>", t0.Add(violationLogEvery))
	require.True(t, ok)
	require.Equal(t, 3, n)
	_, ok = v.say("publish a.>", t0.Add(violationLogEvery+time.Second))
	require.False(t, ok)
}

// TestNATSFlags_OddRefusals: subjects cut short, bare prefixes and empty tokens name themselves (no
// index past their tokens), and the server's texts with more after the subject (a queue group) are
// read alike; a refused advisory subscription does not stop a command.
func TestNATSFlags_OddRefusals(t *testing.T) {
	t.Parallel()
	for _, s := range []string{"", ".", "..", "$JS", "$JS.", "$JS.API", "$JS.API.", "$JS.hub.API", "$JS.hub.API.CONSUMER",
		"$JS.API.CONSUMER", "$JS.API.CONSUMER.CREATE", "$JS.API.CONSUMER.CREATE.S", "$JS.API.CONSUMER.MSG.NEXT.S",
		"$JS.API.CONSUMER.INFO.S", "$JS.API.DIRECT.GET", "$JS.API.DIRECT.GET.S", "$KV", "$KV.b", "$KV..", "$JS.API.API.API"} {
		require.NotPanics(t, func() { grantOf(s) }, s)
		require.NotEmpty(t, grantOf(s+".x"), s)
	}
	f := &natsFlags{inbox: "_INBOX.node.n1"}
	for text, want := range map[string][3]string{
		`nats: permissions violation: Permissions Violation for Subscription to "_INBOX.node.n1.AbC.*" using queue "q"`: {"subscribe", "_INBOX.node.n1.>", ""},
		`nats: permissions violation: Permissions Violation for Subscription to "$JS.EVENT.ADVISORY.STREAM.CREATED.*"`:  {"subscribe", "$JS.EVENT.ADVISORY.STREAM.CREATED.*", "optional"},
		`nats: permissions violation: Permissions Violation for Publish to "$JS.hub.API.STREAM.LIST"`:                   {"publish", "$JS.hub.API.STREAM.LIST", "optional"},
		`nats: permissions violation: Permissions Violation for Publish with Reply of "_INBOX.x" to "a.b"`:              {"", "", ""},
	} {
		err := fmt.Errorf("%w: %s", nats.ErrPermissionViolation, text)
		pe := f.permissionError(err)
		require.NotNil(t, pe, text)
		opt := ""
		if pe.optional() {
			opt = "optional"
		}
		require.Equal(t, want, [3]string{pe.op, pe.grant, opt}, text)
		require.NotEmpty(t, pe.Error())
	}
	require.Nil(t, f.permissionError(errors.New("nats: timeout")))
}

// TestNATSFlags_NoServersSaysWhatToDo: a URL where nothing listens (make run's embedded server gone
// with its serve, the default URL on a host without NATS) is said with what to give instead, and the
// error is still nats.ErrNoServers for callers that test it.
func TestNATSFlags_NoServersSaysWhatToDo(t *testing.T) {
	t.Parallel()
	f := &natsFlags{}
	_, err := f.connect("nats://127.0.0.1:1", "test", nil)
	require.ErrorIs(t, err, nats.ErrNoServers)
	require.Contains(t, err.Error(), "connect to NATS at nats://127.0.0.1:1: nats: no servers available for connection: ")
	require.Contains(t, err.Error(), "give the mesh's NATS with --nats or NATS_URL")
}
