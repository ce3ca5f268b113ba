// Package query answers the verb mesh-provisioner.provisioning from the projection, never from the
// buckets. It declares the few reads it needs (Reader, View); the store implements them. Answers are
// written straight into reused buffers: stored MessagePack values pass through into MessagePack answers
// and are transcoded, not decoded, into JSON ones.
package query

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/denied"
	"github.com/novox/mesh-provisioner/internal/mpk"
	"github.com/novox/mesh-provisioner/store"
)

// The verb's names (CONTRACT section 3).
const (
	ServiceName  = "mesh-provisioner"
	EndpointName = "provisioning"
	Subject      = "mesh-provisioner.provisioning"
)

// View is one consistent read of the projection.
type View interface {
	Rows(r provisioner.Range, fn func(*provisioner.Row) bool) error
	HasRow(r provisioner.Range, key string) (bool, error)
	Anomalies(bucket, node string, max int, fn func(provisioner.Anomaly)) (int64, error)
	Checkpoint(bucket string) (store.Checkpoint, error)
	Close() error
}

// Reader is what the verb needs of the projection.
type Reader interface {
	// View opens a view for an answer of bucket, and says whether that answer is synced: the store
	// chooses what a synced answer reads (store.DB.AnswerRowsView: on a first fill's store without a
	// log, the state a kill cannot take back).
	View(bucket string) (View, bool, error)
	// Applied is the bucket's applied sequence and synced flag as its answers see them
	// (store.DB.Answered).
	Applied(bucket string) (seq uint64, synced bool)
	// Reach is the highest min_seq of a bucket a request is answered for now (store.DB.Reach): the
	// applied sequence, or less while what removed messages unread may not be read yet.
	Reach(bucket string) uint64
	Changed(bucket string) <-chan struct{}
}

// StoreReader adapts a store to Reader.
func StoreReader(db *store.DB) Reader { return storeReader{db} }

type storeReader struct{ *store.DB }

func (s storeReader) View(bucket string) (View, bool, error) {
	v, synced, err := s.DB.AnswerRowsView(bucket)
	if err != nil {
		return nil, false, err
	}
	return v, synced, nil
}

func (s storeReader) Applied(bucket string) (uint64, bool) { return s.DB.Answered(bucket) }

// Rewrites is as the answers see it (store.DB.AnswerRewrites): the read-ahead's (Rewriter).
func (s storeReader) Rewrites() uint64 { return s.DB.AnswerRewrites() }

var (
	_ View = (*store.View)(nil)
	_ View = (*store.RowsView)(nil)
)

// AtFunc answers a request with `at` set, from the event log; see package replay.
type AtFunc func(ctx context.Context, req *Request, e *Encoder) error

// Options configure a Server.
type Options struct {
	Version string
	Logger  *slog.Logger
	// At answers forensics requests; nil answers them 501.
	At AtFunc
	// Plans answers what: plans; nil answers it 501.
	Plans AtFunc
	// Metadata is added to the micro service's metadata.
	Metadata map[string]string
	// Observe, when set, is told of every answered request: what, code, duration.
	Observe func(what string, code int, d time.Duration)
	// Workers is how many requests are answered at once; 0 means GOMAXPROCS, at least 2.
	Workers int
	// NoReadAhead turns off writing the next page of a paged answer ahead (readahead.go).
	NoReadAhead bool
	// MaxWaiting is how many requests may wait for their min_seq at once; 0 means DefaultMaxWaiting.
	// The wide requests (wide) may take half of them (at least one), one node's requests an eighth
	// (at least one).
	MaxWaiting int
	// MaxQueued is how many requests may wait for a worker; 0 means DefaultMaxQueued. The wide
	// requests (wide) wait in a queue of their own, of the same bound.
	MaxQueued int
	// Wake, when set, is told of a bucket that a request waits on (min_seq) before it is reached: a
	// parked composed-<node> bucket tails again at once (projector.Projector.Wake).
	Wake func(bucket string)
}

// Bounds of the requests that wait for min_seq (docs/decisions.md, Serving). A waiting request holds
// its decoded fields (not its body), parked on its bucket (waiters.go), until its sequence comes or
// wait_ms passes; past either bound a request that would wait is answered 504 at once.
// The wide requests (wide) may take half of either, so that the rest is always left to node lookups,
// and the lookups of one node (or the registry's) an eighth, so that one node's flood leaves the rest
// to the others.
const (
	DefaultMaxWaiting   = 4096
	maxWaitingBytes     = 32 << 20 // of the waiting requests' fields
	maxWideWaitingBytes = maxWaitingBytes / 2
	maxNodeWaitingBytes = maxWaitingBytes / 8 // of one node's (not wide) requests, the registry's as one
)

// Bounds of the requests queued for the workers (docs/decisions.md, Serving): past either, a request
// is answered 500 at once, "busy", rather than queued behind seconds of answers its asker will have
// stopped waiting for.
const (
	DefaultMaxQueued = 4096
	maxQueuedBytes   = 32 << 20 // of the queued requests' fields
	// maxWideBytes is the wide requests' share of maxQueuedBytes: the rest is always left to the
	// others, so that a flood of wide requests with long fields cannot have every node lookup
	// answered busy while the worker kept for them is free.
	maxWideBytes = maxQueuedBytes / 2
)

// errBusy is the error of a request that found the workers' queue full.
var errBusy = errors.New("busy")

// errOutOfFDs is the error of an answer whose read could not open a file of the state dir for want
// of a file descriptor (store.IsOutOfFDs). Its text starts with OutOfFDsText, by which a client
// tells it from the other 500s: the contract has no code for "ask again" (docs/decisions.md, h130).
var errOutOfFDs = errors.New(OutOfFDsText)

// OutOfFDsText starts the text of an answer 500 that failed because the seat ran out of file
// descriptors: asked again shortly, or of another seat, it may be answered.
const OutOfFDsText = "the seat is out of file descriptors"

// outOfFDs is err, a read that failed for want of a descriptor, as the verb says it.
func outOfFDs(err error) error {
	return fmt.Errorf("%w: it could not open a file of its state dir (%v): ask again shortly, or ask another seat; its operator raises its limit (LimitNOFILE= of the unit)", errOutOfFDs, err)
}

// Server serves the verb.
type Server struct {
	r    Reader
	opts Options
	log  *slog.Logger
	svc  micro.Service
	nc   *nats.Conn // the verb's connection: its max payload bounds an answer
	pool sync.Pool

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup // the watchers of the buckets that requests wait on (waiters.go)

	waitMu       sync.Mutex // guards the waiters, their count and bytes, and waitClosed
	waiters      map[string]*bucketWaiters
	waiting      int
	waitingBytes int
	// Of those, the wide requests': at most half of MaxWaiting, and maxWideWaitingBytes.
	wideWaiting      int
	wideWaitingBytes int
	// And the others', by the node they narrow by: each at most an eighth of MaxWaiting, and
	// maxNodeWaitingBytes.
	byNode     map[string]*nodeWaiting
	waitClosed bool // Stop waits for the waiters: no more start

	jobsMu      sync.RWMutex // held to read by a sender, to write by Stop closing jobs and wide
	jobs        chan job
	jobsClosed  bool
	queuedBytes atomic.Int64 // of the fields of the requests in jobs and wide
	wideBytes   atomic.Int64 // of those in wide alone: at most maxWideBytes
	// wideFreed (on wideMu) is signalled as the workers take wide requests: a wide request that has
	// waited for its min_seq waits on it for room in wideBytes (waitWideBytes).
	wideMu    sync.Mutex
	wideFreed *sync.Cond
	// wideWanted is the bytes those waiting on wideFreed wait for: kept for them, so that a new wide
	// request does not take the room they wait for (as a place goes to a request waiting for it first).
	// They take it in turn (wideTurn, wideNext: the turn being served and the next one given, under
	// wideMu), so that one that came later does not take it either.
	wideWanted atomic.Int64
	wideTurn   uint64
	wideNext   uint64
	workers    sync.WaitGroup
	// The wide requests' lane (wide): queued in wide, handed to the workers by one dispatcher that
	// takes one of wideSlots (max(1, workers-1)) for each, so that they never take every worker; the
	// read-ahead worker takes one for each page of a wide walk it writes.
	wide      chan job
	wideTaken chan job      // unbuffered: the dispatcher to a free worker
	wideSlots chan struct{} // a slot for each wide answer under way
	wideRoom  chan struct{} // a place for each wide request not yet taken by a worker, the dispatcher's in hand too
	// answering, when set (tests), is called as a worker starts answering a request; writingAhead as
	// the read-ahead worker starts writing a page.
	answering    func(r *Request)
	writingAhead func(r *Request)
	ahead        readAhead

	answered [len(answerCodes)]atomic.Int64 // answers by code (Answered)
	outOfFDs atomic.Int64                   // answers 500 for want of a file descriptor (OutOfFDs)
}

// answerCodes are the codes a verb answer can carry (Code), in the order Server.answered counts them.
var answerCodes = [...]int{200, 400, 404, 410, 500, 501, 504}

// NewServer returns a Server reading from r.
func NewServer(r Reader, opts Options) *Server {
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Server{r: r, opts: opts, log: log}
	s.pool.New = func() any { return &Encoder{} }
	s.wideFreed = sync.NewCond(&s.wideMu)
	s.ctx, s.cancel = context.WithCancel(context.Background())
	return s
}

var (
	notBuildMeta = regexp.MustCompile(`[^0-9A-Za-z.-]+`)
	dots         = regexp.MustCompile(`\.{2,}`)
)

// semVer is micro's own check of a service's version.
var semVer = regexp.MustCompile(`^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$`)

// microVersion is a version micro takes (SemVer, which it refuses to start without) for the version the
// binary was built with: as it is when it is SemVer, without a leading v (git describe of a tag,
// v1.4.0-3-gca375a6), else 0.0.0 with the version as build metadata (a bare commit, ca375a6). The
// version as built is in the service's metadata too.
func microVersion(v string) string {
	if semVer.MatchString(v) {
		return v
	}
	if t := strings.TrimPrefix(v, "v"); semVer.MatchString(t) {
		return t
	}
	meta := strings.Trim(notBuildMeta.ReplaceAllString(v, "-"), ".")
	meta = dots.ReplaceAllString(meta, ".")
	if meta == "" {
		return "0.0.0"
	}
	return "0.0.0+" + meta
}

// Start adds the micro service to a connection: service mesh-provisioner, endpoint provisioning on
// subject mesh-provisioner.provisioning, in the default queue group so several seats share the load.
func (s *Server) Start(nc *nats.Conn, stats func() any) error {
	mark := denied.Mark(nc) // the refusals before are not about this subscription
	md := map[string]string{}
	for k, v := range s.opts.Metadata {
		md[k] = v
	}
	if s.opts.Version != "" {
		md["version"] = s.opts.Version // as built, which micro's version may not be able to say
	}
	cfg := micro.Config{
		Name:        ServiceName,
		Version:     microVersion(s.opts.Version),
		Description: "what every module on every node needs, what is applied where, and what each collection holds",
		Metadata:    md,
	}
	if stats != nil {
		cfg.StatsHandler = func(*micro.Endpoint) any { return stats() }
	}
	svc, err := micro.AddService(nc, cfg)
	if err != nil {
		return fmt.Errorf("add micro service: %w", err)
	}
	s.nc = nc
	s.startWorkers()
	if err := svc.AddEndpoint(EndpointName, micro.HandlerFunc(s.handle), micro.WithEndpointSubject(Subject)); err != nil {
		svc.Stop()
		return fmt.Errorf("add endpoint: %w", err)
	}
	s.svc = svc
	// Once Start returns, the server has the subscription, so a client's next request finds the verb
	// rather than "no responders". A connection that is down re-sends it when it reconnects, and is
	// not waited for.
	if !nc.IsConnected() {
		return nil
	}
	if err := nc.FlushTimeout(5 * time.Second); err != nil {
		s.log.Debug("verb subscribed, not yet confirmed by the server", "err", err)
		return nil
	}
	// A user that may not subscribe to the verb is refused the subscription, which nats.go says only
	// to the connection's error callback: the seat said "answering" and ready, and no request ever
	// reached it ("no responders"). It fails to start instead, naming the grant.
	// Any refusal since counts, not only the connection's last error: the seat's other requests (a
	// node's bucket refused as the projector sets it up) may be refused in between.
	if v := denied.SubscriptionSince(nc, mark, Subject, 5*time.Second); v != nil {
		s.Stop()
		return fmt.Errorf("answer %s: %w", Subject, v)
	}
	return nil
}

// Service is the micro service, once started.
func (s *Server) Service() micro.Service { return s.svc }

// Stop stops taking requests, and answers those still waiting (for min_seq) before returning.
func (s *Server) Stop() {
	if s.svc != nil {
		_ = s.svc.Stop()
	}
	s.jobsMu.Lock()
	if s.jobs != nil && !s.jobsClosed {
		// The service takes no more requests: the workers answer what is queued in both lanes,
		// then end.
		s.jobsClosed = true
		close(s.jobs)
		close(s.wide)
	}
	s.jobsMu.Unlock()
	s.ahead.mu.Lock()
	if s.ahead.jobs != nil && !s.ahead.closed {
		s.ahead.closed = true
		close(s.ahead.jobs)
	}
	s.ahead.mu.Unlock()
	s.workers.Wait()
	s.stopReadAhead()
	s.cancel()
	s.waitMu.Lock()
	s.waitClosed = true
	s.waitMu.Unlock()
	s.wg.Wait()
}

func (s *Server) handle(req micro.Request) {
	start := time.Now()
	if req.Reply() == "" {
		// Published, not asked: no answer could reach anyone, so none is written (a full page costs
		// the seat as much as any other), and it holds no place among the waiters.
		return
	}
	r, format, err := DecodeRequest(req.Data())
	if err != nil {
		// A bad request is answered here, on the subscription's goroutine: its answer costs nothing to
		// write, and micro counts an error in its stats (num_errors, last_error) only when the handler
		// reports it before returning. Errors found while answering, by the workers, are not counted
		// there (the Prometheus metrics count every answer by code).
		s.answerError(req, &r, format, err, start, true)
		return
	}
	j := job{req: replyTo{nc: s.nc, subject: req.Reply()}, r: r, format: format, start: start,
		deadline: start.Add(time.Duration(max(r.WaitMS, 0)) * time.Millisecond)}
	if bucket, ok := s.waits(&r); ok {
		// A wait must not hold up the requests behind it: it waits on its bucket (waiters.go), and a
		// worker answers it once its sequence has come. Past the waiters' bound it is answered now.
		parked, err := s.park(j, bucket)
		if err != nil {
			s.answerError(req, &r, format, err, start, true)
		}
		if parked || err != nil {
			return
		}
	}
	// Answers are written by a few workers, so a long answer (a module across the mesh) does not hold
	// up the short ones behind it on the subscription's one goroutine. The job keeps the reply subject,
	// not the message. Past the queue's bounds the request is answered busy, here.
	if err := s.queue(j, false); err != nil {
		s.answerError(req, &r, format, err, start, true)
	}
}

// queue hands a decoded request to the workers, or answers it here once they have stopped (micro
// drains its subscription after Stop: a late request is answered on its goroutine). A wide request
// goes to the wide requests' queue. With its queue full (in requests, or both queues in bytes) it
// returns errBusy (the wide requests may hold only maxWideBytes of the bytes), or when wait is set (a
// request that has waited for its min_seq already) waits for a place.
func (s *Server) queue(j job, wait bool) error {
	s.jobsMu.RLock()
	defer s.jobsMu.RUnlock()
	if s.jobs == nil || s.jobsClosed {
		s.respond(j)
		return nil
	}
	j.size = j.r.size()
	// A page of a wide walk already written ahead, and still the answer, is answered by copying it: not
	// a wide answer, and not held behind the page after it that the read-ahead worker writes meanwhile
	// in the wide slot. Should it go stale before a worker takes it, the worker hands the request on to
	// the wide requests' queue (requeueWide).
	isWide := wide(&j.r)
	if isWide && s.aheadReady(&j.r, j.format) {
		isWide, j.ahead = false, true
	}
	if !wait && (s.queuedBytes.Load()+int64(j.size) > maxQueuedBytes || isWide && !s.wideFits(j.size)) {
		if isWide {
			return s.busy(len(s.wideRoom))
		}
		return s.busy(len(s.jobs))
	}
	if isWide {
		// A place first: the dispatcher may hold one request taken from the channel already.
		if wait {
			s.wideRoom <- struct{}{}
			s.waitWideBytes(j.size)
		} else {
			select {
			case s.wideRoom <- struct{}{}:
			default:
				return s.busy(len(s.wideRoom))
			}
			s.wideBytes.Add(int64(j.size))
		}
		s.queuedBytes.Add(int64(j.size))
		s.wide <- j // never blocks: it has a place
		return nil
	}
	s.queuedBytes.Add(int64(j.size))
	if wait {
		s.jobs <- j
		return nil
	}
	select {
	case s.jobs <- j:
		return nil
	default:
		s.queuedBytes.Add(-int64(j.size))
		return s.busy(len(s.jobs))
	}
}

// waitWideBytes waits until the wide requests' share of the queued bytes has room for n more, or holds
// none (a request alone always fits), and counts them in: a wide request that has waited for its
// min_seq waits for its room in bytes as for its place, rather than taking the bytes left to the
// others. The workers make room as they take wide requests.
// While it waits, the room it waits for is kept for it (wideWanted): new wide requests are answered
// busy rather than take the bytes each answer frees, and those that wait so take the room in the turn
// they came, which would otherwise keep a request with longer fields than the others' waiting for as
// long as they came.
func (s *Server) waitWideBytes(n int) {
	s.wideMu.Lock()
	defer s.wideMu.Unlock()
	fits := func() bool { b := s.wideBytes.Load(); return b == 0 || b+int64(n) <= maxWideBytes }
	if s.wideTurn == s.wideNext && fits() {
		s.wideBytes.Add(int64(n))
		return
	}
	turn := s.wideNext
	s.wideNext++
	s.wideWanted.Add(int64(n))
	for s.wideTurn != turn || !fits() {
		s.wideFreed.Wait()
	}
	s.wideBytes.Add(int64(n)) // before its room is given up, so that no new request takes it between
	s.wideWanted.Add(-int64(n))
	s.wideTurn++
	s.wideFreed.Broadcast() // the next in turn may fit too
}

// wideFits reports whether a wide request of n bytes of fields fits in the wide requests' share of the
// queued bytes, beside those queued and the room kept for the reached requests waiting for it.
func (s *Server) wideFits(n int) bool {
	return s.wideBytes.Load()+s.wideWanted.Load()+int64(n) <= maxWideBytes
}

// requeueWide hands a request queued for a page written ahead (job.ahead), whose page went stale before
// a worker took it (a commit), to the wide requests' queue: its answer is a wide one to write, which
// the worker kept for node lookups must not write. It reports whether it did, or the busy error of a
// full wide queue; any other request, or one while the server stops, is answered where it is. It never
// waits: a worker must not wait for jobsMu, which Stop may be waiting to take while a request that
// waited for its min_seq holds it to wait for a place that only the workers make.
func (s *Server) requeueWide(j job) (bool, error) {
	if !j.ahead || !s.jobsMu.TryRLock() {
		return false, nil
	}
	defer s.jobsMu.RUnlock()
	if s.jobsClosed {
		return false, nil
	}
	j.ahead = false
	if s.queuedBytes.Load()+int64(j.size) > maxQueuedBytes || !s.wideFits(j.size) {
		return false, s.busy(len(s.wideRoom))
	}
	select {
	case s.wideRoom <- struct{}{}:
	default:
		return false, s.busy(len(s.wideRoom))
	}
	s.wideBytes.Add(int64(j.size))
	s.queuedBytes.Add(int64(j.size))
	s.wide <- j // never blocks: it has a place
	return true, nil
}

// busy is the error of a request that finds its queue full, n requests in it.
func (s *Server) busy(n int) error {
	return fmt.Errorf("%w: the seat is busy, %d requests are queued before this one: ask again shortly, or ask another seat", errBusy, n)
}

// Queued is how many requests wait for a worker now, in both queues.
func (s *Server) Queued() int { return len(s.jobs) + len(s.wideRoom) }

// wide reports whether a request is answered in the wide requests' lane, which never takes every
// worker (docs/decisions.md, Serving): forensics (at, plans as of a point included), whose pages are
// read from the event log and whose plans fill a store from the inputs' history, and live answers no
// node narrows (a module, kind, collection or contributor across the mesh, or a whole bucket; every
// node's plans), whose pages are up to a NATS message of rows. A node's answer, and the registry's
// (a few kinds), are the short ones the lane keeps a worker free for.
func wide(r *Request) bool {
	if r.At != "" {
		return true
	}
	switch provisioner.What(r.What) {
	case provisioner.WhatNeeds, provisioner.WhatApplied, provisioner.WhatCollect, provisioner.WhatPlans:
		return r.Node == ""
	}
	return false
}

// waits reports whether a request is to wait for its min_seq before it is answered, and the bucket it
// waits on: it asks for a sequence its bucket has not applied yet, and may wait for it (wait_ms above
// 0, the server not stopping). One that may not wait goes to the workers, which answer it 504 at once.
func (s *Server) waits(r *Request) (string, bool) {
	if r.MinSeq <= 0 || r.At != "" || r.WaitMS <= 0 || s.ctx.Err() != nil {
		return "", false
	}
	b := bucketOf(r)
	return b, b != "" && s.r.Reach(b) < uint64(r.MinSeq)
}

// responder is what answering needs of a request: micro's, or the reply subject a waiter kept.
type responder interface {
	Respond(data []byte, opts ...micro.RespondOpt) error
}

// replyTo answers on a reply subject, as micro's request does.
type replyTo struct {
	nc      *nats.Conn
	subject string
}

func (r replyTo) Respond(data []byte, opts ...micro.RespondOpt) error {
	if r.nc == nil || r.subject == "" {
		return nats.ErrMsgNoReply
	}
	m := &nats.Msg{Subject: r.subject, Data: data}
	for _, o := range opts {
		o(m)
	}
	return r.nc.PublishMsg(m)
}

// job is a decoded request waiting for a worker.
type job struct {
	req    responder
	r      Request
	format Format
	start  time.Time
	// deadline is when its wait_ms ends: until then an answer that finds min_seq not reached waits
	// for it again (waiters.go).
	deadline time.Time
	size     int // of its fields, counted in queuedBytes
	// ahead is set on a wide request queued to the workers' queue for a page written ahead: should
	// the page be stale once a worker takes it, the request goes to the wide requests' queue.
	ahead bool
	// reached is set on a request that waited for its min_seq, which came: it waits for a place in
	// its queue rather than be answered busy, also when its page written ahead goes stale (respond).
	reached bool
}

// startWorkers starts the workers that answer; Stop ends them once the service no longer takes requests.
func (s *Server) startWorkers() {
	n := s.opts.Workers
	if n <= 0 {
		n = max(2, runtime.GOMAXPROCS(0))
	}
	queued := s.opts.MaxQueued
	if queued <= 0 {
		queued = DefaultMaxQueued
	}
	s.jobs = make(chan job, queued)
	// The dispatcher holds one wide request besides those in wide: a place in wideRoom is taken for
	// each until a worker takes it, so the bound counts both, and a request given a place has one in
	// the channel.
	s.wideRoom = make(chan struct{}, queued)
	s.wide = make(chan job, cap(s.wideRoom))
	s.wideTaken = make(chan job)
	s.wideSlots = make(chan struct{}, max(1, n-1))
	s.startReadAhead()
	// The dispatcher of the wide requests: it takes a request, then a slot, then waits for a free
	// worker, so at most max(1, n-1) wide answers are under way and, with two workers or more, one
	// worker is always left to the short answers. It ends once Stop has closed wide and its requests
	// are handed over; the workers end once both lanes are closed and empty.
	s.workers.Add(1)
	go func() {
		defer s.workers.Done()
		defer close(s.wideTaken)
		for j := range s.wide {
			s.wideSlots <- struct{}{}
			s.wideTaken <- j
		}
	}()
	for i := 0; i < n; i++ {
		s.workers.Add(1)
		go func() {
			defer s.workers.Done()
			jobs, wide := s.jobs, s.wideTaken
			for jobs != nil || wide != nil {
				select {
				case j, ok := <-jobs:
					if !ok {
						jobs = nil
						continue
					}
					s.queuedBytes.Add(-int64(j.size))
					s.respond(j)
				case j, ok := <-wide:
					if !ok {
						wide = nil
						continue
					}
					s.queuedBytes.Add(-int64(j.size))
					s.wideBytes.Add(-int64(j.size))
					s.wideMu.Lock()
					s.wideFreed.Broadcast() // room for a wide request that has waited for its min_seq
					s.wideMu.Unlock()
					<-s.wideRoom
					s.respond(j)
					<-s.wideSlots
				}
			}
		}()
	}
}

func appliedSeq(r applied, bucket string) uint64 {
	seq, _ := r.Applied(bucket)
	return seq
}

// respond answers a decoded request, or parks it again when its answer finds min_seq not reached
// (behind a rebuild's swap) while its wait_ms lasts.
func (s *Server) respond(j job) {
	req, r, format, start := j.req, &j.r, j.format, j.start
	if s.answering != nil {
		s.answering(r)
	}
	e := s.pool.Get().(*Encoder)
	defer func() { s.pool.Put(e) }()
	max := maxAnswer(s.nc)
	e.SetMaxBytes(max)
	var err error
	if page := s.takeAhead(r, format); page != nil {
		s.pool.Put(e)
		e = page
	} else if handed, werr := s.requeueWide(j); handed || werr != nil {
		if werr != nil && j.reached {
			// It waited for its min_seq: it waits for a place in the wide requests' queue, in a
			// goroutine of its own, since a worker must not wait for the places the workers make.
			j.ahead = false
			s.wg.Add(1)
			go func() {
				defer s.wg.Done()
				_ = s.queue(j, true)
			}()
			return
		}
		if werr != nil {
			s.answerError(req, r, format, werr, start, false)
		}
		return
	} else {
		err = s.Answer(s.ctx, r, format, e)
		if err == nil && max > 0 && len(e.Bytes()) > max {
			err = tooLarge(len(e.Bytes()), max) // an answer not bounded by limits.go: say so, not time out
		}
	}
	if nr, ok := errNotReached(err); ok {
		if err = s.waitAgain(j, nr); err == nil {
			return
		}
	}
	if err != nil {
		s.answerError(req, r, format, err, start, false)
		return
	}
	s.readNextAhead(r, format, e) // the next page is written while this one travels
	s.count(200)
	if rerr := req.Respond(e.Bytes()); rerr != nil {
		s.log.Debug("respond", "err", rerr)
	}
	s.observe(r, 200, start)
}

// answerError answers err with the micro convention's headers and an {"error": ...} body. In the
// handler (inline) it goes through req.Error, which micro counts in its stats; a worker answers after
// the handler has returned, when micro no longer reads what req.Error records, so it sends the same
// headers with Respond.
func (s *Server) answerError(req responder, r *Request, format Format, err error, start time.Time, inline bool) {
	if store.IsOutOfFDs(err) && !errors.Is(err, errOutOfFDs) {
		err = outOfFDs(err)
	}
	code := Code(err)
	msg := clipText(err.Error())
	switch {
	case errors.Is(err, errOutOfFDs):
		// Logged at the 1st, 2nd, 4th, 8th... of them: a burst says itself without a line per answer.
		if n := s.outOfFDs.Add(1); n&(n-1) == 0 {
			s.log.Warn("answers fail: the seat is out of file descriptors", "answers", n, "err", err)
		}
	case code == 500 && !errors.Is(err, errBusy):
		s.log.Error("answer failed", "what", r.What, "err", err)
	}
	body := ErrorBody(format, msg)
	s.count(code)
	var rerr error
	if m, ok := req.(micro.Request); ok && inline && msg != "" { // micro refuses an empty description
		rerr = m.Error(strconv.Itoa(code), msg, body)
	} else {
		hdr := micro.Headers{micro.ErrorCodeHeader: []string{strconv.Itoa(code)}, micro.ErrorHeader: []string{msg}}
		rerr = req.Respond(body, micro.WithHeaders(hdr))
	}
	if rerr != nil {
		s.log.Debug("respond", "err", rerr)
	}
	s.observe(r, code, start)
}

// count counts an answer by its code before it is sent, so that a client that has its answer finds it
// counted in the stats it asks for next.
func (s *Server) count(code int) {
	for i, c := range answerCodes {
		if c == code {
			s.answered[i].Add(1)
			return
		}
	}
}

// observe tells Options.Observe of an answer sent, with the time it took.
func (s *Server) observe(r *Request, code int, start time.Time) {
	if s.opts.Observe != nil {
		s.opts.Observe(r.What, code, time.Since(start))
	}
}

// Answered returns how many answers the Server has given since it started, by code ("200" for rows,
// then the error codes of Code), each code once answered. micro's own stats count as errors only those
// answered in its handler (requests that cannot be decoded): these count every one, the 404, 410, 504
// and 500 that workers answer after the handler returned too, for `nats micro stats` (the seat's
// stats data) as well as Prometheus.
func (s *Server) Answered() map[string]int64 {
	m := map[string]int64{}
	for i, c := range answerCodes {
		if n := s.answered[i].Load(); n > 0 {
			m[strconv.Itoa(c)] = n
		}
	}
	return m
}

// OutOfFDs is how many answers failed since the Server started because a read could not open a
// file of the state dir for want of a file descriptor: answered 500, their text starting with
// OutOfFDsText.
func (s *Server) OutOfFDs() int64 { return s.outOfFDs.Load() }

// ErrorBody is the body of an error answer: {"error": "..."} in the request's format.
func ErrorBody(format Format, msg string) []byte {
	var b []byte
	if format == FormatMsgpack {
		b = mpk.AppendMapHeader(b, 1)
		b = mpk.AppendString(b, "error")
		return mpk.AppendString(b, msg)
	}
	b = append(b, `{"error":`...)
	b = mpk.AppendJSONString(b, msg)
	return append(b, '}')
}

// Errors that map to verb codes; Code maps every error in one place.
var (
	errNotFound       = errors.New("not found")
	errGone           = errors.New("gone")
	errTimeout        = errors.New("timeout")
	errNotImplemented = errors.New("not implemented")
)

// NotFound, Gone and NotImplemented wrap a message as an error of the code 404, 410 or 501, for the
// forensics and plans answers.
func NotFound(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{errNotFound}, args...)...)
}

func Gone(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{errGone}, args...)...)
}

func NotImplemented(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{errNotImplemented}, args...)...)
}

// BadRequest wraps a message as an error of code 400.
func BadRequest(format string, args ...any) error { return badf(format, args...) }

// Code is the verb's error code for an error.
func Code(err error) int {
	var br *badRequest
	switch {
	case err == nil:
		return 200
	case errors.As(err, &br):
		return 400
	case errors.Is(err, errNotFound):
		return 404
	case errors.Is(err, errGone):
		return 410
	case errors.Is(err, errTimeout):
		return 504
	case errors.Is(err, errNotImplemented):
		return 501
	}
	return 500
}

// bucketOf is the bucket a request's min_seq is a sequence of: the bucket of its what, and for plans
// the node's composed-<node> (plans.go).
func bucketOf(r *Request) string {
	if s, ok := provisioner.ShapeOfWhat(provisioner.What(r.What)); ok {
		return s.Bucket
	}
	if provisioner.What(r.What) == provisioner.WhatPlans && r.Node != "" {
		return provisioner.ComposedPrefix + r.Node
	}
	return ""
}

// applied is what waiting for a sequence needs of the projection.
type applied interface {
	Applied(bucket string) (seq uint64, synced bool)
	Reach(bucket string) uint64
	Changed(bucket string) <-chan struct{}
}
