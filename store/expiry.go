package store

import (
	"bytes"
	"container/heap"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/cockroachdb/pebble/v2"

	provisioner "github.com/novox/mesh-provisioner"
)

// Pending expiries. nats-server writes a TTL marker (Nats-Marker-Reason) only for an expiring message
// that is the last one its subject holds in the stream (filestore and memstore expireMsgs: a marker when
// the subject's remaining messages are one, a plain removal otherwise). A put carrying a per-message TTL
// over a key whose older revision or delete the bucket keeps (History > 1: a kv.Create with KeyTTL on a
// key deleted before, say) is removed silently when it expires: the bucket answers the older revision,
// or nothing, again, and no message says so. The store therefore remembers each applied put that
// carries a TTL (provisioner.Message.Expires) while it is its key's newest message, and the projector
// asks the stream, once it is due, what the key's last message is now (projector/expire.go): Expire
// applies that.
//
// The pending expiries are written with the message, in its batch, under
//
//	0x0b <bucket> 00 01 <raw key> -> uvarint seq of the put, varint when it expires (Unix ns)
//
// and any later message of the key (a put without a TTL, a delete, a marker, a rollup that removed it)
// deletes its entry in its own batch, so the keyspace holds at most one entry a key, and only for the
// keys whose newest message is a TTL'd put. Open reads them all into memory (a map by key and a heap by
// due time): a store reopened after a stop, or rebuilt from the streams (whose messages carry their
// Nats-TTL headers as stored), finds the same ones. A state dir an older binary wrote has none for the
// puts it applied; a rebuild finds them.

// Expiry is a put with a per-message TTL that is its key's newest message in the store.
type Expiry struct {
	Bucket string
	Key    string // the raw key
	Seq    uint64 // the put's stream sequence
	Due    int64  // when the server removes it (Unix ns), or when to ask again (Postpone)
	Tries  int    // how many times it was postponed

	index int // in expiries.queue
}

// expiries are a store's pending expiries in memory, as committed.
type expiries struct {
	mu    sync.Mutex
	keys  map[string]map[string]*Expiry // bucket -> raw key
	queue expiryQueue                   // by Due
	n     atomic.Int64                  // entries: a batch with none pending looks nothing up
	added chan struct{}                 // capacity 1: an entry came, or came due sooner (ExpiryAdded)
}

func newExpiries() expiries {
	return expiries{keys: map[string]map[string]*Expiry{}, added: make(chan struct{}, 1)}
}

type expiryQueue []*Expiry

func (q expiryQueue) Len() int           { return len(q) }
func (q expiryQueue) Less(i, j int) bool { return q[i].Due < q[j].Due }
func (q expiryQueue) Swap(i, j int) {
	q[i], q[j] = q[j], q[i]
	q[i].index, q[j].index = i, j
}
func (q *expiryQueue) Push(x any) {
	e := x.(*Expiry)
	e.index = len(*q)
	*q = append(*q, e)
}
func (q *expiryQueue) Pop() any {
	old := *q
	e := old[len(old)-1]
	old[len(old)-1] = nil
	*q = old[:len(old)-1]
	return e
}

// lookup is the entry of a key, or nil; under mu.
func (x *expiries) lookup(bucket, key string) *Expiry { return x.keys[bucket][key] }

// setLocked remembers (or, with e nil, forgets) the pending expiry of a key; under mu.
func (x *expiries) setLocked(bucket, key string, e *Expiry) {
	old := x.keys[bucket][key]
	if e == nil {
		if old != nil {
			heap.Remove(&x.queue, old.index)
			delete(x.keys[bucket], key)
			if len(x.keys[bucket]) == 0 {
				delete(x.keys, bucket)
			}
			x.n.Add(-1)
		}
		return
	}
	first := len(x.queue) == 0 || e.Due < x.queue[0].Due
	if old != nil {
		old.Seq, old.Due, old.Tries = e.Seq, e.Due, 0
		heap.Fix(&x.queue, old.index)
	} else {
		e := &Expiry{Bucket: bucket, Key: key, Seq: e.Seq, Due: e.Due}
		if x.keys[bucket] == nil {
			x.keys[bucket] = map[string]*Expiry{}
		}
		x.keys[bucket][key] = e
		heap.Push(&x.queue, e)
		x.n.Add(1)
	}
	if first {
		select {
		case x.added <- struct{}{}:
		default:
		}
	}
}

// dropBucket forgets every pending expiry of a bucket (Forget).
func (x *expiries) dropBucket(bucket string) {
	x.mu.Lock()
	defer x.mu.Unlock()
	for key := range x.keys[bucket] {
		x.setLocked(bucket, key, nil)
	}
}

// expKey names a key of a bucket in a batch's pending expiries.
type expKey struct{ bucket, key string }

func expiryKey(dst []byte, bucket, key string) []byte {
	return appendEsc(bucketPrefix(dst, prefixExpiry, bucket), key)
}

func encodeExpiry(seq uint64, due int64) []byte {
	return binary.AppendVarint(binary.AppendUvarint(nil, seq), due)
}

// noteExpiry keeps a key's pending expiry as the batch leaves it, as m is applied: a put carrying a
// TTL is remembered (its entry replaces an older one), any other message of a key that has one forgets
// it. A key without one costs no lookup while the store has none at all.
func (a *applier) noteExpiry(bucket string, m *provisioner.Message) {
	k := expKey{bucket, m.Key}
	if m.Op == provisioner.OpPut && m.Expires > 0 {
		a.set(expiryKey(nil, bucket, m.Key), encodeExpiry(m.Seq, m.Expires))
		if a.exp == nil {
			a.exp = map[expKey]*Expiry{}
		}
		a.exp[k] = &Expiry{Seq: m.Seq, Due: m.Expires}
		return
	}
	if e, ok := a.exp[k]; ok {
		if e == nil {
			return
		}
	} else {
		if a.db.exp.n.Load() == 0 {
			return
		}
		a.db.exp.mu.Lock()
		e := a.db.exp.lookup(bucket, m.Key)
		a.db.exp.mu.Unlock()
		if e == nil {
			return
		}
	}
	a.delete(expiryKey(nil, bucket, m.Key))
	if a.exp == nil {
		a.exp = map[expKey]*Expiry{}
	}
	a.exp[k] = nil
}

// commitExpiries makes memory follow the pending expiries a committed batch changed.
func (a *applier) commitExpiries() {
	if len(a.exp) == 0 {
		return
	}
	x := &a.db.exp
	x.mu.Lock()
	defer x.mu.Unlock()
	for k, e := range a.exp {
		x.setLocked(k.bucket, k.key, e)
	}
}

// loadExpiries reads every pending expiry into memory (Open).
func (db *DB) loadExpiries() error {
	it, err := db.pdb.NewIter(&pebble.IterOptions{LowerBound: []byte{prefixExpiry}, UpperBound: []byte{prefixExpiry + 1}})
	if err != nil {
		return readErr(err)
	}
	db.exp.mu.Lock()
	defer db.exp.mu.Unlock()
	for it.First(); it.Valid(); it.Next() {
		k := it.Key()[1:]
		i := termIndex(k)
		seq, w := binary.Uvarint(it.Value())
		due, w2 := int64(0), 0
		if w > 0 {
			due, w2 = binary.Varint(it.Value()[w:])
		}
		if i < 0 || w <= 0 || w2 <= 0 {
			it.Close()
			return fmt.Errorf("%w: pending expiry %q", ErrCorrupt, it.Key())
		}
		db.exp.setLocked(string(unesc(nil, k[:i])), string(unesc(nil, k[i+2:])), &Expiry{Seq: seq, Due: due})
	}
	if err := it.Close(); err != nil {
		return readErr(err)
	}
	return nil
}

// ExpiryAdded is told, without blocking (capacity 1), when a pending expiry is added that is due
// before every other one: whoever waits for the first one due waits again.
func (db *DB) ExpiryAdded() <-chan struct{} { return db.exp.added }

// NextExpiry returns the pending expiry due first.
func (db *DB) NextExpiry() (Expiry, bool) {
	db.exp.mu.Lock()
	defer db.exp.mu.Unlock()
	if len(db.exp.queue) == 0 {
		return Expiry{}, false
	}
	e := *db.exp.queue[0]
	e.index = 0
	return e, true
}

// PendingExpiry returns the pending expiry of a key, when it has one.
func (db *DB) PendingExpiry(bucket, key string) (Expiry, bool) {
	db.exp.mu.Lock()
	defer db.exp.mu.Unlock()
	e := db.exp.lookup(bucket, key)
	if e == nil {
		return Expiry{}, false
	}
	c := *e
	c.index = 0
	return c, true
}

// Expiries is how many pending expiries the store holds.
func (db *DB) Expiries() int { return int(db.exp.n.Load()) }

// Postpone moves a pending expiry to be asked again at due, when it is still the one e names (its
// key's newest message is still the put at e.Seq): the server had not removed it yet.
func (db *DB) Postpone(e Expiry, due int64) {
	db.exp.mu.Lock()
	defer db.exp.mu.Unlock()
	if cur := db.exp.lookup(e.Bucket, e.Key); cur != nil && cur.Seq == e.Seq {
		cur.Due = due
		cur.Tries++
		heap.Fix(&db.exp.queue, cur.index)
	}
}

// TakeDue returns the pending expiry due first when it is due at or before now, and moves it to be
// due again at lease (its Tries unchanged), so that the next TakeDue returns the next one: whoever
// takes it asks about it and then Postpones it, or has it forgotten; when they cannot, it comes due
// again at lease.
func (db *DB) TakeDue(now, lease int64) (Expiry, bool) {
	db.exp.mu.Lock()
	defer db.exp.mu.Unlock()
	if len(db.exp.queue) == 0 || db.exp.queue[0].Due > now {
		return Expiry{}, false
	}
	first := db.exp.queue[0]
	e := *first
	e.index = 0
	first.Due = lease
	heap.Fix(&db.exp.queue, 0)
	return e, true
}

// Release gives back a pending expiry taken (TakeDue) and not asked about: it is due again as it was
// when taken, when it is still the one e names.
func (db *DB) Release(e Expiry) {
	db.exp.mu.Lock()
	defer db.exp.mu.Unlock()
	if cur := db.exp.lookup(e.Bucket, e.Key); cur != nil && cur.Seq == e.Seq {
		cur.Due = e.Due
		heap.Fix(&db.exp.queue, cur.index)
	}
}

// Rewrites counts the commits that changed the store without moving an applied sequence (Expire):
// a cache of answers keyed by applied sequences keys by it too.
func (db *DB) Rewrites() uint64 { return db.rewrites.Load() }

// ErrExpireComposed says Expire was asked of a composed-<node> bucket: its build records are a fold of
// the bucket's history, which an expired message left, so the bucket is read again instead.
var ErrExpireComposed = errors.New("store: a composed-<node> bucket's expired put is read again from its stream")

// Expire applies what the stream now holds of a key whose TTL'd put e the server removed without a
// marker: last is the key's last message in the stream now (below e.Seq), or nil when it holds none.
// It reports whether anything changed: nothing does when the key's newest message in the store is no
// longer the put at e.Seq (a later message was applied meanwhile: a stale entry is forgotten), or last
// is not below it (the put itself: not removed yet; a later message: the tail applies it).
//
// The change is as of the expired put's own sequence, as the stream now has it: the put's event leaves
// the log (by key and by sequence), and last is applied as it was, its event written again at its own
// sequence (a trim may have dropped it), so the row is last's again, with its own revision and created,
// its anomalies with it; with no last, the put's event becomes a TTL marker's at the put's sequence and
// time, removing the key. The bucket's applied sequence does not move. So the live answer, an answer
// as of any point from the put on, replay of the log and a rebuild from the streams all say the same:
// the stream holds no trace of the put, and the log holds none either.
func (db *DB) Expire(e Expiry, last *provisioner.Message) (bool, error) {
	n, err := db.ExpireAll(e.Bucket, []Expired{{Expiry: e, Last: last}})
	return n > 0, err
}

// Expired is a pending expiry with what its key's stream holds now, for ExpireAll: Last is the key's
// last message, nil when there is none.
type Expired struct {
	Expiry
	Last *provisioner.Message
}

// ExpireAll is Expire for many keys of one bucket (each at most once) in one commit: a mesh that
// writes TTL'd puts in bulk has them come due together. It reports how many changed; a
// composed-<node> bucket's that would change make it ErrExpireComposed, and nothing is written.
func (db *DB) ExpireAll(bucket string, items []Expired) (int, error) {
	if db.closed.Load() {
		return 0, ErrClosed
	}
	shape, ok := provisioner.ShapeOf(bucket)
	if !ok {
		return 0, fmt.Errorf("store: no shape for bucket %q", bucket)
	}
	if err := db.writeFailed.failed(); err != nil {
		return 0, err
	}
	// Below the applied sequence: not beside a trim walking the bucket's log (lockHistory).
	defer db.lockHistory(bucket)()
	db.applyMu.Lock()
	defer db.applyMu.Unlock()
	if db.closed.Load() {
		return 0, ErrClosed
	}
	if err := db.checkRoom(); err != nil {
		return 0, err
	}
	a := db.newApplier()
	defer a.close()
	// One iterator over the bucket's log for every key's newest event: one a key cost more than the
	// rest of its expiry.
	lower := bucketPrefix(nil, prefixHistory, bucket)
	log, err := db.pdb.NewIter(&pebble.IterOptions{LowerBound: lower, UpperBound: prefixEnd(lower)})
	if err != nil {
		return 0, readErr(err)
	}
	defer log.Close()
	changed, wrote := 0, false
	var live uint64 // the lowest older put that is its key's newest again
	for _, item := range items {
		e, last := item.Expiry, item.Last
		if e.Bucket != bucket {
			return 0, fmt.Errorf("store: expire %s %q with the keys of %s", e.Bucket, e.Key, bucket)
		}
		if last != nil && (last.Seq == e.Seq || last.Key != e.Key || last.Foreign) {
			continue
		}
		db.exp.mu.Lock()
		cur := db.exp.lookup(bucket, e.Key)
		db.exp.mu.Unlock()
		if cur == nil || cur.Seq != e.Seq {
			continue
		}
		// The key's newest event must be the put: the pending entry says so, the log is the proof.
		newest, err := newestEventAt(log, bucket, e.Key)
		if err != nil {
			return 0, err
		}
		if newest != e.Seq {
			// Stale: a later message of the key was applied without forgetting it (an older binary
			// wrote it); forgotten now, else it would be asked about for good.
			a.noteExpiry(bucket, &provisioner.Message{Key: e.Key, Op: provisioner.OpDelete})
			wrote = true
			continue
		}
		if last != nil && last.Seq > e.Seq {
			continue // a later message: applying it forgets the put's entry
		}
		if provisioner.IsComposedBucket(bucket) {
			return 0, ErrExpireComposed
		}
		if last == nil {
			// The put's event becomes a marker's: the key is removed as of it (applier.apply forgets
			// the pending entry).
			put, err := db.eventTimeOf(bucket, e.Key, e.Seq)
			if err != nil {
				return 0, err
			}
			if err := a.apply(shape, &provisioner.Message{Seq: e.Seq, Time: put, Key: e.Key, Op: provisioner.OpExpire}); err != nil {
				return 0, fmt.Errorf("expire %s %q: %w", bucket, e.Key, err)
			}
		} else {
			a.delete(historyKey(nil, bucket, e.Key, e.Seq))
			a.delete(eventKey(nil, bucket, e.Seq))
			// Its event as it was written (with its rollup, whose removals stand), its row, anomalies
			// and derived state; its pending expiry replaces the put's when it carries a TTL too.
			m := *last
			if err := a.apply(shape, &m); err != nil {
				return 0, fmt.Errorf("expire %s %q: %w", bucket, e.Key, err)
			}
			if m.Op == provisioner.OpPut && (live == 0 || m.Seq < live) {
				live = m.Seq
			}
		}
		changed++
		wrote = true
	}
	if !wrote {
		return 0, nil
	}
	if live > 0 {
		// An older put is its key's newest again: no event below LiveBelow's mark was live, and this
		// one is now.
		checked, err := db.liveChecked(bucket)
		if err != nil {
			return 0, err
		}
		if checked > live {
			a.set(liveCheckedKey(nil, bucket), binary.AppendUvarint(nil, live))
		}
	}
	if err := a.finish(bucket, a.checkpoint(bucket), false, false); err != nil {
		return 0, err
	}
	if changed > 0 {
		db.rewrites.Add(1)
	}
	return changed, nil
}

// newestEventAt is the sequence of a key's newest event in the log, 0 when it has none, read by an
// iterator over the bucket's log.
func newestEventAt(it *pebble.Iterator, bucket, key string) (uint64, error) {
	start := historyKeyStart(nil, bucket, key)
	if !it.SeekLT(prefixEnd(start)) || !bytes.HasPrefix(it.Key(), start) {
		return 0, it.Error()
	}
	k := it.Key()
	if len(k) != len(start)+8 {
		return 0, fmt.Errorf("%w: event key", ErrCorrupt)
	}
	return binary.BigEndian.Uint64(k[len(k)-8:]), nil
}

// eventTimeOf is the time of a key's event at seq.
func (db *DB) eventTimeOf(bucket, key string, seq uint64) (int64, error) {
	v, closer, err := db.pdb.Get(historyKey(nil, bucket, key, seq))
	if err != nil {
		return 0, err
	}
	defer closer.Close()
	_, _, t, _, err := decodeEventValue(v)
	return t, err
}
