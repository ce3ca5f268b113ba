package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	neturl "net/url"
	"os"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/denied"
)

// natsFlags are the NATS connection flags every command reads, by the NATS conventions.
type natsFlags struct {
	url      string
	creds    string
	user     string
	password string
	inbox    string

	// denied, when set (stopOnDenied), is told each permissions violation the server reports on the
	// connection, as a *permissionError.
	denied func(error)
	// spareComposed, with denied, lets a violation on one composed-<node> bucket's stream through
	// (permissionError.composed): a command reading every bucket goes on without that node's bucket,
	// as a seat does (replay.Fill), and names it, rather than stop for one node among thousands.
	spareComposed bool
}

// defaultInboxPrefix keeps the program's replies under a subject of its own, so that its NATS user can be
// granted `_INBOX.mesh-provisioner.>` rather than every reply of the account (docs/accounts.md); a user
// granted `_INBOX.>` still receives them.
const defaultInboxPrefix = "_INBOX.mesh-provisioner"

func (f *natsFlags) register(fs *flag.FlagSet, defaultURL string) {
	if env := os.Getenv("NATS_URL"); env != "" {
		defaultURL = env
	}
	fs.StringVar(&f.url, "nats", defaultURL, "NATS server URL(s), comma separated (env NATS_URL)")
	fs.StringVar(&f.creds, "creds", os.Getenv("NATS_CREDS"), "NATS credentials file (env NATS_CREDS)")
	fs.StringVar(&f.user, "user", os.Getenv("NATS_USER"), "NATS user (env NATS_USER)")
	fs.StringVar(&f.password, "password", os.Getenv("NATS_PASSWORD"), "NATS password (env NATS_PASSWORD)")
	inbox := os.Getenv("NATS_INBOX_PREFIX")
	if inbox == "" {
		inbox = defaultInboxPrefix
	}
	fs.StringVar(&f.inbox, "inbox-prefix", inbox, "subject prefix of reply inboxes, which the NATS user must be allowed to subscribe to (env NATS_INBOX_PREFIX)")
	// The usage (--help, and a wrong flag, which a unit file's typo sends to the journal) prints each
	// flag's default: the environment's password and a URL's credentials are not said there.
	fs.Lookup("password").DefValue = ""
	fs.Lookup("nats").DefValue = redact(defaultURL)
}

// validate reports flags that cannot be used together.
func (f *natsFlags) validate() error {
	if f.password != "" && f.user == "" {
		// Sent alone, the password was dropped and the server's refusal said nothing of why.
		return &usageError{"--password (or NATS_PASSWORD) is set without --user (or NATS_USER): give both"}
	}
	return nil
}

// connect dials NATS with the flags, reconnecting forever with backoff once connected.
func (f *natsFlags) connect(url, name string, log *slog.Logger) (*nats.Conn, error) {
	if err := f.validate(); err != nil {
		return nil, err
	}
	opts := []nats.Option{
		nats.Name(name),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250 * time.Millisecond),
		nats.ReconnectJitter(100*time.Millisecond, time.Second),
		nats.RetryOnFailedConnect(false),
	}
	if f.inbox != "" {
		opts = append(opts, nats.CustomInboxPrefix(f.inbox))
	}
	if f.creds != "" {
		opts = append(opts, nats.UserCredentials(f.creds))
	}
	if f.user != "" {
		opts = append(opts, nats.UserInfo(f.user, f.password))
	}
	if log != nil {
		violations := &violationLog{seen: map[string]*violationSeen{}}
		opts = append(opts,
			nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
				if err != nil {
					log.Warn("disconnected from NATS", "err", err)
				}
			}),
			nats.ReconnectHandler(func(nc *nats.Conn) { log.Info("reconnected to NATS", "url", redact(nc.ConnectedUrl())) }),
			nats.ErrorHandler(func(_ *nats.Conn, sub *nats.Subscription, err error) {
				pe := f.permissionError(err)
				f.deny(pe)
				if pe != nil {
					if repeated, ok := violations.say(pe.op+" "+pe.grant, time.Now()); ok {
						args := []any{"subject", pe.subject, "err", pe}
						if repeated > 0 {
							args = append(args, "repeated", repeated)
						}
						log.Warn("NATS error", args...)
					}
					return
				}
				subj := ""
				if sub != nil {
					subj = sub.Subject
				}
				log.Warn("NATS error", "subject", subj, "err", err)
			}),
		)
	} else if f.denied != nil {
		opts = append(opts, nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) { f.deny(f.permissionError(err)) }))
	}
	nc, err := nats.Connect(url, opts...)
	if errors.Is(err, nats.ErrAuthorization) {
		return nil, fmt.Errorf("connect to NATS at %s: %w: %s", redact(url), err, f.refusedWho(url))
	}
	if errors.Is(err, nats.ErrNoServers) {
		// Said alone, "no servers available" left an operator at a dead end: after make run's serve
		// was stopped (its embedded server with it), a rebuild by the README got only this.
		return nil, fmt.Errorf("connect to NATS at %s: %w: nothing answers there; give the mesh's NATS with --nats or NATS_URL "+
			"(serve's embedded server, as make run starts it, runs only while that serve does)", redact(url), err)
	}
	if err != nil {
		return nil, fmt.Errorf("connect to NATS at %s: %w", redact(url), err)
	}
	return nc, nil
}

// refusedWho says which credentials the server refused, and where they came from: "Authorization
// Violation" alone did not say whether none were given (a runbook's env file not loaded), or which.
// Credentials written in the URL count as given (nats.go sends them when no --user is given); a
// password or token is never said.
func (f *natsFlags) refusedWho(servers string) string {
	switch {
	case f.creds != "":
		return fmt.Sprintf("the server refused the credentials file %s (--creds, env NATS_CREDS): is it a user of this NATS? (docs/accounts.md)", f.creds)
	case f.user != "" && f.password == "":
		return fmt.Sprintf("the server refused user %s, given without a password: give --password (env NATS_PASSWORD)", f.user)
	case f.user != "":
		return fmt.Sprintf("the server refused user %s with the password given (--user, --password, env NATS_USER, NATS_PASSWORD)", f.user)
	}
	for _, s := range strings.Split(servers, ",") {
		s = strings.TrimSpace(s)
		if !strings.Contains(s, "://") {
			s = "nats://" + s // as nats.go reads a server without a scheme
		}
		u, err := neturl.Parse(s)
		if err != nil || u.User == nil {
			continue
		}
		if _, ok := u.User.Password(); ok {
			return fmt.Sprintf("the server refused user %s given in the URL, with its password (--nats, env NATS_URL)", u.User.Username())
		}
		return "the server refused the token given in the URL (--nats, env NATS_URL)"
	}
	return "no credentials were given, and this NATS wants them: give --creds FILE, or --user and --password (env NATS_CREDS, NATS_USER, NATS_PASSWORD; docs/accounts.md)"
}

// deny tells denied of a permissions violation the command cannot do without; pe nil is none.
func (f *natsFlags) deny(pe *permissionError) {
	if f.denied != nil && pe != nil && !pe.optional() && (!f.spareComposed || pe.composed() == "") {
		f.denied(pe)
	}
}

// deniedSoFar makes a round trip on nc, so that every permissions violation the server reported on it
// before has been read, and returns the last one when the command cannot do without it (the error
// handler tells stopOnDenied's context as well, on a goroutine of its own, maybe later); else nil.
func (f *natsFlags) deniedSoFar(nc *nats.Conn) error {
	_ = nc.Flush()
	if pe := f.permissionError(nc.LastError()); pe != nil && !pe.optional() {
		return pe
	}
	return nil
}

// stopOnDenied makes the connection connect dials next end the context it returns at the first
// permissions violation the server reports on it (one the command can do without aside), with a
// *permissionError as the context's cause: a one-shot command stops at once and says what NATS
// refused, rather than waiting out a request's timeout for an answer that cannot arrive and blaming
// the server or the stream. serve does not call it: a seat keeps serving, and logs the violations.
func (f *natsFlags) stopOnDenied(ctx context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancelCause(ctx)
	f.denied = cancel
	return ctx, func() { cancel(nil) }
}

// openStreams connects a one-shot command that reads the streams (replay, export): ctx ends at the
// first permission the user lacks (stopOnDenied), and the provisioner's streams must be there. done
// closes the connection, then stops the watch.
func (f *natsFlags) openStreams(ctx context.Context, name string) (_ context.Context, nc *nats.Conn, js jetstream.JetStream, done func(), err error) {
	ctx, stop := f.stopOnDenied(ctx)
	if nc, err = f.connect(f.url, name, nil); err != nil {
		stop()
		return ctx, nil, nil, nil, err
	}
	done = func() {
		nc.Close()
		stop()
	}
	if js, err = jetstream.New(nc); err != nil {
		done()
		return ctx, nil, nil, nil, fmt.Errorf("jetstream: %w", err)
	}
	if err := hasProvisionerStreams(ctx, js, f.url); err != nil {
		err = refused(ctx, err) // before done: the watch's cause is read from ctx
		done()
		return ctx, nil, nil, nil, err
	}
	return ctx, nc, js, done, nil
}

// refused returns the permissions violation that ended ctx (stopOnDenied) in place of err, which is
// what waiting on ctx gave (context canceled, a request cut short); err itself when it is nil or
// already says the violation, or when no violation ended ctx.
func refused(ctx context.Context, err error) error {
	var pe *permissionError
	if err == nil || errors.As(err, &pe) || !errors.As(context.Cause(ctx), &pe) {
		return err
	}
	return pe
}

// permissionError is a permissions violation the server reported on a command's connection: what it
// refused this user (publish or subscribe, on which subject), and what to grant, as
// docs/nats-accounts.conf grants it.
type permissionError struct {
	op      string // "publish" or "subscribe"
	subject string // as refused
	grant   string // the subject to grant: the refused one with a consumer's name or a key made a wildcard
	inbox   string // the connection's inbox prefix, when the refused subscription is one of its inboxes
	err     error  // nats.go's, which wraps nats.ErrPermissionViolation
}

var violationRe = regexp.MustCompile(`Permissions Violation for (Publish|Subscription) to "([^"]+)"`)

// permissionError reads a permissions violation nats.go reported; nil for any other error.
func (f *natsFlags) permissionError(err error) *permissionError {
	if !errors.Is(err, nats.ErrPermissionViolation) {
		return nil
	}
	pe := &permissionError{err: err}
	m := violationRe.FindStringSubmatch(err.Error())
	if m == nil {
		return pe // "Publish with Reply of": said as the server said it
	}
	pe.subject = m[2]
	pe.op, pe.grant = "publish", grantOf(m[2])
	if m[1] == "Subscription" {
		pe.op, pe.grant = "subscribe", m[2]
		if f.inbox != "" && strings.HasPrefix(m[2], f.inbox+".") {
			pe.inbox, pe.grant = f.inbox, f.inbox+".>"
		}
	}
	return pe
}

func (e *permissionError) Error() string {
	switch {
	case e.inbox != "":
		return fmt.Sprintf("%v: this NATS user may not subscribe to its reply inboxes %s.>: give --inbox-prefix (env NATS_INBOX_PREFIX) a prefix it may subscribe to, such as _INBOX.node.<node> for a node's user, or grant it subscribe on %s.> (docs/accounts.md)", e.err, e.inbox, e.inbox)
	case e.grant != "":
		return fmt.Sprintf("%v: grant this NATS user %s on %s (docs/accounts.md lists what each user needs)", e.err, e.op, e.grant)
	}
	return fmt.Sprintf("%v: docs/accounts.md lists what each user needs", e.err)
}

func (e *permissionError) Unwrap() error { return e.err }

// optional says whether a one-shot command does without what was refused, as docs/accounts.md says
// the seat does: the listing of every stream's info ($JS.API.STREAM.LIST: each stream is asked for its
// own instead), and the stream-created advisories (new buckets are found by listing their names).
func (e *permissionError) optional() bool {
	switch e.op {
	case "publish":
		return strings.HasSuffix(e.subject, ".STREAM.LIST")
	case "subscribe":
		return strings.HasPrefix(e.subject, "$JS.EVENT.ADVISORY.")
	}
	return false
}

// composed returns the composed-<node> bucket whose stream (KV_composed-<node>, in a JetStream API
// subject) or subjects ($KV.composed-<node>.>) the refused subject names; "" when it names none.
func (e *permissionError) composed() string {
	toks := strings.Split(e.subject, ".")
	for i, t := range toks {
		b, ok := strings.CutPrefix(t, "KV_")
		if !ok && t == "$KV" && i+1 < len(toks) {
			b, ok = toks[i+1], true
		}
		if ok && provisioner.IsComposedBucket(b) {
			return b
		}
	}
	return ""
}

// grantOf is the subject docs/nats-accounts.conf grants for a refused publish (denied.Grant).
func grantOf(subject string) string { return denied.Grant(subject) }

// violationLogEvery is how often a permissions violation that goes on is logged again, per grant.
const violationLogEvery = time.Minute

// violationLog says each permissions violation once, then at most once every violationLogEvery per
// grant, with how many it did not say since: a seat retries what NATS refuses, each bucket every few
// seconds (a consumer create, say), and logged a line per retry, per bucket, for as long as the
// permission was missing. Violations are counted by the subject to grant, so the consumers' names,
// new on each retry, do not make each one new.
type violationLog struct {
	mu   sync.Mutex
	seen map[string]*violationSeen
}

type violationSeen struct {
	said    time.Time
	skipped int
}

// say reports whether to log a violation of grant now, and how many were not logged since the last.
func (v *violationLog) say(grant string, now time.Time) (repeated int, ok bool) {
	v.mu.Lock()
	defer v.mu.Unlock()
	s := v.seen[grant]
	if s == nil {
		v.seen[grant] = &violationSeen{said: now}
		return 0, true
	}
	if now.Sub(s.said) < violationLogEvery {
		s.skipped++
		return 0, false
	}
	repeated = s.skipped
	s.said, s.skipped = now, 0
	return repeated, true
}

// redact hides the credentials (user and password, or a token) of every server in a URL, for messages.
func redact(url string) string {
	servers := strings.Split(url, ",")
	for i, s := range servers {
		at := strings.LastIndex(s, "@")
		if at < 0 {
			continue
		}
		// What comes before the host is credentials (user:password, or a token), in each server
		// of a list, with a scheme or without (nats.go reads "user:pw@host:4222" too).
		start := 0
		if j := strings.Index(s, "://"); j >= 0 && j < at {
			start = j + 3
		} else {
			start = len(s) - len(strings.TrimLeft(s, " "))
		}
		servers[i] = s[:start] + "***" + s[at:]
	}
	return strings.Join(servers, ",")
}

// logFlags set up log/slog.
type logFlags struct {
	format string
	level  string
}

func (f *logFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.format, "log-format", "text", "log format: text or json")
	fs.StringVar(&f.level, "log-level", "info", "log level: debug, info, warn or error")
}

func (f *logFlags) logger(w io.Writer) (*slog.Logger, error) {
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(f.level)); err != nil {
		return nil, &usageError{msg: fmt.Sprintf("--log-level %q: want debug, info, warn or error", f.level)}
	}
	o := &slog.HandlerOptions{Level: lvl, ReplaceAttr: durationsAsText}
	switch f.format {
	case "text":
		return slog.New(slog.NewTextHandler(w, o)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, o)), nil
	}
	return nil, &usageError{msg: fmt.Sprintf("--log-format %q: want text or json", f.format)}
}

// durationsAsText writes durations as "1.5s" rather than nanoseconds, so JSON logs read as the text
// ones do ("took": "13ms").
func durationsAsText(_ []string, a slog.Attr) slog.Attr {
	if a.Value.Kind() == slog.KindDuration {
		return slog.String(a.Key, a.Value.Duration().String())
	}
	return a
}

// parseFlags parses a subcommand's flags, and turns a parse error into a usage error.
func parseFlags(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if err == flag.ErrHelp {
			return err
		}
		return &usageError{msg: err.Error()}
	}
	return nil
}

// parseInterleaved parses a subcommand's flags with its positional arguments before, between or after
// them (`query --node n7 needs --json`), and returns the positional ones in order. The flag package
// stops at the first argument that is not a flag, so the flags after it were taken for positional
// arguments: `query --node n7 needs --json` said "query takes one WHAT, got ["" "needs" "--json"]". An
// argument after "--" is positional even when it starts with "-" (a key may: replay history needs --
// -n1.mod.config.x).
func parseInterleaved(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := parseFlags(fs, args); err != nil {
			return nil, err
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return pos, nil
		}
		if n := len(args) - len(rest); n > 0 && args[n-1] == "--" {
			return append(pos, rest...), nil
		}
		pos, args = append(pos, rest[0]), rest[1:]
	}
}

// parseNoArgs parses the flags of a subcommand that takes no positional arguments.
func parseNoArgs(fs *flag.FlagSet, args []string) error {
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return &usageError{msg: fmt.Sprintf("%s takes no arguments, got %q", fs.Name(), fs.Args())}
	}
	return nil
}
