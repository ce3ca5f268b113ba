// Package denied tells a request that NATS refused it. A publish or request to a subject the user may
// not publish to is dropped by the server, which tells the connection (a permissions violation, handed
// only to the connection's error callback and kept as its last error): the request gets no answer and
// waits out its whole timeout, then says nothing of why. Context ends a request's context as soon as
// the connection reports a violation of one of the request's subjects, with an *Error that names the
// subject and what to grant. It hears every violation from the connection's error callback (watch),
// which it chains to the one the connection had: the connection's last error, which nats.go keeps
// alone, is another request's as soon as two are refused at once.
package denied

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
)

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

// SubscriptionSince returns the refusal of a subscription to subject that the connection reported
// after mark (Mark, taken before subscribing), once a flush after the subscription has returned. The
// server refuses a subscription as it reads it, so the connection's last error is then the refusal or
// one that came after it (another request refused meanwhile, which a look at the last error alone
// missed); the callback hears them in order, and is waited for, at most wait, until it has heard that
// last error.
func SubscriptionSince(nc *nats.Conn, mark uint64, subject string, wait time.Duration) *Error {
	if nc == nil {
		return nil
	}
	w := watch(nc)
	last := nc.LastError()
	deadline := time.Now().Add(wait)
	for {
		w.mu.Lock()
		heard := w.heard
		s := w.last["subscribe "+subject]
		w.mu.Unlock()
		if s != nil && s.seq > mark {
			return s.v
		}
		if parse(last) == nil || sameErr(heard, last) || time.Now().After(deadline) {
			return nil
		}
		time.Sleep(time.Millisecond)
	}
}

// sameErr reports whether two errors are the same value (a violation is a new one each time).
func sameErr(a, b error) bool {
	return a != nil && b != nil && reflect.TypeOf(a) == reflect.TypeOf(b) && reflect.TypeOf(a).Comparable() && a == b
}

// Context returns a context below ctx that ends, with an *Error as its cause, as soon as the connection
// reports a permissions violation of a publish whose subject match accepts. The cancel func returned
// stops the watch, and the caller must call it. It sees every violation the connection reports (watch),
// not the last error alone: a violation of this request followed by another's (the pulls of another
// bucket refused too) was missed before, and the request waited out its timeout.
func Context(ctx context.Context, nc *nats.Conn, match func(subject string) bool) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancelCause(ctx)
	if nc == nil {
		return ctx, func() { cancel(nil) }
	}
	w := watch(nc)
	wt := &waiter{match: match, refused: func(v *Error) { cancel(v) }}
	w.mu.Lock()
	w.waits[wt] = struct{}{}
	w.mu.Unlock()
	return ctx, func() {
		w.mu.Lock()
		delete(w.waits, wt)
		w.mu.Unlock()
		cancel(nil)
	}
}

// Mark is where the connection's violations stand now: Since reports one that comes after it. It
// starts watching the connection (watch) if nothing did yet.
func Mark(nc *nats.Conn) uint64 {
	if nc == nil {
		return 0
	}
	w := watch(nc)
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.seq
}

// Since returns the latest violation of a publish whose subject match accepts that the connection
// reported after mark (Mark), or nil. Every violation counts, not the connection's last error only:
// many buckets whose pulls are refused take turns as the last error, and a tail that asked it at its
// missed heartbeats found another bucket's each time and read on for ever. What it keeps is the latest
// violation of each grant (maxKept of them): a request that names its own consumer or key is found
// by what to grant for it.
func Since(nc *nats.Conn, mark uint64, match func(subject string) bool) *Error {
	if nc == nil {
		return nil
	}
	w := watch(nc)
	w.mu.Lock()
	defer w.mu.Unlock()
	var got *seen
	for _, s := range w.last {
		if s.seq > mark && s.v.Op == "publish" && (got == nil || s.seq > got.seq) && match(s.v.Subject) {
			got = s
		}
	}
	if got == nil {
		return nil
	}
	return got.v
}

// maxKept bounds the grants a watcher keeps the latest violation of: a grant is a stream's request
// or a bucket's keys, but a publish to a reply subject not granted is a grant of its own each time.
// Past it the oldest is forgotten.
const maxKept = 4096

// watcher records every permissions violation a connection reports, from its error callback, which
// it chains to the one the connection had (the owner's log line goes on as before).
type watcher struct {
	once  sync.Once
	mu    sync.Mutex
	seq   uint64           // violations seen
	heard error            // the last error the callback was handed
	last  map[string]*seen // op and grant -> its latest violation
	waits map[*waiter]struct{}
}

type seen struct {
	seq uint64
	v   *Error
}

// waiter is a Context under way.
type waiter struct {
	match   func(subject string) bool
	refused func(*Error)
}

// watchers are the connections watched: one watcher each, forgotten when the connection closes.
var watchers sync.Map // *nats.Conn -> *watcher

// watch returns the connection's watcher, set up on the first call: its error callback then records
// the violations before calling the one it had, and its closed callback forgets it before calling
// the one it had. A callback set on the connection later without chaining the one it had stops it.
func watch(nc *nats.Conn) *watcher {
	if nc.IsClosed() {
		// Nothing more is reported, and a callback set now would never be forgotten (each call on
		// the closed connection would wrap the last).
		return &watcher{last: map[string]*seen{}, waits: map[*waiter]struct{}{}}
	}
	v, _ := watchers.LoadOrStore(nc, &watcher{last: map[string]*seen{}, waits: map[*waiter]struct{}{}})
	w := v.(*watcher)
	w.once.Do(func() {
		prev := nc.ErrorHandler()
		nc.SetErrorHandler(func(c *nats.Conn, sub *nats.Subscription, err error) {
			w.saw(err)
			if prev != nil {
				prev(c, sub, err)
			}
		})
		closed := nc.ClosedHandler()
		nc.SetClosedHandler(func(c *nats.Conn) {
			watchers.CompareAndDelete(nc, w)
			if closed != nil {
				closed(c)
			}
		})
		if nc.IsClosed() {
			watchers.CompareAndDelete(nc, w)
		}
	})
	return w
}

// saw records a violation and ends the Contexts it refuses.
func (w *watcher) saw(err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.heard = err
	v := parse(err)
	if v == nil {
		return
	}
	key := v.Op + " " + v.Subject
	if v.Op == "publish" {
		key = v.Op + " " + Grant(v.Subject)
	}
	w.seq++
	if _, ok := w.last[key]; !ok && len(w.last) >= maxKept {
		var oldest string
		for k, s := range w.last {
			if oldest == "" || s.seq < w.last[oldest].seq {
				oldest = k
			}
		}
		delete(w.last, oldest)
	}
	w.last[key] = &seen{seq: w.seq, v: v}
	if v.Op != "publish" {
		return
	}
	for wt := range w.waits {
		if wt.match(v.Subject) {
			wt.refused(v)
		}
	}
}

// parse returns a permissions violation as an *Error, or nil for any other error.
func parse(err error) *Error {
	if err == nil || !errors.Is(err, nats.ErrPermissionViolation) {
		return nil
	}
	if m := publishRe.FindStringSubmatch(err.Error()); m != nil {
		return &Error{Op: "publish", Subject: m[1], Err: err}
	}
	if m := subscribeRe.FindStringSubmatch(err.Error()); m != nil {
		return &Error{Op: "subscribe", Subject: m[1], Err: err}
	}
	return nil
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
