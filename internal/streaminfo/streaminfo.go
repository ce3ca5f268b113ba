// Package streaminfo reads the info of every stream of the account with one paged listing
// ($JS.API.STREAM.LIST, about 256 stream infos a request) instead of one STREAM.INFO request per
// stream. A seat with plans tails one composed-<node> bucket per node, thousands of streams: asking
// each for its info every few seconds is hundreds of requests a second on the JetStream meta leader,
// where a listing is a handful.
//
// A Poller keeps the newest info of each stream with the time its listing started (the info is at
// least that new). It has no goroutine of its own: the owner calls List when it wants a listing, or
// runs Run on a goroutine it owns and stops through Run's context.
package streaminfo

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// listTimeout bounds one listing, every page of it.
const listTimeout = 30 * time.Second

// Poller lists the account's streams and keeps the newest info of each.
type Poller struct {
	js jetstream.JetStream

	mu    sync.Mutex
	infos map[string]entry // stream name -> newest info
}

type entry struct {
	info *jetstream.StreamInfo
	read time.Time // when the listing that returned it started
}

// New returns a Poller that lists the streams of js's account.
func New(js jetstream.JetStream) *Poller {
	return &Poller{js: js, infos: map[string]entry{}}
}

// List lists every stream once and keeps each info; it returns when the listing started: every info
// it returned was read after that. A stream the listing did not return is forgotten when the listing
// completes; after an error, what the listing returned before it is kept along with older infos.
func (p *Poller) List(ctx context.Context) (time.Time, error) {
	start := time.Now()
	lctx, cancel := context.WithTimeout(ctx, listTimeout)
	defer cancel()
	l := p.js.ListStreams(lctx)
	seen := map[string]bool{}
	for info := range l.Info() {
		if info == nil {
			continue
		}
		name := info.Config.Name
		seen[name] = true
		p.mu.Lock()
		if e, ok := p.infos[name]; !ok || !e.read.After(start) {
			p.infos[name] = entry{info: info, read: start}
		}
		p.mu.Unlock()
	}
	if err := l.Err(); err != nil {
		return start, err
	}
	p.mu.Lock()
	for name, e := range p.infos {
		if !seen[name] && e.read.Before(start) {
			delete(p.infos, name) // deleted since (or listed by a listing running beside this one)
		}
	}
	p.mu.Unlock()
	return start, nil
}

// Info returns the newest info of a stream and when the listing that read it started; ok is false when
// no listing has returned the stream (yet, or since it was deleted).
func (p *Poller) Info(stream string) (info *jetstream.StreamInfo, read time.Time, ok bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	e, ok := p.infos[stream]
	return e.info, e.read, ok
}

// Run lists the streams now and every `every` until ctx ends. The first failure is logged, and
// "recovered" once a listing works again; in between the infos get older, and their readers ask each
// stream themselves.
func (p *Poller) Run(ctx context.Context, every time.Duration, log *slog.Logger) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	t := time.NewTicker(every)
	defer t.Stop()
	failing := false
	for {
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
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
