package query

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/store"
)

// TestReadAhead_SameBytesOrNone walks a module page by page with pages written ahead: each page taken
// is byte for byte the answer written at the time it is asked for, and a page written before a commit
// that changes the answer (a row of the bucket, or for needs a registry entry) is not taken.
func TestReadAhead_SameBytesOrNone(t *testing.T) {
	db := smallStore(t)
	kind := provisioner.Registry.Entries[0]
	var msgs []provisioner.Message
	for i := 0; i < 50; i++ {
		msgs = append(msgs, provisioner.Message{Seq: uint64(i + 1), Time: int64(i+1) * 1e9, Key: fmt.Sprintf("n%02d.m1.%s.a", i, kind.Kind), Op: provisioner.OpPut, Value: []byte{0x01}})
	}
	require.NoError(t, db.Apply(provisioner.BucketNeeds, msgs, 0, false))
	db.SetSynced(provisioner.BucketNeeds, true)
	s := NewServer(StoreReader(db), Options{})
	s.startWorkers()
	defer s.Stop()
	fresh := NewServer(StoreReader(db), Options{NoReadAhead: true})

	answer := func(srv *Server, r Request, f Format) *Encoder {
		e := &Encoder{}
		require.NoError(t, srv.Answer(context.Background(), &r, f, e))
		return e
	}
	// waitAhead waits until the page of r is written ahead.
	waitAhead := func(r Request, f Format) {
		key := keyOf(&r, f)
		require.Eventually(t, func() bool {
			s.ahead.mu.Lock()
			defer s.ahead.mu.Unlock()
			return s.ahead.find(key) >= 0
		}, 5*time.Second, time.Millisecond)
	}

	for _, f := range []Format{FormatJSON, FormatMsgpack} {
		req := Request{What: "needs", Module: "m1", Limit: ptr(int64(10))}
		e := answer(s, req, f)
		pages := 1
		for e.next != "" {
			s.readNextAhead(&req, f, e)
			req.After = e.next
			waitAhead(req, f)
			got := s.takeAhead(&req, f)
			require.NotNil(t, got, "page %d", pages)
			want := answer(fresh, req, f)
			require.Equal(t, string(want.Bytes()), string(got.Bytes()), "page %d", pages)
			e = got
			pages++
		}
		require.Equal(t, 5, pages)
	}

	// A commit between the page written ahead and the request: the page is not taken. (Each with a
	// walk of its own: a walk whose page went stale is not read ahead until one would be taken.)
	for n, change := range []provisioner.Message{
		{Seq: 51, Key: "n99.m1." + kind.Kind + ".b", Value: []byte{0x01}},
		{Seq: 1, Key: kind.Kind, Value: kind.Value()}, // the needs' kind is answered now: their anomalies go
	} {
		bucket := provisioner.BucketNeeds
		if change.Seq == 1 {
			bucket = provisioner.BucketRegistry
		}
		req := Request{What: "needs", Module: "m1", Limit: ptr(int64(10 + n))}
		e := answer(s, req, FormatMsgpack)
		s.readNextAhead(&req, FormatMsgpack, e)
		req.After = e.next
		waitAhead(req, FormatMsgpack)
		before := answer(fresh, req, FormatMsgpack)
		change.Op, change.Time = provisioner.OpPut, int64(change.Seq)*1e9
		require.NoError(t, db.Apply(bucket, []provisioner.Message{change}, 0, false), bucket)
		require.NotEqual(t, string(before.Bytes()), string(answer(fresh, req, FormatMsgpack).Bytes()), "the commit to %s changes the page", bucket)
		require.Nil(t, s.takeAhead(&req, FormatMsgpack), "after a commit to %s", bucket)
	}
}

// TestReadAhead_GoesOnAsTheAskerTakesPages walks a module as an asker does, slower than the pages are
// written: once it takes the second page, the fourth is written ahead too, before it takes the third
// (aheadDepth pages past the last one sent). Before, the page after one written ahead already was
// written only once the asker had taken that one, and the asker then waited for it.
func TestReadAhead_GoesOnAsTheAskerTakesPages(t *testing.T) {
	db := smallStore(t)
	kind := provisioner.Registry.Entries[0]
	var msgs []provisioner.Message
	for i := 0; i < 10; i++ {
		msgs = append(msgs, provisioner.Message{Seq: uint64(i + 1), Time: int64(i+1) * 1e9, Key: fmt.Sprintf("n%02d.m1.%s.a", i, kind.Kind), Op: provisioner.OpPut, Value: []byte{0x01}})
	}
	require.NoError(t, db.Apply(provisioner.BucketNeeds, msgs, 0, false))
	db.SetSynced(provisioner.BucketNeeds, true)
	s := NewServer(StoreReader(db), Options{})
	s.startWorkers()
	defer s.Stop()

	// written waits until the page of r is written ahead.
	written := func(r Request) {
		t.Helper()
		key := keyOf(&r, FormatMsgpack)
		require.Eventually(t, func() bool {
			s.ahead.mu.Lock()
			defer s.ahead.mu.Unlock()
			return s.ahead.find(key) >= 0
		}, 30*time.Second, time.Millisecond, "page after %q", r.After)
	}
	req := Request{What: "needs", Module: "m1", Limit: ptr(int64(1))}
	page := func(after string) Request { r := req; r.After = after; return r }
	e := &Encoder{}
	require.NoError(t, s.Answer(context.Background(), &req, FormatMsgpack, e))
	require.Equal(t, "n00.m1."+kind.Kind+".a", e.next)
	s.readNextAhead(&req, FormatMsgpack, e) // the first page is sent
	written(page("n00.m1." + kind.Kind + ".a"))
	written(page("n01.m1." + kind.Kind + ".a"))

	// The asker takes the second page; the third is written already, the fourth is next.
	second := page("n00.m1." + kind.Kind + ".a")
	got := s.takeAhead(&second, FormatMsgpack)
	require.NotNil(t, got)
	require.Equal(t, "n01.m1."+kind.Kind+".a", got.next)
	s.readNextAhead(&second, FormatMsgpack, got)
	written(page("n02.m1." + kind.Kind + ".a"))
	s.pool.Put(got)
	require.Equal(t, 2, s.Ahead(), "the third and fourth pages, no more")
}

// TestReadAhead_GoesOnOnlyFromAFreshPage: the page after one written ahead is asked for from that
// page's next only while the page is still the answer; after a commit, its asker is answered afresh and
// the page after it asked for from that answer.
func TestReadAhead_GoesOnOnlyFromAFreshPage(t *testing.T) {
	db := smallStore(t)
	kind := provisioner.Registry.Entries[0]
	var msgs []provisioner.Message
	for i := 0; i < 4; i++ {
		msgs = append(msgs, provisioner.Message{Seq: uint64(i + 1), Time: int64(i+1) * 1e9, Key: fmt.Sprintf("n%02d.m1.%s.a", i, kind.Kind), Op: provisioner.OpPut, Value: []byte{0x01}})
	}
	require.NoError(t, db.Apply(provisioner.BucketNeeds, msgs, 0, false))
	s := NewServer(StoreReader(db), Options{})
	// No worker: the jobs queued stay in the queue, to be counted.
	s.ahead.inflight = map[aheadKey]chan struct{}{}
	s.ahead.jobs = make(chan aheadJob, aheadQueue)

	second := Request{What: "needs", Module: "m1", Limit: ptr(int64(1)), After: "n00.m1." + kind.Kind + ".a"}
	e := &Encoder{}
	st := s.aheadState(provisioner.BucketNeeds)
	require.NoError(t, s.Answer(context.Background(), &second, FormatMsgpack, e))
	s.ahead.pages = append(s.ahead.pages, aheadPage{key: keyOf(&second, FormatMsgpack), state: st, e: e, made: time.Now()})

	require.True(t, s.continueAhead(&aheadJob{r: second, format: FormatMsgpack, depth: 1}))
	require.Len(t, s.ahead.jobs, 1, "the third page, from the second's next")
	j := <-s.ahead.jobs
	require.Equal(t, "n01.m1."+kind.Kind+".a", j.r.After)
	require.Equal(t, 2, j.depth)

	require.NoError(t, db.Apply(provisioner.BucketNeeds, []provisioner.Message{{Seq: 5, Time: 5e9, Key: "n09.m1." + kind.Kind + ".a", Op: provisioner.OpPut, Value: []byte{0x01}}}, 0, false))
	require.True(t, s.continueAhead(&aheadJob{r: second, format: FormatMsgpack, depth: 1}))
	require.Empty(t, s.ahead.jobs, "nothing from a page gone stale")
}

// TestReadAhead_NoPageDroppedForAFartherOne: with aheadPages kept, each the next page of a walk of its
// own, a page written ahead for a fifth walk, or two pages ahead of one of them, is not written: it
// would drop a page its asker is about to take. A page two ahead gives way to a next one. Before, the
// oldest page was dropped for each page written: with more walks at once than pages kept, most pages
// written ahead were dropped before their askers came (with 20 walkers of 10 pages, 331 to 355 pages
// written for 200 answered, against 200 to 203 now).
func TestReadAhead_NoPageDroppedForAFartherOne(t *testing.T) {
	db := smallStore(t)
	kind := provisioner.Registry.Entries[0].Kind
	var msgs []provisioner.Message
	for m := 1; m <= aheadPages+1; m++ {
		for i := 0; i < 4; i++ {
			msgs = append(msgs, provisioner.Message{Seq: uint64(len(msgs) + 1), Time: int64(len(msgs)+1) * 1e9, Key: fmt.Sprintf("n%02d.m%d.%s.a", i, m, kind), Op: provisioner.OpPut, Value: []byte{0x01}})
		}
	}
	require.NoError(t, db.Apply(provisioner.BucketNeeds, msgs, 0, false))
	idle := aheadIdle
	aheadIdle = time.Hour // no page kept is taken for one whose walk was left
	t.Cleanup(func() { aheadIdle = idle })
	// No worker: the jobs are run here, one by one, and those they queue are dropped.
	s := workerless(StoreReader(db))
	drain := func() {
		for len(s.ahead.jobs) > 0 {
			<-s.ahead.jobs
		}
	}
	// page is the request for module m's page after its row i, with one row a page.
	page := func(m, i int) Request {
		return Request{What: "needs", Module: fmt.Sprintf("m%d", m), Limit: ptr(int64(1)), After: fmt.Sprintf("n%02d.m%d.%s.a", i, m, kind)}
	}
	write := func(r Request, depth int) {
		s.writeAhead(&aheadJob{r: r, format: FormatMsgpack, depth: depth})
		drain()
	}
	kept := func(r Request) bool {
		s.ahead.mu.Lock()
		defer s.ahead.mu.Unlock()
		return s.ahead.find(keyOf(&r, FormatMsgpack)) >= 0
	}

	for m := 1; m <= aheadPages; m++ {
		write(page(m, 0), 1) // the second page of walk m, its first one sent
	}
	require.EqualValues(t, aheadPages, s.ahead.written.Load())
	write(page(aheadPages+1, 0), 1)
	write(page(1, 1), 2)
	require.EqualValues(t, aheadPages, s.ahead.written.Load(), "no page written to be dropped, or to drop one")
	for m := 1; m <= aheadPages; m++ {
		require.True(t, kept(page(m, 0)), "walk m%d's next page is kept", m)
	}

	// Walk 1 takes its page; the one after is written two ahead, and gives way to a next one.
	r := page(1, 0)
	e := s.takeAhead(&r, FormatMsgpack)
	require.NotNil(t, e)
	s.pool.Put(e)
	write(page(1, 1), 2)
	require.True(t, kept(page(1, 1)))
	write(page(aheadPages+1, 0), 1)
	require.True(t, kept(page(aheadPages+1, 0)))
	require.False(t, kept(page(1, 1)), "the page two ahead gave way")
	for m := 2; m <= aheadPages; m++ {
		require.True(t, kept(page(m, 0)), "walk m%d's next page is kept", m)
	}

	// A page two ahead asked for as the next one (its asker took the one before) is a next one.
	r = page(aheadPages+1, 0)
	e = s.takeAhead(&r, FormatMsgpack)
	require.NotNil(t, e)
	s.pool.Put(e)
	write(page(aheadPages+1, 1), 2)
	write(page(aheadPages+1, 1), 1) // found: it is its walk's next page now
	r = page(2, 0)
	e = s.takeAhead(&r, FormatMsgpack)
	require.NotNil(t, e)
	s.pool.Put(e)
	write(page(2, 1), 2)
	write(page(1, 1), 1)
	require.True(t, kept(page(1, 1)))
	require.True(t, kept(page(aheadPages+1, 1)), "walk m%d's page is a next one: not the one to give way", aheadPages+1)
	require.False(t, kept(page(2, 1)), "the page two ahead gave way")

	// Kept untaken for aheadIdle, the oldest page gives way to any: its walk was most likely left.
	write(page(2, 1), 2)
	require.False(t, kept(page(2, 1)))
	aheadIdle = 0
	write(page(2, 1), 2)
	require.True(t, kept(page(2, 1)))
	require.False(t, kept(page(3, 0)), "the oldest page gave way")
}

// TestReadAhead_NoRoomNoWaitForASlot: a page of a walk across the mesh that would find no room among
// the pages kept is not waited for the wide slot for: the read-ahead worker goes on with the jobs
// behind it. Before, it waited for the slot (held here; a wide answer under way), then dropped the job.
func TestReadAhead_NoRoomNoWaitForASlot(t *testing.T) {
	db := smallStore(t)
	kind := provisioner.Registry.Entries[0].Kind
	var msgs []provisioner.Message
	for m := 1; m <= aheadPages; m++ {
		for i := 0; i < 3; i++ {
			msgs = append(msgs, provisioner.Message{Seq: uint64(len(msgs) + 1), Time: int64(len(msgs)+1) * 1e9, Key: fmt.Sprintf("n%02d.m%d.%s.a", i, m, kind), Op: provisioner.OpPut, Value: []byte{0x01}})
		}
	}
	require.NoError(t, db.Apply(provisioner.BucketNeeds, msgs, 0, false))
	s := workerless(StoreReader(db))
	page := func(m, i int) Request {
		return Request{What: "needs", Module: fmt.Sprintf("m%d", m), Limit: ptr(int64(1)), After: fmt.Sprintf("n%02d.m%d.%s.a", i, m, kind)}
	}
	for m := 1; m <= aheadPages; m++ {
		s.writeAhead(&aheadJob{r: page(m, 0), format: FormatMsgpack, depth: 1})
	}
	require.Equal(t, aheadPages, s.Ahead())

	s.wideSlots <- struct{}{} // a wide answer under way
	defer func() { <-s.wideSlots }()
	done := make(chan struct{})
	go func() {
		defer close(done)
		s.writeAhead(&aheadJob{r: page(1, 1), format: FormatMsgpack, depth: 2})
	}()
	natstest.Receive(t, done, 10*time.Second, "the job with no room to wait for no slot")
	require.EqualValues(t, aheadPages, s.ahead.written.Load())
}

// TestReadAhead_NothingWrittenOnceStopping: the jobs left in the read-ahead worker's queue as the
// server stops, and the one it had begun, write no page: nobody would take it. Before, Stop waited
// while the worker wrote each of them.
func TestReadAhead_NothingWrittenOnceStopping(t *testing.T) {
	db := smallStore(t)
	kind := provisioner.Registry.Entries[0].Kind
	var msgs []provisioner.Message
	for m := 1; m <= aheadQueue+1; m++ {
		for i := 0; i < 3; i++ {
			msgs = append(msgs, provisioner.Message{Seq: uint64(len(msgs) + 1), Time: int64(len(msgs)+1) * 1e9, Key: fmt.Sprintf("n%02d.m%d.%s.a", i, m, kind), Op: provisioner.OpPut, Value: []byte{0x01}})
		}
	}
	require.NoError(t, db.Apply(provisioner.BucketNeeds, msgs, 0, false))
	s := NewServer(StoreReader(db), Options{})
	begun, release := make(chan struct{}, 1), make(chan struct{})
	s.writingAhead = func(*Request) {
		select {
		case begun <- struct{}{}:
			<-release // the first job, held as Stop begins
		default:
		}
	}
	s.startWorkers()
	job := func(m int) aheadJob {
		return aheadJob{r: Request{What: "needs", Module: fmt.Sprintf("m%d", m), Limit: ptr(int64(1))}, format: FormatMsgpack, depth: 1}
	}
	s.queueAhead(job(1), fmt.Sprintf("n00.m1.%s.a", kind))
	natstest.Receive(t, begun, 10*time.Second, "the first job begun")
	for m := 2; m <= aheadQueue+1; m++ {
		s.queueAhead(job(m), fmt.Sprintf("n00.m%d.%s.a", m, kind))
	}
	require.Len(t, s.ahead.jobs, aheadQueue)
	stopped := make(chan struct{})
	go func() { s.Stop(); close(stopped) }()
	natstest.CheckFor(t, 10*time.Second, time.Millisecond, func() error {
		s.ahead.mu.Lock()
		defer s.ahead.mu.Unlock()
		if !s.ahead.closed {
			return fmt.Errorf("not stopping yet")
		}
		return nil
	})
	close(release)
	natstest.Receive(t, stopped, 10*time.Second, "Stop to return")
	require.Zero(t, s.ahead.written.Load(), "pages written as the server stopped")
}

// TestReadAhead_NotWrittenOnceAskedFor: a page whose request came before the read-ahead worker began
// it (the worker waiting for the wide slot, which the request took first) was answered afresh: the
// job queued for it writes nothing. Before, the worker wrote the page after all, for nobody, and a
// walk whose requests kept coming first had each of its pages written twice. A request for the same
// page before the job was queued (another walk's) does not count.
func TestReadAhead_NotWrittenOnceAskedFor(t *testing.T) {
	db := smallStore(t)
	kind := provisioner.Registry.Entries[0].Kind
	msgs := oneModuleRows(kind, 4)
	require.NoError(t, db.Apply(provisioner.BucketNeeds, msgs, 0, false))
	// No worker: the jobs are run here.
	s := workerless(StoreReader(db))
	first := Request{What: "needs", Module: "m1", Limit: ptr(int64(1))}
	second := first
	second.After = "n00.m1." + kind + ".a"

	// Asked for, then the job queued (another walk's request came earlier): the page is written.
	require.Nil(t, s.takeAhead(&second, FormatMsgpack))
	s.queueAhead(aheadJob{r: first, format: FormatMsgpack, depth: 1}, second.After)
	j := <-s.ahead.jobs
	s.writeAhead(&j)
	require.EqualValues(t, 1, s.ahead.written.Load())
	e := s.takeAhead(&second, FormatMsgpack)
	require.NotNil(t, e)
	s.pool.Put(e)
	for len(s.ahead.jobs) > 0 {
		<-s.ahead.jobs
	}

	// The job queued, then its page asked for and answered afresh before the worker begins it.
	s.queueAhead(aheadJob{r: first, format: FormatMsgpack, depth: 1}, second.After)
	require.Nil(t, s.takeAhead(&second, FormatMsgpack))
	j = <-s.ahead.jobs
	s.writeAhead(&j)
	require.EqualValues(t, 1, s.ahead.written.Load(), "a page written for a request answered already")
	require.Zero(t, s.Ahead())

	// Queued twice (as the worker goes on two ahead, and as the asker takes the page before), the page
	// written for the first job and taken: the second writes it no more.
	s.queueAhead(aheadJob{r: first, format: FormatMsgpack, depth: 2}, second.After)
	s.queueAhead(aheadJob{r: first, format: FormatMsgpack, depth: 1}, second.After)
	j = <-s.ahead.jobs
	s.writeAhead(&j)
	require.EqualValues(t, 2, s.ahead.written.Load())
	e = s.takeAhead(&second, FormatMsgpack)
	require.NotNil(t, e)
	s.pool.Put(e)
	j = <-s.ahead.jobs
	s.writeAhead(&j)
	require.EqualValues(t, 2, s.ahead.written.Load(), "a page written again once taken")
	require.Zero(t, s.Ahead(), "a page kept for nobody")
}

// genReader reads whichever of two stores is current, swapped as a seat's rebuild does
// (Generationer); onApplied and onReach, when armed, run once as Applied or Reach is called.
type genReader struct {
	cur       atomic.Pointer[store.DB]
	gen       atomic.Uint64
	onApplied atomic.Pointer[func()]
	onReach   atomic.Pointer[func()]
}

func (r *genReader) View(bucket string) (View, bool, error) {
	return StoreReader(r.cur.Load()).View(bucket)
}

func (r *genReader) Applied(bucket string) (uint64, bool) {
	if fn := r.onApplied.Swap(nil); fn != nil {
		(*fn)()
	}
	return r.cur.Load().Answered(bucket)
}

func (r *genReader) Reach(bucket string) uint64 {
	if fn := r.onReach.Swap(nil); fn != nil {
		(*fn)()
	}
	return r.cur.Load().Reach(bucket)
}

func (r *genReader) Changed(bucket string) <-chan struct{} { return r.cur.Load().Changed(bucket) }

func (r *genReader) Generation() uint64 { return r.gen.Load() }

// TestReadAhead_NotFromTheStoreSwappedOut: a page written ahead from the old store as a rebuild's
// swap begins (the view opened just before the new store is made current) is not answered after the
// swap, although the new store has reached the same sequence (as a rebuild's swap waits for it to)
// and holds another value. Before, the page's generation was read after its sequence, already raised
// by the swap, and the new store's answer was then taken to be the page: the old store's value was
// answered.
func TestReadAhead_NotFromTheStoreSwappedOut(t *testing.T) {
	kind := provisioner.Registry.Entries[0].Kind
	storeOf := func(value byte) *store.DB {
		db := smallStore(t)
		var msgs []provisioner.Message
		for i := 0; i < 3; i++ {
			msgs = append(msgs, provisioner.Message{Seq: uint64(i + 1), Time: int64(i+1) * 1e9, Key: fmt.Sprintf("n%02d.m1.%s.a", i, kind), Op: provisioner.OpPut, Value: []byte{value}})
		}
		require.NoError(t, db.Apply(provisioner.BucketNeeds, msgs, 0, false))
		db.SetSynced(provisioner.BucketNeeds, true)
		return db
	}
	old, rebuilt := storeOf(0x01), storeOf(0x02)
	r := &genReader{}
	r.cur.Store(old)
	s := workerless(r)
	second := Request{What: "needs", Module: "m1", Limit: ptr(int64(1)), After: "n00.m1." + kind + ".a"}

	// The swap begins as the page's state is read; its view is opened on the old store.
	begin := func() { r.gen.Add(1) }
	r.onApplied.Store(&begin)
	s.writeAhead(&aheadJob{r: second, format: FormatMsgpack, depth: 1})
	require.Nil(t, r.onApplied.Load())
	r.cur.Store(rebuilt) // the new store is current; the swap has not yet ended
	check := func() *Encoder {
		t.Helper()
		want := &Encoder{}
		require.NoError(t, NewServer(StoreReader(rebuilt), Options{NoReadAhead: true}).Answer(context.Background(), &second, FormatMsgpack, want))
		got := s.takeAhead(&second, FormatMsgpack)
		if got != nil {
			require.Equal(t, string(want.Bytes()), string(got.Bytes()), "the page answered is the old store's")
		}
		return got
	}
	check()
	r.gen.Add(1) // the swap ends
	s.writeAhead(&aheadJob{r: second, format: FormatMsgpack, depth: 1, asks: s.ahead.asks})
	require.NotNil(t, check(), "a page written once the swap has ended is answered")
}

// TestReadAhead_AColdWalkWaitsForAPageThatWouldBeTaken: once a walk's page written ahead went stale
// before its asker came, none of its pages is written ahead while commits keep landing between its
// requests, and it is read ahead again from the first request a page written ahead would have
// answered (one page ahead until one is taken, then aheadDepth). A commit to another module moves the
// bucket's sequence alike. Before, each page of such a
// walk was written ahead and dropped: under steady writes read-ahead wrote about 75% more pages than
// the walks took.
func TestReadAhead_AColdWalkWaitsForAPageThatWouldBeTaken(t *testing.T) {
	db := smallStore(t)
	kind := provisioner.Registry.Entries[0].Kind
	msgs := oneModuleRows(kind, 8)
	require.NoError(t, db.Apply(provisioner.BucketNeeds, msgs, 0, false))
	db.SetSynced(provisioner.BucketNeeds, true)
	seq := uint64(len(msgs))
	commit := func() { // another module's need: the walk's answers are the same, its bucket moved
		t.Helper()
		seq++
		require.NoError(t, db.Apply(provisioner.BucketNeeds, []provisioner.Message{{Seq: seq, Time: int64(seq) * 1e9, Key: "n00.m2." + kind + ".a", Op: provisioner.OpPut, Value: []byte{0x01}}}, 0, false))
	}
	// No worker: the jobs queued are run here, one by one.
	s := workerless(StoreReader(db))
	page := func(i int) Request {
		r := Request{What: "needs", Module: "m1", Limit: ptr(int64(1))}
		if i > 0 {
			r.After = fmt.Sprintf("n%02d.m1.%s.a", i-1, kind)
		}
		return r
	}
	// send answers page i as respond does, from a page written ahead when one is the answer, and says
	// whether it was; the jobs it queues are left in the queue.
	send := func(i int) bool {
		t.Helper()
		r := page(i)
		return answerAsRespond(t, s, &r)
	}
	run := func() int { // runs the jobs queued, and those they queue; how many were
		n := 0
		for len(s.ahead.jobs) > 0 {
			j := <-s.ahead.jobs
			s.writeAhead(&j)
			n++
		}
		return n
	}

	send(0)
	require.Equal(t, 2, run(), "pages 1 and 2 written ahead")
	commit()
	require.False(t, send(1), "page 1 went stale")
	require.Zero(t, run(), "the walk is cold: page 2 was written ahead already, and no page after")
	require.EqualValues(t, 2, s.ahead.written.Load())
	commit()
	require.False(t, send(2), "page 2 went stale too")
	require.Zero(t, run())
	commit()
	require.False(t, send(3), "no page written ahead")
	require.Zero(t, run(), "a commit while its asker read page 3: still cold")
	require.EqualValues(t, 2, s.ahead.written.Load(), "no page written for nothing")

	require.False(t, send(4), "no page written ahead")
	require.Equal(t, 1, run(), "no commit while its asker read page 4: a page written ahead would have answered; it is read ahead again, one page until one is taken")
	require.True(t, send(5))
	require.Equal(t, 2, run(), "page 5 was taken: two pages ahead again")
	require.True(t, send(6))
	require.EqualValues(t, 2, s.ahead.taken.Load())
	require.EqualValues(t, 5, s.ahead.written.Load())

}

// TestReadAhead_NotForAMinSeqInsideAnOpenGap: a page written ahead does not answer a request whose
// min_seq lies inside an open history gap (messages removed before the projector read them, whose
// remover may be unread: store.DB.Reach), although the bucket has applied past it; without read-ahead
// the request is answered 504 (or waits), not with a state that may lack a write. Before, a page
// written ahead was taken once its applied sequence reached min_seq.
func TestReadAhead_NotForAMinSeqInsideAnOpenGap(t *testing.T) {
	db := smallStore(t)
	kind := provisioner.Registry.Entries[0].Kind
	msgs := oneModuleRows(kind, 4)
	// 5 was removed before it was read; 6 is read: what removed 5 may come later.
	msgs = append(msgs, provisioner.Message{Seq: 6, Time: 6e9, Key: "n09.m1." + kind + ".a", Op: provisioner.OpPut, Value: []byte{0x01}})
	require.NoError(t, db.Apply(provisioner.BucketNeeds, msgs, 0, false))
	db.SetSynced(provisioner.BucketNeeds, true)
	require.Equal(t, uint64(4), db.Reach(provisioner.BucketNeeds))
	s := workerless(StoreReader(db))

	second := Request{What: "needs", Module: "m1", Limit: ptr(int64(1)), After: "n00.m1." + kind + ".a", MinSeq: 6}
	err := s.Answer(context.Background(), &second, FormatMsgpack, &Encoder{})
	require.Equal(t, 504, Code(err), "without read-ahead")
	s.writeAhead(&aheadJob{r: second, format: FormatMsgpack, depth: 1})
	require.Equal(t, 1, s.Ahead())
	require.False(t, s.aheadReady(&second, FormatMsgpack))
	require.Nil(t, s.takeAhead(&second, FormatMsgpack), "a page for a min_seq inside the gap")

	require.NoError(t, db.CaughtUp(provisioner.BucketNeeds, 6)) // the stream's end is read: 6 is reached
	s.writeAhead(&aheadJob{r: second, format: FormatMsgpack, depth: 1, asks: s.ahead.asks})
	require.True(t, s.aheadReady(&second, FormatMsgpack))
	e := s.takeAhead(&second, FormatMsgpack)
	require.NotNil(t, e, "reached: the page is the answer")
	s.pool.Put(e)
}

// TestReadAhead_AColdWalkOfManyAskersWarmsOnAQuietBucket: a walk gone cold (one page written ahead
// went stale) that more askers walk than ghosts are kept (aheadGhosts) warms again once the bucket is
// quiet. Before, the ghosts were only one ring for all cold walks, each found by its page: with 17
// askers at different pages of a walk, each asker's ghost was overwritten by the others' before its
// next request, and the walk stayed cold for ever, on a quiet bucket, no page of it written ahead again.
func TestReadAhead_AColdWalkOfManyAskersWarmsOnAQuietBucket(t *testing.T) {
	db := smallStore(t)
	kind := provisioner.Registry.Entries[0].Kind
	const rows = 60
	msgs := oneModuleRows(kind, rows)
	require.NoError(t, db.Apply(provisioner.BucketNeeds, msgs, 0, false))
	db.SetSynced(provisioner.BucketNeeds, true)
	s := workerless(StoreReader(db))
	send := func(i int) bool {
		t.Helper()
		r := Request{What: "needs", Module: "m1", Limit: ptr(int64(1))}
		if i > 0 {
			r.After = fmt.Sprintf("n%02d.m1.%s.a", i-1, kind)
		}
		return answerAsRespond(t, s, &r)
	}
	run := func() {
		for len(s.ahead.jobs) > 0 {
			j := <-s.ahead.jobs
			s.writeAhead(&j)
		}
	}

	send(0)
	run()
	require.NoError(t, db.Apply(provisioner.BucketNeeds, []provisioner.Message{{Seq: rows + 1, Time: (rows + 1) * 1e9, Key: "n00.m2." + kind + ".a", Op: provisioner.OpPut, Value: []byte{0x01}}}, 0, false))
	require.False(t, send(1), "page 1 went stale: the walk is cold")
	run()

	// Quiet from here: askers of the walk, each at a page of its own, take turns.
	const askers = aheadGhosts + 1
	pos := make([]int, askers)
	for a := range pos {
		pos[a] = 2 + 3*a
	}
	taken := 0
	for round := 0; round < 3; round++ {
		for a := range pos {
			if send(pos[a]) {
				taken++
			}
			run()
			pos[a]++
		}
	}
	require.Positive(t, taken, "no commit since the walk went cold: its pages are written ahead again")
}

// TestReadAhead_NotForAMinSeqReachedByALaterCommit: a page written ahead at a state whose open history
// gap holds a request's min_seq does not answer it when, as the page is checked, a commit lands that
// moves the bucket and closes the gap: the page's state never reached min_seq (the write its gap lost
// may be what the commit removed), and without read-ahead the request is answered from the commit's
// state. Before, the page's state was compared first and Reach read after it: the commit landed between
// the two, Reach had min_seq, and the page answered with the as_of of the state inside the gap.
func TestReadAhead_NotForAMinSeqReachedByALaterCommit(t *testing.T) {
	db := smallStore(t)
	kind := provisioner.Registry.Entries[0].Kind
	msgs := oneModuleRows(kind, 4)
	// 5 was removed before it was read; 6 is read: what removed 5 may come later.
	msgs = append(msgs, provisioner.Message{Seq: 6, Time: 6e9, Key: "n09.m1." + kind + ".a", Op: provisioner.OpPut, Value: []byte{0x01}})
	require.NoError(t, db.Apply(provisioner.BucketNeeds, msgs, 0, false))
	db.SetSynced(provisioner.BucketNeeds, true)
	require.Equal(t, uint64(4), db.Reach(provisioner.BucketNeeds))
	gr := &genReader{}
	gr.cur.Store(db)
	s := workerless(gr)

	second := Request{What: "needs", Module: "m1", Limit: ptr(int64(1)), After: "n00.m1." + kind + ".a", MinSeq: 6}
	s.writeAhead(&aheadJob{r: second, format: FormatMsgpack, depth: 1})
	require.Equal(t, 1, s.Ahead())
	commit := func() { // what removed 5 (its purge) is read, and the stream's end with it
		require.NoError(t, db.Apply(provisioner.BucketNeeds, []provisioner.Message{{Seq: 7, Time: 7e9, Key: "n01.m1." + kind + ".a", Op: provisioner.OpDelete}}, 0, false))
		require.NoError(t, db.CaughtUp(provisioner.BucketNeeds, 7))
	}
	gr.onReach.Store(&commit)
	e := s.takeAhead(&second, FormatMsgpack)
	require.Nil(t, gr.onReach.Load(), "the commit landed as the page was checked")
	require.Equal(t, uint64(7), db.Reach(provisioner.BucketNeeds))
	if e != nil {
		want := &Encoder{}
		require.NoError(t, s.Answer(context.Background(), &second, FormatMsgpack, want))
		require.Equal(t, string(want.Bytes()), string(e.Bytes()), "the page answered is the answer without read-ahead")
	}
}

// TestReadAhead_AColdWalkWhosePageIsTakenIsWarm: a page of a cold walk written ahead before it went
// cold (by the worker going on, after a commit) and taken, the answer it would be given, warms the walk:
// its next page is written ahead. Before, the walk stayed cold after the page was taken, and the next
// page was answered afresh, the walk warmed only by that request's ghost.
func TestReadAhead_AColdWalkWhosePageIsTakenIsWarm(t *testing.T) {
	db := smallStore(t)
	kind := provisioner.Registry.Entries[0].Kind
	msgs := oneModuleRows(kind, 8)
	require.NoError(t, db.Apply(provisioner.BucketNeeds, msgs, 0, false))
	db.SetSynced(provisioner.BucketNeeds, true)
	s := workerless(StoreReader(db))
	send := func(i int) bool {
		t.Helper()
		r := Request{What: "needs", Module: "m1", Limit: ptr(int64(1))}
		if i > 0 {
			r.After = fmt.Sprintf("n%02d.m1.%s.a", i-1, kind)
		}
		return answerAsRespond(t, s, &r)
	}
	runOne := func() {
		t.Helper()
		require.NotZero(t, len(s.ahead.jobs))
		j := <-s.ahead.jobs
		s.writeAhead(&j)
	}
	run := func() {
		for len(s.ahead.jobs) > 0 {
			runOne()
		}
	}

	send(0)
	runOne() // page 1, and page 2 queued
	require.NoError(t, db.Apply(provisioner.BucketNeeds, []provisioner.Message{{Seq: 9, Time: 9e9, Key: "n00.m2." + kind + ".a", Op: provisioner.OpPut, Value: []byte{0x01}}}, 0, false))
	runOne() // page 2, after the commit
	require.False(t, send(1), "page 1 went stale: the walk is cold")
	run()
	require.True(t, send(2), "page 2 was written after the commit")
	run()
	require.True(t, send(3), "a page of the walk was taken: the walk reads ahead again")
}

// workerless is a Server over r whose read-ahead has no worker: a test runs the jobs queued itself,
// one wide slot beside them.
func workerless(r Reader) *Server {
	s := NewServer(r, Options{})
	s.ahead.inflight = map[aheadKey]chan struct{}{}
	s.ahead.jobs = make(chan aheadJob, aheadQueue)
	s.wideSlots = make(chan struct{}, 1)
	return s
}

// oneModuleRows are n needs of module m1 of kind, one a node (n00, n01, ...), at sequences 1 to n.
func oneModuleRows(kind string, n int) []provisioner.Message {
	var msgs []provisioner.Message
	for i := 0; i < n; i++ {
		msgs = append(msgs, provisioner.Message{Seq: uint64(i + 1), Time: int64(i+1) * 1e9, Key: fmt.Sprintf("n%02d.m1.%s.a", i, kind), Op: provisioner.OpPut, Value: []byte{0x01}})
	}
	return msgs
}

// answerAsRespond answers r as respond does, from a page written ahead when one is the answer (and says
// whether it was), else afresh, then queues the job of the page after it.
func answerAsRespond(t *testing.T, s *Server, r *Request) bool {
	t.Helper()
	e := s.takeAhead(r, FormatMsgpack)
	taken := e != nil
	if e == nil {
		e = &Encoder{}
		require.NoError(t, s.Answer(context.Background(), r, FormatMsgpack, e))
	}
	s.readNextAhead(r, FormatMsgpack, e)
	return taken
}
