package main

// TestDocs_CommandsRun runs every line of every sh block of README.md and docs/*.md against a running
// demo seat, so the docs cannot drift from the binary. docs/protocol.md ("Commands in these docs are
// tested") says what each kind of line is checked for; in short:
//
//	mesh-provisioner ..., go run ./cmd/mesh-provisioner ...   run in this process; exit 0 or "# exits N"
//	nats req|micro|stream ...                                   the same request through nats.go
//	curl URL [| grep PATTERN]                                   fetched; 200 or "# answers N"
//	make, systemctl, journalctl, kubectl, export                skipped: they need a host, or are this test
//	the files in runElsewhere                                   skipped: another test runs them
//
// Any other program fails the test: add a handler below, or write the block as text.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nats.go/micro"
	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/internal/metrics/metricstest"
	"github.com/novox/mesh-provisioner/internal/natstest"
)

// docLine is one command of a sh block, continuation lines joined.
type docLine struct {
	file string
	line int
	text string
}

func (d docLine) String() string { return fmt.Sprintf("%s:%d: %s", d.file, d.line, d.text) }

// docCommands reads the sh, shell and bash blocks of markdown files under root, in order.
func docCommands(tb testing.TB, root string, files []string) []docLine {
	tb.Helper()
	var out []docLine
	for _, f := range files {
		b, err := os.ReadFile(f)
		require.NoError(tb, err)
		name, err := filepath.Rel(root, f)
		require.NoError(tb, err)
		sc := bufio.NewScanner(bytes.NewReader(b))
		in, n := false, 0
		var cur *docLine
		for sc.Scan() {
			n++
			l := sc.Text()
			trimmed := strings.TrimSpace(l)
			if strings.HasPrefix(trimmed, "```") {
				lang := strings.TrimPrefix(trimmed, "```")
				if !in && (lang == "sh" || lang == "shell" || lang == "bash") {
					in = true
				} else if in {
					in = false
				}
				continue
			}
			if !in {
				continue
			}
			if cur != nil {
				cur.text += " " + strings.TrimSuffix(trimmed, "\\")
			} else {
				if trimmed == "" || strings.HasPrefix(trimmed, "#") {
					continue
				}
				cur = &docLine{file: name, line: n, text: strings.TrimSuffix(trimmed, "\\")}
			}
			if !strings.HasSuffix(trimmed, "\\") {
				out = append(out, *cur)
				cur = nil
			}
		}
	}
	return out
}

// splitShell splits a command line as sh does for the simple lines docs hold: words, '...' and "..."
// quoting, backslash escapes, $VAR and ${VAR} from env (not inside '...'), "|" as a word of its own,
// and a trailing "# comment", returned apart.
func splitShell(s string, env func(string) string) (words []string, comment string, err error) {
	var cur strings.Builder
	have := false
	flush := func() {
		if have {
			words = append(words, cur.String())
		}
		cur.Reset()
		have = false
	}
	expand := func(i int) int { // s[i] == '$'; returns the index after the variable
		j := i + 1
		if j < len(s) && s[j] == '{' {
			k := strings.IndexByte(s[j:], '}')
			if k < 0 {
				return -1
			}
			cur.WriteString(env(s[j+1 : j+k]))
			return j + k + 1
		}
		k := j
		for k < len(s) && (s[k] == '_' || s[k] >= 'A' && s[k] <= 'Z' || s[k] >= 'a' && s[k] <= 'z' || s[k] >= '0' && s[k] <= '9') {
			k++
		}
		if k == j {
			cur.WriteByte('$')
			return j
		}
		cur.WriteString(env(s[j:k]))
		return k
	}
	for i := 0; i < len(s); {
		c := s[i]
		switch {
		case c == ' ' || c == '\t':
			flush()
			i++
		case c == '#' && !have:
			flush()
			return words, strings.TrimSpace(s[i+1:]), nil
		case c == '|':
			flush()
			words = append(words, "|")
			i++
		case c == '\'':
			k := strings.IndexByte(s[i+1:], '\'')
			if k < 0 {
				return nil, "", fmt.Errorf("unterminated '")
			}
			cur.WriteString(s[i+1 : i+1+k])
			have = true
			i += k + 2
		case c == '"':
			have = true
			i++
			for ; i < len(s) && s[i] != '"'; i++ {
				switch {
				case s[i] == '\\' && i+1 < len(s) && strings.IndexByte(`"\$`, s[i+1]) >= 0:
					i++
					cur.WriteByte(s[i])
				case s[i] == '$':
					j := expand(i)
					if j < 0 {
						return nil, "", fmt.Errorf("unterminated ${")
					}
					i = j - 1
				default:
					cur.WriteByte(s[i])
				}
			}
			if i >= len(s) {
				return nil, "", fmt.Errorf("unterminated \"")
			}
			i++
		case c == '\\' && i+1 < len(s):
			cur.WriteByte(s[i+1])
			have = true
			i += 2
		case c == '$':
			have = true
			j := expand(i)
			if j < 0 {
				return nil, "", fmt.Errorf("unterminated ${")
			}
			i = j
		default:
			cur.WriteByte(c)
			have = true
			i++
		}
	}
	flush()
	return words, "", nil
}

func TestSplitShell(t *testing.T) {
	t.Parallel()
	env := func(k string) string { return map[string]string{"STATE": "/s t", "X": "x"}[k] }
	cases := []struct {
		in      string
		words   []string
		comment string
	}{
		{`nats req a.b '{"what":"needs"}'`, []string{"nats", "req", "a.b", `{"what":"needs"}`}, ""},
		{`mesh-provisioner rebuild --state "$STATE"  # exits 0`, []string{"mesh-provisioner", "rebuild", "--state", "/s t"}, "exits 0"},
		{`curl -s http://h/metrics | grep 'a b'`, []string{"curl", "-s", "http://h/metrics", "|", "grep", "a b"}, ""},
		{`echo ${X}y\ z '$X' "a\"b" a#b`, []string{"echo", "xy z", "$X", `a"b`, "a#b"}, ""},
	}
	for _, tc := range cases {
		words, comment, err := splitShell(tc.in, env)
		require.NoError(t, err, tc.in)
		require.Equal(t, tc.words, words, tc.in)
		require.Equal(t, tc.comment, comment, tc.in)
	}
}

var expectRe = regexp.MustCompile(`^(exits|answers)\s+(\d+)$`)

// runElsewhere names the doc files whose sh blocks run against another setup than the demo seat, and
// the test that runs them there instead. Keep it short: a file here is not checked by this test.
var runElsewhere = map[string]string{
	// A walkthrough against nats-server -c docs/nats-accounts.conf, with its users, nsc and kv puts
	// that must be refused.
	filepath.Join("docs", "accounts.md"): "seat/accounts_test.go runs the seat against docs/nats-accounts.conf",
}

// docsRunner runs doc lines against the demo seat.
type docsRunner struct {
	t       *testing.T
	seat    *servedSeat
	nc      *nats.Conn
	js      jetstream.JetStream
	ran     map[string]int
	skipped []string
}

func TestDocs_CommandsRun(t *testing.T) {
	root, err := filepath.Abs("../..")
	require.NoError(t, err)
	files := []string{filepath.Join(root, "README.md")}
	docs, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	require.NoError(t, err)
	files = append(files, docs...)
	lines := docCommands(t, root, files)
	require.NotEmpty(t, lines)

	s := demoSeat(t)
	s.waitReady(t)
	work := t.TempDir()
	t.Chdir(work) // relative paths the docs write (archives, ./data) land here
	// ./data/state, the default the README's commands name, is the running demo seat's state dir, as it
	// is after `make run`.
	require.NoError(t, os.MkdirAll(filepath.Join(work, "data"), 0o755))
	require.NoError(t, os.Symlink(filepath.Join(s.dir, "state"), filepath.Join(work, "data", "state")))
	t.Setenv("NATS_URL", s.natsURL)
	t.Setenv("STATE", filepath.Join(work, "state"))
	nc, js := natstest.Connect(t, s.natsURL)
	r := &docsRunner{t: t, seat: s, nc: nc, js: js, ran: map[string]int{}}
	for _, l := range lines {
		if why, ok := runElsewhere[l.file]; ok {
			r.skip(l, why)
			continue
		}
		t.Run(fmt.Sprintf("%s:%d", l.file, l.line), func(t *testing.T) { r.run(t, l) })
	}
	t.Logf("ran %v; skipped %d lines:\n  %s", r.ran, len(r.skipped), strings.Join(r.skipped, "\n  "))
}

func (r *docsRunner) skip(l docLine, why string) {
	r.skipped = append(r.skipped, fmt.Sprintf("%s (%s)", l, why))
}

func (r *docsRunner) run(t *testing.T, l docLine) {
	words, comment, err := splitShell(l.text, os.Getenv)
	require.NoError(t, err, l.String())
	want, wantSet := 0, false
	if comment != "" {
		if m := expectRe.FindStringSubmatch(comment); m != nil {
			want, _ = strconv.Atoi(m[2])
			wantSet = true
		}
	}
	var grep []string
	for i, w := range words {
		if w == "|" {
			grep = words[i+1:]
			words = words[:i]
			break
		}
	}
	if len(grep) > 0 {
		require.Equal(t, "grep", grep[0], "%s: only `| grep PATTERN` is run", l)
		grep = grep[1:]
		if len(grep) > 1 && strings.HasPrefix(grep[0], "-") {
			grep = grep[1:] // -E and friends: Go's regexp reads both
		}
		require.Len(t, grep, 1, "%s: grep takes one pattern here", l)
	}
	if len(words) > 0 && words[0] == "sudo" { // run as the seat's user: here, as the test
		words = words[1:]
		for len(words) > 0 && strings.HasPrefix(words[0], "-") {
			if (words[0] == "-u" || words[0] == "-g") && len(words) > 1 {
				words = words[1:]
			}
			words = words[1:]
		}
	}
	require.NotEmpty(t, words, l.String())

	var out string
	switch prog := words[0]; {
	case prog == "mesh-provisioner" || strings.HasSuffix(prog, "/mesh-provisioner"):
		out = r.binary(t, l, words[1:], want)
	case prog == "go" && len(words) > 2 && words[1] == "run" && words[2] == "./cmd/mesh-provisioner":
		out = r.binary(t, l, words[3:], want)
	case prog == "nats":
		out = r.nats(t, l, words[1:], want, wantSet)
	case prog == "curl":
		out = r.curl(t, l, words[1:], want, wantSet)
	case prog == "make" || prog == "systemctl" || prog == "journalctl" || prog == "kubectl" || prog == "export":
		r.skip(l, prog+" needs a host, or is this test")
		return
	default:
		t.Fatalf("%s: no way to run %q here: add a handler in docs_test.go, or write the block as text", l, prog)
	}
	if out == "" && len(grep) == 0 {
		return
	}
	if len(grep) == 1 {
		re, err := regexp.Compile(grep[0])
		require.NoError(t, err, l.String())
		require.Regexp(t, re, out, "%s: no line matches", l)
	}
}

// binary runs a line of the binary in this process. serve lines have their flags checked only: the
// test's demo seat is the running serve.
func (r *docsRunner) binary(t *testing.T, l docLine, args []string, want int) string {
	r.ran["mesh-provisioner"]++
	if len(args) == 0 {
		t.Fatalf("%s: no subcommand", l)
	}
	help := false
	for _, a := range args {
		help = help || a == "-h" || a == "--help" || a == "-help"
	}
	switch cmd := args[0]; {
	case cmd == "serve" && !help:
		var stderr bytes.Buffer
		fs := (&ServeCommand{Stdout: io.Discard, Stderr: &stderr}).flags()
		require.NoError(t, fs.Parse(args[1:]), "%s\n%s", l, stderr.String())
		require.Zero(t, fs.NArg(), "%s: serve takes no arguments", l)
		return ""
	case cmd == "serve" || cmd == "query" || cmd == "version" || cmd == "help":
	default:
		if _, ok := extraCommands[cmd]; !ok {
			r.skip(l, "this build has no "+cmd+" command yet")
			return ""
		}
	}
	var stdout, stderr bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	code := exitCode(NewMain(&stdout, &stderr).Run(ctx, args), &stderr)
	require.Equal(t, want, code, "%s\nstdout:\n%s\nstderr:\n%s", l, stdout.String(), stderr.String())
	return stdout.String() + stderr.String()
}

// nats sends what a nats CLI line sends, through nats.go.
func (r *docsRunner) nats(t *testing.T, l docLine, args []string, want int, wantSet bool) string {
	r.ran["nats"]++
	// Connection flags name the operator's own NATS: the test seat's stands in for it.
	var rest []string
	for i := 0; i < len(args); i++ {
		switch args[i] {
		case "--creds", "-s", "--server", "--context", "--user", "--password":
			i++
		default:
			rest = append(rest, args[i])
		}
	}
	args = rest
	require.NotEmpty(t, args, l.String())
	switch args[0] {
	case "req", "request":
		require.True(t, len(args) == 2 || len(args) == 3, "%s: nats req SUBJECT [BODY]", l)
		body := ""
		if len(args) == 3 {
			body = args[2]
		}
		msg, err := r.nc.Request(args[1], []byte(body), 15*time.Second)
		require.NoError(t, err, l.String())
		code := 0
		if h := msg.Header.Get(micro.ErrorCodeHeader); h != "" {
			code, _ = strconv.Atoi(h)
		}
		if code == 501 && !(wantSet && want == 501) {
			r.skip(l, "this build answers 501: "+msg.Header.Get(micro.ErrorHeader))
			return ""
		}
		if wantSet {
			require.Equal(t, want, code, "%s: %s", l, msg.Data)
		} else {
			require.Zero(t, code, "%s: %s %s", l, msg.Header.Get(micro.ErrorHeader), msg.Data)
		}
		var v map[string]any
		require.NoError(t, json.Unmarshal(msg.Data, &v), "%s: the answer is one JSON object", l)
		return string(msg.Data)
	case "micro":
		require.GreaterOrEqual(t, len(args), 2, l.String())
		verb, typ := map[string]micro.Verb{"ls": micro.InfoVerb, "list": micro.InfoVerb, "info": micro.InfoVerb, "stats": micro.StatsVerb, "ping": micro.PingVerb}[args[1]], ""
		switch verb {
		case micro.InfoVerb:
			typ = micro.InfoResponseType
		case micro.StatsVerb:
			typ = micro.StatsResponseType
		case micro.PingVerb:
			typ = micro.PingResponseType
		default:
			t.Fatalf("%s: nats micro %s is not handled here", l, args[1])
		}
		name := ""
		if len(args) > 2 {
			name = args[2]
		}
		subj, err := micro.ControlSubject(verb, name, "")
		require.NoError(t, err)
		msg, err := r.nc.Request(subj, nil, 5*time.Second)
		require.NoError(t, err, l.String())
		var v struct {
			Type string `json:"type"`
			Name string `json:"name"`
		}
		require.NoError(t, json.Unmarshal(msg.Data, &v), l.String())
		require.Equal(t, typ, v.Type, l.String())
		return string(msg.Data)
	case "stream":
		require.True(t, len(args) == 3 && args[1] == "info", "%s: nats stream info NAME", l)
		_, err := r.js.Stream(context.Background(), args[2])
		require.NoError(t, err, l.String())
		return ""
	}
	t.Fatalf("%s: nats %s is not handled here", l, args[0])
	return ""
}

// curl fetches a URL of the seat's metrics listener (the documented 127.0.0.1:9464 is the test seat's).
func (r *docsRunner) curl(t *testing.T, l docLine, args []string, want int, wantSet bool) string {
	r.ran["curl"]++
	var url string
	for _, a := range args {
		if strings.HasPrefix(a, "-") {
			continue
		}
		require.Empty(t, url, "%s: one URL", l)
		url = a
	}
	url = strings.TrimPrefix(url, "http://")
	for _, doc := range []string{"127.0.0.1:9464", "localhost:9464"} {
		url = strings.Replace(url, doc, r.seat.metricsAddr, 1)
	}
	code, body, err := metricstest.Get("http://" + url)
	require.NoError(t, err, l.String())
	if !wantSet {
		want = http.StatusOK
	}
	require.Equal(t, want, code, "%s: %s", l, body)
	return body
}
