package main

// The operator-facing docs against the binary as built: the flag tables of docs/operations.md against
// each command's --help, the metrics table against a running seat's /metrics, the log table against
// the log calls of the code and the seat's own start line, and the examples of docs/protocol.md
// against what the verb and $SRV.* answer. TestDocs_CommandsRun runs the docs' sh blocks; these check
// the statements around them.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/metrics/metricstest"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/store"
)

// mdTable is a markdown table: its header cells, its rows' cells, the line it starts on, and the
// heading it sits under.
type mdTable struct {
	heading string
	line    int
	header  []string
	rows    [][]string
}

// mdTables reads every table of a markdown file.
func mdTables(tb testing.TB, rel string) []mdTable {
	tb.Helper()
	var out []mdTable
	var cur *mdTable
	heading := ""
	sc := bufio.NewScanner(bytes.NewReader(repoFile(tb, rel)))
	n := 0
	for sc.Scan() {
		n++
		l := strings.TrimSpace(sc.Text())
		if strings.HasPrefix(l, "#") {
			heading = strings.TrimSpace(strings.TrimLeft(l, "#"))
		}
		if !strings.HasPrefix(l, "|") {
			if cur != nil {
				out = append(out, *cur)
				cur = nil
			}
			continue
		}
		cells := splitRow(l)
		switch {
		case cur == nil:
			cur = &mdTable{heading: heading, line: n, header: cells}
		case len(cur.rows) == 0 && strings.Trim(strings.Join(cells, ""), "-: ") == "":
			// the separator row
		default:
			cur.rows = append(cur.rows, cells)
		}
	}
	if cur != nil {
		out = append(out, *cur)
	}
	return out
}

// splitRow splits a table row on the | outside backticks (`text\|json` holds an escaped one).
func splitRow(l string) []string {
	l = strings.TrimSuffix(strings.TrimPrefix(l, "|"), "|")
	var cells []string
	var cur strings.Builder
	code := false
	for i := 0; i < len(l); i++ {
		switch c := l[i]; {
		case c == '`':
			code = !code
			cur.WriteByte(c)
		case c == '\\' && i+1 < len(l) && l[i+1] == '|':
			cur.WriteByte('|')
			i++
		case c == '|' && !code:
			cells = append(cells, strings.TrimSpace(cur.String()))
			cur.Reset()
		default:
			cur.WriteByte(c)
		}
	}
	return append(cells, strings.TrimSpace(cur.String()))
}

var codeSpanRe = regexp.MustCompile("`` (.*?) ``|`([^`]*)`")

// codeSpans are the `...` spans of a cell, in order; a span holding a backtick is written “ ... “.
func codeSpans(cell string) []string {
	var out []string
	for _, m := range codeSpanRe.FindAllStringSubmatch(cell, -1) {
		out = append(out, m[1]+m[2])
	}
	return out
}

// helpFlag is one flag as a command's --help shows it.
type helpFlag struct {
	def string // the default the help states, "" when none
	env string // the environment variable it names, "" when none
}

var (
	helpFlagRe = regexp.MustCompile(`^  -([a-z0-9-]+)(?: (\S+))?$`)
	helpDefRe  = regexp.MustCompile(`\(default ("(?:[^"\\]|\\.)*"|[^,)]*)`)
	helpEnvRe  = regexp.MustCompile(`\(env ([A-Z_]+)\)`)
)

// helpFlags runs `mesh-provisioner CMD --help` and reads the flags it lists.
func helpFlags(t *testing.T, cmd string) map[string]helpFlag {
	t.Helper()
	var stdout, stderr bytes.Buffer
	err := NewMain(&stdout, &stderr).Run(context.Background(), []string{cmd, "--help"})
	require.Equal(t, 0, exitCode(err, &stderr), "%s --help: %s", cmd, stderr.String())
	out := map[string]helpFlag{}
	name, usage := "", ""
	flush := func() {
		if name == "" {
			return
		}
		f := helpFlag{}
		if m := helpDefRe.FindAllStringSubmatch(usage, -1); m != nil {
			f.def = m[len(m)-1][1]
			if s, err := strconv.Unquote(f.def); err == nil {
				f.def = s
			}
		}
		if m := helpEnvRe.FindStringSubmatch(usage); m != nil {
			f.env = m[1]
		}
		out[name] = f
	}
	for _, l := range strings.Split(stderr.String(), "\n") {
		if m := helpFlagRe.FindStringSubmatch(l); m != nil {
			flush()
			name, usage = m[1], ""
			continue
		}
		if name != "" && strings.HasPrefix(l, "    \t") {
			usage += " " + strings.TrimSpace(l)
		}
	}
	flush()
	require.NotEmpty(t, out, "%s --help lists no flags:\n%s", cmd, stderr.String())
	return out
}

// sameDefault compares a documented default with the help's: equal as written, or as durations (1h
// and 1h0m0s).
func sameDefault(doc, help string) bool {
	if doc == help {
		return true
	}
	d1, err1 := time.ParseDuration(doc)
	d2, err2 := time.ParseDuration(help)
	return err1 == nil && err2 == nil && d1 == d2
}

// The flag tables of docs/operations.md, one per command (headed "`CMD` flag"), say every flag of that
// command's --help with the default and the environment variable the help states, and nothing else;
// every --flag the docs name in prose is a flag of some command.
func TestDocs_FlagTables(t *testing.T) {
	for _, env := range []string{"NATS_URL", "NATS_CREDS", "NATS_USER", "NATS_PASSWORD", "NATS_INBOX_PREFIX"} {
		t.Setenv(env, "") // the defaults as the help shows them without the environment
	}
	commands := []string{"serve", "query", "rebuild", "replay", "export"}
	tables := map[string]mdTable{}
	for _, tbl := range mdTables(t, "docs/operations.md") {
		spans := codeSpans(tbl.header[0])
		if len(spans) == 1 && strings.HasSuffix(tbl.header[0], "flag") {
			require.NotContains(t, tables, spans[0], "two flag tables of %s", spans[0])
			tables[spans[0]] = tbl
		}
	}
	known := map[string]bool{"help": true, "version": true} // the flag package answers -h and --help; main, --version
	for _, cmd := range commands {
		t.Run(cmd, func(t *testing.T) {
			help := helpFlags(t, cmd)
			for name := range help {
				known[name] = true
			}
			tbl, ok := tables[cmd]
			require.True(t, ok, "docs/operations.md has no table headed \"`%s` flag\"", cmd)
			require.Equal(t, []string{"`" + cmd + "` flag", "env", "default"}, tbl.header[:3], "docs/operations.md:%d", tbl.line)
			documented := map[string]bool{}
			for _, row := range tbl.rows {
				names := codeSpans(row[0])
				envs, defs := codeSpans(row[1]), codeSpans(row[2])
				require.NotEmpty(t, names, "docs/operations.md:%d: %v", tbl.line, row)
				require.True(t, len(envs) == 0 || len(envs) == len(names), "%v: one env per flag, or none", row)
				require.True(t, len(defs) == 0 || len(defs) == len(names), "%v: one default per flag, or none", row)
				for i, n := range names {
					require.True(t, strings.HasPrefix(n, "--"), "%v: %q is not a flag", row, n)
					n = strings.TrimPrefix(n, "--")
					documented[n] = true
					h, ok := help[n]
					require.True(t, ok, "docs/operations.md documents %s --%s, which its --help does not list", cmd, n)
					env, def := "", ""
					if len(envs) > 0 {
						env = envs[i]
					}
					if len(defs) > 0 {
						def = defs[i]
					}
					require.Equal(t, h.env, env, "%s --%s: the environment variable", cmd, n)
					if def == "" {
						require.Contains(t, []string{"", "false", "0"}, h.def, "%s --%s: the docs give no default, --help says %q", cmd, n, h.def)
					} else {
						require.True(t, sameDefault(def, h.def), "%s --%s: docs say default %q, --help says %q", cmd, n, def, h.def)
					}
				}
			}
			var missing []string
			for n := range help {
				if !documented[n] {
					missing = append(missing, "--"+n)
				}
			}
			sort.Strings(missing)
			require.Empty(t, missing, "%s --help lists flags docs/operations.md does not document", cmd)
		})
	}

	// Every `--flag` of the docs' prose is one a command takes.
	files, err := filepath.Glob(filepath.Join("..", "..", "docs", "*.md"))
	require.NoError(t, err)
	files = append(files, filepath.Join("..", "..", "README.md"))
	flagRe := regexp.MustCompile("`--([a-z][a-z0-9-]*)[ `=]")
	for _, f := range files {
		b, err := os.ReadFile(f)
		require.NoError(t, err)
		for _, m := range flagRe.FindAllStringSubmatch(string(b), -1) {
			if strings.HasSuffix(m[1], "-") {
				continue // a family, such as `--embedded-*`
			}
			require.True(t, known[m[1]], "%s names --%s, which no command takes", f, m[1])
		}
	}
}

// The metrics table of docs/operations.md is what a running seat exports: every mesh_provisioner_*
// family it serves is a row, with the type and the labels the row states, and every row is served.
func TestDocs_MetricsTable(t *testing.T) {
	s := demoSeat(t)
	s.waitReady(t)
	nc, _ := natstest.Connect(t, s.natsURL)
	_, _, err := natstest.Ask(nc, query.Subject, nil, false) // the request histogram has a series once asked
	require.NoError(t, err)
	var fams metricstest.Families
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		fams, err = metricstest.Scrape(s.metricsAddr)
		if err != nil {
			return err
		}
		if _, ok := fams.Value("mesh_provisioner_request_duration_seconds"); !ok {
			return fmt.Errorf("no request counted yet")
		}
		return nil
	})

	type doc struct {
		typ    string
		labels []string
	}
	documented := map[string]doc{}
	for _, tbl := range mdTables(t, "docs/operations.md") {
		if len(tbl.header) < 3 || tbl.header[0] != "metric" {
			continue
		}
		require.Equal(t, []string{"metric", "type", "labels"}, tbl.header[:3])
		for _, row := range tbl.rows {
			labels := codeSpans(row[2])
			sort.Strings(labels)
			for _, name := range codeSpans(row[0]) {
				require.NotContains(t, documented, name, "documented twice")
				documented[name] = doc{typ: row[1], labels: labels}
			}
		}
	}
	require.NotEmpty(t, documented, "docs/operations.md has no metrics table")

	for name, d := range documented {
		f, ok := fams[name]
		require.True(t, ok, "docs/operations.md documents %s, which the seat does not serve", name)
		require.Equal(t, d.typ, strings.ToLower(f.GetType().String()), "%s: type", name)
		require.NotEmpty(t, f.GetMetric(), "%s: no sample to read its labels from", name)
		for _, m := range f.GetMetric() {
			var have []string
			for _, lp := range m.GetLabel() {
				have = append(have, lp.GetName())
			}
			sort.Strings(have)
			require.Equal(t, fmt.Sprint(d.labels), fmt.Sprint(have), "%s: labels", name)
		}
	}
	var undocumented []string
	for name := range fams {
		if _, ok := documented[name]; strings.HasPrefix(name, "mesh_provisioner_") && !ok {
			undocumented = append(undocumented, name)
		}
	}
	sort.Strings(undocumented)
	require.Empty(t, undocumented, "served but not in the metrics table of docs/operations.md")
}

// logCall is a log line the code writes: its message and level.
type logCall struct {
	msg, level, at string
}

// logCalls reads every Info, Warn and Error call with a constant message in the program's code (not
// tests, benchmarks or the reliability harness).
func logCalls(t *testing.T) []logCall {
	t.Helper()
	root := filepath.Join("..", "..")
	var out []logCall
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		if d.IsDir() {
			switch rel {
			case "cmd/bench", "reliability", "testdata", ".git":
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		fset := token.NewFileSet()
		f, err := parser.ParseFile(fset, path, nil, 0)
		if err != nil {
			return err
		}
		ast.Inspect(f, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok || len(call.Args) == 0 {
				return true
			}
			sel, ok := call.Fun.(*ast.SelectorExpr)
			if !ok {
				return true
			}
			level := map[string]string{"Info": "info", "Warn": "warn", "Error": "error"}[sel.Sel.Name]
			if level == "" {
				return true
			}
			// The message: a literal; a literal prefix and more ("metrics: " + ...), written "metrics: ...";
			// or a variable, which takes each literal the file assigns to a variable of its name.
			var lits []*ast.BasicLit
			suffix := ""
			switch a := call.Args[0].(type) {
			case *ast.BasicLit:
				lits = append(lits, a)
			case *ast.BinaryExpr:
				if l, ok := a.X.(*ast.BasicLit); ok {
					lits, suffix = append(lits, l), "..."
				}
			case *ast.Ident:
				ast.Inspect(f, func(n ast.Node) bool {
					if as, ok := n.(*ast.AssignStmt); ok && len(as.Lhs) == 1 && len(as.Rhs) == 1 {
						if id, ok := as.Lhs[0].(*ast.Ident); ok && id.Name == a.Name {
							if l, ok := as.Rhs[0].(*ast.BasicLit); ok {
								lits = append(lits, l)
							}
						}
					}
					return true
				})
			}
			if len(lits) == 0 {
				return true
			}
			// A slog call: the receiver is a logger (log, s.log, w.log, ...).
			recv := ""
			switch x := sel.X.(type) {
			case *ast.Ident:
				recv = x.Name
			case *ast.SelectorExpr:
				recv = x.Sel.Name
			}
			if recv != "log" && recv != "l" && recv != "logger" {
				return true
			}
			for _, lit := range lits {
				if lit.Kind != token.STRING {
					continue
				}
				msg, err := strconv.Unquote(lit.Value)
				if err != nil {
					continue
				}
				out = append(out, logCall{msg: msg + suffix, level: level, at: fmt.Sprintf("%s:%d", rel, fset.Position(call.Pos()).Line)})
			}
			return true
		})
		return nil
	})
	require.NoError(t, err)
	require.NotEmpty(t, out)
	return out
}

// The log table of docs/operations.md names every line the program logs, each at the level the code
// writes it, and the start line carries the fields it lists: one per setting, so every serve flag.
func TestDocs_LogMessages(t *testing.T) {
	calls := logCalls(t)
	type row struct {
		level string
		line  int
	}
	documented := map[string]row{}
	for _, tbl := range mdTables(t, "docs/operations.md") {
		if tbl.heading != "Logs" || len(tbl.header) < 2 || tbl.header[0] != "message" {
			continue
		}
		require.Equal(t, "level", tbl.header[1])
		for _, r := range tbl.rows {
			for _, msg := range codeSpans(r[0]) {
				documented[msg] = row{level: r[1], line: tbl.line}
			}
		}
	}
	require.NotEmpty(t, documented, "docs/operations.md has no log table under Logs")
	// Each documented message is logged by the code at the documented level.
	for msg, r := range documented {
		found := false
		for _, c := range calls {
			if c.msg == msg {
				found = true
				require.Equal(t, r.level, c.level, "%q (%s) is logged at %s, docs/operations.md says %s", msg, c.at, c.level, r.level)
			}
		}
		require.True(t, found, "docs/operations.md quotes the log line %q, which the code never writes", msg)
	}
	// And every line the code writes is documented.
	var missing []string
	for _, c := range calls {
		if _, ok := documented[c.msg]; !ok {
			missing = append(missing, fmt.Sprintf("%s %q (%s)", c.level, c.msg, c.at))
		}
	}
	sort.Strings(missing)
	require.Empty(t, missing, "log lines the log table of docs/operations.md does not name")

	// The start line, as the demo seat wrote it (--log-format json).
	s := demoSeat(t)
	var start map[string]any
	for _, l := range strings.Split(s.stderr.String(), "\n") {
		var m map[string]any
		if json.Unmarshal([]byte(l), &m) == nil && m["msg"] == "mesh-provisioner starting" {
			start = m
			break
		}
	}
	require.NotNil(t, start, "no start line in the demo seat's log")
	var fields []string
	for _, tbl := range mdTables(t, "docs/operations.md") {
		for _, r := range tbl.rows {
			if tbl.heading == "Logs" && len(r) > 3 && strings.Contains(r[0], "`mesh-provisioner starting`") {
				fields = codeSpans(r[3])
			}
		}
	}
	require.NotEmpty(t, fields, "the log table gives the start line's fields")
	var have []string
	for k := range start {
		if k != "time" && k != "level" && k != "msg" {
			have = append(have, k)
		}
	}
	sort.Strings(have)
	sort.Strings(fields)
	require.Equal(t, fields, have, "the start line's fields")
	// "every setting": each serve flag has its field (--no-registry is write_registry; the password
	// is never logged; --nats is nats with the embedded server's URL when it is not given).
	for name := range helpFlags(t, "serve") {
		field := strings.ReplaceAll(name, "-", "_")
		switch name {
		case "no-registry":
			field = "write_registry"
		case "password":
			continue
		}
		require.Contains(t, have, field, "serve --%s is a setting the start line does not say", name)
	}
}

// readBlock returns the body of the first fenced block of lang in a markdown file that follows a line
// containing after.
func readBlock(tb testing.TB, rel, after, lang string) string {
	tb.Helper()
	text := string(repoFile(tb, rel))
	i := strings.Index(text, after)
	require.GreaterOrEqual(tb, i, 0, "%s: no %q", rel, after)
	text = text[i:]
	open := "```" + lang + "\n"
	j := strings.Index(text, open)
	require.GreaterOrEqual(tb, j, 0, "%s: no %s block after %q", rel, lang, after)
	text = text[j+len(open):]
	k := strings.Index(text, "```")
	require.GreaterOrEqual(tb, k, 0)
	return text[:k]
}

// keysOf lists a JSON object's keys, sorted.
func keysOf(m map[string]any) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// The examples of docs/protocol.md are what the demo seat answers: the applied answer, the error's
// headers and body, and the fields of $SRV.INFO and $SRV.STATS.
func TestDocs_ProtocolExamples(t *testing.T) {
	s := demoSeat(t)
	s.waitReady(t)
	nc, _ := natstest.Connect(t, s.natsURL)

	t.Run("answer", func(t *testing.T) {
		var want map[string]any
		require.NoError(t, json.Unmarshal([]byte(readBlock(t, "docs/protocol.md", "A real answer of the demo mesh", "json")), &want))
		// The request is the one the text before the block names: (`'{...}'`, ...).
		text := string(repoFile(t, "docs/protocol.md"))
		intro := text[strings.Index(text, "A real answer of the demo mesh"):]
		req := regexp.MustCompile("`'([^']*)'`").FindStringSubmatch(intro)
		require.NotNil(t, req, "the example names its request")
		msg, err := nc.Request(query.Subject, []byte(req[1]), 10*time.Second)
		require.NoError(t, err)
		require.Empty(t, msg.Header.Get(micro.ErrorCodeHeader), string(msg.Data))
		var got map[string]any
		require.NoError(t, json.Unmarshal(msg.Data, &got))
		require.Equal(t, keysOf(want), keysOf(got), "the answer's fields")
		for _, k := range []string{"what", "anomalies", "anomalies_total", "as_of", "synced"} {
			require.Equal(t, want[k], got[k], k)
		}
		// The rows shown are rows of the answer, as answered but for their time.
		byKey := map[string]map[string]any{}
		for _, r := range got["rows"].([]any) {
			row := r.(map[string]any)
			byKey[row["key"].(string)] = row
		}
		for _, r := range want["rows"].([]any) {
			row := r.(map[string]any)
			have, ok := byKey[row["key"].(string)]
			require.True(t, ok, "no row %v", row["key"])
			require.Equal(t, keysOf(row), keysOf(have), "%v: fields", row["key"])
			for k, v := range row {
				if k != "created" {
					require.Equal(t, v, have[k], "%v: %s", row["key"], k)
				}
			}
		}
	})

	t.Run("error", func(t *testing.T) {
		block := readBlock(t, "docs/protocol.md", "The code is in the header", "text")
		head, body, ok := strings.Cut(block, "\n\n")
		require.True(t, ok)
		msg, err := nc.Request(query.Subject, []byte(`{"what":"wants"}`), 10*time.Second)
		require.NoError(t, err)
		for _, l := range strings.Split(strings.TrimSpace(head), "\n") {
			k, v, ok := strings.Cut(l, ": ")
			require.True(t, ok, l)
			require.Equal(t, v, msg.Header.Get(k), k)
		}
		require.JSONEq(t, strings.TrimSpace(body), string(msg.Data))
	})

	t.Run("$SRV.INFO", func(t *testing.T) {
		msg, err := nc.Request("$SRV.INFO."+query.ServiceName, nil, 5*time.Second)
		require.NoError(t, err)
		var info micro.Info
		require.NoError(t, json.Unmarshal(msg.Data, &info))
		require.Equal(t, Version, info.Version)
		require.Equal(t, query.ServiceName, info.Name)
		require.Equal(t, Version, info.Metadata["version"])
		require.Contains(t, info.Metadata, "schema")
		require.Contains(t, info.Metadata, "buckets")
		require.Contains(t, info.Metadata["buckets"], "mesh-provisioner_needs")
		require.Len(t, info.Endpoints, 1)
		require.Equal(t, query.Subject, info.Endpoints[0].Subject)
		require.Equal(t, "q", info.Endpoints[0].QueueGroup)
	})

	t.Run("$SRV.STATS", func(t *testing.T) {
		var want map[string]any
		require.NoError(t, json.Unmarshal([]byte(readBlock(t, "docs/protocol.md", "`$SRV.STATS` carries", "json")), &want))
		msg, err := nc.Request("$SRV.STATS."+query.ServiceName, nil, 5*time.Second)
		require.NoError(t, err)
		var stats struct {
			Endpoints []struct {
				Data map[string]any `json:"data"`
			} `json:"endpoints"`
		}
		require.NoError(t, json.Unmarshal(msg.Data, &stats))
		require.Len(t, stats.Endpoints, 1)
		got := stats.Endpoints[0].Data
		require.Equal(t, keysOf(want), keysOf(got), "the endpoint's data")
		wb := want["buckets"].(map[string]any)["mesh-provisioner_needs"].(map[string]any)
		gb, ok := got["buckets"].(map[string]any)["mesh-provisioner_needs"].(map[string]any)
		require.True(t, ok, "needs is listed")
		require.Equal(t, keysOf(wb), keysOf(gb), "a bucket's fields")
	})
}

// docs/operations.md, Upgrade: a binary of another state dir schema does not refuse the old state dir
// when it serves: it starts it over from the streams and answers meanwhile (replay --state and export
// --state, which only read, refuse it and say to rebuild).
func TestDocs_UpgradeStartsOver(t *testing.T) {
	t.Setenv("NATS_URL", "")
	dir := t.TempDir()
	db, err := store.OpenState(filepath.Join(dir, "state"), store.Options{})
	require.NoError(t, err)
	gen := db.Dir()
	require.NoError(t, db.Close())
	// The state dir as an older binary left it: schema 0.
	pdb, err := pebble.Open(gen, &pebble.Options{})
	require.NoError(t, err)
	require.NoError(t, pdb.Set([]byte("\x01schema"), []byte("0"), pebble.Sync))
	require.NoError(t, pdb.Close())

	code, _, stderr := run(t, "replay", "state", "needs", "--at", "seq:1", "--state", filepath.Join(dir, "state"))
	require.Equal(t, exitFailure, code, stderr)
	require.Contains(t, stderr, "mesh-provisioner rebuild")

	s, err := startServe(dir, "--log-format", "json")
	require.NoError(t, err)
	defer func() { require.NoError(t, s.stop()) }()
	require.Contains(t, s.stderr.String(), "the state dir cannot be used; rebuilding it from the streams")
	nc, _ := natstest.Connect(t, s.natsURL)
	natstest.CheckFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		a, _, err := natstest.Ask(nc, query.Subject, []byte(`{"what":"registry"}`), false)
		if err != nil {
			return err
		}
		if len(a.Rows) == 0 {
			return fmt.Errorf("no registry rows yet")
		}
		return nil
	})
}

// The examples of each command's --help take flags the command has, with values it reads: an operator
// copies them at 3 a.m.
func TestDocs_HelpExamplesParse(t *testing.T) {
	t.Setenv("NATS_URL", "")
	for _, cmd := range []string{"serve", "query", "rebuild", "replay", "export"} {
		var stdout, stderr bytes.Buffer
		err := NewMain(&stdout, &stderr).Run(context.Background(), []string{cmd, "--help"})
		require.Equal(t, 0, exitCode(err, &stderr))
		var examples []string
		lines := strings.Split(stderr.String(), "\n")
		inExamples := false
		for i := 0; i < len(lines); i++ {
			l := strings.TrimSpace(lines[i])
			if strings.HasPrefix(lines[i], "Example") {
				inExamples = true
			}
			if strings.HasPrefix(lines[i], "Flags:") {
				inExamples = false
			}
			if !inExamples || !strings.HasPrefix(l, "mesh-provisioner "+cmd+" ") {
				continue
			}
			for strings.HasSuffix(l, "\\") && i+1 < len(lines) {
				i++
				l = strings.TrimSuffix(l, "\\") + " " + strings.TrimSpace(lines[i])
			}
			examples = append(examples, l)
		}
		require.NotEmpty(t, examples, "%s --help has an example", cmd)
		for _, ex := range examples {
			words, _, err := splitShell(ex, func(string) string { return "" })
			require.NoError(t, err, ex)
			args := words[2:]
			// Positional arguments first (query WHAT, replay QUESTION WHAT or BUCKET KEY), then flags.
			for len(args) > 0 && !strings.HasPrefix(args[0], "-") {
				args = args[1:]
			}
			var errb bytes.Buffer
			var fs *flag.FlagSet
			switch cmd {
			case "serve":
				fs = (&ServeCommand{Stderr: &errb}).flags()
			case "query":
				fs = (&QueryCommand{Stderr: &errb}).flags()
			case "rebuild":
				fs = (&RebuildCommand{Stderr: &errb}).flags()
			case "replay":
				fs = (&ReplayCommand{Stderr: &errb}).flags()
			case "export":
				fs = (&ExportCommand{Stderr: &errb}).flags()
			}
			require.NoError(t, fs.Parse(args), "%s --help: %s\n%s", cmd, ex, errb.String())
			require.Zero(t, fs.NArg(), "%s --help: %s: arguments after the flags", cmd, ex)
		}
	}
}

// docs/operations.md, "A seat does not get ready": a permission the seat's user lacks shows as
// `tailing failed; retrying with backoff`, with a `NATS error` warning naming the subject refused, and
// /readyz stays 503 naming the bucket.
func TestDocs_RunbookPermissionError(t *testing.T) {
	t.Setenv("NATS_URL", "")
	ns := natstest.RunServerSeatDenied(t, "$JS.API.CONSUMER.CREATE.KV_mesh-provisioner_needs.>")
	_, js := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("admin", "admin"))
	require.NoError(t, fixtures.CreateBuckets(context.Background(), js, "mesh-provisioner_needs"))
	kv, err := js.KeyValue(context.Background(), "mesh-provisioner_needs")
	require.NoError(t, err)
	_, err = kv.Put(context.Background(), "n1.web.config.listen", []byte{0x80})
	require.NoError(t, err)

	s, err := startServe(t.TempDir(), "--nats", ns.ClientURL(), "--user", "seat", "--password", "seat",
		"--metrics-addr", "127.0.0.1:0", "--metrics-poll", "100ms", "--log-format", "json")
	require.NoError(t, err)
	defer func() { require.NoError(t, s.stop()) }()
	natstest.CheckFor(t, 30*time.Second, 50*time.Millisecond, func() error {
		var tailing, natsErr bool
		for _, l := range strings.Split(s.stderr.String(), "\n") {
			var m map[string]any
			if json.Unmarshal([]byte(l), &m) != nil {
				continue
			}
			switch {
			case m["msg"] == "tailing failed; retrying with backoff" && m["level"] == "WARN" && m["bucket"] == "mesh-provisioner_needs":
				tailing = true
			case m["msg"] == "NATS error" && m["level"] == "WARN" && strings.Contains(fmt.Sprint(m["err"]), "$JS.API.CONSUMER.CREATE.KV_mesh-provisioner_needs"):
				natsErr = true
			}
		}
		if !tailing || !natsErr {
			return fmt.Errorf("tailing failed said: %v, NATS error said: %v\n%s", tailing, natsErr, s.stderr.String())
		}
		return nil
	})
	code, body, err := metricstest.Get("http://" + s.metricsAddr + "/readyz")
	require.NoError(t, err)
	require.Equal(t, 503, code)
	require.Contains(t, body, "mesh-provisioner_needs")
	// The metrics the runbook and the alert rules read show the bucket too: not synced, applied 0, and
	// a lag of the message it cannot read (MeshProvisionerProjectorStuck: lag > 0, applied standing).
	natstest.CheckFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		fams, err := metricstest.Scrape(s.metricsAddr)
		if err != nil {
			return err
		}
		synced, ok1 := fams.Value("mesh_provisioner_bucket_synced", "bucket", "mesh-provisioner_needs")
		applied, ok2 := fams.Value("mesh_provisioner_bucket_applied_sequence", "bucket", "mesh-provisioner_needs")
		lag, ok3 := fams.Value("mesh_provisioner_bucket_lag", "bucket", "mesh-provisioner_needs")
		if !ok1 || !ok2 || !ok3 || synced != 0 || applied != 0 || lag != 1 {
			return fmt.Errorf("needs: synced %v (%v), applied %v (%v), lag %v (%v); want 0, 0, 1", synced, ok1, applied, ok2, lag, ok3)
		}
		return nil
	})
}

// deploy/Dockerfile builds with -X main.Version=$(git describe --always), which is a commit hash, or a
// tag with a leading v and a distance: micro takes SemVer only, and the seat must still start, and say
// the version it was built with.
func TestServe_VersionNotSemVer(t *testing.T) {
	t.Setenv("NATS_URL", "")
	for _, tc := range []struct{ version, micro string }{
		{"ca375a6", "0.0.0+ca375a6"},
		{"v1.4.0-3-gca375a6", "1.4.0-3-gca375a6"},
		{"1.4.0", "1.4.0"},
	} {
		t.Run(tc.version, func(t *testing.T) {
			old := Version
			Version = tc.version
			defer func() { Version = old }()
			s, err := startServe(t.TempDir())
			require.NoError(t, err)
			defer func() { require.NoError(t, s.stop()) }()
			nc, _ := natstest.Connect(t, s.natsURL)
			msg, err := nc.Request("$SRV.INFO."+query.ServiceName, nil, 5*time.Second)
			require.NoError(t, err)
			var info micro.Info
			require.NoError(t, json.Unmarshal(msg.Data, &info))
			require.Equal(t, tc.micro, info.Version)
			require.Equal(t, tc.version, info.Metadata["version"], "the version as built")
		})
	}
}

// logLines are the JSON lines of a seat's log with this message.
func logLines(s *servedSeat, msg string) []map[string]any {
	var out []map[string]any
	for _, l := range strings.Split(s.stderr.String(), "\n") {
		var m map[string]any
		if json.Unmarshal([]byte(l), &m) == nil && m["msg"] == msg {
			out = append(out, m)
		}
	}
	return out
}

// docs/operations.md, "A seat does not get ready": a fixed bucket's stream purged under a running seat
// makes it rebuild by itself (`rebuild started`, then `rebuild swapped in`), and the metrics the alert
// rules read say so: the rebuild is counted (MeshProvisionerRebuildFailed reads
// mesh_provisioner_rebuilds_total), the applied counter does not run backwards across the swap, and
// the purged bucket has no lag left, since nothing is left to read (MeshProvisionerProjectorStuck,
// lag > 0 with the applied sequence standing, would page on it for good).
func TestDocs_RunbookRebuildByItself(t *testing.T) {
	t.Setenv("NATS_URL", "")
	ctx := context.Background()
	s, err := startServe(t.TempDir(), "--plans=false", "--metrics-addr", "127.0.0.1:0", "--metrics-poll", "50ms", "--log-format", "json")
	require.NoError(t, err)
	defer func() { require.NoError(t, s.stop()) }()
	_, js := natstest.Connect(t, s.natsURL)
	require.NoError(t, fixtures.CreateBuckets(ctx, js, "mesh-provisioner_collect"))
	kv, err := js.KeyValue(ctx, "mesh-provisioner_collect")
	require.NoError(t, err)
	const n = 20
	for i := range n {
		_, err := kv.Put(ctx, fmt.Sprintf("n%d.shell.mod", i), []byte{0xc0})
		require.NoError(t, err)
	}
	scrape := func() metricstest.Families {
		fams, err := metricstest.Scrape(s.metricsAddr)
		require.NoError(t, err)
		return fams
	}
	natstest.CheckFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		if v, _ := scrape().Value("mesh_provisioner_bucket_applied_sequence", "bucket", "mesh-provisioner_collect"); v != n {
			return fmt.Errorf("collect applied %v, want %d", v, n)
		}
		return nil
	})
	before, _ := scrape().Value("mesh_provisioner_messages_applied_total")

	stream, err := js.Stream(ctx, "KV_mesh-provisioner_collect")
	require.NoError(t, err)
	require.NoError(t, stream.Purge(ctx))
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if len(logLines(s, "rebuild swapped in")) == 0 {
			return fmt.Errorf("no rebuild swapped in yet\n%s", s.stderr.String())
		}
		return nil
	})
	started := logLines(s, "rebuild started")
	require.NotEmpty(t, started)
	require.NotZero(t, started[0]["messages"], "rebuild started says how many messages it reads")

	fams := scrape()
	ok, _ := fams.Value("mesh_provisioner_rebuilds_total", "result", "ok")
	require.Equal(t, 1.0, ok, "the seat's own rebuild is counted")
	took, _ := fams.Value("mesh_provisioner_rebuild_duration_seconds")
	require.Equal(t, 1.0, took, "and timed")
	running, _ := fams.Value("mesh_provisioner_rebuild_running")
	require.Zero(t, running)
	after, _ := fams.Value("mesh_provisioner_messages_applied_total")
	require.GreaterOrEqual(t, after, before, "a counter never runs backwards")
	natstest.CheckFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		fams := scrape()
		last, _ := fams.Value("mesh_provisioner_bucket_stream_last_sequence", "bucket", "mesh-provisioner_collect")
		lag, ok := fams.Value("mesh_provisioner_bucket_lag", "bucket", "mesh-provisioner_collect")
		if last != n || !ok || lag != 0 {
			return fmt.Errorf("collect: stream last %v, lag %v (shown %v), want %d and 0", last, lag, ok, n)
		}
		return nil
	})
	code, body, err := metricstest.Get("http://" + s.metricsAddr + "/readyz")
	require.NoError(t, err)
	require.Equal(t, 200, code, body)
}

// docs/operations.md, "Keys out of shape": the runbook's own example, run against the demo mesh, shows
// what the entry is about, anomaly rows in the answer, and the rows mesh_provisioner_anomaly_rows
// counts for that bucket.
func TestDocs_RunbookKeysOutOfShape(t *testing.T) {
	s := demoSeat(t)
	natstest.CheckFor(t, 30*time.Second, 20*time.Millisecond, func() error {
		if code, body, err := metricstest.Get("http://" + s.metricsAddr + "/readyz"); err != nil || code != 200 {
			return fmt.Errorf("demo seat not ready: %d %s %v", code, body, err)
		}
		return nil
	})
	block := readBlock(t, "docs/operations.md", "### Keys out of shape", "sh")
	var line string
	for _, l := range strings.Split(block, "\n") {
		if strings.Contains(l, "query needs") && strings.Contains(l, "--json") {
			line = l
		}
	}
	require.NotEmpty(t, line, "the entry asks for needs as JSON")
	words, _, err := splitShell(line, func(string) string { return "" })
	require.NoError(t, err)
	code, stdout, stderr := run(t, append(words[1:], "--nats", s.natsURL)...)
	require.Equal(t, exitOK, code, stderr)
	var a struct {
		Anomalies []struct {
			Bucket, Key, Reason string
		} `json:"anomalies"`
		AnomaliesTotal int `json:"anomalies_total"`
	}
	require.NoError(t, json.Unmarshal([]byte(strings.SplitN(stdout, "\n", 2)[0]), &a))
	require.NotEmpty(t, a.Anomalies, "%s: the example shows no anomaly row\n%.600s", line, stdout)
	fams, err := metricstest.Scrape(s.metricsAddr)
	require.NoError(t, err)
	var counted float64
	for _, reason := range fams.LabelValues("mesh_provisioner_anomaly_rows", "reason") {
		v, _ := fams.Value("mesh_provisioner_anomaly_rows", "bucket", "mesh-provisioner_needs", "reason", reason)
		counted += v
	}
	require.GreaterOrEqual(t, counted, float64(a.AnomaliesTotal), "the metric counts the rows the answer shows")
}

// docs/operations.md, Upgrade: "a downgrade keeps the state dir" until its log holds a wildcard rollup;
// the operator reads which schema the state dir is in from mesh_provisioner_state_schema and $SRV.STATS
// (build_info's schema is the binary's), and it moves to 2 with such a rollup.
func TestDocs_UpgradeSaysTheStateDirSchema(t *testing.T) {
	t.Setenv("NATS_URL", "")
	ctx := context.Background()
	s, err := startServe(t.TempDir(), "--plans=false", "--metrics-addr", "127.0.0.1:0", "--log-format", "json")
	require.NoError(t, err)
	defer func() { require.NoError(t, s.stop()) }()
	nc, js := natstest.Connect(t, s.natsURL)
	require.NoError(t, fixtures.CreateBuckets(ctx, js, "mesh-provisioner_needs"))
	kv, err := js.KeyValue(ctx, "mesh-provisioner_needs")
	require.NoError(t, err)
	_, err = kv.Put(ctx, "n1.web.config.a", []byte{0xc0})
	require.NoError(t, err)

	schemas := func() (state, binary, stats float64) {
		fams, err := metricstest.Scrape(s.metricsAddr)
		require.NoError(t, err)
		state, _ = fams.Value("mesh_provisioner_state_schema")
		vs := fams.LabelValues("mesh_provisioner_build_info", "schema")
		require.Len(t, vs, 1)
		binary, err = strconv.ParseFloat(vs[0], 64)
		require.NoError(t, err)
		msg, err := nc.Request("$SRV.STATS."+query.ServiceName, nil, 5*time.Second)
		require.NoError(t, err)
		var st micro.Stats
		require.NoError(t, json.Unmarshal(msg.Data, &st))
		require.NotEmpty(t, st.Endpoints)
		var data struct{ Schema float64 }
		require.NoError(t, json.Unmarshal(st.Endpoints[0].Data, &data))
		return state, binary, data.Schema
	}
	state, binary, stats := schemas()
	require.Equal(t, float64(store.SchemaVersion), binary, "build_info: the binary's")
	require.Equal(t, 1.0, state, "a state dir without a rollup is schema 1, which a downgrade keeps")
	require.Equal(t, 1.0, stats)

	msg := nats.NewMsg("$KV.mesh-provisioner_needs.n1.web.*.*")
	msg.Header.Set("KV-Operation", "PURGE")
	msg.Header.Set("Nats-Rollup", "sub")
	pa, err := js.PublishMsg(ctx, msg)
	require.NoError(t, err)
	natstest.CheckFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		if state, _, stats := schemas(); state != 2 || stats != 2 {
			return fmt.Errorf("after the wildcard rollup at %d: state dir schema %v, stats %v; want 2", pa.Sequence, state, stats)
		}
		return nil
	})
}
