package main

import (
	"bufio"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/mpk"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/replay"
	"github.com/novox/mesh-provisioner/store"
)

func init() {
	extraCommands["replay"] = func(ctx context.Context, m *Main, args []string) error {
		return (&ReplayCommand{Stdout: m.Stdout, Stderr: m.Stderr}).Run(ctx, args)
	}
}

// ReplayCommand answers forensics questions from an event log: the local one, the streams', or an
// archive's.
type ReplayCommand struct {
	Stdout, Stderr io.Writer

	nats       natsFlags
	state      string
	archive    string
	at         string
	from, to   string
	node       string
	module     string
	contrib    string
	collection string
	kind       string
	jsonOut    bool
}

const replayUsage = `Usage: mesh-provisioner replay state WHAT --at POINT [narrowing] [source] [--json]
       mesh-provisioner replay history BUCKET KEY [source] [--json]
       mesh-provisioner replay diff WHAT --from POINT --to POINT [narrowing] [source] [--json]

Forensics over the buckets' history. A POINT is an RFC 3339 time (2026-11-02T03:12:00Z) or seq:<n>, a
stream sequence of the bucket WHAT reads; "as of" a point is the state after every message at or before
it. WHAT is registry, needs, applied or collect (state also takes plans, at a time); BUCKET is one of
those too, or a bucket's full name.

  state    the table as of a point, narrowed like query (--node, --module, --collection, --kind)
  history  every revision of one key: time, sequence, operation, value. The key is raw, as stored:
           a collection in =XX escapes (n17.shell=3Azsh=3Anormal.mod-web), read as written and
           not as a pattern (n17.> is the key a rollup of n17's keys was written on)
  diff     rows added, changed and removed between two points, and anomalies that appeared or cleared

Sources (one of):
  --state DIR      the seat's local event log, which outlives the buckets' history. Works beside a
                   running serve: replay reads a private copy (hard links) of the current generation.
  --archive FILE   an archive written by mesh-provisioner export
  --nats URL       the streams' own history (the default, with NATS_URL): only what they still hold.
                   A history reads its key's messages, a state or diff with --node its node's;
                   any other question reads the whole bucket into a temporary store.

A point the log cannot rebuild exactly (trimmed by retention, or messages the stream removed before the
seat read them) is refused with the nearest points that can be answered, never guessed.

plans from --nats, or from an archive that lists buckets it could not read, answer without a
composed-<node> bucket that cannot be read, and exit 4 naming it; a question narrowed to its node
fails (exit 1).

Examples:
  mesh-provisioner replay state needs --node n17 --at 2026-11-02T03:12:00Z --state /var/lib/mesh-provisioner/state
  mesh-provisioner replay diff applied --node n17 --from 2026-11-02T03:12:00Z --to 2026-11-02T09:00:00Z --archive incident.mph
  mesh-provisioner replay history needs n17.mod-web.config.port --state /var/lib/mesh-provisioner/state

Flags:
`

func (c *ReplayCommand) flags() *flag.FlagSet {
	fs := flag.NewFlagSet("replay", flag.ContinueOnError)
	fs.SetOutput(c.Stderr)
	c.nats.register(fs, nats.DefaultURL)
	fs.StringVar(&c.state, "state", "", "read the seat's local event log in this state dir")
	fs.StringVar(&c.archive, "archive", "", "read an archive written by export")
	fs.StringVar(&c.at, "at", "", "state: the point, an RFC 3339 time or seq:<n>")
	fs.StringVar(&c.from, "from", "", "diff: the earlier point")
	fs.StringVar(&c.to, "to", "", "diff: the later point")
	fs.StringVar(&c.node, "node", "", "only this node")
	fs.StringVar(&c.module, "module", "", "only this module (for collect: this contributor)")
	fs.StringVar(&c.contrib, "contributor", "", "collect: only this contributor (same as --module)")
	fs.StringVar(&c.collection, "collection", "", "collect: only this collection, by its decoded name")
	fs.StringVar(&c.kind, "kind", "", "registry and needs: only this kind")
	fs.BoolVar(&c.jsonOut, "json", false, "print JSON for scripts")
	fs.Usage = func() {
		fmt.Fprint(c.Stderr, replayUsage)
		fs.PrintDefaults()
	}
	return fs
}

// Run answers the question.
// questionFlags are the flags each question reads besides its source and --json: any other given is
// refused rather than ignored, since an operator who gives `history --at` or `state --from` expects it
// to narrow the answer.
var questionFlags = map[string][]string{
	"state":   {"at", "node", "module", "contributor", "collection", "kind"},
	"diff":    {"from", "to", "node", "module", "contributor", "collection", "kind"},
	"history": {},
}

// notFor refuses the flags given on the command line that the question does not read.
func notFor(fs *flag.FlagSet, question string, reads []string) error {
	var wrong []string
	fs.Visit(func(f *flag.Flag) {
		switch f.Name {
		case "state", "archive", "nats", "creds", "user", "password", "json", "inbox-prefix":
			return // the source, and how to print
		}
		if !slices.Contains(reads, f.Name) {
			wrong = append(wrong, "--"+f.Name)
		}
	})
	if len(wrong) == 0 {
		return nil
	}
	hint := ""
	switch question {
	case "history":
		hint = ": it lists every revision of the key the source holds (state --at answers as of a point, diff --from --to between two)"
	case "state":
		hint = ": it answers as of --at (diff --from --to answers what changed between two points)"
	case "diff":
		hint = ": it answers what changed between --from and --to (state --at answers as of one point)"
	}
	return &usageError{msg: fmt.Sprintf("replay %s does not read %s%s", question, strings.Join(wrong, ", "), hint)}
}

func (c *ReplayCommand) Run(ctx context.Context, args []string) error {
	fs := c.flags()
	if len(args) == 0 || strings.HasPrefix(args[0], "-") {
		if len(args) > 0 && (args[0] == "-h" || args[0] == "--help") {
			fs.Usage()
			return flag.ErrHelp
		}
		fs.Usage()
		return &usageError{msg: "replay wants a question: state, history or diff"}
	}
	question := args[0]
	// The stores a question reads (a copy of --state, a temporary store filled from the streams or an
	// archive, a plans answer's) are Pebble's: out of descriptors they stop as serve does (onFatal).
	replay.SetOnFatal(onFatal(nil, c.Stderr))
	// Positional arguments may come before, between or after the flags.
	pos, err := parseInterleaved(fs, args[1:])
	if err != nil {
		return err
	}
	switch question {
	case "state":
		if len(pos) > 1 {
			return &usageError{msg: fmt.Sprintf("replay state takes one WHAT, got %q", pos)}
		}
		if c.at == "" {
			return &usageError{msg: "replay state needs --at (an RFC 3339 time or seq:<n>)"}
		}
	case "diff":
		if len(pos) > 1 {
			return &usageError{msg: fmt.Sprintf("replay diff takes one WHAT, got %q", pos)}
		}
		if c.from == "" || c.to == "" {
			return &usageError{msg: "replay diff needs --from and --to (RFC 3339 times or seq:<n>)"}
		}
	case "history":
		if len(pos) != 2 {
			return &usageError{msg: "replay history takes BUCKET KEY"}
		}
	default:
		fs.Usage()
		return &usageError{msg: fmt.Sprintf("unknown question %q: want state, history or diff", question)}
	}
	if err := notFor(fs, question, questionFlags[question]); err != nil {
		return err
	}
	if err := c.oneSource(fs); err != nil {
		return err
	}
	what := "registry"
	if len(pos) > 0 && question != "history" {
		what = pos[0]
	}
	if what == string(provisioner.WhatPlans) && question != "state" {
		return &usageError{msg: "plans are replayed with state, at an RFC 3339 time"}
	}
	// The points are checked before a source is read: reading the streams or an archive of a large
	// mesh takes minutes, and a typo should not cost them.
	var from, to replay.Point
	switch question {
	case "state":
		p, err := replay.ParsePoint(c.at)
		if err != nil {
			return &usageError{msg: "--at: " + err.Error()}
		}
		if what == string(provisioner.WhatPlans) && !p.IsTime() {
			return &usageError{msg: fmt.Sprintf("--at %s: plans are read from several buckets, so they are replayed at an RFC 3339 time, not a sequence of one", c.at)}
		}
	case "diff":
		var err error
		if from, err = replay.ParsePoint(c.from); err != nil {
			return &usageError{msg: "--from: " + err.Error()}
		}
		if to, err = replay.ParsePoint(c.to); err != nil {
			return &usageError{msg: "--to: " + err.Error()}
		}
		if from.IsTime() == to.IsTime() && (from.Time.After(to.Time) || from.Seq > to.Seq) {
			return &usageError{msg: fmt.Sprintf("--from %s is after --to %s: give the earlier point as --from", c.from, c.to)}
		}
	}
	var req query.Request
	if question != "history" {
		r, err := c.request(what)
		if err != nil {
			return err
		}
		req = r
	} else {
		b, err := bucketName(pos[0])
		if err != nil {
			return err
		}
		if err := checkHistoryKey(pos[1]); err != nil {
			return err
		}
		pos[0] = b
	}

	if question == "history" && c.state == "" && c.archive == "" && replay.BySubject(pos[1]) {
		// One key from the streams: its own subject is read, not the stream into a temporary store.
		return c.historyFromStream(ctx, pos[0], pos[1])
	}
	if question != "history" && c.state == "" && c.archive == "" && req.Node != "" && what != string(provisioner.WhatPlans) {
		// One node from the streams: its own subjects are read, not the bucket into a temporary store.
		return c.nodeFromStream(ctx, question, req, from, to)
	}
	l, err := c.open(ctx, questionBuckets(question, what, pos))
	if err != nil {
		return err
	}
	defer l.Close()
	if len(l.Unread) > 0 && req.Node != "" && slices.Contains(l.Unread, provisioner.ComposedPrefix+req.Node) {
		// The node asked is one whose compositions could not be read: no answer of its plans is right.
		return fmt.Errorf("%s of node %s cannot be answered: its bucket %s could not be read (the log above says why)", what, req.Node, provisioner.ComposedPrefix+req.Node)
	}
	switch question {
	case "state":
		err = c.runState(ctx, l, req)
	case "diff":
		err = c.runDiff(ctx, l, req, from, to)
	default:
		err = c.runHistory(ctx, l, l.Source, pos[0], pos[1])
	}
	if err == nil && len(l.Unread) > 0 {
		// Answered without some nodes' compositions (replay.Fill): those nodes' rows are not what the
		// streams hold, and the exit code says so.
		return &incompleteError{did: "answered", buckets: l.Unread, then: "their nodes' rows lack their compositions; ask them again once their streams can be read"}
	}
	return err
}

// revisionSource is where a key's history is read: a Log, or the bucket's stream (streamRevisions).
type revisionSource interface {
	EachRevision(ctx context.Context, bucket, key string, fn func(*replay.Revision) error) (replay.KeyHistory, error)
}

// streamRevisions reads a key's history from its bucket's stream (replay.EachRevisionInStream).
type streamRevisions struct {
	js       jetstream.JetStream
	progress replay.Progress
	denied   func() error // a permissions violation reported so far, checked once the read ends
}

func (s streamRevisions) EachRevision(ctx context.Context, bucket, key string, fn func(*replay.Revision) error) (replay.KeyHistory, error) {
	h, err := replay.EachRevisionInStream(ctx, s.js, bucket, key, s.progress, fn)
	if s.denied != nil {
		// A key without messages is answered without a pull, and a pull refused ends as an empty one:
		// the violation, reported on its own, may not have ended ctx yet.
		if derr := s.denied(); derr != nil {
			return h, derr
		}
	}
	return h, err
}

// nearKeyer is a revisionSource that can name keys like one it holds no revision of.
type nearKeyer interface {
	nearKeys(ctx context.Context, bucket, key string) ([]string, error)
}

// nearKeysShown is how many keys a history that found none suggests.
const nearKeysShown = 5

// nearKeys asks the stream for the keys around key (replay.NearKeysInStream): its node's and
// module's, never the whole bucket's.
func (s streamRevisions) nearKeys(ctx context.Context, bucket, key string) ([]string, error) {
	return replay.NearKeysInStream(ctx, s.js, bucket, key, nearKeysShown)
}

// historyFromStream answers history from the streams: the key's messages alone, and the stream's
// sequences when some were removed (the gaps), with the progress of that read, which is the long part.
func (c *ReplayCommand) historyFromStream(ctx context.Context, bucket, key string) error {
	ctx, nc, js, done, err := c.nats.openStreams(ctx, "mesh-provisioner replay")
	if err != nil {
		return err
	}
	defer done()
	report, end := lazyBar(c.Stderr, "reading stream")
	src := streamRevisions{js: js, progress: report, denied: func() error { return c.nats.deniedSoFar(nc) }}
	err = c.runHistory(ctx, src, "nats "+redact(c.nats.url), bucket, key)
	end()
	return refused(ctx, err)
}

// nodeFromStream answers state or diff narrowed by a node from the streams (replay.NodeFromNATS): the
// node's messages, the registry for needs, and the stream's sequences when some were removed (the
// gaps), with the progress of that read, which is the long part.
func (c *ReplayCommand) nodeFromStream(ctx context.Context, question string, req query.Request, from, to replay.Point) error {
	ctx, nc, js, done, err := c.nats.openStreams(ctx, "mesh-provisioner replay")
	if err != nil {
		return err
	}
	defer done()
	shape, _ := provisioner.ShapeOfWhat(provisioner.What(req.What))
	report, end := lazyBar(c.Stderr, "reading stream")
	l, err := replay.NodeFromNATS(ctx, js, shape.Bucket, req.Node, "nats "+redact(c.nats.url), report)
	end()
	if err == nil {
		// A pull refused ends as an empty one: the violation, reported on its own, may not have ended
		// ctx yet.
		err = c.nats.deniedSoFar(nc)
	}
	if err != nil {
		if l != nil {
			l.Close()
		}
		return refused(ctx, err)
	}
	defer l.Close()
	if question == "state" {
		err = c.runState(ctx, l, req)
	} else {
		err = c.runDiff(ctx, l, req, from, to)
	}
	if derr := c.nats.deniedSoFar(nc); derr != nil {
		return derr
	}
	return refused(ctx, err)
}

// oneSource refuses two sources: --state with --archive, or either with a --nats given on the command
// line (NATS_URL in the environment is the default of --nats, not a choice of source).
func (c *ReplayCommand) oneSource(fs *flag.FlagSet) error {
	if n := countSources(fs, c.state, c.archive); n > 1 {
		return &usageError{msg: "give one source: --state, --archive or --nats"}
	}
	return nil
}

// countSources counts the sources a command line gives: --state, --archive and an explicit --nats.
func countSources(fs *flag.FlagSet, state, archive string) int {
	n := 0
	for _, s := range []string{state, archive} {
		if s != "" {
			n++
		}
	}
	fs.Visit(func(f *flag.Flag) {
		if f.Name == "nats" {
			n++
		}
	})
	return n
}

// request builds and checks the verb request the narrowing flags make, as the verb would.
func (c *ReplayCommand) request(what string) (query.Request, error) {
	m := map[string]any{"what": what, "at": "seq:0"}
	for k, v := range map[string]string{"node": c.node, "module": c.module, "contributor": c.contrib, "collection": c.collection, "kind": c.kind} {
		if v != "" {
			m[k] = v
		}
	}
	body, _ := json.Marshal(m)
	r, _, err := query.DecodeRequest(body)
	if err != nil {
		return r, &usageError{msg: err.Error()}
	}
	if _, ok := provisioner.ShapeOfWhat(provisioner.What(r.What)); !ok && r.What != string(provisioner.WhatPlans) {
		return r, &usageError{msg: fmt.Sprintf("replay answers registry, needs, applied, collect and plans, not %s", what)}
	}
	return r, nil
}

// questionBuckets are the buckets a question reads, for a source that is read into a temporary store
// (the streams, an archive): a history its key's bucket; a state or diff its bucket, and the registry
// for needs (unanswered-kind reads it as of the same moment); nil, every bucket, for plans (every
// composed-<node> bucket is an input). Each source read every bucket of the mesh for any question,
// so a key's history cost the whole mesh's messages, thousands of composed-<node> streams included.
func questionBuckets(question, what string, pos []string) []string {
	if question == "history" {
		return []string{pos[0]} // the bucket's full name, read by Run
	}
	shape, ok := provisioner.ShapeOfWhat(provisioner.What(what))
	if !ok {
		return nil // plans
	}
	if shape.Bucket == provisioner.BucketNeeds {
		return []string{provisioner.BucketNeeds, provisioner.BucketRegistry}
	}
	return []string{shape.Bucket}
}

// open reads the source: a state dir's copy whole, or the buckets given (nil: every bucket a seat
// reads) of the streams or an archive.
func (c *ReplayCommand) open(ctx context.Context, buckets []string) (*replay.Log, error) {
	switch {
	case c.state != "":
		return replay.OpenState(c.state)
	case c.archive != "":
		report, end := lazyBar(c.Stderr, "reading archive")
		l, err := replay.FromArchiveBuckets(ctx, c.archive, buckets, report)
		end()
		return l, err
	}
	// A permission the user lacks ends the read at once, naming it: the streams are read in full
	// before anything is answered, so nothing is printed. But for one composed-<node> bucket's stream,
	// when every bucket is read: the read goes on without it (replay.Fill), and the answer says so.
	c.nats.spareComposed = buckets == nil
	ctx, _, js, done, err := c.nats.openStreams(ctx, "mesh-provisioner replay")
	if err != nil {
		return nil, err
	}
	defer done()
	report, end := lazyBar(c.Stderr, "reading streams")
	l, err := replay.FromNATS(ctx, js, buckets, "nats "+redact(c.nats.url), report)
	end()
	return l, refused(ctx, err)
}

// answerError turns a verb error code into the command's error.
func (c *ReplayCommand) answerError(err error) error {
	if code := query.Code(err); code != 500 {
		msg := err.Error()
		if c.state == "" && c.archive == "" && errors.Is(err, store.ErrGap) {
			// The streams no longer hold those messages; the seat read them, and its log keeps them.
			msg += "; or ask the seat's local event log, which keeps what the stream removed after the seat read it: --state DIR (or an archive of it, export --state)"
		}
		return &verbError{code: code, msg: msg}
	}
	return err
}

func (c *ReplayCommand) runState(ctx context.Context, l *replay.Log, req query.Request) error {
	m := map[string]any{"what": req.What, "at": c.at}
	for k, v := range map[string]string{"node": req.Node, "module": req.Module, "collection": req.Collection, "kind": req.Kind} {
		if v != "" {
			m[k] = v
		}
	}
	// Each page is printed as it is read, a table aligned a page at a time: a state of a whole bucket
	// is never held in memory.
	var tw *tabwriter.Writer
	var last map[string]any
	rows := 0
	for {
		// Ctrl-C is read between pages, and within one at each key (its anomalies read the whole state).
		if err := ctx.Err(); err != nil {
			return err
		}
		body, _ := json.Marshal(m)
		out, err := l.AskContext(ctx, body)
		if err != nil {
			return c.answerError(err)
		}
		if c.jsonOut {
			fmt.Fprintln(c.Stdout, string(out))
		}
		var ans map[string]any
		dec := json.NewDecoder(strings.NewReader(string(out)))
		dec.UseNumber()
		if err := dec.Decode(&ans); err != nil {
			return fmt.Errorf("read answer: %w", err)
		}
		if !c.jsonOut {
			if tw == nil {
				tw = tableHeader(c.Stdout, req.What)
			}
			if rows, err = tableRows(tw, req.What, ans, rows); err != nil {
				return err
			}
			if err := tw.Flush(); err != nil {
				return err
			}
		}
		last = ans
		next, _ := ans["next"].(string)
		if next == "" {
			break
		}
		m["after"] = next
	}
	if !c.jsonOut {
		tableEnd(c.Stdout, last, rows)
		fmt.Fprintf(c.Stdout, "(from %s, at %s)\n", l.Source, c.at)
	}
	return nil
}

// jsonRow is a row as replay prints it in JSON: as the verb writes it, without the key's parts.
type jsonRow struct {
	Key      string          `json:"key"`
	Revision uint64          `json:"revision"`
	Created  time.Time       `json:"created"`
	Value    json.RawMessage `json:"value"`
	ValueRaw []byte          `json:"value_raw,omitempty"`
}

func rowJSON(r replay.Row) jsonRow {
	j := jsonRow{Key: r.Key, Revision: r.Revision, Created: r.Created, Value: json.RawMessage("null")}
	if s, ok := replay.ValueJSON(r.Value); ok {
		j.Value = json.RawMessage(s)
	} else {
		j.ValueRaw = r.Value
	}
	return j
}

type jsonAnomaly struct {
	Bucket   string `json:"bucket"`
	Key      string `json:"key"`
	Revision uint64 `json:"revision"`
	Reason   string `json:"reason"`
}

func anomalyJSON(a provisioner.Anomaly) jsonAnomaly {
	return jsonAnomaly{Bucket: a.Bucket, Key: a.Key, Revision: a.Revision, Reason: a.Text()}
}

func (c *ReplayCommand) runDiff(ctx context.Context, l *replay.Log, req query.Request, pf, pt replay.Point) error {
	// Each part of the answer (rows added, changed, removed; anomalies appeared, cleared) is written
	// to a temporary file as the two states are walked side by side, then printed in order: a diff of
	// a whole bucket of millions of keys holds none of its rows in memory.
	var parts [5]*spool
	for i := range parts {
		parts[i] = newSpool()
		defer parts[i].close()
	}
	var fromSeq, toSeq uint64
	ordered := func(a, b uint64) error {
		if a > b {
			// A time and a sequence are ordered by the log only: the diff would list every row added
			// in between as removed.
			return &usageError{msg: fmt.Sprintf("--from %s (as of sequence %d) is after --to %s (as of sequence %d): give the earlier point as --from", c.from, a, c.to, b)}
		}
		fromSeq, toSeq = a, b
		return nil
	}
	err := l.DiffEach(ctx, req, pf, pt, ordered, func(it *replay.DiffItem) error {
		sp := parts[it.Kind]
		if c.jsonOut {
			var v any
			switch it.Kind {
			case replay.DiffChanged:
				v = struct {
					Key  string  `json:"key"`
					From jsonRow `json:"from"`
					To   jsonRow `json:"to"`
				}{Key: it.Row.Key, From: rowJSON(it.From), To: rowJSON(it.Row)}
			case replay.DiffAppeared, replay.DiffCleared:
				v = anomalyJSON(it.Anomaly)
			default:
				v = rowJSON(it.Row)
			}
			b, err := json.Marshal(v)
			if err != nil {
				return err
			}
			return sp.element(b)
		}
		switch it.Kind {
		case replay.DiffAdded:
			return sp.line("added\t%s\t%d\t%s\n", it.Row.Key, it.Row.Revision, valueCell(it.Row.Value))
		case replay.DiffChanged:
			return sp.line("changed\t%s\t%d -> %d\t%s -> %s\n", it.Row.Key, it.From.Revision, it.Row.Revision, valueCell(it.From.Value), valueCell(it.Row.Value))
		case replay.DiffRemoved:
			return sp.line("removed\t%s\t%d\t%s\n", it.Row.Key, it.Row.Revision, valueCell(it.Row.Value))
		case replay.DiffAppeared:
			return sp.line("appeared\t%s\t%d\t%s\n", it.Anomaly.Key, it.Anomaly.Revision, it.Anomaly.Text())
		default:
			return sp.line("cleared\t%s\t%d\t%s\n", it.Anomaly.Key, it.Anomaly.Revision, it.Anomaly.Text())
		}
	})
	if err != nil {
		var ue *usageError
		if errors.As(err, &ue) {
			return err
		}
		return c.answerError(err)
	}
	added, changed, removed, appeared, cleared := parts[replay.DiffAdded], parts[replay.DiffChanged], parts[replay.DiffRemoved], parts[replay.DiffAppeared], parts[replay.DiffCleared]
	w := bufio.NewWriter(c.Stdout)
	if c.jsonOut {
		fmt.Fprintf(w, `{"what":%s,"from_as_of":%d,"to_as_of":%d`, jsonString(req.What), fromSeq, toSeq)
		for _, p := range []struct {
			name string
			sp   *spool
		}{{"added", added}, {"changed", changed}, {"removed", removed}, {"anomalies_appeared", appeared}, {"anomalies_cleared", cleared}} {
			fmt.Fprintf(w, `,%q:[`, p.name)
			if err := p.sp.copyTo(ctx, w); err != nil {
				return err
			}
			w.WriteString("]")
		}
		w.WriteString("}\n")
		return w.Flush()
	}
	fmt.Fprintf(w, "%s from %s (as of sequence %d) to %s (as of sequence %d), %s:\n\n", req.What, pf, fromSeq, pt, toSeq, l.Source)
	nRows, nAnoms := added.n+changed.n+removed.n, appeared.n+cleared.n
	if nRows+nAnoms == 0 {
		fmt.Fprintln(w, "no changes")
		return w.Flush()
	}
	if nRows > 0 {
		if err := printSpooled(ctx, w, "CHANGE\tKEY\tREVISION\tVALUE\n", added, changed, removed); err != nil {
			return err
		}
	}
	if nAnoms > 0 {
		fmt.Fprintln(w)
		if err := printSpooled(ctx, w, "ANOMALY\tKEY\tREVISION\tREASON\n", appeared, cleared); err != nil {
			return err
		}
	}
	fmt.Fprintf(w, "\n%d added, %d changed, %d removed; %d anomalies appeared, %d cleared\n",
		added.n, changed.n, removed.n, appeared.n, cleared.n)
	return w.Flush()
}

// valueCell is a value for a table cell: its JSON, cut to a line, or what it is when JSON cannot
// show it.
func valueCell(v []byte) string {
	s, ok := replay.ValueJSON(v)
	if !ok {
		return rawCell(v)
	}
	if len(s) > 72 {
		s = s[:69] + "..."
	}
	return s
}

// rawCell is a table cell of a value JSON does not show, its bytes in base64, saying why: not
// MessagePack at all, or MessagePack JSON has no form for (a NaN or infinite float, a string not
// UTF-8, map keys nested too deep), which is a value all the same and no anomaly.
func rawCell(v []byte) string {
	if mpk.Valid(v) {
		return fmt.Sprintf("(MessagePack with no JSON form: %s)", base64.StdEncoding.EncodeToString(v))
	}
	return fmt.Sprintf("(not MessagePack: %s)", base64.StdEncoding.EncodeToString(v))
}

// bucketName reads a bucket given by its full name or by what it answers (needs).
func bucketName(s string) (string, error) {
	if shape, ok := provisioner.ShapeOfWhat(provisioner.What(s)); ok {
		return shape.Bucket, nil
	}
	if _, ok := provisioner.ShapeOf(s); ok {
		return s, nil
	}
	return "", &usageError{msg: fmt.Sprintf("bucket %q: want registry, needs, applied, collect or a bucket's full name", s)}
}

func (c *ReplayCommand) runHistory(ctx context.Context, l revisionSource, source, bucketArg, key string) error {
	bucket, err := bucketName(bucketArg)
	if err != nil {
		return err
	}
	// The revisions are printed as they are read: a key with a million revisions is never held in
	// memory, and Ctrl-C stops the walk.
	w := bufio.NewWriter(c.Stdout)
	n := 0
	var h replay.KeyHistory
	if c.jsonOut {
		type rev struct {
			Revision uint64          `json:"revision"`
			Time     time.Time       `json:"time"`
			Op       string          `json:"op"`
			Value    json.RawMessage `json:"value,omitempty"`
			ValueRaw []byte          `json:"value_raw,omitempty"`
		}
		fmt.Fprintf(w, `{"bucket":%s,"key":%s,"revisions":[`, jsonString(bucket), jsonString(key))
		h, err = l.EachRevision(ctx, bucket, key, func(r *replay.Revision) error {
			x := rev{Revision: r.Seq, Time: r.Time, Op: r.Op.String()}
			if r.Op == provisioner.OpPut {
				if s, ok := replay.ValueJSON(r.Value); ok {
					x.Value = json.RawMessage(s)
				} else {
					x.ValueRaw = r.Value
				}
			}
			b, err := json.Marshal(x)
			if err != nil {
				return err
			}
			if n > 0 {
				w.WriteByte(',')
			}
			n++
			_, err = w.Write(b)
			return err
		})
		if err != nil {
			return err
		}
		type gap struct {
			From uint64 `json:"from"`
			To   uint64 `json:"to,omitempty"`
		}
		gaps := []gap{}
		for _, g := range h.Gaps {
			gaps = append(gaps, gap{From: g.From, To: g.To})
		}
		b, _ := json.Marshal(gaps)
		fmt.Fprintf(w, `],"floor":%d,"gaps":%s}`+"\n", h.Floor, b)
		if err := w.Flush(); err != nil {
			return err
		}
	} else {
		tw := newTable(w)
		fmt.Fprintln(tw, "TIME\tREVISION\tOP\tVALUE")
		h, err = l.EachRevision(ctx, bucket, key, func(r *replay.Revision) error {
			val := "-"
			if r.Op == provisioner.OpPut {
				val = valueCell(r.Value)
			}
			fmt.Fprintf(tw, "%s\t%d\t%s\t%s\n", r.Time.Format(time.RFC3339Nano), r.Seq, r.Op, val)
			if n++; n%tableChunk == 0 {
				return tw.Flush()
			}
			return nil
		})
		if err != nil {
			return err
		}
		tw.Flush()
		fmt.Fprintf(w, "\n%d revisions of %s in %s (from %s)\n", n, key, bucket, source)
		if h.Floor > 0 {
			kept := "revisions before the newest one at or below it are gone"
			if _, ok := provisioner.ComposedNode(bucket); ok {
				kept = "of the revisions at or below it, the newest and the newest published one are kept, the others are gone"
			}
			fmt.Fprintf(w, "the log was trimmed to sequence %d: %s\n", h.Floor, kept)
		}
		for _, g := range h.Gaps {
			fmt.Fprintf(w, "messages from sequence %d to %d were removed from the stream before the seat read them: a revision may be missing there\n", g.From, g.OpenedAt-1)
		}
		if err := w.Flush(); err != nil {
			return err
		}
	}
	if n == 0 {
		msg := fmt.Sprintf("the log holds no revision of %s in %s", key, bucket)
		if raw := rawCollectKey(key); bucket == provisioner.BucketCollect && raw != key {
			errFound := errors.New("found")
			if _, err := l.EachRevision(ctx, bucket, raw, func(*replay.Revision) error { return errFound }); errors.Is(err, errFound) {
				msg += fmt.Sprintf("; keys are raw, with the collection written in =XX escapes: did you mean %s?", raw)
			}
		}
		if near, ok := l.(nearKeyer); ok && !strings.Contains(msg, "did you mean") {
			keys, err := near.nearKeys(ctx, bucket, key)
			if err := ctx.Err(); err != nil {
				return err
			}
			if err == nil && len(keys) > 0 {
				msg += fmt.Sprintf("; did you mean %s?", strings.Join(keys, ", "))
			}
			// A suggestion that cannot be asked (a permission, a slow server) leaves the 404 as it is.
		}
		if provisioner.HasWildcard(key) {
			what := bucket
			if shape, ok := provisioner.ShapeOf(bucket); ok && shape.What != "" {
				what = string(shape.What)
			}
			msg += fmt.Sprintf(" (a key is read as written, not as a pattern: for a node's keys as of a point, use replay state %s --node NODE --at POINT)", what)
		}
		return &verbError{code: 404, msg: msg}
	}
	return nil
}

// checkHistoryKey refuses what cannot be one key: nothing. A key with a wildcard token is read as
// written: NATS stores a message published on such a subject (a rollup of the keys it matches), and
// the seat names it in an anomaly row.
func checkHistoryKey(key string) error {
	if key == "" {
		return &usageError{msg: "replay history takes BUCKET KEY, and the key is empty"}
	}
	return nil
}

// rawCollectKey is a collect key as an operator may write it (the collection by its decoded name,
// shell:zsh:normal, or with lower-case escapes) as it is stored: <node>.<escaped collection>.<contributor>,
// the collection being every token between the first and the last.
func rawCollectKey(key string) string {
	toks := strings.Split(key, ".")
	if len(toks) < 3 {
		return key
	}
	coll := strings.Join(toks[1:len(toks)-1], ".")
	if name, err := provisioner.DecodeCollection(coll); err == nil {
		coll = name
	}
	return toks[0] + "." + provisioner.EncodeCollection(coll) + "." + toks[len(toks)-1]
}
