package query

import (
	"container/heap"
	"errors"
	"fmt"
	"time"
)

// Requests that wait for their min_seq (docs/decisions.md, Serving). A waiter is a decoded request
// (reply subject and fields, not the message) parked on its bucket until the bucket's projection has
// applied its min_seq, or its wait_ms has passed, or the server stops.
//
// The waiters of a bucket are kept in two heaps, by min_seq and by deadline, and watched by one
// goroutine of the bucket's own, which exists while the bucket has waiters. A commit of the bucket
// wakes that goroutine alone: it reads the applied sequence once and takes, from the top of the
// min_seq heap, exactly the waiters the commit answers (each then answered by the workers like any
// other request); those still short of their sequence are not looked at. A commit that answers
// nobody costs one look, whatever the number of waiters (each waiter used to wait in a goroutine of
// its own, and every commit of its bucket woke them all to compare). The deadline heap's top sets
// the watcher's one timer: at it, the waiters whose wait_ms has passed are answered 504.
//
// No wake-up is lost: the watcher takes the bucket's Changed channel before it reads the applied
// sequence, so a commit after that read closes the channel it waits on, and a waiter added after a
// look kicks the watcher into another look. An answer, once taken, is checked against the view it is
// written from (notReached): a rebuild may have swapped in a store that has not applied min_seq yet,
// and the request then waits again for what is left of its wait_ms.

// waiter is a request waiting for its min_seq on a bucket.
type waiter struct {
	j    job
	seq  uint64
	size int  // of its fields, counted in waitingBytes
	wide bool // a wide request (server.go, wide), counted in wideWaiting and wideWaitingBytes too
	// node is the node a request that is not wide narrows by ("" for the registry's), counted in
	// Server.byNode; unset on a wide request.
	node   string
	bySeq  int // its index in its bucket's heaps
	byTime int
}

// bucketWaiters are the requests that wait on one bucket; under Server.waitMu.
type bucketWaiters struct {
	bySeq  seqHeap
	byTime timeHeap
	kick   chan struct{} // capacity 1: a waiter was added, look again
}

type seqHeap []*waiter

func (h seqHeap) Len() int           { return len(h) }
func (h seqHeap) Less(i, j int) bool { return h[i].seq < h[j].seq }
func (h seqHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i]; h[i].bySeq = i; h[j].bySeq = j }
func (h *seqHeap) Push(x any)        { w := x.(*waiter); w.bySeq = len(*h); *h = append(*h, w) }
func (h *seqHeap) Pop() any {
	old := *h
	w := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return w
}

type timeHeap []*waiter

func (h timeHeap) Len() int           { return len(h) }
func (h timeHeap) Less(i, j int) bool { return h[i].j.deadline.Before(h[j].j.deadline) }
func (h timeHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i]; h[i].byTime = i; h[j].byTime = j }
func (h *timeHeap) Push(x any)        { w := x.(*waiter); w.byTime = len(*h); *h = append(*h, w) }
func (h *timeHeap) Pop() any {
	old := *h
	w := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return w
}

// notReached is the error of an answer whose view has not applied the request's min_seq: answered
// 504, or waited for again while the request's wait_ms lasts (Server.respond).
type notReached struct {
	bucket    string
	seq, have uint64
}

func (e *notReached) Error() string {
	return fmt.Sprintf("min_seq %d not reached (applied %d)", e.seq, e.have)
}

func (e *notReached) Unwrap() error { return errTimeout }

// reached returns nil when a bucket's projection, as a view or the reader reads it (have), has applied
// a request's min_seq, else a *notReached.
func reached(r *Request, bucket string, have uint64) error {
	if r.MinSeq <= 0 || have >= uint64(r.MinSeq) {
		return nil
	}
	return &notReached{bucket: bucket, seq: uint64(r.MinSeq), have: have}
}

// timedOut is the 504 of a request whose min_seq did not come in time, or before the server stopped.
// have is the applied sequence: at or past min_seq when the request waited inside an open history
// gap for what removed its messages (store.DB.Reach), which the answer says.
func (s *Server) timedOut(r *Request, have uint64) error {
	why := ""
	if have >= uint64(r.MinSeq) {
		why = ", but messages up to min_seq were removed from the stream before they were read, and what removed them is not read yet"
	}
	if s.ctx.Err() != nil {
		return fmt.Errorf("%w: min_seq %d not reached before the server stopped (applied %d%s)", errTimeout, r.MinSeq, have, why)
	}
	return fmt.Errorf("%w: min_seq %d not reached within %d ms (applied %d%s)", errTimeout, r.MinSeq, r.WaitMS, have, why)
}

// waitAgain parks a request whose answer found its min_seq not reached (nr) while its wait_ms lasts,
// and returns nil; or returns the error to answer it with.
//
// The 504 says the bucket's applied sequence, not nr.have: that is Reach (store.DB.Reach), the gap's
// start less one while an open history gap holds min_seq, and a request with wait_ms 0 was told
// "applied 2" of a bucket at 5, without the gap's reason.
func (s *Server) waitAgain(j job, nr *notReached) error {
	if s.ctx.Err() != nil || !time.Now().Before(j.deadline) {
		return s.timedOut(&j.r, appliedSeq(s.r, nr.bucket))
	}
	parked, err := s.park(j, nr.bucket)
	if err != nil {
		return err
	}
	if !parked {
		return s.timedOut(&j.r, appliedSeq(s.r, nr.bucket))
	}
	return nil
}

// park makes a request wait on its bucket until its min_seq comes. It reports false once Stop has ended
// the waiters, and a 504 past the waiters' bounds.
func (s *Server) park(j job, bucket string) (bool, error) {
	size := j.r.size()
	limit := s.opts.MaxWaiting
	if limit <= 0 {
		limit = DefaultMaxWaiting
	}
	s.waitMu.Lock()
	if s.waitClosed || s.ctx.Err() != nil {
		s.waitMu.Unlock()
		return false, nil
	}
	if s.waiting >= limit || s.waitingBytes+size > maxWaitingBytes {
		n := s.waiting
		s.waitMu.Unlock()
		return false, fmt.Errorf("%w: min_seq %d not reached (applied %d), and %d requests wait for theirs already, as many as this seat holds: ask again", errTimeout, j.r.MinSeq, appliedSeq(s.r, bucket), n)
	}
	// A wide request may take half of the places and of the bytes: the rest is the node lookups'
	// (read-your-writes of the mesh's node clients), which a flood of requests across the mesh waiting
	// for a sequence far ahead must not have answered 504 at once.
	isWide := wide(&j.r)
	if isWide && (s.wideWaiting >= max(1, limit/2) || s.wideWaitingBytes+size > maxWideWaitingBytes) {
		n := s.wideWaiting
		s.waitMu.Unlock()
		return false, fmt.Errorf("%w: min_seq %d not reached (applied %d), and %d requests not narrowed by node wait for theirs already, as many as this seat holds of them: ask again", errTimeout, j.r.MinSeq, appliedSeq(s.r, bucket), n)
	}
	// And one node (or the registry's requests) may take an eighth of them (at least one): a client
	// flooding its node's lookups with min_seq far ahead must not have every other node's answered
	// 504 at once.
	var nw *nodeWaiting
	if !isWide {
		nw = s.byNode[j.r.Node]
		if nw != nil && (nw.n >= max(1, limit/8) || nw.bytes+size > maxNodeWaitingBytes) {
			n := nw.n
			s.waitMu.Unlock()
			return false, fmt.Errorf("%w: min_seq %d not reached (applied %d), and %d requests %s wait for theirs already, as many as this seat holds for one node: ask again", errTimeout, j.r.MinSeq, appliedSeq(s.r, bucket), n, ofNode(j.r.Node))
		}
		if nw == nil {
			if s.byNode == nil {
				s.byNode = map[string]*nodeWaiting{}
			}
			nw = &nodeWaiting{}
			s.byNode[j.r.Node] = nw
		}
		nw.n++
		nw.bytes += size
	}
	s.waiting++
	s.waitingBytes += size
	if isWide {
		s.wideWaiting++
		s.wideWaitingBytes += size
	}
	bw := s.waiters[bucket]
	if bw == nil {
		if s.waiters == nil {
			s.waiters = map[string]*bucketWaiters{}
		}
		bw = &bucketWaiters{kick: make(chan struct{}, 1)}
		s.waiters[bucket] = bw
		s.wg.Add(1)
		go s.watch(bucket, bw)
	}
	w := &waiter{j: j, seq: uint64(j.r.MinSeq), size: size, wide: isWide, node: j.r.Node}
	heap.Push(&bw.bySeq, w)
	heap.Push(&bw.byTime, w)
	select {
	case bw.kick <- struct{}{}:
	default: // a look is due already
	}
	s.waitMu.Unlock()
	if s.opts.Wake != nil {
		s.opts.Wake(bucket)
	}
	return true, nil
}

// watch answers the waiters of a bucket as their sequences come and their wait_ms pass, until the
// bucket has none left or the server stops.
func (s *Server) watch(bucket string, bw *bucketWaiters) {
	defer s.wg.Done()
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	var ready, expired []*waiter
	for {
		// The channel before the sequence: a commit after this read closes it (no lost wake-up).
		changed := s.r.Changed(bucket)
		have := s.r.Reach(bucket) // the applied sequence but inside an open history gap (store.DB.Reach)
		var next time.Time
		var empty bool
		ready, expired, next, empty = s.take(bucket, bw, have, time.Now(), ready[:0], expired[:0])
		for _, w := range expired {
			s.answerError(w.j.req, &w.j.r, w.j.format, s.timedOut(&w.j.r, appliedSeq(s.r, bucket)), w.j.start, false)
			s.unwait(w)
		}
		var full [2][]*waiter // by the queue they wait for: the workers' (0), the wide requests' (1)
		for _, w := range ready {
			w.j.reached = true
			// Reached: a worker answers, as any other request, so that a sequence that many wait for
			// does not set them all writing answers at once. Until it has a place it counts as waiting.
			// Once one finds its queue full, those after it of the same queue wait behind it, in
			// order; those of the other queue do not.
			lane := 0
			if wide(&w.j.r) {
				lane = 1
			}
			if len(full[lane]) == 0 {
				if err := s.queue(w.j, false); !errors.Is(err, errBusy) {
					s.unwait(w)
					continue
				}
			}
			full[lane] = append(full[lane], w)
		}
		for _, ws := range full {
			if len(ws) > 0 {
				// Their queue is full: they wait for a place in a goroutine of their own, so that the
				// watcher goes on answering the bucket's other waiters when their wait_ms passes, and
				// a node lookup never waits for a place among the wide requests.
				s.wg.Add(1)
				go s.queueWhenRoom(ws)
			}
		}
		clear(ready)
		clear(expired)
		if empty {
			return
		}
		timer.Reset(time.Until(next))
		select {
		case <-changed:
		case <-bw.kick:
		case <-timer.C:
		case <-s.ctx.Done():
			for _, w := range s.takeAll(bucket, bw) {
				s.answerError(w.j.req, &w.j.r, w.j.format, s.timedOut(&w.j.r, appliedSeq(s.r, bucket)), w.j.start, false)
				s.unwait(w)
			}
			return
		}
	}
}

// queueWhenRoom hands waiters whose min_seq has come to the workers, waiting for a place in their
// queue, which the workers make as they answer (Stop lets them answer what is queued first).
func (s *Server) queueWhenRoom(ws []*waiter) {
	defer s.wg.Done()
	for _, w := range ws {
		_ = s.queue(w.j, true)
		s.unwait(w)
	}
}

// take removes from a bucket's waiters those whose min_seq the bucket has applied (have), then those
// whose deadline has passed, and returns them with the next deadline; with none left, the bucket's
// waiters are removed (empty), and a request that waits on it later starts another watcher.
func (s *Server) take(bucket string, bw *bucketWaiters, have uint64, now time.Time, ready, expired []*waiter) ([]*waiter, []*waiter, time.Time, bool) {
	s.waitMu.Lock()
	defer s.waitMu.Unlock()
	for len(bw.bySeq) > 0 && bw.bySeq[0].seq <= have {
		w := heap.Pop(&bw.bySeq).(*waiter)
		heap.Remove(&bw.byTime, w.byTime)
		ready = append(ready, w)
	}
	for len(bw.byTime) > 0 && !bw.byTime[0].j.deadline.After(now) {
		w := heap.Pop(&bw.byTime).(*waiter)
		heap.Remove(&bw.bySeq, w.bySeq)
		expired = append(expired, w)
	}
	if len(bw.bySeq) == 0 {
		delete(s.waiters, bucket)
		return ready, expired, time.Time{}, true
	}
	return ready, expired, bw.byTime[0].j.deadline, false
}

// takeAll removes every waiter of a bucket, as the server stops.
func (s *Server) takeAll(bucket string, bw *bucketWaiters) []*waiter {
	s.waitMu.Lock()
	defer s.waitMu.Unlock()
	all := []*waiter(bw.bySeq)
	bw.bySeq, bw.byTime = nil, nil
	delete(s.waiters, bucket)
	return all
}

// unwait counts a waiter out once it has been answered or handed to the workers.
func (s *Server) unwait(w *waiter) {
	s.waitMu.Lock()
	s.waiting--
	s.waitingBytes -= w.size
	if w.wide {
		s.wideWaiting--
		s.wideWaitingBytes -= w.size
	} else if nw := s.byNode[w.node]; nw != nil {
		nw.n--
		nw.bytes -= w.size
		if nw.n == 0 {
			delete(s.byNode, w.node)
		}
	}
	s.waitMu.Unlock()
}

// nodeWaiting is how many requests of one node (not wide) wait for their min_seq, and their bytes.
type nodeWaiting struct {
	n, bytes int
}

// ofNode names the requests of a node in an answer: those of the registry when it is "".
func ofNode(node string) string {
	if node == "" {
		return "for the registry"
	}
	return fmt.Sprintf("for node %q", node)
}

// Waiting is how many requests wait for their min_seq now.
func (s *Server) Waiting() int {
	s.waitMu.Lock()
	defer s.waitMu.Unlock()
	return s.waiting
}

// errNotReached reports whether err is an answer's min_seq not reached, and which.
func errNotReached(err error) (*notReached, bool) {
	var nr *notReached
	return nr, errors.As(err, &nr)
}
