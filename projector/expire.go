package projector

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/msgget"
	"github.com/novox/mesh-provisioner/store"
)

// TTL'd puts that expire without a marker. nats-server writes a marker only for an expiring message
// that is the last its subject holds; a put with a per-message TTL over an older revision or delete
// of its key that the bucket keeps is removed silently, and the bucket answers the older one again
// (store/expiry.go). The store remembers each applied put with a TTL while it is its key's newest; one
// goroutine of the Projector (expireLoop) waits for the first of them to come due, then asks the
// stream for the key's last message, of every key due at once (a mesh that writes TTL'd puts in bulk
// has them come due together): a round takes up to expireBatch due keys, asks each bucket's stream
// about all of them by one direct get (msgget.LastOfMany), whose answer stands only when the replica
// that gave it had stored every message the projection applied and is one of the stream's own (not a
// mirror's, which removes what it holds by rules of its own), asks the stream's leader about the
// rest (expireWindow at once), and has the store apply the round in one commit per bucket
// (store.DB.ExpireAll). What it finds of each key:
//
//   - the put itself: not removed yet (the server removes expired messages on a timer of its own, and
//     writes a marker when the put is the subject's only message): asked again later, sooner first
//     (expireSlack, doubling up to expireRetryMax), until a message of the key (the marker, a later
//     put) makes the store forget it;
//   - a later message: the tail applies it, which forgets it; asked again later meanwhile, the same;
//   - an older message, or none: the put is gone, and the store applies what the stream holds now
//     (store.DB.ExpireAll);
//   - no answer (a timeout, no leader): asked again later, the same, and the loop backs off.
//
// An expiry is taken from the store for the round (store.DB.TakeDue) and given back, postponed or
// forgotten by it; one the round could not finish comes due again when its take runs out.
//
// A composed-<node> bucket's build records are a fold of its history: one whose put expired so is
// read again from its stream (forget.go), as a rebuild would read it.

// expireSlack is how long after a put's expiry its stream is first asked: nats-server removes
// expired messages on a timer, and its clock and the message's time stamp are the server's.
const expireSlack = time.Second

// expireRetryMax bounds the wait before asking again about a put the stream still holds.
const expireRetryMax = 5 * time.Minute

// expireAsk bounds one ask of the stream. A variable for tests alone (SetExpireAsk).
var expireAsk = 5 * time.Second

// expireLoop runs until ctx ends: owned by the Projector (Start), stopped by Stop.
func (p *Projector) expireLoop(ctx context.Context) {
	log := p.log.With("component", "expire")
	bo := backoff{min: time.Second, max: time.Minute}
	failing := false
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	for {
		var wait <-chan time.Time
		if e, ok := p.db.NextExpiry(); ok {
			d := time.Until(time.Unix(0, e.Due).Add(expireSlack))
			if d < 0 {
				d = 0
			}
			timer.Reset(d)
			wait = timer.C
		}
		select {
		case <-ctx.Done():
			return
		case <-p.db.ExpiryAdded():
			timer.Stop() // no stale tick is received after it (Go 1.23 timers)
			continue
		case <-wait:
		}
		err := p.expireDue(ctx, log)
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			if !failing {
				log.Warn("asking the streams about expired puts failed; retrying with backoff", "err", err)
				failing = true
			}
			if !sleep(ctx, bo.next()) {
				return
			}
			continue
		}
		if failing {
			log.Info("recovered")
			failing = false
		}
		bo.reset()
	}
}

// expireWindow bounds the asks of a stream's leader in flight: they share the seat's connection with
// the tails and the verb, and each is one request of the leader's JetStream API queue (10,000 by
// default, shared by every client of the server).
const expireWindow = 32

// expireBatch and expireBatchBytes bound one round of expireDue: how many keys it takes (one direct
// get asks about them all, msgget.MaxLasts at most), and the bytes of the last messages it holds
// (values, keys, headers) before it stops asking (the asks in flight then may add up to expireWindow
// messages more; the direct get one message more). One round is one commit per bucket.
const (
	expireBatch      = msgget.MaxLasts
	expireBatchBytes = 8 << 20
)

// expireNoDirect is how long a stream whose direct get failed (not allowed, denied, no answer) is asked
// by its leader alone.
const expireNoDirect = 5 * time.Minute

// expireDue asks about every pending expiry due now, in rounds of up to expireBatch keys, and applies
// what each round found in one commit per bucket. An ask that fails postpones its expiry as if the
// stream still held the put, and the first failure is returned once every due one was asked (the loop
// backs off).
func (p *Projector) expireDue(ctx context.Context, log *slog.Logger) error {
	var first error
	for ctx.Err() == nil {
		due := p.takeDue()
		if len(due) == 0 {
			return first
		}
		byBucket := map[string][]store.Expiry{}
		for _, e := range due {
			byBucket[e.Bucket] = append(byBucket[e.Bucket], e)
		}
		for bucket, es := range byBucket {
			err := p.applyAsked(p.askLasts(ctx, bucket, es, log), log)
			if errors.Is(err, store.ErrClosed) {
				return err
			}
			if err != nil && first == nil {
				first = err
			}
		}
	}
	return first
}

// takeDue takes the expiries due now, up to one round's worth (store.DB.TakeDue), for longer than a
// round's asks can last: one the round cannot finish comes due again.
func (p *Projector) takeDue() []store.Expiry {
	now := time.Now()
	var due []store.Expiry
	for len(due) < expireBatch {
		e, ok := p.db.TakeDue(now.Add(-expireSlack).UnixNano(), now.Add(3*expireAsk).UnixNano())
		if !ok {
			break
		}
		due = append(due, e)
	}
	return due
}

// asked is a pending expiry taken from the store (store.DB.TakeDue) with its key's last message in the
// stream, or the ask's error; or not asked at all (the round's bytes ran out), to be given back.
type asked struct {
	e        store.Expiry
	last     provisioner.Message
	found    bool
	err      error
	notAsked bool
}

// askLasts asks a bucket's stream about its expiries taken: first all at once, by one direct get
// (msgget.LastOfMany), whose answer stands when the replica that gave it had stored every message the
// bucket's projection applied (its last sequence at least the applied one, read before asking: it holds
// the puts, and what it says of them is what it did since: a replica stores the stream's messages in
// order, and removes a TTL'd put of a bucket with markers when the leader's removal reaches it); then
// what that did not settle by the stream's leader, up to expireWindow asks at once, none more once one
// failed (the loop backs off before the rest are asked). Each expiry taken is in the answer. A replica
// behind the applied sequence answers when it fell behind after it joined the stream's direct get queue
// group (nats-server does not let a restarted follower join before it has caught up):
// TestProjector_ExpiryAskedOfALaggingReplica.
func (p *Projector) askLasts(ctx context.Context, bucket string, es []store.Expiry, log *slog.Logger) []asked {
	out := make([]asked, 0, len(es))
	bytes := 0
	if !p.expireDirectOff && time.Now().After(p.expireNoDirect[bucket]) {
		applied, _ := p.db.Applied(bucket)
		prefix := provisioner.SubjectPrefix(bucket)
		subjects := make([]string, len(es))
		for i, e := range es {
			subjects[i] = prefix + e.Key
		}
		stream := provisioner.StreamName(bucket)
		dctx, cancel := context.WithTimeout(ctx, expireAsk)
		lasts, err := msgget.LastOfMany(dctx, p.js.Conn(), APIPrefix(p.js), stream, subjects, expireBatchBytes)
		cancel()
		p.expireAsks.Add(1)
		switch {
		case err != nil && ctx.Err() == nil:
			log.Debug("a direct get of expired puts' keys failed; asking the stream's leader", "bucket", bucket, "err", err)
			if p.expireNoDirect == nil {
				p.expireNoDirect = map[string]time.Time{}
			}
			p.expireNoDirect[bucket] = time.Now().Add(expireNoDirect)
		case err == nil && lasts.Stream != "" && lasts.Stream != stream:
			// A mirror with MirrorDirect answered (nats-server 2.15 stream.go subscribeToMirrorDirect):
			// it stores the origin's messages at the origin's sequences, so its up-to sequence passes,
			// but what it removed is its own doing (a mirror nats.go makes keeps one message a subject
			// and no TTLs; one given TTLs removes a put of a key whose older revision it did not keep):
			// it would say a put the origin removed is still held, or that a key the origin holds has
			// none (TestProjector_ExpiryNotTakenFromAMirror). Not counted a failure: the next round's
			// direct get may go to the stream itself.
			log.Debug("a direct get of expired puts' keys was answered by a mirror; asking the stream's leader",
				"bucket", bucket, "answered_by", lasts.Stream)
		case err == nil && lasts.UpTo < applied:
			// Any replica answers a direct get, and one may be behind the leader the tail reads from: it
			// would name an older message as a key's last, or none, where the stream holds the put. An
			// answer with no message at all (404) says no up-to sequence, so it is not told apart from one.
			if lasts.UpTo > 0 {
				p.expireBehind.Add(1)
			}
			log.Debug("a direct get of expired puts' keys was answered by a replica behind the projection, or with no message and no up-to sequence; asking the stream's leader",
				"bucket", bucket, "up_to", lasts.UpTo, "applied", applied)
		case err == nil:
			found := make(map[string]*msgget.Last, len(lasts.Msgs))
			for i := range lasts.Msgs {
				found[lasts.Msgs[i].Subject] = &lasts.Msgs[i]
				bytes += len(lasts.Msgs[i].Subject) + len(lasts.Msgs[i].Data) + 64
			}
			rest := es[:0:0]
			for i, e := range es {
				if l := found[subjects[i]]; l != nil {
					out = append(out, asked{e: e, found: true, last: messageOf(prefix, l.Subject, l.Header, l.Data, l.Seq, l.Time.UnixNano())})
				} else if lasts.Complete {
					out = append(out, asked{e: e})
				} else {
					rest = append(rest, e)
				}
			}
			es = rest
		}
	}
	if len(es) == 0 {
		return out
	}
	var (
		mu     sync.Mutex
		next   int
		failed bool // an ask failed: the rest wait for the loop's backoff (a leader gone, NATS down)
		wg     sync.WaitGroup
	)
	take := func() (store.Expiry, bool) {
		mu.Lock()
		defer mu.Unlock()
		for next < len(es) && (bytes >= expireBatchBytes || failed || ctx.Err() != nil) {
			out = append(out, asked{e: es[next], notAsked: true})
			next++
		}
		if next == len(es) {
			return store.Expiry{}, false
		}
		next++
		return es[next-1], true
	}
	for range min(expireWindow, len(es)) {
		wg.Go(func() {
			for {
				e, ok := take()
				if !ok {
					return
				}
				actx, cancel := context.WithTimeout(ctx, expireAsk)
				a := asked{e: e}
				p.expireAsks.Add(1)
				a.last, a.found, a.err = p.lastOfKey(actx, e.Bucket, e.Key)
				cancel()
				if a.err != nil {
					a.err = fmt.Errorf("%s %q: %w", e.Bucket, e.Key, a.err)
				}
				mu.Lock()
				out = append(out, a)
				bytes += len(a.last.Key) + len(a.last.Value) + 64
				failed = failed || a.err != nil
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return out
}

// applyAsked has the store apply, one commit per bucket, what the stream holds now of the keys whose
// put is gone, and postpones every other one: still held (the server has not removed it yet), a later
// message (the tail applies it), or an ask that failed. It returns the first failure.
func (p *Projector) applyAsked(asked []asked, log *slog.Logger) error {
	var first error
	byBucket := map[string][]store.Expired{}
	for i := range asked {
		a := &asked[i]
		switch {
		case a.notAsked:
			p.db.Release(a.e)
		case a.err != nil:
			if first == nil {
				first = a.err
			}
		case a.found && a.last.Seq >= a.e.Seq:
			// Still held, or a later message: asked again later.
		case a.found:
			byBucket[a.e.Bucket] = append(byBucket[a.e.Bucket], store.Expired{Expiry: a.e, Last: &a.last})
		default:
			byBucket[a.e.Bucket] = append(byBucket[a.e.Bucket], store.Expired{Expiry: a.e})
		}
	}
	for bucket, items := range byBucket {
		n, err := p.db.ExpireAll(bucket, items)
		switch {
		case errors.Is(err, store.ErrExpireComposed):
			p.rereadExpired(bucket)
		case errors.Is(err, store.ErrClosed):
			return err
		case err != nil:
			if first == nil {
				first = fmt.Errorf("expire %d keys of %s: %w", len(items), bucket, err)
			}
		case n > 0:
			log.Debug("TTL'd puts expired without a marker", "bucket", bucket, "keys", n)
		}
	}
	// Each one taken the store still holds is asked about again later, sooner first.
	now := time.Now()
	for i := range asked {
		if e := asked[i].e; !asked[i].notAsked && !p.expired(e) {
			p.db.Postpone(e, now.Add(min(expireSlack<<min(e.Tries, 16), expireRetryMax)).UnixNano())
		}
	}
	return first
}

// expired reports whether the store no longer holds e as pending (applied, or a later message came).
func (p *Projector) expired(e store.Expiry) bool {
	cur, ok := p.db.PendingExpiry(e.Bucket, e.Key)
	return !ok || cur.Seq != e.Seq
}

// lastOfKey asks the stream's leader for the last message of a key's subject ($JS.API.STREAM.MSG.GET
// with last_by_subj): a direct get is answered by any replica from what it holds, and one behind the
// leader could say an older message is the last while the put was read from the leader.
func (p *Projector) lastOfKey(ctx context.Context, bucket, key string) (provisioner.Message, bool, error) {
	subject := provisioner.SubjectPrefix(bucket) + key
	last, found, err := msgget.Get(ctx, p.js.Conn(), APIPrefix(p.js), provisioner.StreamName(bucket), msgget.Request{Last: subject})
	switch {
	case err != nil || !found:
		return provisioner.Message{}, false, err
	case last.Subject != subject:
		return provisioner.Message{}, false, fmt.Errorf("message get: a message of %s in the answer, asked for %s", last.Subject, subject)
	}
	var h nats.Header
	if len(last.Header) > 0 {
		if h, err = nats.DecodeHeadersMsg(last.Header); err != nil {
			return provisioner.Message{}, false, fmt.Errorf("message get: headers: %w", err)
		}
	}
	return messageOf(provisioner.SubjectPrefix(bucket), subject, h, last.Data, last.Seq, last.Time.UnixNano()), true, nil
}

// rereadExpired has a composed-<node> bucket whose TTL'd put expired without a marker read again
// from its stream: its tail's next check ends it with ErrCannotResume (runBucket forgets it in place
// and reads it again), a parked one woken for it.
func (p *Projector) rereadExpired(bucket string) {
	p.mu.Lock()
	tailed := p.tailed[bucket]
	p.mu.Unlock()
	if !tailed {
		return
	}
	p.expiredUnmarked.Store(bucket, struct{}{})
	p.Wake(bucket)
}

// takeExpired reports, once, that a bucket is to be read again for a put that expired without a
// marker (rereadExpired).
func (p *Projector) takeExpired(bucket string) error {
	if _, ok := p.expiredUnmarked.LoadAndDelete(bucket); ok {
		return fmt.Errorf("%w: a TTL'd put expired without a marker", ErrCannotResume)
	}
	return nil
}
