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
// stream's leader for the key's last message:
//
//   - the put itself: not removed yet (the server removes expired messages on a timer of its own, and
//     writes a marker when the put is the subject's only message): asked again later, sooner first
//     (expireSlack, doubling up to expireRetryMax), until a message of the key (the marker, a later
//     put) makes the store forget it;
//   - a later message: the tail applies it, which forgets it; asked again later meanwhile, the same;
//   - an older message, or none: the put is gone, and the store applies what the stream holds now
//     (store.DB.Expire).
//
// A composed-<node> bucket's build records are a fold of its history: one whose put expired so is
// read again from its stream (forget.go), as a rebuild would read it.

// expireSlack is how long after a put's expiry its stream is first asked: nats-server removes
// expired messages on a timer, and its clock and the message's time stamp are the server's.
const expireSlack = time.Second

// expireRetryMax bounds the wait before asking again about a put the stream still holds.
const expireRetryMax = 5 * time.Minute

// expireAsk bounds one ask of the stream.
const expireAsk = 5 * time.Second

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

// expireWindow bounds the asks in flight: they share the seat's connection with the tails and the
// verb, and each is one request of the leader's JetStream API queue (10,000 by default, shared by
// every client of the server).
const expireWindow = 32

// expireBatch and expireBatchBytes bound one round of expireDue: how many keys it asks about, and
// the bytes of the last messages it holds (values, keys, headers) before it stops taking more (the
// asks in flight then may add up to expireWindow messages more). One round is one commit per bucket.
const (
	expireBatch      = 1024
	expireBatchBytes = 8 << 20
)

// expireDue asks about every pending expiry due now, in rounds of up to expireBatch keys with up to
// expireWindow asks in flight, and applies what each round found in one commit per bucket. An ask
// that fails postpones its expiry as if the stream still held the put, and the first failure is
// returned once every due one was asked (the loop backs off).
func (p *Projector) expireDue(ctx context.Context, log *slog.Logger) error {
	var first error
	for ctx.Err() == nil {
		asked := p.askDue(ctx)
		if len(asked) == 0 {
			return first
		}
		err := p.applyAsked(asked, log)
		if errors.Is(err, store.ErrClosed) {
			return err
		}
		if err != nil && first == nil {
			first = err
		}
	}
	return first
}

// asked is a pending expiry taken from the store (store.DB.TakeDue) with its key's last message in the
// stream, or the ask's error.
type asked struct {
	e     store.Expiry
	last  provisioner.Message
	found bool
	err   error
}

// askDue takes the expiries due now, up to one round's worth, and asks the stream about each, up to
// expireWindow at once. Each one taken is in the answer, asked or with the error that kept it from it.
func (p *Projector) askDue(ctx context.Context) []asked {
	var (
		mu    sync.Mutex
		out   []asked
		taken int
		bytes int
		wg    sync.WaitGroup
	)
	take := func() (store.Expiry, bool) {
		mu.Lock()
		defer mu.Unlock()
		if taken >= expireBatch || bytes >= expireBatchBytes || ctx.Err() != nil {
			return store.Expiry{}, false
		}
		now := time.Now()
		// Taken for longer than an ask can last: one the round cannot finish comes due again.
		e, ok := p.db.TakeDue(now.Add(-expireSlack).UnixNano(), now.Add(2*expireAsk).UnixNano())
		if ok {
			taken++
		}
		return e, ok
	}
	for range expireWindow {
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
		if e := asked[i].e; !p.expired(e) {
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
