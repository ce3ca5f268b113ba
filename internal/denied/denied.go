// Package denied tells a request that NATS refused it. A publish or request to a subject the user may
// not publish to is dropped by the server, which tells the connection (a permissions violation, handed
// only to the connection's error callback and kept as its last error): the request gets no answer and
// waits out its whole timeout, then says nothing of why. Context ends a request's context as soon as
// the connection's last error is a violation of one of the request's subjects, with an *Error that names
// the subject and what to grant.
package denied

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"regexp"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
)

// Poll is how often Context looks at the connection's last error.
const Poll = 10 * time.Millisecond

// Error is a publish, or a subscription, NATS refused this connection's user.
type Error struct {
	Op      string // "publish" or "subscribe"
	Subject string // as refused
	Err     error  // nats.go's, which wraps nats.ErrPermissionViolation
}

func (e *Error) Error() string {
	grant := e.Subject
	if e.Op == "publish" {
		grant = Grant(e.Subject)
	}
	return fmt.Sprintf("%v: grant this NATS user %s on %s (docs/accounts.md lists what each user needs)", e.Err, e.Op, grant)
}

func (e *Error) Unwrap() error { return e.Err }

var (
	publishRe   = regexp.MustCompile(`Permissions Violation for Publish to "([^"]+)"`)
	subscribeRe = regexp.MustCompile(`Permissions Violation for Subscription to "([^"]+)"`)
)

// Violation returns the connection's last error as an *Error when it is a permissions violation of a
// publish whose subject match accepts, and is not before (the last error when the caller started: each
// violation is a new error value, and the same one is an older request's). nats.go keeps only the last
// error: a violation followed within a Poll by another is not seen, and its request waits out its
// timeout as before.
func Violation(nc *nats.Conn, before error, match func(subject string) bool) *Error {
	if nc == nil {
		return nil
	}
	err := nc.LastError()
	if err == nil || !errors.Is(err, nats.ErrPermissionViolation) || same(err, before) {
		return nil
	}
	m := publishRe.FindStringSubmatch(err.Error())
	if m == nil || !match(m[1]) {
		return nil
	}
	return &Error{Op: "publish", Subject: m[1], Err: err}
}

// Subscription returns the connection's last error as an *Error when it is a permissions violation of
// a subscription to subject, and is not before. The server refuses a subscription as it reads it: once
// a flush after the subscription has returned, the violation is the connection's last error, unless
// another error came between.
func Subscription(nc *nats.Conn, before error, subject string) *Error {
	if nc == nil {
		return nil
	}
	err := nc.LastError()
	if err == nil || !errors.Is(err, nats.ErrPermissionViolation) || same(err, before) {
		return nil
	}
	m := subscribeRe.FindStringSubmatch(err.Error())
	if m == nil || m[1] != subject {
		return nil
	}
	return &Error{Op: "subscribe", Subject: subject, Err: err}
}

func same(err, before error) bool {
	return before != nil && reflect.TypeOf(err) == reflect.TypeOf(before) && reflect.TypeOf(err).Comparable() && err == before
}

// Context returns a context below ctx that ends, with an *Error as its cause, as soon as the connection
// reports a permissions violation of a publish whose subject match accepts. The goroutine that watches
// is stopped, and waited for, by the cancel func returned, which the caller must call.
func Context(ctx context.Context, nc *nats.Conn, match func(subject string) bool) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancelCause(ctx)
	if nc == nil {
		return ctx, func() { cancel(nil) }
	}
	before := nc.LastError()
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(Poll)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			if v := Violation(nc, before, match); v != nil {
				cancel(v)
				return
			}
		}
	}()
	return ctx, func() {
		cancel(nil)
		<-done
	}
}

// Cause returns the *Error that ended ctx (Context) in place of err, what the request under ctx
// returned (a context error, a timeout); err itself when it is nil or no violation ended ctx.
func Cause(ctx context.Context, err error) error {
	var de *Error
	if err == nil || errors.As(err, &de) || !errors.As(context.Cause(ctx), &de) {
		return err
	}
	return de
}

// OfStream returns a match of the JetStream API's subjects about a stream (its info, consumers,
// messages, under any API prefix) and of the KV subjects of its bucket when it is KV_<bucket>.
func OfStream(stream string) func(subject string) bool {
	kv := ""
	if b, ok := strings.CutPrefix(stream, "KV_"); ok {
		kv = "$KV." + b + "."
	}
	return func(subject string) bool {
		if kv != "" && strings.HasPrefix(subject, kv) {
			return true
		}
		if !strings.HasPrefix(subject, "$JS.") {
			return false
		}
		for _, tok := range strings.Split(subject, ".") {
			if tok == stream {
				return true
			}
		}
		return false
	}
}

// Grant is the subject docs/nats-accounts.conf grants for a refused publish: the JetStream API's
// consumer requests for any consumer of the stream (CREATE with any filter), direct gets of any key,
// and a bucket's keys with >.
func Grant(subject string) string {
	toks := strings.Split(subject, ".")
	api := 2 // $JS.API.<request>: tokens before the request's name
	if len(toks) > 3 && toks[0] == "$JS" && toks[1] != "API" && toks[2] == "API" {
		api = 3 // $JS.<domain>.API.<request>
	}
	switch {
	case toks[0] == "$KV" && len(toks) > 2:
		return strings.Join(toks[:2], ".") + ".>"
	case toks[0] != "$JS" || len(toks) <= api+1:
		return subject
	}
	req := toks[api:]
	switch {
	case req[0] == "CONSUMER" && len(req) > 3 && req[1] == "CREATE":
		return strings.Join(toks[:api+3], ".") + ".>" // CONSUMER.CREATE.<stream>.<name>[.<filter>]
	case req[0] == "CONSUMER" && len(req) > 4 && req[1] == "MSG" && req[2] == "NEXT":
		return strings.Join(toks[:api+4], ".") + ".*" // CONSUMER.MSG.NEXT.<stream>.<name>
	case req[0] == "CONSUMER" && len(req) > 3 && (req[1] == "INFO" || req[1] == "DELETE"):
		return strings.Join(toks[:api+3], ".") + ".*" // CONSUMER.INFO|DELETE.<stream>.<name>
	case req[0] == "DIRECT" && len(req) > 3 && req[1] == "GET":
		return strings.Join(toks[:api+3], ".") + ".>" // DIRECT.GET.<stream>.<subject>
	}
	return subject
}
