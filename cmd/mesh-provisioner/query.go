package main

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	"github.com/novox/mesh-provisioner/query"
)

// verbError is an error answer of the verb.
type verbError struct {
	code int
	msg  string
}

func (e *verbError) Error() string { return fmt.Sprintf("%d: %s", e.code, e.msg) }

// QueryCommand asks the verb and prints what it answers.
type QueryCommand struct {
	Stdout, Stderr io.Writer

	nats       natsFlags
	node       string
	module     string
	contrib    string
	collection string
	kind       string
	at         string
	limit      int
	after      string
	minSeq     int64
	wait       time.Duration
	timeout    time.Duration
	jsonOut    bool
	onePage    bool
}

func (c *QueryCommand) flags() *flag.FlagSet {
	fs := flag.NewFlagSet("query", flag.ContinueOnError)
	fs.SetOutput(c.Stderr)
	c.nats.register(fs, nats.DefaultURL)
	fs.StringVar(&c.node, "node", "", "only this node")
	fs.StringVar(&c.module, "module", "", "only this module (for collect: this contributor)")
	fs.StringVar(&c.contrib, "contributor", "", "collect: only this contributor (same as --module)")
	fs.StringVar(&c.collection, "collection", "", "collect: only this collection, by its decoded name (shell:zsh:normal)")
	fs.StringVar(&c.kind, "kind", "", "registry and needs: only this kind")
	fs.StringVar(&c.at, "at", "", "forensics (the request's at): as of an RFC 3339 time or seq:<n>; past the newest answers the newest")
	fs.IntVar(&c.limit, "limit", 0, "rows per page, the request's limit: 1 to 10000 (default 1000)")
	fs.StringVar(&c.after, "after", "", "the request's after: start after this cursor (a previous answer's next)")
	fs.Int64Var(&c.minSeq, "min-seq", 0, "the request's min_seq: answer only once the projection has applied this stream sequence")
	fs.DurationVar(&c.wait, "wait", 0, "the request's wait_ms, as a duration: how long the seat may wait for --min-seq, 0 to 10s")
	fs.DurationVar(&c.timeout, "timeout", 15*time.Second, "how long to wait for each answer")
	fs.BoolVar(&c.jsonOut, "json", false, "print each answer as one JSON object per line, for scripts")
	fs.BoolVar(&c.onePage, "one-page", false, "print one page only, not every page (stderr says the --after of the next)")
	fs.Usage = func() {
		fmt.Fprint(c.Stderr, `Usage: mesh-provisioner query [WHAT] [flags]

Asks mesh-provisioner.provisioning and prints an aligned table, every page of it (--json for scripts).
WHAT is registry (the default), needs, applied, collect or plans: the request's what. The flags
--node, --module, --contributor, --collection, --kind, --at, --limit, --after, --min-seq and --wait
are the request's fields of those names (min_seq, and wait_ms in milliseconds).

Examples:
  mesh-provisioner query registry
  mesh-provisioner query needs --node n00007
  mesh-provisioner query collect --collection shell:zsh:normal --json
  mesh-provisioner query plans --node edge-1

Flags:
`)
		fs.PrintDefaults()
	}
	return fs
}

// Run asks and prints.
func (c *QueryCommand) Run(ctx context.Context, args []string) (err error) {
	fs := c.flags()
	// WHAT may come before, between or after the flags.
	pos, err := parseInterleaved(fs, args)
	if err != nil {
		return err
	}
	if len(pos) > 1 {
		return &usageError{msg: fmt.Sprintf("query takes one WHAT, got %q", pos)}
	}
	what := ""
	if len(pos) == 1 {
		what = pos[0]
	}
	if what == "" {
		what = "registry"
	}
	if c.timeout <= 0 {
		return &usageError{msg: fmt.Sprintf("--timeout %s: want how long to wait for each answer, above 0", c.timeout)}
	}
	// The contract's bounds are checked here, before anything is sent: a wrong number is the command
	// line's fault (exit 2), not an answer of the seat's (a 400, exit 3).
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if set["limit"] && (c.limit < 1 || c.limit > query.MaxLimit) {
		return &usageError{msg: fmt.Sprintf("--limit %d: want rows per page from 1 to %d (default 1000)", c.limit, query.MaxLimit)}
	}
	if c.minSeq < 0 {
		return &usageError{msg: fmt.Sprintf("--min-seq %d: want a stream sequence, 1 or more", c.minSeq)}
	}
	if maxWait := query.MaxWaitMS * time.Millisecond; c.wait < 0 || c.wait.Milliseconds() > query.MaxWaitMS {
		return &usageError{msg: fmt.Sprintf("--wait %s: want from 0 to %s (the seat waits at most that for --min-seq)", c.wait, maxWait)}
	}
	if c.wait != 0 && c.minSeq == 0 {
		return &usageError{msg: "--wait is how long the seat may wait for --min-seq: give --min-seq too"}
	}
	// A request NATS refuses (the reply inbox, or the verb's subject, not permitted to this user) ends
	// at once with what was refused.
	askCtx, stop := c.nats.stopOnDenied(ctx)
	defer stop()
	nc, err := c.nats.connect(c.nats.url, "mesh-provisioner query", nil)
	if err != nil {
		return err
	}
	defer nc.Close()

	req := map[string]any{"what": what}
	// --contributor is the request's contributor, so the seat judges it as it judges any client's
	// (collect only, the same as module when both are given).
	for k, v := range map[string]string{"node": c.node, "module": c.module, "contributor": c.contrib, "collection": c.collection, "kind": c.kind, "at": c.at} {
		if v != "" {
			req[k] = v
		}
	}
	if c.limit != 0 {
		req["limit"] = c.limit
	}
	if c.minSeq != 0 {
		req["min_seq"] = c.minSeq
		req["wait_ms"] = c.wait.Milliseconds()
	}
	after := c.after
	// The table is printed as the pages come, aligned tableChunk lines at a time, so a query of a whole
	// bucket (millions of rows) holds one page, not all of them.
	var (
		tw   *tabwriter.Writer
		last map[string]any
		rows int
	)
	defer func() {
		if err == nil || tw == nil {
			return
		}
		// A later page failed (its cursor's row removed meanwhile: 404, a timeout): the rows of the
		// pages before are printed, all of them, not up to the last chunk aligned, and the error says
		// the table stops there.
		if ferr := tw.Flush(); ferr == nil {
			err = fmt.Errorf("%w (the table above is the %d rows of the pages before; the rest are not printed)", err, rows)
		}
	}()
	for {
		if after != "" {
			req["after"] = after
		}
		body, _ := json.Marshal(req)
		rctx, cancel := context.WithTimeout(askCtx, c.timeout)
		msg, err := nc.RequestWithContext(rctx, query.Subject, body)
		cancel()
		var pe *permissionError
		switch {
		case err != nil && errors.As(refused(askCtx, err), &pe):
			return fmt.Errorf("ask %s: %w", query.Subject, pe)
		case errors.Is(err, nats.ErrNoResponders):
			return fmt.Errorf("no seat answers %s on %s: is a mesh-provisioner serve running, and connected there? (nats micro ls lists the seats): %w", query.Subject, redact(nc.ConnectedUrl()), err)
		case errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil:
			return fmt.Errorf("ask %s: no answer within %s (--timeout): the seat may be overloaded, or stopping", query.Subject, c.timeout)
		case err != nil:
			return fmt.Errorf("ask %s: %w", query.Subject, err)
		}
		if code := msg.Header.Get(micro.ErrorCodeHeader); code != "" {
			n, _ := strconv.Atoi(code)
			return &verbError{code: n, msg: msg.Header.Get(micro.ErrorHeader)}
		}
		if c.jsonOut {
			fmt.Fprintln(c.Stdout, strings.TrimSpace(string(msg.Data)))
		}
		var ans map[string]any
		dec := json.NewDecoder(strings.NewReader(string(msg.Data)))
		dec.UseNumber()
		if err := dec.Decode(&ans); err != nil {
			return fmt.Errorf("read answer: %w", err)
		}
		last = ans
		if !c.jsonOut {
			if tw == nil {
				tw = tableHeader(c.Stdout, what)
			}
			if rows, err = tableRows(tw, what, ans, rows); err != nil {
				return fmt.Errorf("print: %w", err)
			}
		}
		next, _ := ans["next"].(string)
		if next != "" && c.onePage {
			// On stderr, so --json's stdout stays the answers alone.
			fmt.Fprintf(c.Stderr, "mesh-provisioner: more rows follow: add --after %s for the next page, or leave out --one-page for every page\n", shellWord(next))
		}
		if next == "" || c.onePage {
			break
		}
		after = next
	}
	if !c.jsonOut {
		if err := tw.Flush(); err != nil {
			return fmt.Errorf("print: %w", err)
		}
		tableEnd(c.Stdout, last, rows)
	}
	return nil
}

// shellWord is s as one shell word: as it is when it is safe unquoted, else in single quotes.
func shellWord(s string) string {
	if s != "" && strings.IndexFunc(s, func(r rune) bool {
		return !(r < utf8.RuneSelf && (r == '.' || r == '-' || r == '_' || r == '/' || r == '=' || r == ':' ||
			r >= '0' && r <= '9' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z'))
	}) < 0 {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// tableHeader starts a table of what's rows.
func tableHeader(w io.Writer, what string) *tabwriter.Writer {
	tw := newTable(w)
	fmt.Fprintln(tw, strings.ToUpper(strings.Join(columns(what), "\t")))
	return tw
}

// tableRows prints the rows of one page after the n printed before it, aligned tableChunk lines at a
// time, and returns how many are printed now.
func tableRows(tw *tabwriter.Writer, what string, a map[string]any, n int) (int, error) {
	cols := columns(what)
	list, _ := a["rows"].([]any)
	for _, r := range list {
		row, _ := r.(map[string]any)
		cells := make([]string, len(cols))
		for i, col := range cols {
			cells[i] = cell(what, col, row)
		}
		fmt.Fprintln(tw, strings.Join(cells, "\t"))
		if n++; n%tableChunk == 0 {
			if err := tw.Flush(); err != nil {
				return n, err
			}
		}
	}
	return n, nil
}

// tableEnd prints the anomalies of the last page and where the projection stood.
func tableEnd(w io.Writer, last map[string]any, rows int) {
	anoms, _ := last["anomalies"].([]any)
	if len(anoms) > 0 {
		total := num(last["anomalies_total"])
		if n, err := strconv.Atoi(total); err == nil && n > len(anoms) {
			// The answer carries at most 1000: say the list is cut, and of how many.
			fmt.Fprintf(w, "\nanomalies (%d of %d, the first by key; keys or values out of shape):\n", len(anoms), n)
		} else {
			fmt.Fprintf(w, "\n%d anomalies (keys or values out of shape):\n", len(anoms))
		}
		tw := newTable(w)
		fmt.Fprintln(tw, "BUCKET\tKEY\tREVISION\tREASON")
		for _, x := range anoms {
			a, _ := x.(map[string]any)
			bucket, _ := a["bucket"].(string)
			key, _ := a["key"].(string)
			reason, _ := a["reason"].(string)
			fmt.Fprintf(tw, "%s\t%s\t%v\t%s\n", tableText(bucket), tableText(key), num(a["revision"]), lineText(reason))
		}
		tw.Flush()
	}
	synced := "synced"
	if s, _ := last["synced"].(bool); !s {
		synced = "catching up"
	}
	fmt.Fprintf(w, "\n%d rows, as of %s (%s)\n", rows, asOf(last["as_of"]), synced)
}

// asOf prints as_of: one stream sequence, or for plans one per input bucket.
func asOf(v any) string {
	m, ok := v.(map[string]any)
	if !ok {
		return "sequence " + num(v)
	}
	buckets := make([]string, 0, len(m))
	for b := range m {
		buckets = append(buckets, b)
	}
	sort.Strings(buckets)
	parts := make([]string, len(buckets))
	for i, b := range buckets {
		parts[i] = b + " " + num(m[b])
	}
	return strings.Join(parts, ", ")
}

func columns(what string) []string {
	switch what {
	case "registry":
		return []string{"kind", "module", "where"}
	case "needs":
		return []string{"node", "module", "kind", "name", "revision", "value"}
	case "applied":
		return []string{"node", "module", "revision", "value"}
	case "collect":
		return []string{"node", "collection", "contributor", "revision", "value"}
	case "plans":
		return []string{"node", "module", "want", "have", "newest_build", "current", "newest"}
	}
	return []string{"key", "revision", "value"}
}

func cell(what, col string, row map[string]any) string {
	switch {
	case what == "registry" && col == "where":
		return whereCell(row)
	case what == "plans" && (col == "current" || col == "newest"):
		return planCell(row[col])
	case col == "value":
		if n, ok := row["value_omitted"]; ok && row["value"] == nil {
			// Too large for any answer: the bucket still holds it (replay history shows it).
			return fmt.Sprintf("(omitted: %s bytes, too large to answer)", num(n))
		}
		if raw, ok := row["value_raw"]; ok && row["value"] == nil {
			s, _ := raw.(string)
			if b, err := base64.StdEncoding.DecodeString(s); err == nil {
				return rawCell(b)
			}
			return fmt.Sprintf("(value_raw: %v)", raw)
		}
		b, _ := json.Marshal(row["value"])
		s := string(b)
		if len(s) > 72 {
			s = s[:69] + "..."
		}
		return s
	case col == "revision" || col == "want" || col == "have" || col == "newest_build":
		return num(row[col])
	}
	if v, ok := row[col]; ok && v != nil {
		if s, ok := v.(string); ok {
			return tableText(s)
		}
		return fmt.Sprint(v)
	}
	return "-"
}

// tableText is a cell's text: as it is, or quoted as Go quotes a string when it is empty or holds
// white space, a control character, a quote or bytes that are not printable UTF-8, so each row stays
// one line, its cells stay apart and aligned, and an empty value is not taken for a missing one ("-").
// A decoded collection name may hold any of these (`=0A` is a newline).
func tableText(s string) string {
	if s == "" || !utf8.ValidString(s) {
		return strconv.Quote(s)
	}
	for _, r := range s {
		if unicode.IsSpace(r) || !unicode.IsPrint(r) || r == '"' || r == '\'' || r == '`' || r == '\\' {
			return strconv.Quote(s)
		}
	}
	return s
}

// lineText is free text for the last column (an anomaly's reason): its spaces kept, quoted only when
// it would break the line.
func lineText(s string) string {
	if strings.IndexFunc(s, func(r rune) bool { return r != ' ' && (unicode.IsSpace(r) || !unicode.IsPrint(r)) }) >= 0 || !utf8.ValidString(s) {
		return strconv.Quote(s)
	}
	return s
}

// whereCell says where a kind's values are: a verb, or a bucket with its key shape; "-" for a kind
// with neither (a value out of shape), never a blank cell or "bucket <nil>".
func whereCell(row map[string]any) string {
	if v, _ := row["verb"].(string); v != "" {
		return "verb " + v
	}
	b, _ := row["bucket"].(string)
	if b == "" {
		return "-"
	}
	if shape, _ := row["key_shape"].(string); shape != "" {
		return "bucket " + b + "  " + shape
	}
	return "bucket " + b
}

func planCell(v any) string {
	m, ok := v.(map[string]any)
	if !ok {
		return "-"
	}
	s := fmt.Sprint(m["status"])
	if b, ok := m["build"]; ok {
		s = num(b) + " " + s
	}
	if hb, ok := m["held_because"]; ok {
		s += " (" + fmt.Sprint(hb) + ")"
	}
	return s
}

// num prints a JSON number without a float's exponent.
func num(v any) string {
	if v == nil {
		return "-"
	}
	return fmt.Sprint(v)
}
