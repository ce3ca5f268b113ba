package main

import (
	"encoding/json"
	"strconv"
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
	t.Parallel()
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

// TestQuery_TableQuotesOddCells: a cell that is empty or holds white space, a control character or a
// quote is printed quoted as Go quotes it, so each row stays one line and its cells stay apart (a
// decoded collection name may hold any of them: =0A is a newline); the anomalies header says when the
// answer cut the list (anomalies_total above the rows shown).
func TestQuery_TableQuotesOddCells(t *testing.T) {
	t.Parallel()
	odd := []string{"shell zsh", "two\nlines", "tab\there", `say "hi"`, "", "bell\a"}
	var rows []any
	for i, c := range odd {
		rows = append(rows, map[string]any{"key": "n1.x.m", "node": "n1", "collection": c, "collection_key": "x",
			"contributor": "m", "revision": i + 1, "value": map[string]any{}})
	}
	url := fakeSeat(t, map[string]any{"what": "collect", "rows": rows,
		"anomalies":       []any{map[string]any{"bucket": "mesh-provisioner_collect", "key": "n1.a b", "revision": 9, "reason": "token-count: want 3, have 2"}},
		"anomalies_total": 2345, "as_of": 9, "synced": true})
	code, out, stderr := run(t, "query", "collect", "--nats", url)
	require.Equal(t, 0, code, stderr)
	table, rest := tableLines(out)
	require.Len(t, table, 1+len(odd), "a line a row:\n%s", out)
	for i, c := range odd {
		require.Equal(t, []string{"n1", strconv.Quote(c), "m", strconv.Itoa(i + 1), "{}"}, fieldsQuoted(table[1+i]), "row %d", i)
	}
	require.Contains(t, rest, "anomalies (1 of 2345")
	require.Contains(t, rest, `mesh-provisioner_collect  "n1.a b"`)
}

// fieldsQuoted splits a table line as strings.Fields does, but keeps a Go-quoted cell whole.
func fieldsQuoted(line string) []string {
	var out []string
	for line = strings.TrimSpace(line); line != ""; line = strings.TrimSpace(line) {
		if line[0] == '"' {
			if q, err := strconv.QuotedPrefix(line); err == nil {
				out, line = append(out, q), line[len(q):]
				continue
			}
		}
		f := strings.Fields(line)[0]
		out, line = append(out, f), line[len(f):]
	}
	return out
}

// TestQuery_TableSaysOmittedValue: a row answered without its value (value null, value_omitted with
// its size) says so in VALUE, not "null" as if the value were null.
func TestQuery_TableSaysOmittedValue(t *testing.T) {
	t.Parallel()
	url := fakeSeat(t, map[string]any{"what": "applied", "rows": []any{
		map[string]any{"key": "n1.big", "node": "n1", "module": "big", "revision": 1, "value": nil, "value_omitted": 2000000},
		map[string]any{"key": "n1.nil", "node": "n1", "module": "nil", "revision": 2, "value": nil},
	}, "anomalies": []any{}, "anomalies_total": 0, "as_of": 2, "synced": true})
	code, out, stderr := run(t, "query", "applied", "--nats", url)
	require.Equal(t, 0, code, stderr)
	table, _ := tableLines(out)
	require.Equal(t, []string{"n1", "big", "1", "(omitted:", "2000000", "bytes,", "too", "large", "to", "answer)"}, strings.Fields(table[1]))
	require.Equal(t, []string{"n1", "nil", "2", "null"}, strings.Fields(table[2]), "a null value is null")
}

// TestQuery_OnePageSaysMoreFollow: --one-page stops after the first answer; when that answer had
// next, stderr says more rows follow and the --after that asks for them.
func TestQuery_OnePageSaysMoreFollow(t *testing.T) {
	t.Parallel()
	url := fakeSeat(t, map[string]any{"what": "applied", "rows": []any{
		map[string]any{"key": "n1.m", "node": "n1", "module": "m", "revision": 1, "value": map[string]any{}},
	}, "anomalies": []any{}, "anomalies_total": 0, "as_of": 2, "synced": true, "next": "n1.m"})
	for _, args := range [][]string{{}, {"--json"}} {
		code, out, stderr := run(t, append([]string{"query", "applied", "--one-page", "--nats", url}, args...)...)
		require.Equal(t, 0, code, stderr)
		require.Contains(t, stderr, "more rows follow: add --after n1.m for the next page", "%v", args)
		require.NotContains(t, out, "more rows follow", "%v: stdout is the answer alone", args)
	}
}

// TestQuery_HelpNamesTheRequestFields: query --help names the request field each flag sends, as the
// contract writes them, and the bounds the command checks.
func TestQuery_HelpNamesTheRequestFields(t *testing.T) {
	t.Parallel()
	code, _, stderr := run(t, "query", "--help")
	require.Equal(t, 0, code)
	for _, field := range []string{"request's what", "request's at", "request's limit: 1 to 10000 (default 1000)", "request's after",
		"request's min_seq", "request's wait_ms", "0 to 10s"} {
		require.Contains(t, stderr, field)
	}
}
