// Package streaminfo reads the info of every stream of the account with one paged listing
// ($JS.API.STREAM.LIST, about 256 stream infos a request) instead of one STREAM.INFO request per
// stream. A seat with plans tails one composed-<node> bucket per node, thousands of streams: asking
// each for its info every few seconds is hundreds of requests a second on the JetStream meta leader,
// where a listing is a handful.
//
// A Poller keeps the newest info of each stream with the time it was read (the time its listing, or
// its own STREAM.INFO request, started: the info is at least that new). It has no goroutine of its
// own: the owner calls List when it wants a listing, or runs Run on a goroutine it owns and stops
// through Run's context. One Poller is meant to be shared by every reader of a process's stream infos
// (a seat's projectors and its lag metric), so that the account's streams are listed once per interval
// and not once per reader.
package streaminfo

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/novox/mesh-provisioner/internal/denied"
)

// listTimeout bounds one listing, every page of it.
const listTimeout = 30 * time.Second

// firstPageTimeout bounds the wait for a listing's first page: nats.go's default for a JetStream API
// request. A listing whose first page has not come by then got no answer (the JetStream API is down or
// the request was dropped); the pages after it share listTimeout.
const firstPageTimeout = 5 * time.Second

// unansweredRetries is how many of Run's intervals the retries of a listing that got no answer grow
// to: asked again after one interval, then after twice as long, up to this many (a minute at a seat's
// default 5 s).
const unansweredRetries = 12

// ErrUnanswered says a listing got no answer: the user may not list ($JS.API.STREAM.LIST denied: the
// server drops the request and tells the connection, whose permissions violation the error wraps),
// or the JetStream API did not answer its first page within 5 s.
var ErrUnanswered = errors.New("streaminfo: the listing got no answer")

// Poller lists the account's streams and keeps the newest info of each.
type Poller struct {
	js jetstream.JetStream

	failures   atomic.Int64  // listings that failed (not counting those stopped by their context)
	unanswered atomic.Bool   // the last listing got no answer (ErrUnanswered)
	every      atomic.Int64  // Run's interval, as a time.Duration; 0 when Run is not running
	kick       chan struct{} // Refresh: list now

	mu     sync.Mutex
	infos  map[string]entry // stream name -> newest info
	listed time.Time        // when the newest listing that returned every stream started
	took   time.Duration    // how long that listing took
}

type entry struct {
	info *jetstream.StreamInfo
	read time.Time // when the listing or request that returned it started
}

// New returns a Poller that lists the streams of js's account.
func New(js jetstream.JetStream) *Poller {
	return &Poller{js: js, infos: map[string]entry{}, kick: make(chan struct{}, 1)}
}

// List lists every stream once and keeps each info; it returns when the listing started: every info
// it returned was read after that. A stream the listing did not return is forgotten when the listing
// completes; after an error, what the listing returned before it is kept along with older infos.
//
// A listing that gets no answer fails with ErrUnanswered as soon as the connection reports a
// permissions violation of it, or once its first page is 5 s late, rather than at the 30 s the
// whole listing may take: a user denied $JS.API.STREAM.LIST never gets one.
func (p *Poller) List(ctx context.Context) (time.Time, error) {
	start := time.Now()
	lctx, cancel := context.WithTimeout(ctx, listTimeout)
	defer cancel()
	// A refusal of the listing, heard among every one the connection reports: its last error alone
	// was another request's as soon as one more was refused (a node's bucket, say), and the listing
	// waited out its first page's 5 s.
	dctx, unwatch := denied.Context(lctx, p.js.Conn(), func(subject string) bool { return strings.HasSuffix(subject, "STREAM.LIST") })
	defer unwatch()
	l := p.js.ListStreams(lctx)
	first := time.NewTimer(firstPageTimeout)
	defer first.Stop()
	firstC, watchC := first.C, dctx.Done() // nil once the first page came
	var unanswered error
	seen := map[string]bool{}
	for infos := l.Info(); infos != nil; {
		select {
		case info, ok := <-infos:
			firstC, watchC = nil, nil
			if !ok {
				infos = nil
				continue
			}
			if info == nil {
				continue
			}
			name := info.Config.Name
			seen[name] = true
			p.keep(name, info, start)
		case <-firstC:
			unanswered = fmt.Errorf("%w within %v", ErrUnanswered, firstPageTimeout)
			firstC, watchC = nil, nil
			cancel() // the lister closes its channel
		case <-watchC:
			watchC = nil
			if v := (*denied.Error)(nil); errors.As(context.Cause(dctx), &v) {
				unanswered = fmt.Errorf("%w: %w", ErrUnanswered, v.Err)
				firstC = nil
				cancel()
			}
		}
	}
	if err := l.Err(); err != nil {
		if unanswered != nil && ctx.Err() == nil {
			err = unanswered
		}
		p.unanswered.Store(unanswered != nil)
		if ctx.Err() == nil {
			p.failures.Add(1)
		}
		return start, err
	}
	p.unanswered.Store(false)
	p.mu.Lock()
	for name, e := range p.infos {
		if !seen[name] && e.read.Before(start) {
			delete(p.infos, name) // deleted since (or listed by a listing running beside this one)
		}
	}
	if start.After(p.listed) {
		p.listed, p.took = start, time.Since(start)
	}
	p.mu.Unlock()
	return start, nil
}

// Read asks one stream for its info (one STREAM.INFO request) and keeps it like a listed one, so every
// reader of the Poller sees it: the way to a stream's info when the listing fails or is late. A
// stream that does not exist is forgotten, and Read returns jetstream.ErrStreamNotFound.
func (p *Poller) Read(ctx context.Context, stream string) (*jetstream.StreamInfo, error) {
	start := time.Now()
	s, err := p.js.Stream(ctx, stream)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		p.mu.Lock()
		if e, ok := p.infos[stream]; ok && e.read.Before(start) {
			delete(p.infos, stream)
		}
		p.mu.Unlock()
		return nil, err
	}
	if err != nil {
		return nil, err
	}
	info := s.CachedInfo()
	p.keep(stream, info, start)
	return info, nil
}

// keep stores an info read at a time unless a newer one is kept already.
func (p *Poller) keep(name string, info *jetstream.StreamInfo, read time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if e, ok := p.infos[name]; !ok || !e.read.After(read) {
		p.infos[name] = entry{info: info, read: read}
	}
}

// Info returns the newest info of a stream and when the listing or request that read it started; ok
// is false when nothing has returned the stream (yet, or since it was deleted).
func (p *Poller) Info(stream string) (info *jetstream.StreamInfo, read time.Time, ok bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	e, ok := p.infos[stream]
	return e.info, e.read, ok
}

// Names returns the name of every stream the Poller holds an info of: those the newest complete
// listing returned, and those listed or read since. A reader of every stream's name (discovery of new
// buckets) takes them here rather than listing them again.
func (p *Poller) Names() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	names := make([]string, 0, len(p.infos))
	for name := range p.infos {
		names = append(names, name)
	}
	return names
}

// Refresh asks Run, while it runs, for a listing now rather than at its next interval: for a reader
// that needs a listing newer than a moment (a projector's discovery as it starts). Requests made
// before the listing starts are one.
func (p *Poller) Refresh() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// Listed is when the newest listing that completed started: a stream it did not return did not exist
// then. Zero before the first one completes.
func (p *Poller) Listed() time.Time {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.listed
}

// Took is how long the newest listing that completed took (Listed is when it started): a reader that
// judges whether the listing still runs allows for listings slower than their interval.
func (p *Poller) Took() time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.took
}

// Failures is how many listings failed since New (a listing stopped by its context is not counted).
func (p *Poller) Failures() int64 { return p.failures.Load() }

// Every is the interval Run lists at while it runs, and 0 when it does not: a reader that only reads
// the Poller can tell a late listing from one that is not due yet.
func (p *Poller) Every() time.Duration { return time.Duration(p.every.Load()) }

// Unanswered reports whether the last listing got no answer (ErrUnanswered): the user may not list,
// or the JetStream API does not answer.
func (p *Poller) Unanswered() bool { return p.unanswered.Load() }

// Go runs Run on a goroutine of its own, counted in wg, and says it runs (Every) before it returns: a
// reader started just after (a projector's discovery, whose first listing lets the buckets the store
// left caught up start parked) finds the listing running, not a Poller that nothing runs. Run on a
// goroutine started by its owner sets Every only once that goroutine runs, which a loaded process
// can leave later than the reader's look: every such bucket then tailed with a consumer of its own.
func (p *Poller) Go(ctx context.Context, wg *sync.WaitGroup, every time.Duration, log *slog.Logger) {
	p.every.Store(int64(every))
	wg.Add(1)
	go func() {
		defer wg.Done()
		p.Run(ctx, every, log)
	}()
}

// Run lists the streams now and every `every` until ctx ends. The first failure is logged, and
// "recovered" once a listing works again; in between the infos get older, and their readers ask each
// stream themselves (Read). A listing that got no answer (ErrUnanswered: denied, most likely) is
// asked again after one interval, then after twice as long each time up to 12 intervals, in case the
// permission is granted: a denied request costs nothing on the JetStream API, but the server logs each
// one.
func (p *Poller) Run(ctx context.Context, every time.Duration, log *slog.Logger) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	p.every.Store(int64(every))
	defer p.every.Store(0)
	t := time.NewTimer(every)
	defer t.Stop()
	failing := false
	retry := every // the wait after a listing that got no answer
	for {
		start := time.Now()
		_, err := p.List(ctx)
		if ctx.Err() != nil {
			return
		}
		switch {
		case err != nil && !failing:
			log.Warn("listing stream infos failed; each stream is asked for its own until it works again", "err", err)
			failing = true
		case err == nil && failing:
			log.Info("listing stream infos recovered")
			failing = false
		}
		wait := every
		if errors.Is(err, ErrUnanswered) {
			wait, retry = retry, min(2*retry, unansweredRetries*every)
		} else {
			retry = every
		}
		t.Reset(time.Until(start.Add(wait)))
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-p.kick:
		}
	}
}
