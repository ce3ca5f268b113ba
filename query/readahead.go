package query

import (
	"slices"
	"sync"
	"sync/atomic"
	"time"

	provisioner "github.com/novox/mesh-provisioner"
)

// Read-ahead. A wide lookup (a module across the mesh: 20,000 rows, several pages of one NATS message
// each) is a walk: the asker reads a page, then asks again with its next as after. While a page
// travels and the asker reads it, a worker of its own writes the next page, and the asker's next
// request is answered with it, when nothing that answer reads has changed meanwhile:
//
//   - the applied sequence and synced flag of the page's bucket, and for needs the registry's applied
//     sequence (the registry raises and clears the needs' unanswered-kind anomalies), are what they
//     were before the page's view was opened, and the reader's generation is the same (a rebuild swaps
//     in a new store), and so are its rewrites (Rewriter: an expired put applied as the stream now has
//     it). Everything an answer holds is written by a commit that moves one of them. The
//     view was opened after they were read, so it saw that state or a later one, and a later one would
//     have moved them: the page is the answer the request would be given now, byte for byte, with the
//     as_of and synced it would have;
//   - min_seq, when the request has it, is reached already (the page would not have waited).
//
// Otherwise the page is dropped and the request answered as any other. A request that arrives while
// its page is still being written waits for it rather than writing it twice. Pages are written up to
// aheadDepth ahead of the last one sent; at most aheadPages are kept, each at most aheadTTL; `at` and
// plans answers are not read ahead.
//
// A walk whose page went stale before its asker came (a commit to its bucket meanwhile, the normal
// case for needs on a mesh whose nodes write continuously) is cold: none of its pages is written
// ahead, since each would most likely be dropped too, a wide answer's writing for nothing on the cores
// node lookups need. For each of its pages sent the state a page written ahead would have been kept
// with is noted instead (a ghost: no writing), and the walk is read ahead again from the first of its
// requests that such a page would have answered: nothing it reads changed while its asker read the
// page before (or, that ghost gone, since the walk's last page was sent). It is then read one page
// ahead (probing) until a page written ahead is taken, and aheadDepth after. A walk is the request's
// fields but after, so askers of the same pages share it.
const (
	aheadPages = 4
	aheadTTL   = 2 * time.Second
	aheadQueue = 4
	aheadDepth = 2 // pages written ahead of the last one sent
)

// aheadKey is what names an answer's page: every field of the request that the answer depends on.
type aheadKey struct {
	what, node, module, contributor, collection, kind, after string
	limit                                                    int64
	format                                                   Format
}

func keyOf(r *Request, f Format) aheadKey {
	return aheadKey{what: r.What, node: r.Node, module: r.Module, contributor: r.Contributor, collection: r.Collection,
		kind: r.Kind, after: r.After, limit: int64(r.limit()), format: f}
}

// aheadState is what an answer of a bucket reads, as far as any commit changes it.
type aheadState struct {
	seq, registry uint64
	synced        bool
	gen           uint64
	rewrites      uint64
}

// Rewriter is a Reader whose store can change its answers without moving an applied sequence: an
// expired put applied as the stream now has it (store.DB.Expire). Rewrites counts those changes, and
// moves once each has committed.
type Rewriter interface {
	Rewrites() uint64
}

// Generationer is a Reader whose store can be swapped for another (a rebuild): Generation is raised
// by one before the new store is made current and by one after, so it is odd while a swap is under
// way.
type Generationer interface {
	Generation() uint64
}

// generation is the reader's Generation, 0 for a reader whose store is never swapped.
func (s *Server) generation() uint64 {
	if g, ok := s.r.(Generationer); ok {
		return g.Generation()
	}
	return 0
}

// aheadState is the state an answer of bucket reads now. The generation is read first, and again
// after: a page whose state was read while a swap was under way (odd, or moved meanwhile) is never
// fresh, nor is a state read then. Otherwise a page written ahead from the old store as a swap began
// (the view opened just before the new store was made current) could be answered, after the
// swap, as the new store's answer, when the new store had reached the same sequence (as a rebuild's
// swap waits for it to).
func (s *Server) aheadState(bucket string) aheadState {
	var st aheadState
	st.gen = s.generation()
	if rw, ok := s.r.(Rewriter); ok {
		st.rewrites = rw.Rewrites()
	}
	st.seq, st.synced = s.r.Applied(bucket)
	if bucket == provisioner.BucketNeeds {
		st.registry, _ = s.r.Applied(provisioner.BucketRegistry)
	}
	if st.gen%2 == 1 || s.generation() != st.gen {
		st.gen = swapping
	}
	return st
}

// swapping is the generation of a state read while a swap was under way: no state is equal to it.
const swapping = ^uint64(0)

type aheadPage struct {
	key   aheadKey
	state aheadState
	e     *Encoder
	made  time.Time
	// depth is how many pages ahead of the last one its asker was sent the page was written, or asked
	// for since (continueAhead): a page nearer its asker is not dropped for one farther (victim).
	depth int
}

type aheadJob struct {
	r      Request
	format Format
	depth  int    // pages ahead of the one the asker was last sent
	asks   uint64 // readAhead.asks when it was queued
}

// aheadAsked is how many of the last requests for pages written ahead are remembered: a job queued
// before one of them asked for its page has no page to write (readAhead.askedSince).
const aheadAsked = 16

type askedKey struct {
	key aheadKey
	n   uint64
}

// readAhead holds the pages written ahead, and those being written.
type readAhead struct {
	mu       sync.Mutex
	pages    []aheadPage
	inflight map[aheadKey]chan struct{}
	jobs     chan aheadJob // closed by Stop, under mu
	closed   bool          // jobs is closed; under mu
	done     sync.WaitGroup
	// asks counts the requests for a page written ahead (takeAhead), answered from it or afresh;
	// asked holds the last aheadAsked of them, the nth at n % aheadAsked. Under mu.
	asks  uint64
	asked [aheadAsked]askedKey
	// cold holds the walks whose page written ahead went stale before it was asked for, the last
	// aheadCold of them, oldest first, each with its latest ghost; ghosts the last aheadGhosts ghosts
	// of their pages, the nth at nghost % aheadGhosts. Under mu.
	cold   []coldWalk
	ghosts [aheadGhosts]aheadGhost
	nghost uint64
	// probing holds the walks (walkOf) warmed since (warm), read ahead one page only until one is
	// taken. Under mu.
	probing []aheadKey
	// How many pages were written ahead, and how many of them answered a request: what the tests
	// (and a throwaway build measuring the read-ahead) read.
	written, taken atomic.Int64
}

// aheadCold is how many cold walks are remembered, aheadGhosts how many of their pages' ghosts: a walk
// forgotten is read ahead again (a page or two written for nothing, and it is cold once more).
const (
	aheadCold   = 16
	aheadGhosts = 16
)

// aheadGhost is a page of a cold walk that was not written ahead: the state it would have been kept with.
type aheadGhost struct {
	key   aheadKey
	state aheadState
	made  time.Time
}

// coldWalk is a cold walk (walkOf) and its latest ghost (made zero when none was noted since it went
// cold), whichever page of the walk it was. A request of the walk whose page's own ghost is gone from
// ghosts (more pages of cold walks sent meanwhile than it holds: many askers) is judged by it: when it
// is still current nothing the walk reads changed since the walk's last page was sent. Before, such a
// request found no ghost and the walk stayed cold: with 17 askers at different pages of a walk, each
// asker's ghost was overwritten before it came back, for ever, on a quiet bucket. The page's own ghost
// is preferred: another asker's latest ghost may be current where this asker's page would have gone
// stale (with the walk's latest alone, the walks under writes wrote about a tenth more pages).
type coldWalk struct {
	walk  aheadKey
	ghost aheadGhost
}

// walkOf is the walk a page belongs to: its key without after.
func walkOf(key aheadKey) aheadKey {
	key.after = ""
	return key
}

// coldOf is the index of a walk in cold, or -1; under mu.
func (a *readAhead) coldOf(walk aheadKey) int {
	return slices.IndexFunc(a.cold, func(c coldWalk) bool { return c.walk == walk })
}

// setCold makes a walk cold; under mu.
func (a *readAhead) setCold(walk aheadKey) {
	a.probing = remove(a.probing, walk)
	if a.coldOf(walk) >= 0 {
		return
	}
	if len(a.cold) >= aheadCold {
		a.cold = slices.Delete(a.cold, 0, 1)
	}
	a.cold = append(a.cold, coldWalk{walk: walk})
}

// warm makes a cold walk read ahead again, one page ahead until one is taken; under mu.
func (a *readAhead) warm(walk aheadKey) {
	if i := a.coldOf(walk); i >= 0 {
		a.cold = slices.Delete(a.cold, i, i+1)
	}
	a.probing = add(a.probing, walk)
}

// add adds a walk to a list of at most aheadCold, dropping the oldest (probing).
func add(walks []aheadKey, walk aheadKey) []aheadKey {
	if slices.Contains(walks, walk) {
		return walks
	}
	if len(walks) >= aheadCold {
		walks = slices.Delete(walks, 0, 1)
	}
	return append(walks, walk)
}

func remove(walks []aheadKey, walk aheadKey) []aheadKey {
	if i := slices.Index(walks, walk); i >= 0 {
		return slices.Delete(walks, i, i+1)
	}
	return walks
}

// readsAhead reports whether the next page of a request is written ahead.
func readsAhead(r *Request) bool {
	if r.At != "" {
		return false
	}
	_, ok := provisioner.ShapeOfWhat(provisioner.What(r.What))
	return ok
}

// startReadAhead starts the worker that writes pages ahead; Stop ends it.
func (s *Server) startReadAhead() {
	a := &s.ahead
	a.inflight = map[aheadKey]chan struct{}{}
	a.jobs = make(chan aheadJob, aheadQueue)
	a.done.Add(1)
	go func() {
		defer a.done.Done()
		// Pages nobody asked for (a walk abandoned, its asker gone) are dropped once they are older
		// than aheadTTL, also when no other page is written after them.
		expire := time.NewTimer(aheadTTL)
		defer expire.Stop()
		for {
			select {
			case j, ok := <-a.jobs:
				if !ok {
					return
				}
				s.writeAhead(&j)
			case <-expire.C:
				a.mu.Lock()
				a.dropStale(s, time.Now())
				a.mu.Unlock()
			}
			expire.Reset(a.untilExpiry())
		}
	}()
}

// untilExpiry is how long until the oldest page kept is older than aheadTTL (aheadTTL when none is).
func (a *readAhead) untilExpiry() time.Duration {
	a.mu.Lock()
	defer a.mu.Unlock()
	d := aheadTTL
	for _, p := range a.pages {
		d = min(d, time.Until(p.made.Add(aheadTTL)))
	}
	return max(d, time.Millisecond)
}

// Ahead is how many pages written ahead are kept now.
func (s *Server) Ahead() int {
	s.ahead.mu.Lock()
	defer s.ahead.mu.Unlock()
	return len(s.ahead.pages)
}

// readNextAhead asks for the page after e's answer to r to be written ahead, when it has one and a worker is
// free for it.
func (s *Server) readNextAhead(r *Request, format Format, e *Encoder) {
	if s.opts.NoReadAhead || e.next == "" || !readsAhead(r) {
		return
	}
	s.queueAhead(aheadJob{r: *r, format: format, depth: 1}, e.next)
}

// queueAhead queues the page after next of a request, when a worker is free for it and its walk is
// not cold; for a cold walk's next page it notes the page's ghost instead.
func (s *Server) queueAhead(j aheadJob, next string) {
	j.r.After = next
	var st aheadState
	if j.depth == 1 {
		// As the worker would read it before writing the page: read before the lock, as there.
		shape, _ := provisioner.ShapeOfWhat(provisioner.What(j.r.What))
		st = s.aheadState(shape.Bucket)
	}
	// Under the pages' lock, not the workers' queue's: a worker must never wait for that one, which Stop
	// waits to take while a request that waited for its min_seq waits for a place in a full queue that
	// only the workers free.
	a := &s.ahead
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.jobs == nil || a.closed {
		return
	}
	key := keyOf(&j.r, j.format)
	if i := a.coldOf(walkOf(key)); i >= 0 {
		if j.depth == 1 {
			g := aheadGhost{key: key, state: st, made: time.Now()}
			a.cold[i].ghost = g
			a.nghost++
			a.ghosts[a.nghost%aheadGhosts] = g
		}
		return
	}
	if j.depth > 1 && slices.Contains(a.probing, walkOf(key)) {
		return
	}
	j.asks = a.asks
	select {
	case a.jobs <- j:
	default: // the worker is behind: this walk's next page is written when asked for
	}
}

func (s *Server) writeAhead(j *aheadJob) {
	if s.continueAhead(j) {
		return
	}
	a := &s.ahead
	a.mu.Lock()
	room := a.room(s, j.depth) && !a.askedSince(keyOf(&j.r, j.format), j.asks)
	a.mu.Unlock()
	if !room {
		return // before it waits for a wide slot, holding up the jobs behind it, for a page it drops
	}
	if wide(&j.r) {
		// A page of a walk across the mesh is a wide answer: it takes one of their slots, so that the
		// page written ahead and the wide answers of the workers never take every core from the
		// short answers (server.go, wide). The slot is taken before the page is marked in flight: a
		// worker that waits for a page in flight never holds the slot the page waits for.
		select {
		case s.wideSlots <- struct{}{}:
		case <-s.ctx.Done():
			return
		}
		defer func() { <-s.wideSlots }()
	}
	if s.writingAhead != nil {
		s.writingAhead(&j.r)
	}
	key := keyOf(&j.r, j.format)
	a.mu.Lock()
	if _, ok := a.inflight[key]; ok || a.find(key) >= 0 {
		a.mu.Unlock()
		s.continueAhead(j) // written meanwhile: go on from it
		return
	}
	if !a.room(s, j.depth) || a.askedSince(key, j.asks) { // again: the slot may have taken a while
		a.mu.Unlock()
		return
	}
	ch := make(chan struct{})
	a.inflight[key] = ch
	a.mu.Unlock()

	shape, _ := provisioner.ShapeOfWhat(provisioner.What(j.r.What))
	st := s.aheadState(shape.Bucket) // before the view opens: see the package comment above
	e := s.pool.Get().(*Encoder)
	max := maxAnswer(s.nc)
	e.SetMaxBytes(max)
	r := j.r
	r.MinSeq, r.WaitMS = 0, 0 // the page is kept only for a state that has reached min_seq
	err := s.Answer(s.ctx, &r, j.format, e)
	a.written.Add(1)
	keep := err == nil && (max == 0 || len(e.Bytes()) <= max)
	// Read before the page is published: from then on a request may take e, answer with it and put
	// it back in the pool for another answer.
	next := e.next

	a.mu.Lock()
	delete(a.inflight, key)
	close(ch)
	if keep {
		a.dropStale(s, time.Now())
		if len(a.pages) >= aheadPages {
			if v := a.victim(j.depth); v >= 0 {
				s.pool.Put(a.pages[v].e)
				a.pages = slices.Delete(a.pages, v, v+1)
			} else {
				keep = false // the pages kept were asked for nearer their askers meanwhile
			}
		}
	}
	if keep {
		a.pages = append(a.pages, aheadPage{key: key, state: st, e: e, made: time.Now(), depth: j.depth})
	}
	a.mu.Unlock()
	if !keep {
		s.pool.Put(e)
		return
	}
	if j.depth < aheadDepth && next != "" {
		// The asker is still reading an earlier page: go on with the one after.
		s.queueAhead(aheadJob{r: j.r, format: j.format, depth: j.depth + 1}, next)
	}
}

// continueAhead reports whether the page a job asks for is written ahead already; if so, and the job is
// nearer the asker than aheadDepth, it queues the page after that one. A page is asked for again, one
// nearer, each time the asker takes the page before it: without going on from it, the page after it
// was written only once the asker had taken it, and the asker waited for it (a third of a module walk
// of 5 pages went so; docs/performance.md, "Session 12").
func (s *Server) continueAhead(j *aheadJob) bool {
	a := &s.ahead
	key := keyOf(&j.r, j.format)
	a.mu.Lock()
	i := a.find(key)
	var p aheadPage
	var next string
	if i >= 0 {
		a.pages[i].depth = min(a.pages[i].depth, j.depth) // its asker came a page nearer
		p = a.pages[i]
		next = p.e.next // the encoder is not taken while the page is kept
	}
	a.mu.Unlock()
	if i < 0 {
		return false
	}
	// Not from a page gone stale (a commit since): its asker is answered afresh, and the page after it
	// is asked for from that answer's next.
	if j.depth < aheadDepth && next != "" && s.fresh(&p, &j.r) {
		s.queueAhead(aheadJob{r: j.r, format: j.format, depth: j.depth + 1}, next)
	}
	return true
}

// find is the index of key's page, or -1; under mu.
func (a *readAhead) find(key aheadKey) int {
	for i := range a.pages {
		if a.pages[i].key == key {
			return i
		}
	}
	return -1
}

// room reports whether a page depth pages ahead of its asker is to be written: the server is not
// stopping (nobody would take it), and fewer than aheadPages are kept or one farther ahead of its asker
// gives way (victim); otherwise it would drop a page about to be taken, and be dropped in turn, and its
// asker is answered as without read-ahead. Under mu.
func (a *readAhead) room(s *Server, depth int) bool {
	if a.closed {
		return false
	}
	a.dropStale(s, time.Now())
	return len(a.pages) < aheadPages || a.victim(depth) >= 0
}

// askedSince reports whether a request for key's page was answered since asks: a job queued before has
// no page to write, its asker has it already. Otherwise, when the asker's request came before the
// worker had begun its page (the worker waiting for the wide slot, which the request took first), the
// worker wrote it after all, for nobody, and again for each page after it that went so; and a job
// queued twice for a page (by the worker going on two ahead, and by the asker taking the page before)
// wrote it again after its asker had taken it, a page kept for nobody. Under mu.
func (a *readAhead) askedSince(key aheadKey, asks uint64) bool {
	for _, k := range a.asked {
		if k.n > asks && k.key == key {
			return true
		}
	}
	return false
}

// victim is the page to drop for one written depth pages ahead of its asker, when aheadPages are kept:
// the oldest of those farthest ahead of their askers, when farther than depth, else the oldest when it
// has been kept aheadIdle; -1 when none is. Under
// mu. Before, the oldest page was dropped, most often the next one of a walk about to take it: with
// more walks than pages kept, most pages written ahead were dropped so, and their writing wasted
// (docs/decisions.md, "The next page is written ahead").
// A page kept untaken for aheadIdle most likely belongs to a walk its asker left: it gives way to any
// page, so that walks left do not hold the read-ahead of the others for aheadTTL.
var aheadIdle = aheadTTL / 4

func (a *readAhead) victim(depth int) int {
	v := -1
	for i := range a.pages {
		if d := a.pages[i].depth; d > depth && (v < 0 || d > a.pages[v].depth) {
			v = i
		}
	}
	if v < 0 && len(a.pages) > 0 && time.Since(a.pages[0].made) > aheadIdle {
		v = 0 // the oldest: pages are kept in the order they were written
	}
	return v
}

// dropStale drops the pages older than aheadTTL; under mu.
func (a *readAhead) dropStale(s *Server, now time.Time) {
	kept := a.pages[:0]
	for _, p := range a.pages {
		if now.Sub(p.made) > aheadTTL {
			s.pool.Put(p.e)
			continue
		}
		kept = append(kept, p)
	}
	clear(a.pages[len(kept):])
	a.pages = kept
}

// aheadReady reports whether the page a request asks for is written ahead already (not one still being
// written), and is the answer it would be given now, as takeAhead checks it: answering it is a copy
// (queue). A stale page is a page to write again, a wide answer for a walk across the mesh.
func (s *Server) aheadReady(r *Request, format Format) bool {
	if s.opts.NoReadAhead || r.After == "" || !readsAhead(r) {
		return false
	}
	a := &s.ahead
	a.mu.Lock()
	i := a.find(keyOf(r, format))
	var p aheadPage
	if i >= 0 {
		p = a.pages[i]
	}
	a.mu.Unlock()
	return i >= 0 && s.fresh(&p, r)
}

// fresh reports whether a page written ahead is the answer a request would be given now: not older
// than aheadTTL, nothing it reads changed since, and min_seq reached. Reached as Answer has it, by
// the bucket's Reach: a min_seq inside an open history gap is not, though the applied sequence is past
// it (store.DB.Reach); such a request waits, or is answered 504 when it may not. Reach is read before
// the state: reached then, and the state the page's still, it was reached at the page's state (a
// commit since would have moved it). Read after, a commit landing between the two (what removed the
// gap's messages, read to the stream's end) gave a Reach the page's state never had, and the page, a
// state lacking the gap's write, answered min_seq.
func (s *Server) fresh(p *aheadPage, r *Request) bool {
	shape, _ := provisioner.ShapeOfWhat(provisioner.What(r.What))
	reached := r.MinSeq <= 0 || s.r.Reach(shape.Bucket) >= uint64(r.MinSeq)
	now := s.aheadState(shape.Bucket)
	return reached && time.Since(p.made) <= aheadTTL && now.gen != swapping && now == p.state
}

// takeGhost removes and returns the latest ghost of key's page, if any, else the latest ghost of its
// walk when the walk is cold; under mu.
func (a *readAhead) takeGhost(key aheadKey) (aheadGhost, bool) {
	k := -1
	for i := range a.ghosts {
		if g := &a.ghosts[i]; g.key == key && !g.made.IsZero() && (k < 0 || g.made.After(a.ghosts[k].made)) {
			k = i
		}
	}
	if k >= 0 {
		g := a.ghosts[k]
		a.ghosts[k] = aheadGhost{}
		return g, true
	}
	if i := a.coldOf(walkOf(key)); i >= 0 && !a.cold[i].ghost.made.IsZero() {
		return a.cold[i].ghost, true
	}
	return aheadGhost{}, false
}

// ghostFresh reports whether a page written ahead in place of a ghost would be the answer to r now.
func (s *Server) ghostFresh(g *aheadGhost, r *Request) bool {
	return s.fresh(&aheadPage{state: g.state, made: g.made}, r)
}

// takeAhead returns the page written ahead for a request, when it is the answer the request would be
// given now; the caller puts the encoder back in the pool. A page still being written is waited for.
func (s *Server) takeAhead(r *Request, format Format) *Encoder {
	if s.opts.NoReadAhead || r.After == "" || !readsAhead(r) {
		return nil
	}
	a := &s.ahead
	key := keyOf(r, format)
	a.mu.Lock()
	if ch, ok := a.inflight[key]; ok {
		a.mu.Unlock()
		select {
		case <-ch:
		case <-s.ctx.Done():
			return nil
		}
		a.mu.Lock()
	}
	i := a.find(key)
	if i < 0 {
		a.ask(key)
		g, ok := a.takeGhost(key)
		a.mu.Unlock()
		if ok && s.ghostFresh(&g, r) {
			// A page written ahead would have answered: the walk is read ahead again from this page.
			a.mu.Lock()
			a.warm(walkOf(key))
			a.mu.Unlock()
		}
		return nil
	}
	p := a.pages[i]
	a.pages = slices.Delete(a.pages, i, i+1)
	a.ask(key)
	a.mu.Unlock()
	fresh := s.fresh(&p, r)
	a.mu.Lock()
	if fresh {
		// Taken: the walk is read aheadDepth ahead, also when it was cold (the page written before it
		// went cold, or after the commit that made it so); before, it stayed cold, and its next page
		// was answered afresh.
		a.probing = remove(a.probing, walkOf(key))
		if i := a.coldOf(walkOf(key)); i >= 0 {
			a.cold = slices.Delete(a.cold, i, i+1)
		}
	} else {
		a.setCold(walkOf(key))
	}
	a.mu.Unlock()
	if !fresh {
		s.pool.Put(p.e)
		return nil
	}
	a.taken.Add(1)
	return p.e
}

// ask records a request for key's page, answered from it or afresh (askedSince); under mu.
func (a *readAhead) ask(key aheadKey) {
	a.asks++
	a.asked[a.asks%aheadAsked] = askedKey{key: key, n: a.asks}
}

// stopReadAhead ends the worker (its jobs channel closed already) and drops the pages.
func (s *Server) stopReadAhead() {
	a := &s.ahead
	if a.jobs == nil {
		return
	}
	a.done.Wait()
	a.mu.Lock()
	for _, p := range a.pages {
		s.pool.Put(p.e)
	}
	a.pages = nil
	a.mu.Unlock()
}
