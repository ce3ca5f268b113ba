package query

import (
	"encoding/json"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/store"
)

// lookingReader is a store's Reader that counts the looks of the requests waiting for min_seq: each
// look at a bucket starts by taking its Changed channel (before its applied sequence, so that no
// commit after the look goes unseen). afterApplied, when armed, runs once after the next Reach that
// a request's handler makes (Server.waits), not a watcher or an answer.
type lookingReader struct {
	Reader
	looks        atomic.Int64
	afterApplied atomic.Pointer[func()]
}

func (l *lookingReader) Changed(bucket string) <-chan struct{} {
	l.looks.Add(1)
	return l.Reader.Changed(bucket)
}

func (l *lookingReader) Reach(bucket string) uint64 {
	seq := l.Reader.Reach(bucket)
	if l.afterApplied.Load() != nil && calledFrom("query.(*Server).waits") {
		if fn := l.afterApplied.Swap(nil); fn != nil {
			(*fn)()
		}
	}
	return seq
}

// calledFrom reports whether fn is on the calling goroutine's stack.
func calledFrom(fn string) bool {
	pcs := make([]uintptr, 16)
	frames := runtime.CallersFrames(pcs[:runtime.Callers(2, pcs)])
	for {
		f, more := frames.Next()
		if strings.HasSuffix(f.Function, fn) {
			return true
		}
		if !more {
			return false
		}
	}
}

// lookingServer serves a store holding need 1, synced, through a lookingReader, with two workers and
// no read-ahead, on a nats-server of its own; the caller stops it.
func lookingServer(t *testing.T) (*store.DB, *lookingReader, *server.Server, *Server) {
	t.Helper()
	db := smallStore(t)
	putNeed(t, db, 1)
	db.SetSynced(provisioner.BucketNeeds, true)
	lr := &lookingReader{Reader: StoreReader(db)}
	ns := natstest.RunServer(t)
	snc, _ := natstest.Connect(t, ns.ClientURL())
	s := NewServer(lr, Options{Workers: 2, NoReadAhead: true})
	require.NoError(t, s.Start(snc, nil))
	return db, lr, ns, s
}

// TestServer_CommitLooksOnlyAtTheWaitersItAnswers: docs/decisions.md (Serving), a commit wakes only the
// requests it answers. A thousand requests wait for a sequence far ahead while ten commits each answer
// one request waiting for exactly that sequence: every one of those is answered at its commit, the
// thousand go on waiting, and the commits cost a few looks at the bucket, not a look per waiting
// request per commit (each waiter used to wake at every commit of its bucket to compare).
func TestServer_CommitLooksOnlyAtTheWaitersItAnswers(t *testing.T) {
	db, lr, ns, s := lookingServer(t)
	put := func(seq uint64) { putNeed(t, db, seq) }
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			s.Stop()
		}
	})

	nc, _ := natstest.Connect(t, ns.ClientURL())
	got, inbox := collect(t, nc)
	const far = 1000
	for i := 0; i < far; i++ {
		require.NoError(t, nc.PublishRequest(Subject, fmt.Sprintf("%s.far%d", inbox, i), []byte(`{"what":"needs","min_seq":1000000,"wait_ms":10000}`)))
	}
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if w := s.Waiting(); w != far {
			return fmt.Errorf("%d of %d waiting", w, far)
		}
		return nil
	})

	before := lr.looks.Load()
	const commits = 10
	for k := uint64(2); k < 2+commits; k++ {
		body := fmt.Sprintf(`{"what":"needs","min_seq":%d,"wait_ms":10000}`, k)
		require.NoError(t, nc.PublishRequest(Subject, fmt.Sprintf("%s.near%d", inbox, k), []byte(body)))
		natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
			if w := s.Waiting(); w != far+1 {
				return fmt.Errorf("%d waiting", w)
			}
			return nil
		})
		require.Zero(t, got.get("200"), "not answered before its commit")
		put(k)
		natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
			if n := got.get("200"); n != 1 {
				return fmt.Errorf("%d answered at commit %d", n, k)
			}
			return nil
		})
		got.mu.Lock()
		got.n["200"] = 0
		got.mu.Unlock()
	}
	looks := lr.looks.Load() - before
	t.Logf("%d looks for %d commits with %d requests waiting", looks, commits, far)
	// A look for each request added and one for each commit: a few per commit, whatever waits.
	require.LessOrEqual(t, looks, int64(4*commits), "looks at the bucket for %d commits with %d requests waiting", commits, far)
	require.Equal(t, far, s.Waiting(), "the far requests still wait")
	require.Zero(t, got.get("504"))

	// Stop answers every request still waiting, 504.
	s.Stop()
	stopped = true
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if n := got.get("504"); n != far {
			return fmt.Errorf("%d of %d answered 504", n, far)
		}
		return nil
	})
	require.Zero(t, s.Waiting())
}

// TestServer_WaiterAddedAsItsCommitLands: a request that finds its min_seq not applied, and whose
// commit lands before it is parked (after the bucket's watcher has looked at that commit, finding no
// one to answer), is answered at once, not at its wait_ms (a lost wake-up). Each round stages it with
// a commit made right after the request read the applied sequence.
func TestServer_WaiterAddedAsItsCommitLands(t *testing.T) {
	db, lr, ns, s := lookingServer(t)
	t.Cleanup(s.Stop)
	nc, _ := natstest.Connect(t, ns.ClientURL())

	// A request far ahead keeps the bucket watched, its watcher waiting for the next commit.
	_, inbox := collect(t, nc)
	require.NoError(t, nc.PublishRequest(Subject, inbox+".far", []byte(`{"what":"needs","min_seq":1000000,"wait_ms":10000}`)))
	natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
		if w := s.Waiting(); w != 1 {
			return fmt.Errorf("%d waiting", w)
		}
		return nil
	})
	for k := uint64(2); k < 22; k++ {
		looks := lr.looks.Load()
		var commitErr error
		commit := func() {
			// Runs on the request's handler, right after it read the applied sequence (k-1): the commit
			// lands, and the watcher looks at it, before the request is parked.
			m := provisioner.Message{Seq: k, Time: int64(k), Key: fmt.Sprintf("n%d.m.config.a", k), Op: provisioner.OpPut, Value: []byte{0x80}}
			if commitErr = db.Apply(provisioner.BucketNeeds, []provisioner.Message{m}, 0, true); commitErr != nil {
				return
			}
			for deadline := time.Now().Add(10 * time.Second); lr.looks.Load() == looks; time.Sleep(time.Millisecond) {
				if time.Now().After(deadline) {
					commitErr = errors.New("the watcher did not look at the commit")
					return
				}
			}
		}
		lr.afterApplied.Store(&commit)
		// wait_ms longer than the ask's own timeout: a lost wake-up is an ask that times out.
		a, _, err := natstest.Ask(nc, Subject, []byte(fmt.Sprintf(`{"what":"needs","min_seq":%d,"wait_ms":10000}`, k)), false)
		require.Nil(t, lr.afterApplied.Load(), "the commit was made")
		require.NoError(t, commitErr)
		require.NoError(t, err, "round %d: a request whose commit landed as it was parked was not answered", k)
		require.GreaterOrEqual(t, a.AsOf, k)
	}
	require.Equal(t, 1, s.Waiting())
}

// swappingReader reads whichever of two real stores is current, as a seat does across a rebuild;
// beforeView, when armed, runs once as a view is about to be opened.
type swappingReader struct {
	cur        atomic.Pointer[store.DB]
	beforeView atomic.Pointer[func()]
}

func (r *swappingReader) hook() {
	if fn := r.beforeView.Swap(nil); fn != nil {
		(*fn)()
	}
}

func (r *swappingReader) View(bucket string) (View, bool, error) {
	r.hook()
	return StoreReader(r.cur.Load()).View(bucket)
}

func (r *swappingReader) PlansView(synced bool) (PlansView, error) {
	r.hook()
	return StorePlans(r.cur.Load()).PlansView(synced)
}

func (r *swappingReader) Applied(bucket string) (uint64, bool) { return r.cur.Load().Answered(bucket) }

func (r *swappingReader) Reach(bucket string) uint64 { return r.cur.Load().Reach(bucket) }

func (r *swappingReader) Changed(bucket string) <-chan struct{} { return r.cur.Load().Changed(bucket) }

// TestServer_PlansMinSeqAcrossASwap: a plans answer with min_seq (a sequence of the node's
// composed-<node>) is read from a view that has applied it, as_of says so. The store is swapped, for
// one behind min_seq, between the request's check and its view: the request waits again, and is
// answered once the new store has applied min_seq. It used to be answered from the new store at once,
// as_of 2 for a min_seq of 5.
func TestServer_PlansMinSeqAcrossASwap(t *testing.T) {
	const node = "n1"
	bucket := provisioner.ComposedPrefix + node
	comp := func(seq uint64) provisioner.Message {
		v, err := msgpack.Marshal(map[string]any{"status": "published", "plan": fmt.Sprint("plan ", seq)})
		require.NoError(t, err)
		return provisioner.Message{Seq: seq, Time: int64(seq), Key: fmt.Sprintf("web.%d", seq), Op: provisioner.OpPut, Value: v}
	}
	put := func(db *store.DB, from, to uint64) {
		for seq := from; seq <= to; seq++ {
			require.NoError(t, db.Apply(bucket, []provisioner.Message{comp(seq)}, 0, true))
		}
	}
	before, after := smallStore(t), smallStore(t)
	put(before, 1, 5)
	put(after, 1, 2)
	r := &swappingReader{}
	r.cur.Store(before)
	ns := natstest.RunServer(t)
	snc, _ := natstest.Connect(t, ns.ClientURL())
	s := NewServer(r, Options{Workers: 2, NoReadAhead: true, Plans: Plans(r, func(string) bool { return true }, nil)})
	require.NoError(t, s.Start(snc, nil))
	t.Cleanup(s.Stop)
	nc, _ := natstest.Connect(t, ns.ClientURL())

	swap := func() { r.cur.Store(after) }
	r.beforeView.Store(&swap)
	type answer struct {
		AsOf map[string]uint64 `json:"as_of"`
	}
	answered := make(chan *nats.Msg, 1)
	go func() {
		m, err := nc.Request(Subject, []byte(`{"what":"plans","node":"n1","min_seq":5,"wait_ms":10000}`), 10*time.Second)
		if err != nil {
			m = &nats.Msg{Data: []byte(err.Error())}
		}
		answered <- m
	}()
	var early *nats.Msg
	natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
		select {
		case early = <-answered:
			return nil
		default:
		}
		if r.beforeView.Load() != nil || s.Waiting() != 1 {
			return errors.New("the request has not yet swapped the store and waited again")
		}
		return nil
	})
	if early != nil {
		var a answer
		require.NoError(t, json.Unmarshal(early.Data, &a), "%s", early.Data)
		require.GreaterOrEqual(t, a.AsOf[bucket], uint64(5), "answered from a store behind min_seq: %s", early.Data)
	}
	put(after, 3, 5)
	m := <-answered
	require.Empty(t, m.Header.Get(micro.ErrorCodeHeader), "%s", m.Data)
	var a answer
	require.NoError(t, json.Unmarshal(m.Data, &a), "%s", m.Data)
	require.EqualValues(t, 5, a.AsOf[bucket])
}

// TestServer_WaiterQueuedAcrossASwap: a request whose min_seq came on one store, and which waits in
// the workers' queue while the store is swapped for one behind it, waits again for what is left of its
// wait_ms. It used to be answered 504 at once, "not reached within 0 ms", with 10 s left to wait.
func TestServer_WaiterQueuedAcrossASwap(t *testing.T) {
	before, after := smallStore(t), smallStore(t)
	for seq := uint64(1); seq <= 4; seq++ {
		putNeed(t, before, seq)
	}
	putNeed(t, after, 1)
	putNeed(t, after, 2)
	before.SetSynced(provisioner.BucketNeeds, true)
	after.SetSynced(provisioner.BucketNeeds, true)
	r := &swappingReader{}
	r.cur.Store(before)
	ns := natstest.RunServer(t)
	snc, _ := natstest.Connect(t, ns.ClientURL())
	s := NewServer(r, Options{Workers: 1, NoReadAhead: true})
	require.NoError(t, s.Start(snc, nil))
	t.Cleanup(s.Stop)
	nc, _ := natstest.Connect(t, ns.ClientURL())
	got, inbox := collect(t, nc)

	// The one worker is held in the view of another request.
	inView, held := make(chan struct{}), make(chan struct{})
	hold := func() {
		close(inView)
		<-held
	}
	r.beforeView.Store(&hold)
	var once sync.Once
	release := func() { once.Do(func() { close(held) }) }
	t.Cleanup(release)
	require.NoError(t, nc.PublishRequest(Subject, inbox+".other", []byte(`{"what":"needs"}`)))
	<-inView

	require.NoError(t, nc.PublishRequest(Subject, inbox+".waiter", []byte(`{"what":"needs","min_seq":5,"wait_ms":10000}`)))
	natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
		if w := s.Waiting(); w != 1 {
			return fmt.Errorf("%d waiting", w)
		}
		return nil
	})
	putNeed(t, before, 5) // its min_seq comes: it is queued for the held worker
	natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
		if q, w := s.Queued(), s.Waiting(); q != 1 || w != 0 {
			return fmt.Errorf("%d queued, %d waiting", q, w)
		}
		return nil
	})
	r.cur.Store(after)
	release()
	natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
		if got.get("504") > 0 {
			return nil // failed below
		}
		if got.get("200") != 1 || s.Waiting() != 1 {
			return fmt.Errorf("%d answered, %d waiting", got.get("200"), s.Waiting())
		}
		return nil
	})
	require.Zero(t, got.get("504"), "answered 504 with its wait_ms not over")
	putNeed(t, after, 3)
	putNeed(t, after, 4)
	putNeed(t, after, 5)
	natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
		if n := got.get("200"); n != 2 {
			return fmt.Errorf("%d answered", n)
		}
		return nil
	})
	require.Zero(t, got.get("504"))
	require.Zero(t, s.Waiting())
}

// TestServer_MinSeqAcrossASwapToAStoreWhoseGapHoldsIt: an answer to min_seq is read from a view whose
// store answers it (store.DB.Reach), across a rebuild's swap too. The store is swapped, between the
// request's check and its view, for one that has applied past min_seq but holds it in an open history
// gap (it read 2, then 4: 3 was removed unread, by a message it may not have read): the request waits
// again, and is answered once that store's gap no longer holds it. It used to be answered from the
// new store at once (the view's applied sequence alone was checked), the write at 3 maybe lost.
func TestServer_MinSeqAcrossASwapToAStoreWhoseGapHoldsIt(t *testing.T) {
	bucket := provisioner.BucketNeeds
	before, after := smallStore(t), smallStore(t)
	for seq := uint64(1); seq <= 5; seq++ {
		putNeed(t, before, seq)
		if seq != 3 {
			putNeed(t, after, seq)
		}
	}
	require.Equal(t, uint64(5), before.Reach(bucket))
	require.Equal(t, uint64(2), after.Reach(bucket))
	r := &swappingReader{}
	r.cur.Store(before)
	m := askAcrossTheSwap(t, r, after, bucket, Options{Workers: 2, NoReadAhead: true}, `{"what":"needs","min_seq":4,"wait_ms":10000}`)
	require.Empty(t, m.Header.Get(micro.ErrorCodeHeader), "%s", m.Data)
	var a struct {
		AsOf uint64 `json:"as_of"`
	}
	require.NoError(t, json.Unmarshal(m.Data, &a), "%s", m.Data)
	require.EqualValues(t, 5, a.AsOf)
}

// TestServer_PlansMinSeqAcrossASwapToAStoreWhoseGapHoldsIt: as
// TestServer_MinSeqAcrossASwapToAStoreWhoseGapHoldsIt, for plans (min_seq of the node's
// composed-<node>).
func TestServer_PlansMinSeqAcrossASwapToAStoreWhoseGapHoldsIt(t *testing.T) {
	bucket := provisioner.ComposedPrefix + "n1"
	comp := func(db *store.DB, seq uint64) {
		v, err := msgpack.Marshal(map[string]any{"status": "published", "plan": fmt.Sprint("plan ", seq)})
		require.NoError(t, err)
		require.NoError(t, db.Apply(bucket, []provisioner.Message{{Seq: seq, Time: int64(seq), Key: fmt.Sprintf("web.%d", seq), Op: provisioner.OpPut, Value: v}}, 0, true))
	}
	before, after := smallStore(t), smallStore(t)
	for seq := uint64(1); seq <= 5; seq++ {
		comp(before, seq)
		if seq != 3 {
			comp(after, seq)
		}
	}
	require.Equal(t, uint64(2), after.Reach(bucket))
	r := &swappingReader{}
	r.cur.Store(before)
	m := askAcrossTheSwap(t, r, after, bucket, Options{Workers: 2, NoReadAhead: true, Plans: Plans(r, func(string) bool { return true }, nil)},
		`{"what":"plans","node":"n1","min_seq":4,"wait_ms":10000}`)
	require.Empty(t, m.Header.Get(micro.ErrorCodeHeader), "%s", m.Data)
	var a struct {
		AsOf map[string]uint64 `json:"as_of"`
	}
	require.NoError(t, json.Unmarshal(m.Data, &a), "%s", m.Data)
	require.EqualValues(t, 5, a.AsOf[bucket])
}

// TestServer_504InsideAGapSaysWhatIsApplied: a min_seq that an open history gap holds
// (store.DB.Reach) is answered 504 with the sequence the bucket has applied, and why it waited. It
// used to say the gap's start less one as "applied" (2 here, applied 5) with no reason, when wait_ms
// was 0 or ran out before the request was parked.
func TestServer_504InsideAGapSaysWhatIsApplied(t *testing.T) {
	db := smallStore(t)
	for _, seq := range []uint64{1, 2, 4, 5} {
		putNeed(t, db, seq) // 3 removed before it was read
	}
	require.Equal(t, uint64(2), db.Reach(provisioner.BucketNeeds))
	ns := natstest.RunServer(t)
	snc, _ := natstest.Connect(t, ns.ClientURL())
	s := NewServer(StoreReader(db), Options{Workers: 2})
	require.NoError(t, s.Start(snc, nil))
	t.Cleanup(s.Stop)
	nc, _ := natstest.Connect(t, ns.ClientURL())
	for _, wait := range []int{0, 50} {
		m, err := nc.Request(Subject, []byte(fmt.Sprintf(`{"what":"needs","min_seq":4,"wait_ms":%d}`, wait)), 10*time.Second)
		require.NoError(t, err)
		require.Equal(t, "504", m.Header.Get(micro.ErrorCodeHeader), "%s", m.Data)
		require.Contains(t, string(m.Data), "(applied 5, but messages up to min_seq were removed", "wait_ms %d", wait)
	}
}

// askAcrossTheSwap serves r with opts and sends body, whose min_seq 4 the store after holds back (its
// open gap of bucket), having r swap to after just before the request's view: the request must wait
// again, unanswered, rather than answer from after; once after reads the stream's end (the gap holds
// nothing), it is answered, and its answer returned.
func askAcrossTheSwap(t *testing.T, r *swappingReader, after *store.DB, bucket string, opts Options, body string) *nats.Msg {
	t.Helper()
	ns := natstest.RunServer(t)
	snc, _ := natstest.Connect(t, ns.ClientURL())
	s := NewServer(r, opts)
	require.NoError(t, s.Start(snc, nil))
	t.Cleanup(s.Stop)
	nc, _ := natstest.Connect(t, ns.ClientURL())

	swap := func() { r.cur.Store(after) }
	r.beforeView.Store(&swap)
	answered := make(chan *nats.Msg, 1)
	go func() {
		m, err := nc.Request(Subject, []byte(body), 10*time.Second)
		if err != nil {
			m = &nats.Msg{Data: []byte(err.Error())}
		}
		answered <- m
	}()
	natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
		if len(answered) != 0 {
			return nil
		}
		if r.beforeView.Load() != nil || s.Waiting() != 1 {
			return errors.New("the request has not yet swapped the store and waited again")
		}
		return nil
	})
	require.Empty(t, answered, "answered from a store whose open gap holds min_seq 4")
	require.NoError(t, after.CaughtUp(bucket, 5)) // the stream's end read: the gap holds nothing
	return natstest.Receive(t, answered, 10*time.Second, "the answer")
}
