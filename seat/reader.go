package seat

import (
	"sync"
	"sync/atomic"

	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/store"
)

// swapReader is the verb's reader over whichever store is current: a rebuild swaps a new one in while
// requests are being answered. A store is closed only once every view opened on it is closed: each view
// holds its store's handle for reading, and a swap takes the old handle for writing before it lets the
// store go. A request opens one view at a time, so a waiting swap cannot deadlock it.
type swapReader struct {
	cur   atomic.Pointer[handle]
	swaps atomic.Uint64
	// beforeAcquire, when set, is called as a view is about to be opened (tests: a swap between a
	// request's min_seq check and its view).
	beforeAcquire atomic.Pointer[func()]
}

type handle struct {
	db      *store.DB
	mu      sync.RWMutex
	retired bool // under mu: a swap replaced this store
}

var _ query.Reader = (*swapReader)(nil)

func newSwapReader(db *store.DB) *swapReader {
	r := &swapReader{}
	r.cur.Store(&handle{db: db})
	return r
}

// acquire returns the current store's handle, held for reading until release.
func (r *swapReader) acquire() *handle {
	if fn := r.beforeAcquire.Load(); fn != nil {
		(*fn)()
	}
	for {
		h := r.cur.Load()
		h.mu.RLock()
		if !h.retired {
			return h
		}
		h.mu.RUnlock()
	}
}

// open is a view of the current store for the forensics and plans answers, and its release: for an
// answer that says synced, what a kill cannot take back (store.DB.AnswerView).
func (r *swapReader) open(synced bool) (*store.View, func(), error) {
	h := r.acquire()
	v, err := h.db.AnswerView(synced)
	if err != nil {
		h.mu.RUnlock()
		return nil, nil, err
	}
	return v, func() { v.Close(); h.mu.RUnlock() }, nil
}

// View opens a view of the current store's rows for the verb's answers of bucket, and says whether
// they are synced (store.DB.AnswerRowsView).
func (r *swapReader) View(bucket string) (query.View, bool, error) {
	h := r.acquire()
	v, synced, err := h.db.AnswerRowsView(bucket)
	if err != nil {
		h.mu.RUnlock()
		return nil, false, err
	}
	return &heldRowsView{RowsView: v, h: h}, synced, nil
}

type heldRowsView struct {
	*store.RowsView
	h *handle
}

func (v *heldRowsView) Close() error {
	v.RowsView.Close()
	v.h.mu.RUnlock()
	return nil
}

type heldView struct {
	*store.View
	release func()
}

func (v *heldView) Close() error {
	v.release()
	return nil
}

// Applied is as the answers see it (store.DB.Answered).
func (r *swapReader) Applied(bucket string) (uint64, bool) { return r.cur.Load().db.Answered(bucket) }

func (r *swapReader) Reach(bucket string) uint64 { return r.cur.Load().db.Reach(bucket) }

// Changed is the current store's channel; a swap closes the old store, which closes its channels, so a
// waiter wakes and asks again of the new one.
func (r *swapReader) Changed(bucket string) <-chan struct{} { return r.cur.Load().db.Changed(bucket) }

// Generation counts the swaps twice, odd while one is under way: an answer written ahead of one store
// is not an answer of the next (query.Generationer).
func (r *swapReader) Generation() uint64 { return r.swaps.Load() }

// Rewrites is the current store's (query.Rewriter); a swap moves the generation, which the read-ahead
// compares too.
func (r *swapReader) Rewrites() uint64 { return r.cur.Load().db.AnswerRewrites() }

// swap makes db current, and returns once no view of the old store is open. Swaps are made one at a
// time (the seat's rebuild).
func (r *swapReader) swap(db *store.DB) {
	r.swaps.Add(1) // odd: the store is being swapped
	old := r.cur.Swap(&handle{db: db})
	r.swaps.Add(1)
	old.mu.Lock()
	old.retired = true
	old.mu.Unlock()
}

// PlansView opens a view of the current store for a plans answer.
func (r *swapReader) PlansView(synced bool) (query.PlansView, error) {
	v, release, err := r.open(synced)
	if err != nil {
		return nil, err
	}
	return &heldView{View: v, release: release}, nil
}

var _ query.PlansReader = (*swapReader)(nil)

var _ query.Rewriter = (*swapReader)(nil)
