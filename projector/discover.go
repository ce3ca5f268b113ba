package projector

import (
	"context"
	"strings"
	"time"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/streamread"
)

// advisoryStreamCreated is the subject prefix of JetStream's stream-created advisories; the stream's
// name is the last token.
const advisoryStreamCreated = "$JS.EVENT.ADVISORY.STREAM.CREATED."

// maxSettingUp bounds the consumers being set up at once (stream info, consumer create): a seat that
// starts on a mesh of thousands of nodes finds thousands of composed-<node> buckets at once, and the
// JetStream API is better asked a few at a time than flooded.
const maxSettingUp = 16

// maxRetrySettingUp bounds the consumers of buckets whose tail is Failing being set up at once, beside
// maxSettingUp (Projector.settingUp).
const maxRetrySettingUp = 4

// Sizes of a composed-<node> bucket's consumer. One node's compositions are few and the mesh has
// thousands of such buckets, each with its own consumer: a small pipeline each keeps the seat's memory
// bounded (the batch channel is allocated whole, and the server pushes up to the pull size ahead).
// Their pulls are counted in messages, never bounded by bytes (PullMaxBytes): nats.go sizes a bytes
// iterator's buffer for a million messages (8 MB of pointers, allocated whole), which thousands of
// consumers cannot each have; the count is cut down instead so that it holds no more than the bytes
// bound's worth of the largest messages the server takes (sizes).
const (
	composedBatchSize = 64
	composedPull      = 128
)

// sizes returns the batch size, the pull size in messages and the pulls' bound in bytes of a bucket's
// consumer (see streamread.ReadIdle). Every bucket's pulls are bounded by bytes unless
// Options.PullMessages says otherwise: a fixed bucket's each pull, with fixedPull messages held at most;
// a composed-<node> bucket's by a count of messages that the server's largest fit in the bound (at
// least one: composedPull).
func (p *Projector) sizes(bucket string) (batch, pull, bytes int) {
	composed := strings.HasPrefix(bucket, provisioner.ComposedPrefix)
	switch {
	case p.opts.PullMessages > 0 && composed:
		return min(p.opts.BatchSize, composedBatchSize), min(p.opts.PullMessages, composedPull), 0
	case p.opts.PullMessages > 0:
		return p.opts.BatchSize, p.opts.PullMessages, 0
	case composed:
		largest := int(p.js.Conn().MaxPayload()) + streamread.Overhead
		return min(p.opts.BatchSize, composedBatchSize), min(composedPull, max(1, p.pullBytes()/largest)), 0
	}
	return p.opts.BatchSize, fixedPull, p.pullBytes()
}

// fixedPull is how many messages a tail of one of the seat's fixed buckets holds pulled and not yet
// read, each pull also bounded by the bytes of pullBytes (streamread.ReadIdle with both): a bound in
// bytes alone makes nats.go allocate a channel of a million messages per tail, which cost the seat
// 60-80 MiB of peak RSS at 1,000,000 keys (docs/performance.md, session 16).
const fixedPull = 8192

// pullBytes is the bound in bytes of a bucket's pulls and of its pipeline: Options.PullBytes, or
// streamread.MaxBytes; never below one message of the server's max payload (streamread.PullBytes).
func (p *Projector) pullBytes() int {
	return streamread.PullBytes(p.js.Conn(), p.opts.PullBytes)
}

// composedHeartbeat is the idle heartbeat of a composed-<node> bucket's pulls. A seat tails thousands
// of them, each idle for ParkAfter after every read: at streamread.Heartbeat (1 s) that was 4,000
// messages a second at 4,000 buckets on one connection, which a loaded seat heard late (a first read
// confirmed 7,000 late heartbeats with CONSUMER.INFO). A bucket parked is answered within a listing
// interval (10 s) anyway, so a lost consumer found within two heartbeats of 5 s (nats.go's ordered
// consumer's default) keeps a composed-<node> bucket as fresh as parking does.
const composedHeartbeat = 5 * time.Second

// heartbeat is the idle heartbeat of a bucket's pulls: composedHeartbeat for a composed-<node>
// bucket, streamread.Heartbeat for the seat's fixed buckets, whose answers follow writes at once.
func (p *Projector) heartbeat(bucket string) time.Duration {
	if strings.HasPrefix(bucket, provisioner.ComposedPrefix) {
		return composedHeartbeat
	}
	return streamread.Heartbeat
}

// Discovered reports whether the streams were listed once since Start, so every composed-<node>
// bucket that existed then is tailed. Without Options.Composed it is always true.
func (p *Projector) Discovered() bool { return p.discovered.Load() }

// discover finds composed-<node> buckets and tails each: it lists the streams at start and every
// DiscoverEvery, and between listings takes stream-created advisories (watchCreated) for a quick
// pick-up. An account that may not subscribe to the advisories still finds new buckets at the next
// listing.
//
// The names come from the listing of every stream's info the Projector reads for its stream checks
// (Options.Streams, the seat's, or its own), when it has one that started after the previous pass
// (after discover started, for the first: it asks the listing to run now, and waits for it), rather
// than from a STREAM.NAMES listing beside it. Only while that listing fails, gets no answer (a user
// denied $JS.API.STREAM.LIST) or is late by two intervals and two of its durations does discover list
// the names itself.
func (p *Projector) discover(ctx context.Context) {
	log := p.log.With("component", "discover")
	bo := backoff{min: 500 * time.Millisecond, max: p.opts.DiscoverEvery}
	failing := false
	timer := time.NewTimer(0)
	defer timer.Stop()
	since := time.Now() // the advisories are watched already: a stream created after this is announced
	for {
		select {
		case <-ctx.Done():
			return
		case name := <-p.found: // stream-created advisories (watchCreated)
			p.addStream(ctx, name)
		case <-timer.C:
			start := time.Now()
			n, err := p.listStreams(ctx, since)
			if ctx.Err() != nil {
				return
			}
			next := p.opts.DiscoverEvery
			if err != nil {
				if !failing {
					log.Warn("listing streams failed; retrying with backoff", "err", err)
					failing = true
				}
				next = bo.next()
			} else {
				if failing {
					log.Info("recovered")
					failing = false
				}
				bo.reset()
				since = start
				if !p.discovered.Swap(true) {
					log.Info("composed buckets found", "buckets", n)
				}
			}
			timer.Reset(next)
		}
	}
}

// listStreams lists every stream and tails the composed-<node> buckets among them; it returns how many
// there are. The names come from the stream listing when it has one that started at or after since.
func (p *Projector) listStreams(ctx context.Context, since time.Time) (int, error) {
	listed, ok := p.listedNames(ctx, since)
	p.listedOnce.Do(func() { close(p.firstListed) }) // the buckets waiting to start parked look (parkAtStart)
	if ok {
		n := 0
		for _, name := range listed {
			if p.addStream(ctx, name) {
				n++
			}
		}
		return n, nil
	}
	lctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	names := p.js.StreamNames(lctx)
	n := 0
	for name := range names.Name() {
		if p.addStream(ctx, name) {
			n++
		}
	}
	return n, names.Err()
}

// listedNames returns the name of every stream from the stream listing, once it has a listing that
// started at or after since: it asks the listing to run now and waits for it while it runs, taking
// the advisories meanwhile. ok is false when there is none: nothing runs the listing, or it fails,
// gets no answer, or has not come within two of its intervals and two of its durations.
func (p *Projector) listedNames(ctx context.Context, since time.Time) ([]string, bool) {
	if !p.ownStreams && p.streams.Every() == 0 {
		return nil, false
	}
	failures := p.streams.Failures()
	start := time.Now()
	t := time.NewTicker(10 * time.Millisecond)
	defer t.Stop()
	for asked := false; ; {
		if !p.streams.Listed().Before(since) {
			return p.streams.Names(), true
		}
		// Two intervals and two of the newest listing's durations, as listingRuns allows: a listing of
		// thousands of streams can take longer than its interval, and still runs.
		late := time.Since(start) >= 2*(p.listEvery()+p.streams.Took())
		if p.streams.Unanswered() || p.streams.Failures() > failures || late {
			return nil, false
		}
		if !asked {
			p.streams.Refresh()
			asked = true
		}
		select {
		case <-ctx.Done():
			return nil, false
		case name := <-p.found:
			p.addStream(ctx, name)
		case <-t.C:
		}
	}
}

// addStream tails the bucket behind a stream when it is a composed-<node> bucket, and reports whether
// it is one.
func (p *Projector) addStream(ctx context.Context, stream string) bool {
	bucket, ok := strings.CutPrefix(stream, "KV_")
	if !ok || !strings.HasPrefix(bucket, provisioner.ComposedPrefix) || !provisioner.IsPlanInput(bucket) {
		return false
	}
	p.Add(ctx, bucket)
	return true
}
