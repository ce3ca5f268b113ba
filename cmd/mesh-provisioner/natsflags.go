package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
)

// natsFlags are the NATS connection flags every command reads, by the NATS conventions.
type natsFlags struct {
	url      string
	creds    string
	user     string
	password string
	inbox    string

	// denied, when set, is told each permissions violation the server reports on the connection: a
	// command that asks (query) stops at once and says what NATS refused, rather than waiting out its
	// timeout for an answer that cannot arrive.
	denied func(error)
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
		opts = append(opts,
			nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
				if err != nil {
					log.Warn("disconnected from NATS", "err", err)
				}
			}),
			nats.ReconnectHandler(func(nc *nats.Conn) { log.Info("reconnected to NATS", "url", nc.ConnectedUrl()) }),
			nats.ErrorHandler(func(_ *nats.Conn, sub *nats.Subscription, err error) {
				subj := ""
				if sub != nil {
					subj = sub.Subject
				}
				log.Warn("NATS error", "subject", subj, "err", err)
				f.deny(err)
			}),
		)
	} else if f.denied != nil {
		opts = append(opts, nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) { f.deny(err) }))
	}
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		return nil, fmt.Errorf("connect to NATS at %s: %w", redact(url), err)
	}
	return nc, nil
}

func (f *natsFlags) deny(err error) {
	if f.denied != nil && errors.Is(err, nats.ErrPermissionViolation) {
		f.denied(err)
	}
}

// deniedError says what NATS refused the command's user, and for its reply inbox which flag to give.
func (f *natsFlags) deniedError(err error) error {
	if strings.Contains(err.Error(), "Subscription to") && strings.Contains(err.Error(), f.inbox+".") {
		return fmt.Errorf("%w: this NATS user may not subscribe to its reply inboxes %s.>: give --inbox-prefix (env NATS_INBOX_PREFIX) a prefix it may subscribe to, such as _INBOX.node.<node> for a node's user (docs/accounts.md)", err, f.inbox)
	}
	return fmt.Errorf("%w: docs/accounts.md lists what each user needs", err)
}

// redact hides a password in a URL for messages.
func redact(url string) string {
	if i := strings.Index(url, "@"); i >= 0 {
		if j := strings.Index(url, "://"); j >= 0 && j < i {
			return url[:j+3] + "***" + url[i:]
		}
	}
	return url
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
