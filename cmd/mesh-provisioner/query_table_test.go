package main

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/query"
)

// fakeSeat answers every request on the verb's subject with answer, on a real nats-server, for the
// table tests that need answers the demo seat never gives. It returns the server's URL.
func fakeSeat(t *testing.T, answer map[string]any) string {
	t.Helper()
	ns := natstest.RunServer(t)
	nc, _ := natstest.Connect(t, ns.ClientURL())
	body, err := json.Marshal(answer)
	require.NoError(t, err)
	sub, err := nc.Subscribe(query.Subject, func(m *nats.Msg) { _ = m.Respond(body) })
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	require.NoError(t, nc.Flush())
	return ns.ClientURL()
}

// TestQuery_RegistryWhereNeverBlank: a kind whose value names neither a bucket nor a verb (a hand
// edit, another table's value) shows "-" in WHERE, not a blank cell or "bucket <nil>  <nil>".
func TestQuery_RegistryWhereNeverBlank(t *testing.T) {
	url := fakeSeat(t, map[string]any{"what": "registry", "rows": []any{
		map[string]any{"key": "odd", "kind": "odd", "module": "m", "revision": 3, "value": map[string]any{"kind": "odd"}},
		map[string]any{"key": "empty", "kind": "empty", "module": "m", "bucket": "", "verb": "", "revision": 4, "value": map[string]any{}},
		map[string]any{"key": "secret", "kind": "secret", "module": "mesh-vault", "verb": "mesh-vault.secret", "revision": 5, "value": map[string]any{}},
	}, "anomalies": []any{}, "anomalies_total": 0, "as_of": 5, "synced": true})
	code, out, stderr := run(t, "query", "registry", "--nats", url)
	require.Equal(t, 0, code, stderr)
	table, _ := tableLines(out)
	require.Equal(t, []string{"odd", "m", "-"}, strings.Fields(table[1]))
	require.Equal(t, []string{"empty", "m", "-"}, strings.Fields(table[2]))
	require.Equal(t, []string{"secret", "mesh-vault", "verb", "mesh-vault.secret"}, strings.Fields(table[3]))
}
