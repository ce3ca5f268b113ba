package metrics

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/store"
)

// Where each bucket's stream last sequence comes from, each poll:
//
//   - From the listing of every stream's info (streaminfo.Poller), when it is fresh: the metrics' own,
//     listed by this poll; or a shared one (a seat's), whose newest complete listing started less
//     than two intervals ago (two polls, or two of its own intervals when it lists less often), so a
//     listing merely running late is not second-guessed. A stream the fresh listing did not return
//     does not exist: its bucket's stream last sequence is 0.
//   - Otherwise (the listing fails, say for a user without $JS.API.STREAM.LIST, or is late) from the
//     streams themselves, one STREAM.INFO request each, among the buckets not read for half a poll:
//     always every one of the seat's fixed buckets (the four mesh-provisioner_* buckets and the plans'
//     mesh-host_modules and mesh-indexer_builds), plus at most Options.ReadsPerPoll others
//     (composed-<node> buckets), those read longest ago first, so they take turns. A poll therefore
//     never sends more than 6 + ReadsPerPoll requests (70 by default, 14 a second at the default 5 s
//     poll), however many buckets the seat tails, and stops after a poll interval (what is left is read
//     at the next poll, not counted as failed); a seat with N composed-<node> buckets reads each at
//     least every ceil(N / ReadsPerPoll) polls (4,000 buckets: every 63 polls, about 5 minutes).
//
// The reads go through the Poller, so the seat's projectors can check their streams from them too, and
// the metrics take whatever the Poller read last, by whichever reader.
//
// A bucket keeps the last sequence last read, with when: its stream_info_age_seconds gauge says how
// old the stream_last_sequence and lag gauges are, so an alert on the lag can tell a fresh 0 from a
// stale one (docs/operations.md).

// DefaultReadsPerPoll is Options.ReadsPerPoll when it is 0.
const DefaultReadsPerPoll = 64

// readTimeout bounds one STREAM.INFO request of a poll.
const readTimeout = 5 * time.Second

// alwaysRead are the buckets a poll reads itself whenever the listing is not fresh: the seat's fixed
// ones, never more than six.
var alwaysRead = func() map[string]bool {
	m := map[string]bool{provisioner.BucketHostModules: true, provisioner.BucketIndexerBuilds: true}
	for _, s := range provisioner.ProvisionerShapes {
		m[s.Bucket] = true
	}
	return m
}()

// streamRead is a bucket's stream last sequence and when it was read (when the listing or request that
// read it started).
type streamRead struct {
	last  uint64
	first uint64 // the stream's first sequence: the messages before it are gone, not unread
	at    time.Time
}

// lag is how many messages of the stream the projection, at applied sequence seq, has not read yet:
// those after seq up to the last sequence, less those removed from the stream before it read them (a
// purge, a limit), which it never will. A purged stream is lag 0, not its old length: nothing is left
// to read, and an alert on a lag that does not move must not fire on it.
func (r streamRead) lag(seq uint64) uint64 {
	if r.first > 0 {
		seq = max(seq, r.first-1)
	}
	return r.last - min(r.last, seq)
}

// pollLoop reads every bucket's stream last sequence now and every Poll. The first failure is logged,
// and "recovered" once a poll works again; failures in between are only counted.
func (m *Metrics) pollLoop(ctx context.Context) {
	t := time.NewTicker(m.opts.Poll)
	defer t.Stop()
	failing := false
	for {
		err := m.pollOnce(ctx)
		if ctx.Err() != nil {
			return
		}
		switch {
		case err != nil && !failing:
			m.log.Warn("reading stream info for the lag failed; retrying", "err", err)
			failing = true
		case err == nil && failing:
			m.log.Info("reading stream info recovered")
			failing = false
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// pollOnce brings the buckets' stream last sequences up to date: from the listing when it is fresh,
// else from the streams themselves, a bounded number of them (see above).
func (m *Metrics) pollOnce(ctx context.Context) error {
	src := m.source()
	if src == nil {
		return nil
	}
	var err error
	fresh := time.Now().Add(-2 * max(m.opts.Poll, m.infos.Every()))
	if m.ownList {
		read, lerr := m.infos.List(ctx)
		if lerr != nil {
			if ctx.Err() != nil {
				return nil
			}
			err = fmt.Errorf("listing stream infos: %w", lerr)
		}
		fresh = read
	}
	listed := m.infos.Listed()
	listedFresh := !listed.IsZero() && !listed.Before(fresh)
	buckets := shownBuckets(src)
	m.forgetGone(buckets)
	for _, b := range buckets {
		if !m.update(b) && listedFresh {
			m.set(b, streamRead{last: 0, at: listed}) // no stream
		}
	}
	if !listedFresh {
		if rerr := m.readStale(ctx, buckets); rerr != nil && err == nil {
			err = rerr
		}
	}
	m.trackStuck(src.Store(), buckets, time.Now())
	return err
}

// stuckSince is a composed-<node> bucket found behind its stream: at which applied sequence, since when.
type stuckSince struct {
	seq   uint64
	since time.Time
}

// trackStuck follows, each poll, the composed-<node> buckets that are behind their stream (lag above
// 0) and since when their applied sequence has stood: mesh_provisioner_composed_stuck_seconds is the
// longest, the one bucket stuck among thousands that the summed series cannot show. A bucket that
// applies, catches up or goes starts over; only those behind are kept.
func (m *Metrics) trackStuck(db *store.DB, buckets []string, now time.Time) {
	m.stuckMu.Lock()
	defer m.stuckMu.Unlock()
	next := make(map[string]stuckSince, len(m.stuck))
	for _, b := range buckets {
		if !provisioner.IsComposedBucket(b) {
			continue
		}
		r, ok := m.lastRead(b)
		if !ok {
			continue
		}
		seq, _ := db.Applied(b)
		if r.lag(seq) == 0 {
			continue
		}
		if cur, ok := m.stuck[b]; ok && cur.seq == seq {
			next[b] = cur
		} else {
			next[b] = stuckSince{seq: seq, since: now}
		}
	}
	m.stuck = next
}

// stuckFor is how long the longest-standing composed-<node> bucket behind its stream has applied
// nothing, as of the last poll; 0 when none is behind.
func (m *Metrics) stuckFor(now time.Time) time.Duration {
	m.stuckMu.Lock()
	defer m.stuckMu.Unlock()
	var d time.Duration
	for _, s := range m.stuck {
		d = max(d, now.Sub(s.since))
	}
	return d
}

// readStale asks the streams of the buckets not read for half a poll for their info: every fixed
// bucket, and at most ReadsPerPoll others, those read longest ago first.
func (m *Metrics) readStale(ctx context.Context, buckets []string) error {
	start := time.Now()
	cutoff := start.Add(-m.opts.Poll / 2)
	var always, others []string
	readAt := map[string]time.Time{}
	for _, b := range buckets {
		r, ok := m.lastRead(b)
		if ok && !r.at.Before(cutoff) {
			continue
		}
		readAt[b] = r.at // zero when never read: first in line
		if alwaysRead[b] {
			always = append(always, b)
		} else {
			others = append(others, b)
		}
	}
	sort.Slice(others, func(i, j int) bool {
		ai, aj := readAt[others[i]], readAt[others[j]]
		if !ai.Equal(aj) {
			return ai.Before(aj)
		}
		return others[i] < others[j]
	})
	sort.Strings(always)
	todo := append(always, others[:min(len(others), m.opts.ReadsPerPoll)]...)

	// A poll's reads end within a poll interval, whatever the server's answer times.
	pctx, cancel := context.WithTimeout(ctx, m.opts.Poll)
	defer cancel()
	var first error
	failed := 0
reads:
	for _, b := range todo {
		if pctx.Err() != nil {
			break
		}
		at := time.Now()
		rctx, rcancel := context.WithTimeout(pctx, readTimeout)
		info, err := m.infos.Read(rctx, provisioner.StreamName(b))
		rcancel()
		switch {
		case err == nil:
			m.set(b, streamRead{last: info.State.LastSeq, first: info.State.FirstSeq, at: at})
		case errors.Is(err, jetstream.ErrStreamNotFound):
			m.set(b, streamRead{last: 0, at: at})
		case ctx.Err() != nil:
			return nil
		case pctx.Err() != nil:
			// The poll's time is up, not the server's answer: the buckets left are read at the next
			// poll, and their age gauges say how old their readings are meanwhile.
			break reads
		default:
			m.readErrors.Add(1)
			failed++
			if first == nil {
				first = err
			}
		}
	}
	if first != nil {
		return fmt.Errorf("reading %d of %d stream infos: %w", failed, len(todo), first)
	}
	return nil
}

// update takes the newest info the Poller holds of a bucket's stream, when it is newer than the one
// kept; it reports whether the Poller holds one.
func (m *Metrics) update(bucket string) bool {
	info, at, ok := m.infos.Info(provisioner.StreamName(bucket))
	if ok {
		m.set(bucket, streamRead{last: info.State.LastSeq, first: info.State.FirstSeq, at: at})
	}
	return ok
}

// set keeps a bucket's stream read unless a newer one is kept already.
func (m *Metrics) set(bucket string, r streamRead) {
	m.streamsMu.Lock()
	defer m.streamsMu.Unlock()
	if cur, ok := m.streams[bucket]; !ok || !cur.at.After(r.at) {
		m.streams[bucket] = r
	}
}

// lastRead is a bucket's stream last sequence as last read, and when; ok is false before the first
// read. At scrape time the Poller may hold a newer one, read since the last poll.
func (m *Metrics) lastRead(bucket string) (streamRead, bool) {
	if m.infos != nil {
		m.update(bucket)
	}
	m.streamsMu.Lock()
	defer m.streamsMu.Unlock()
	r, ok := m.streams[bucket]
	return r, ok
}

// forgetGone drops the stream reads of buckets the store no longer holds (a composed-<node> bucket
// forgotten when its node was decommissioned): the gauges are made from the store's buckets at each
// scrape and list them no more, and the reads would otherwise pile up, one per node ever seen.
func (m *Metrics) forgetGone(buckets []string) {
	held := make(map[string]struct{}, len(buckets))
	for _, b := range buckets {
		held[b] = struct{}{}
	}
	m.streamsMu.Lock()
	defer m.streamsMu.Unlock()
	for b := range m.streams {
		if _, ok := held[b]; !ok {
			delete(m.streams, b)
		}
	}
}

// shownBuckets are the buckets the per-bucket metrics show, sorted: those the store holds, and those
// the seat tails that have not caught up, which a store may not hold yet. A bucket whose consumer was
// refused from the start (a permission missing) has nothing in the store, and without its series the
// lag alerts could not fire on it: /readyz named it, the metrics did not.
func shownBuckets(src Source) []string {
	buckets := src.Store().Buckets()
	seen := make(map[string]bool, len(buckets))
	for _, b := range buckets {
		seen[b] = true
	}
	for _, b := range src.Unsynced() {
		if !seen[b] {
			seen[b] = true
			buckets = append(buckets, b)
		}
	}
	sort.Strings(buckets)
	return buckets
}
