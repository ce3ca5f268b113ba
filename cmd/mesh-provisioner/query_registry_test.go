package main

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/seat"
	"github.com/novox/mesh-provisioner/store"
)

// TestQueryCommand_RegistryTable checks the table a person reads: a line per kind with its module, and
// where to find the values, a bucket with its key shape or a verb.
func TestQueryCommand_RegistryTable(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	nc, js := natstest.Connect(t, ns.ClientURL())
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	st, err := seat.Start(context.Background(), nc, js, db, seat.Config{WriteRegistry: true})
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, st.Stop())
		require.NoError(t, db.Close())
	})

	var out string
	natstest.CheckFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		var stdout, stderr bytes.Buffer
		if err := NewMain(&stdout, &stderr).Run(context.Background(), []string{"query", "registry", "--nats", ns.ClientURL()}); err != nil {
			return fmt.Errorf("%w: %s", err, stderr.String())
		}
		out = stdout.String()
		if !strings.Contains(out, fmt.Sprintf("%d rows", len(provisioner.Registry.Entries))) {
			return fmt.Errorf("registry not projected yet:\n%s", out)
		}
		return nil
	})

	lines := strings.Split(out, "\n")
	require.Equal(t, []string{"KIND", "MODULE", "WHERE"}, strings.Fields(lines[0]))
	want := map[string][]string{
		"config":    {"config", "mesh-config", "bucket", "mesh-config_values", "<node>.<module>.<name>"},
		"secret":    {"secret", "mesh-vault", "verb", "mesh-vault.secret"},
		"bound":     {"bound", "<provider-module>", "bucket", "<provider-module>_bound", "<node>.<module>.<provision>[.<local>]"},
		"consumers": {"consumers", "mesh-vault", "verb", "mesh-vault.consumers"},
		"shell":     {"shell", "mesh-provisioner", "bucket", "mesh-provisioner_collect", "<node>.<collection>.<contributor>"},
		"port":      {"port", "mesh-controller", "bucket", "mesh-controller_assignments", "<node>.<module>"},
	}
	seen := map[string]bool{}
	for _, line := range lines[1 : 1+len(provisioner.Registry.Entries)] {
		f := strings.Fields(line)
		require.NotEmpty(t, f, "a line per kind")
		seen[f[0]] = true
		if w, ok := want[f[0]]; ok {
			require.Equal(t, w, f, "the line of %s", f[0])
		}
	}
	for _, e := range provisioner.Registry.Entries {
		require.True(t, seen[e.Kind], "kind %s is printed", e.Kind)
	}
}

// TestQueryCommand_InboxPrefix checks that the program's default inbox prefix fits the seat's user of
// docs/nats-accounts.conf, and that --inbox-prefix lets a node's user ask.
func TestQueryCommand_InboxPrefix(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServerAt(t, "127.0.0.1:-1", t.TempDir(), "../../docs/nats-accounts.conf")
	nc, js := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("mesh-provisioner", "provisioner-change-me"),
		nats.CustomInboxPrefix(defaultInboxPrefix))
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	st, err := seat.Start(context.Background(), nc, js, db, seat.Config{WriteRegistry: true})
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, st.Stop())
		require.NoError(t, db.Close())
	})

	for _, args := range [][]string{
		{"--user", "mesh-provisioner", "--password", "provisioner-change-me"},
		{"--user", "node-n1", "--password", "n1-change-me", "--inbox-prefix", "_INBOX.node.n1"},
	} {
		natstest.CheckFor(t, 10*time.Second, 20*time.Millisecond, func() error {
			var stdout, stderr bytes.Buffer
			err := NewMain(&stdout, &stderr).Run(context.Background(),
				append([]string{"query", "registry", "--nats", ns.ClientURL(), "--timeout", "2s"}, args...))
			if err != nil {
				return fmt.Errorf("%v: %w: %s", args, err, stderr.String())
			}
			if !strings.Contains(stdout.String(), fmt.Sprintf("%d rows", len(provisioner.Registry.Entries))) {
				return fmt.Errorf("registry not projected yet:\n%s", stdout.String())
			}
			return nil
		})
	}
}

// query against a NATS where no seat answers says that and what to check, not NATS' "no responders";
// a seat that does not answer in time says how long it waited and the flag for it; flags that cannot
// work are a wrong command line.
func TestQuery_NoSeatOrNoAnswerSaysWhatToCheck(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	url := ns.ClientURL()
	code, _, stderr := run(t, "query", "needs", "--nats", url)
	require.Equal(t, exitFailure, code, stderr)
	require.Contains(t, stderr, "no seat answers mesh-provisioner.provisioning")
	require.Contains(t, stderr, "mesh-provisioner serve")

	nc, _ := natstest.Connect(t, url)
	sub, err := nc.SubscribeSync(query.Subject) // takes requests, never answers
	require.NoError(t, err)
	defer sub.Unsubscribe()
	require.NoError(t, nc.Flush()) // the server has the subscription before the query's request comes
	code, _, stderr = run(t, "query", "needs", "--nats", url, "--timeout", "200ms")
	require.Equal(t, exitFailure, code, stderr)
	require.Contains(t, stderr, "no answer within 200ms")
	require.Contains(t, stderr, "--timeout")

	for _, args := range [][]string{
		{"query", "--timeout", "0s"},
		{"query", "--timeout", "-1s"},
		{"query", "needs", "--wait", "5s"},
	} {
		code, _, stderr := run(t, append(args, "--nats", "nats://127.0.0.1:1")...)
		require.Equal(t, exitUsage, code, "%v: %s", args, stderr)
	}
}
