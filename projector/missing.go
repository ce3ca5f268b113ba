package projector

import (
	"context"
	"strings"
	"time"

	"github.com/nats-io/nats.go"

	provisioner "github.com/novox/mesh-provisioner"
)

// A bucket whose stream does not exist (not created yet, or deleted) is synced and empty until it is
// created. It used to ask for its stream (STREAM.INFO) every Options.Poll, a second, for as long as it
// was missing: a steady load on the JetStream API for every seat, times every missing bucket. Now it
// waits in awaitStream, and is tailed as soon as:
//
//   - a stream-created advisory names its stream (watchCreated: at once, where the account may
//     subscribe to $JS.EVENT.ADVISORY.STREAM.CREATED.*, as the seat's may);
//   - a listing of every stream (streaminfo.Poller: the seat's, or the Projector's own), or any
//     reader's STREAM.INFO through the Poller, returns its stream: within one listing interval plus
//     Options.Poll (6 s at serve's default 5 s metrics poll, 11 s at the 10 s stream check). While the
//     listing runs, the bucket asks nothing itself but once, Options.Poll after it first found the
//     stream missing (the stream may have been created just before it waited for the advisory: the
//     seat creates the registry bucket as its projector starts);
//   - or it asks its stream itself while no listing completes (a user denied $JS.API.STREAM.LIST, or
//     none within two of its intervals and two of its durations: listingRuns, park.go; a listing
//     merely slower than its interval still runs): after Options.Poll, then twice as long each time
//     up to the listing's interval (10 s by default), a tenth of the requests of one a second.
//     Composed-<node> buckets (a deleted one stays tailed) take their turns with the stream checks'
//     asks (mayAsk), so thousands of them stay within Options.AskPerSecond in all.
//
// The bound without an advisory is the listing's interval because that is how fresh the seat keeps
// every other stream fact already (the stream checks, the lag): a bucket created is noticed as soon as
// a bucket purged is.

// missingBackoff is how long a missing bucket waits before it asks for its stream itself while no
// listing runs: Options.Poll, doubling up to the listing's interval.
func (p *Projector) missingBackoff() backoff {
	return backoff{min: p.opts.Poll, max: max(p.opts.Poll, p.listEvery())}
}

// listEvery is the interval of the stream listing the Projector reads: the shared one's while it runs,
// else Options.Verify (the Projector's own).
func (p *Projector) listEvery() time.Duration {
	if every := p.streams.Every(); every > 0 {
		return every
	}
	return p.opts.Verify
}

// awaitStream waits until a missing bucket's stream may exist: a stream-created advisory names it, a
// listing or a read returned it since the bucket found it missing, or the bucket may ask itself (see
// above): once Options.Poll after it first found the stream missing (the advisory may have come
// before the bucket waited for it: the seat creates the registry bucket as its projector starts),
// and then when the listing no longer runs (listingRuns: one merely late or slow is not
// second-guessed) and the bucket's backoff has passed since anything looked for it. It reports false
// when ctx ends.
//
// created is the bucket's channel from waitCreated, which runBucket holds for as long as it runs: an
// advisory that comes between the request that found the stream missing and this wait is kept in it,
// not dropped (it was, when each wait registered its own, and the bucket then waited for the next
// listing: 10 s for the registry bucket a seat creates as its projector starts).
func (p *Projector) awaitStream(ctx context.Context, bucket string, missing *backoff, created <-chan struct{}) bool {
	name := provisioner.StreamName(bucket)
	looked := time.Now() // the stream was missing then (the request that found it started before)
	first := missing.cur == 0
	wait := missing.next()
	v := &verifier{} // its turn to ask, for a composed-<node> bucket (mayAsk)
	t := time.NewTicker(p.opts.Poll)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return false
		case <-created:
			// nats-server sends the advisory before it registers the stream with the account, so a
			// STREAM.INFO right after it can still find nothing. Should the bucket find it missing
			// again, its next wait is a first one: it asks once more after Options.Poll, not at the
			// next listing (up to two of its intervals, 20 s, for the registry bucket a seat creates
			// as its projector starts).
			missing.reset()
			return true
		case <-t.C:
		}
		if _, read, ok := p.streams.Info(name); ok && read.After(looked) {
			return true
		}
		listed := p.streams.Listed()
		if listed.After(looked) {
			looked = listed // listed without it
		}
		now := time.Now()
		if !first && p.listingRuns() {
			continue // the listing runs, slow or not (park.go): it looks again at its next interval
		}
		if now.Sub(looked) >= wait && p.mayAsk(bucket, v, now) {
			return true
		}
	}
}

// waitCreated returns a channel that a stream-created advisory of the bucket's stream wakes, and the
// func that stops waiting. A bucket forgotten and tailed again has a new runBucket, whose channel the
// old one's stop leaves alone.
func (p *Projector) waitCreated(bucket string) (<-chan struct{}, func()) {
	ch := make(chan struct{}, 1)
	p.mu.Lock()
	p.waiting[bucket] = ch
	p.mu.Unlock()
	return ch, func() {
		p.mu.Lock()
		if p.waiting[bucket] == ch {
			delete(p.waiting, bucket)
		}
		p.mu.Unlock()
	}
}

// watchCreated subscribes to JetStream's stream-created advisories until ctx ends: they wake a
// missing bucket whose stream was created, and hand discover every new stream, so that a new
// composed-<node> bucket is tailed between listings. An account that may not subscribe to them (the
// server says so on the connection, asynchronously) still finds new streams by listing.
func (p *Projector) watchCreated(ctx context.Context) {
	nc := p.js.Conn()
	if nc == nil {
		return
	}
	sub, err := nc.Subscribe(advisoryStreamCreated+"*", func(m *nats.Msg) {
		stream := strings.TrimPrefix(m.Subject, advisoryStreamCreated)
		if bucket, ok := strings.CutPrefix(stream, "KV_"); ok {
			p.mu.Lock()
			ch := p.waiting[bucket]
			p.mu.Unlock()
			if ch != nil {
				notify(ch)
			}
		}
		if p.opts.Composed {
			select {
			case p.found <- stream:
			default: // full: the next listing finds it
			}
		}
	})
	if err != nil {
		p.log.Warn("cannot subscribe to stream-created advisories; new buckets are found by listing", "err", err)
		return
	}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		<-ctx.Done()
		_ = sub.Unsubscribe()
	}()
}
