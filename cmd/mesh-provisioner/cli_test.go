package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"sort"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/query"
)

// run runs the binary's Main in this process and returns its exit code, stdout and stderr.
func run(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	err := NewMain(&out, &errb).Run(context.Background(), args)
	return exitCode(err, &errb), out.String(), errb.String()
}

// tableLines splits the table the query prints from its footer.
func tableLines(out string) (table []string, rest string) {
	blocks := strings.SplitN(out, "\n\n", 2)
	table = strings.Split(strings.TrimRight(blocks[0], "\n"), "\n")
	if len(blocks) == 2 {
		rest = blocks[1]
	}
	return table, rest
}

func TestQuery_TableAndJSON(t *testing.T) {
	s := demoSeat(t)
	s.waitReady(t)
	t.Setenv("NATS_URL", s.natsURL)
	nc, _ := natstest.Connect(t, s.natsURL)
	node := fixtures.NodeName(7)

	t.Run("table", func(t *testing.T) {
		want, last, err := natstest.AskAll(nc, query.Subject, map[string]any{"what": "needs", "node": node}, false)
		require.NoError(t, err)
		require.NotEmpty(t, want)
		code, out, stderr := run(t, "query", "needs", "--node", node)
		require.Equal(t, 0, code, stderr)
		table, rest := tableLines(out)
		cols := []string{"NODE", "MODULE", "KIND", "NAME", "REVISION", "VALUE"}
		require.Equal(t, cols, strings.Fields(table[0]))
		// Aligned: every cell starts where its header does.
		offs := make([]int, len(cols))
		for i, c := range cols {
			offs[i] = strings.Index(table[0], c)
		}
		require.Len(t, table[1:], len(want))
		for i, line := range table[1:] {
			row := want[i]
			value, _ := json.Marshal(row["value"])
			cells := []string{node, fmt.Sprint(row["module"]), fmt.Sprint(row["kind"]), fmt.Sprint(row["name"]), fmt.Sprint(row["revision"]), string(value)}
			for j, cell := range cells {
				if len(cell) > 72 {
					cell = cell[:69]
				}
				require.True(t, strings.HasPrefix(line[offs[j]:], cell), "line %d column %s: %q does not start %q", i, cols[j], line[offs[j]:], cell)
			}
		}
		require.Contains(t, rest, fmt.Sprintf("%d rows, as of sequence %d (synced)", len(want), last.AsOf))
	})

	t.Run("table with anomalies", func(t *testing.T) {
		_, last, err := natstest.AskAll(nc, query.Subject, map[string]any{"what": "collect", "collection": "shell:zsh:normal"}, false)
		require.NoError(t, err)
		require.NotEmpty(t, last.Anomalies, "the demo mesh has out-of-shape collect keys")
		code, out, stderr := run(t, "query", "collect", "--collection", "shell:zsh:normal")
		require.Equal(t, 0, code, stderr)
		table, rest := tableLines(out)
		require.Equal(t, []string{"NODE", "COLLECTION", "CONTRIBUTOR", "REVISION", "VALUE"}, strings.Fields(table[0]))
		for _, line := range table[1:] {
			require.Equal(t, "shell:zsh:normal", strings.Fields(line)[1], "the decoded collection name")
		}
		require.Contains(t, rest, fmt.Sprintf("%d anomalies", last.AnomaliesTotal))
		for _, a := range last.Anomalies {
			require.Contains(t, rest, fmt.Sprint(a["key"]))
		}
	})

	t.Run("a table of many pages is printed as they come", func(t *testing.T) {
		// A query of a whole bucket is millions of rows: the table is printed a chunk at a time while
		// the pages come, never held whole. Every request the seat is asked is seen here too.
		want, last, err := natstest.AskAll(nc, query.Subject, map[string]any{"what": "needs"}, false)
		require.NoError(t, err)
		const limit = 1000
		pages := (len(want) + limit - 1) / limit
		require.Greater(t, len(want), 2*tableChunk, "enough rows for several chunks")
		var asked atomic.Int64
		sub, err := nc.Subscribe(query.Subject, func(*nats.Msg) { asked.Add(1) })
		require.NoError(t, err)
		defer sub.Unsubscribe()
		require.NoError(t, nc.Flush())
		out := &firstWrite{}
		out.at = func() { out.askedBefore = asked.Load() }
		var errb bytes.Buffer
		err = NewMain(out, &errb).Run(context.Background(), []string{"query", "needs", "--limit", fmt.Sprint(limit)})
		require.NoError(t, err, errb.String())
		require.Less(t, out.askedBefore, int64(pages), "rows were printed before the last page was asked for")
		table, rest := tableLines(out.String())
		require.Len(t, table[1:], len(want))
		for i, line := range table[1:] {
			require.Equal(t, fmt.Sprint(want[i]["node"]), strings.Fields(line)[0], "line %d in key order", i)
		}
		require.Contains(t, rest, fmt.Sprintf("%d rows, as of sequence %d (synced)", len(want), last.AsOf))
	})

	t.Run("json, one object per answer", func(t *testing.T) {
		want, _, err := natstest.AskAll(nc, query.Subject, map[string]any{"what": "needs", "node": node}, false)
		require.NoError(t, err)
		require.Greater(t, len(want), 5, "enough rows for several pages")
		code, out, stderr := run(t, "query", "needs", "--node", node, "--limit", "5", "--json")
		require.Equal(t, 0, code, stderr)
		lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
		require.Len(t, lines, (len(want)+4)/5, "one line per page")
		var rows []map[string]any
		for i, line := range lines {
			var a natstest.Answer
			require.NoError(t, json.Unmarshal([]byte(line), &a), "line %d is one JSON object", i)
			require.Equal(t, "needs", a.What)
			require.True(t, a.Synced)
			require.Equal(t, i < len(lines)-1, a.Next != "", "next on every page but the last")
			rows = append(rows, a.Rows...)
		}
		require.Len(t, rows, len(want))
		for i := range rows {
			require.Equal(t, want[i]["key"], rows[i]["key"])
		}
	})
}

// firstWrite is a stdout that notes, at its first write, what at finds.
type firstWrite struct {
	bytes.Buffer
	at          func()
	askedBefore int64
	written     bool
}

func (w *firstWrite) Write(p []byte) (int, error) {
	if !w.written {
		w.written = true
		w.at()
	}
	return w.Buffer.Write(p)
}

// Exit codes scripts can trust: 0 done, 1 failed (NATS unreachable, ...), 2 the command line is
// wrong, 3 the verb answered an error.
func TestMain_ExitCodes(t *testing.T) {
	s := demoSeat(t)
	t.Setenv("NATS_URL", s.natsURL)
	cases := []struct {
		args []string
		code int
	}{
		{[]string{"query", "registry"}, 0},
		{[]string{"version"}, 0},
		{[]string{"--version"}, 0},
		{[]string{"version", "extra"}, 2},
		{[]string{"query", "--help"}, 0},
		{[]string{}, 2},
		{[]string{"frobnicate"}, 2},
		{[]string{"query", "--no-such-flag"}, 2},
		{[]string{"query", "needs", "applied"}, 2},
		{[]string{"serve", "--log-format", "xml"}, 2},
		{[]string{"serve", "--demo", "--nats", "nats://127.0.0.1:1"}, 2},
		{[]string{"query", "wants"}, 3},
		{[]string{"query", "needs", "--node", "not a token"}, 3},
		{[]string{"query", "needs", "--after", "n00000.nope.config.x"}, 3},
		{[]string{"query", "needs", "--contributor", "mod-001"}, 3},                          // contributor narrows collect only
		{[]string{"query", "collect", "--module", "mod-001", "--contributor", "mod-002"}, 3}, // the same field, two values
		{[]string{"query", "registry", "--nats", "nats://127.0.0.1:1"}, 1},
	}
	for _, tc := range cases {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			code, _, stderr := run(t, tc.args...)
			require.Equal(t, tc.code, code, stderr)
			if tc.code != 0 {
				require.Contains(t, stderr, "mesh-provisioner:", "says why on stderr")
			}
		})
	}
}

// Every subcommand answers --help with its flags and an example, and exits 0.
func TestMain_HelpOnEveryCommand(t *testing.T) {
	t.Parallel()
	cmds := []string{"serve", "query", "version"}
	for name := range extraCommands {
		cmds = append(cmds, name)
	}
	sort.Strings(cmds)
	for _, name := range cmds {
		for _, flag := range []string{"--help", "-h"} {
			t.Run(name+" "+flag, func(t *testing.T) {
				code, out, stderr := run(t, name, flag)
				require.Equal(t, 0, code, stderr)
				help := out + stderr
				require.Contains(t, help, "Usage: mesh-provisioner "+name)
				require.Contains(t, help, "Example")
				require.Contains(t, help, "mesh-provisioner "+name+" ", "the example runs the command")
			})
		}
	}
	// The top-level usage lists every command.
	code, _, stderr := run(t, "help")
	require.Equal(t, 0, code)
	for _, name := range cmds {
		require.Contains(t, stderr, "  "+name+" ")
	}
}

// Long work draws a progress bar on a terminal only: the demo load under a test (no terminal) leaves
// one summary line in the log and no bar.
func TestServe_DemoLoadQuietWithoutTerminal(t *testing.T) {
	s := demoSeat(t)
	logs := s.stderr.String()
	require.NotContains(t, logs, "\r", "no bar redrawn in place")
	require.NotContains(t, logs, "demo: loading")
	require.Contains(t, logs, `"demo mesh loaded"`)
}

// TestMain_FlagsAroundWhat: query's WHAT and replay's question arguments may come before, between or
// after the flags, and answer as in the documented order. The flag package stops at the first
// argument that is not a flag, so `query --node n7 needs --json` took needs and --json for WHATs and
// said `query takes one WHAT, got ["" "needs" "--json"]` (exit 2); replay did the same with its flags
// after WHAT or KEY.
func TestMain_FlagsAroundWhat(t *testing.T) {
	s := demoSeat(t)
	s.waitReady(t)
	t.Setenv("NATS_URL", s.natsURL)
	node := fixtures.NodeName(7)
	state := filepath.Join(s.dir, "state")
	key := node + ".mod-003.secret.need-03"
	for _, c := range []struct{ documented, around []string }{
		{[]string{"query", "needs", "--node", node, "--json"}, []string{"query", "--node", node, "needs", "--json"}},
		{[]string{"query", "needs", "--node", node}, []string{"query", "--node", node, "needs"}},
		{[]string{"replay", "state", "needs", "--at", "seq:300", "--node", node, "--state", state, "--json"},
			[]string{"replay", "state", "--at", "seq:300", "needs", "--node", node, "--state", state, "--json"}},
		{[]string{"replay", "history", "needs", key, "--state", state, "--json"},
			[]string{"replay", "history", "--state", state, "needs", "--json", key}},
		{[]string{"replay", "history", "needs", key, "--state", state, "--json"},
			[]string{"replay", "history", "--state", state, "--json", "--", "needs", key}},
	} {
		t.Run(strings.Join(c.around, " "), func(t *testing.T) {
			code, want, stderr := run(t, c.documented...)
			require.Equal(t, exitOK, code, stderr)
			code, got, stderr := run(t, c.around...)
			require.Equal(t, exitOK, code, stderr)
			require.Equal(t, want, got)
		})
	}
	// Two WHATs are still one too many, wherever they are.
	code, _, stderr := run(t, "query", "--node", node, "needs", "applied")
	require.Equal(t, exitUsage, code, stderr)
	require.Contains(t, stderr, `query takes one WHAT, got ["needs" "applied"]`)
	code, _, stderr = run(t, "replay", "state", "--at", "seq:1", "needs", "--node", node, "applied", "--state", state)
	require.Equal(t, exitUsage, code, stderr)
	require.Contains(t, stderr, `replay state takes one WHAT, got ["needs" "applied"]`)
}

// TestServe_DemoSaysCommandsThatReachIt: the commands serve --demo prints to try reach this seat. On
// an --embedded-listen other than the default they named no server, so they asked
// nats://127.0.0.1:4222, where nothing answers, or another seat does.
func TestServe_DemoSaysCommandsThatReachIt(t *testing.T) {
	s := demoSeat(t)
	s.waitReady(t)
	t.Setenv("NATS_URL", "")
	var tried int
	for _, line := range strings.Split(s.stdout.String(), "\n") {
		args, ok := strings.CutPrefix(strings.TrimSpace(line), "go run ./cmd/mesh-provisioner ")
		if !ok {
			continue
		}
		tried++
		code, out, stderr := run(t, strings.Fields(args)...)
		require.Equal(t, exitOK, code, "%s: %s", line, stderr)
		require.NotContains(t, out, "\n0 rows", line)
	}
	require.Equal(t, 3, tried, "the commands to try:\n%s", s.stdout.String())
	require.Contains(t, s.stdout.String(), "nats --server "+s.natsURL+" req mesh-provisioner.provisioning")
}
