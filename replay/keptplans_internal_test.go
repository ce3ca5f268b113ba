package replay

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/store"
)

// A seat answers plans at a point from a temporary store filled with the plans' inputs up to it, and
// filled a new one for every page. These tests read a Handler over a live store (real Pebble), as the
// seat wires it, with the temporary stores made under a TMPDIR of the test's own, so that they can be
// counted.

// plansTmp points the temporary stores of plans at a directory of the test's own, and returns it.
func plansTmp(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	t.Setenv("TMPDIR", dir)
	return dir
}

// onePlanInputs is a store of one node's plans inputs (plansMesh 1, 1, 2) whose temporary stores of
// plans go under tmp (plansTmp), a view of it closed when the test ends, and its inputs as of 100 s.
func onePlanInputs(t *testing.T) (tmp string, v *store.View, inputs []planInput) {
	t.Helper()
	tmp = plansTmp(t)
	db := openTestStore(t)
	plansMesh(t, db, 1, 1, 2)
	v, err := db.View()
	require.NoError(t, err)
	t.Cleanup(func() { v.Close() })
	inputs, err = resolvePlanInputs(v, "", Point{Time: time.Unix(100, 0)})
	require.NoError(t, err)
	return tmp, v, inputs
}

// plansDirs lists the temporary stores of plans under tmp.
func plansDirs(t *testing.T, tmp string) []string {
	t.Helper()
	ms, err := filepath.Glob(filepath.Join(tmp, "mesh-provisioner-plans-at-*"))
	require.NoError(t, err)
	return ms
}

func mpOf(t *testing.T, v any) []byte {
	t.Helper()
	b, err := msgpack.Marshal(v)
	require.NoError(t, err)
	return b
}

// plansMesh applies to db nodes of modules each wanting build want, every build published in its
// node's composed-<node> bucket; message i of a bucket is stamped at i seconds.
func plansMesh(t *testing.T, db *store.DB, nodes, modules, want int) {
	t.Helper()
	var hm []provisioner.Message
	for n := 0; n < nodes; n++ {
		node := fmt.Sprintf("n%02d", n)
		var comp []provisioner.Message
		for m := 0; m < modules; m++ {
			hm = append(hm, provisioner.Message{Seq: uint64(len(hm) + 1), Time: int64(len(hm)+1) * 1e9, Key: fmt.Sprintf("%s.m%02d", node, m), Op: provisioner.OpPut, Value: mpOf(t, map[string]any{"want": want})})
			comp = append(comp, provisioner.Message{Seq: uint64(len(comp) + 1), Time: int64(len(comp)+1) * 1e9, Key: fmt.Sprintf("m%02d.%d", m, want), Op: provisioner.OpPut,
				Value: mpOf(t, map[string]any{"status": "published", "plan": fmt.Sprintf("%s m%02d %d", node, m, want)})})
		}
		require.NoError(t, db.Apply(provisioner.ComposedPrefix+node, comp, 1, false))
	}
	require.NoError(t, db.Apply(provisioner.BucketHostModules, hm, 1, false))
}

// openerOf opens views of *cur, the store a seat currently reads.
func openerOf(cur **store.DB) Opener {
	return func(bool) (*store.View, func(), error) {
		v, err := (*cur).View()
		if err != nil {
			return nil, nil, err
		}
		return v, func() { v.Close() }, nil
	}
}

func openTestStore(t *testing.T) *store.DB {
	t.Helper()
	db, err := store.Open(t.TempDir(), store.Options{CacheSize: 8 << 20, MemTableSize: 8 << 20, MinFreeBytes: -1})
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	return db
}

type plansPage struct {
	Rows []struct {
		Key     string
		Current struct{ Build int }
	}
	AsOf map[string]uint64 `json:"as_of"`
	Next string
}

// askHandler asks h one page of plans, and decodes it.
func askHandler(t *testing.T, h *Handler, req query.Request) (plansPage, []byte) {
	t.Helper()
	var e query.Encoder
	e.Reset(query.FormatJSON)
	require.NoError(t, h.Answer(context.Background(), &req, &e))
	var p plansPage
	require.NoError(t, json.Unmarshal(e.Bytes(), &p), "%s", e.Bytes())
	return p, append([]byte(nil), e.Bytes()...)
}

// freshAnswer is the answer of a store filled for this request alone.
func freshAnswer(t *testing.T, db *store.DB, req query.Request) []byte {
	t.Helper()
	v, err := db.View()
	require.NoError(t, err)
	defer v.Close()
	var e query.Encoder
	e.Reset(query.FormatJSON)
	require.NoError(t, Answer(v, &req, &e, true))
	return append([]byte(nil), e.Bytes()...)
}

func fills(h *Handler) int {
	h.plans.mu.Lock()
	defer h.plans.mu.Unlock()
	return h.plans.fills
}

// TestHandler_PlansPagesFillOnce: every page of a plans walk at a point filled a new temporary store
// from every plans' input up to it. The pages after the first now read the store the first filled:
// one store, the same one, is there after every page, and each page is what a store filled for it
// answers.
func TestHandler_PlansPagesFillOnce(t *testing.T) {
	tmp := plansTmp(t)
	db := openTestStore(t)
	plansMesh(t, db, 6, 4, 2)
	h := NewHandler(openerOf(&db), func(string) bool { return true })
	defer h.Close()

	limit := int64(5)
	req := query.Request{What: "plans", At: "2100-01-01T00:00:00Z", Limit: &limit}
	var kept string
	rows := 0
	for page := 0; ; page++ {
		p, got := askHandler(t, h, req)
		require.JSONEq(t, string(freshAnswer(t, db, req)), string(got), "page %d", page)
		dirs := plansDirs(t, tmp)
		require.Len(t, dirs, 1, "page %d: the store the walk's first page filled is kept", page)
		if kept == "" {
			kept = dirs[0]
		}
		require.Equal(t, kept, dirs[0], "page %d filled a store again", page)
		rows += len(p.Rows)
		if p.Next == "" {
			break
		}
		req.After = p.Next
	}
	require.Equal(t, 6*4, rows)
	require.Equal(t, 1, fills(h))
}

// TestHandler_PlansAfterTheNewestEventFollowTheLog: a time after the newest event resolves to the
// newest sequences, which move as the live store applies more: a store kept for the time alone would
// answer the plans before them. The new plans are answered, from a store filled once for them.
func TestHandler_PlansAfterTheNewestEventFollowTheLog(t *testing.T) {
	tmp := plansTmp(t)
	db := openTestStore(t)
	plansMesh(t, db, 3, 2, 2)
	h := NewHandler(openerOf(&db), func(string) bool { return true })
	defer h.Close()
	limit := int64(2)
	req := query.Request{What: "plans", At: "2100-01-01T00:00:00Z", Limit: &limit}
	p, _ := askHandler(t, h, req)
	require.Equal(t, 2, p.Rows[0].Current.Build)
	require.Equal(t, uint64(6), p.AsOf[provisioner.BucketHostModules])

	// n00 moves to build 3, published.
	require.NoError(t, db.Apply(provisioner.ComposedPrefix+"n00", []provisioner.Message{{Seq: 3, Time: 10e9, Key: "m00.3", Op: provisioner.OpPut,
		Value: mpOf(t, map[string]any{"status": "published", "plan": "n00 m00 3"})}}, 1, false))
	require.NoError(t, db.Apply(provisioner.BucketHostModules, []provisioner.Message{{Seq: 7, Time: 11e9, Key: "n00.m00", Op: provisioner.OpPut,
		Value: mpOf(t, map[string]any{"want": 3})}}, 1, false))
	for page := 0; page < 2; page++ {
		p, got := askHandler(t, h, req)
		require.JSONEq(t, string(freshAnswer(t, db, req)), string(got), "page %d", page)
		if page == 0 {
			require.Equal(t, "n00.m00", p.Rows[0].Key)
			require.Equal(t, 3, p.Rows[0].Current.Build, "the plans of the events applied since")
			require.Equal(t, uint64(7), p.AsOf[provisioner.BucketHostModules])
		}
		req.After = p.Next
	}
	require.Equal(t, 2, fills(h), "one store for each state of the log, filled once")
	require.Len(t, plansDirs(t, tmp), 2)
}

// TestHandler_PlansAfterASwap: a rebuild swaps in another store, whose log may hold other events at
// the same sequences (its streams recreated). What the old store's keep holds is not answered from
// the new one.
func TestHandler_PlansAfterASwap(t *testing.T) {
	plansTmp(t)
	old, next := openTestStore(t), openTestStore(t)
	plansMesh(t, old, 2, 2, 2)
	plansMesh(t, next, 2, 2, 5) // the same sequences and times, other builds
	cur := old
	h := NewHandler(openerOf(&cur), func(string) bool { return true })
	defer h.Close()
	req := query.Request{What: "plans", At: "2100-01-01T00:00:00Z"}
	p, _ := askHandler(t, h, req)
	require.Equal(t, 2, p.Rows[0].Current.Build)
	cur = next
	p, got := askHandler(t, h, req)
	require.Equal(t, 5, p.Rows[0].Current.Build, "the swapped-in store's plans")
	require.JSONEq(t, string(freshAnswer(t, next, req)), string(got))
	require.Equal(t, 2, fills(h))
}

// TestHandler_PlansKeptAreEvictedAndClosed: a seat keeps the stores of its last few points, not one
// per point ever asked, and removes them when it stops.
func TestHandler_PlansKeptAreEvictedAndClosed(t *testing.T) {
	tmp := plansTmp(t)
	db := openTestStore(t)
	plansMesh(t, db, 1, seatPlansKept+2, 2) // one node: its messages are at 1 s, 2 s, ...
	h := NewHandler(openerOf(&db), func(string) bool { return true })
	at := func(sec int) query.Request {
		return query.Request{What: "plans", At: time.Unix(int64(sec), 0).UTC().Format(time.RFC3339)}
	}
	for sec := 1; sec <= seatPlansKept+1; sec++ {
		p, _ := askHandler(t, h, at(sec))
		require.Len(t, p.Rows, sec, "as of %d s", sec)
		require.Len(t, plansDirs(t, tmp), min(sec, seatPlansKept), "after %d points", sec)
	}
	require.Equal(t, seatPlansKept+1, fills(h))
	askHandler(t, h, at(seatPlansKept+1)) // kept
	require.Equal(t, seatPlansKept+1, fills(h))
	askHandler(t, h, at(1)) // the least recently used: evicted, filled again
	require.Equal(t, seatPlansKept+2, fills(h))
	require.Len(t, plansDirs(t, tmp), seatPlansKept)

	h.Close()
	require.Empty(t, plansDirs(t, tmp), "Close removes the stores kept")
	p, _ := askHandler(t, h, at(2)) // after Close: answered, nothing kept
	require.Len(t, p.Rows, 2)
	require.Empty(t, plansDirs(t, tmp))
}

// TestKeptPlans_OneFillAKeyAndKeysSideBySide: two answers of one key at once fill it once (the second
// waits for the first's store), and a fill of another key is not held up by a fill under way: the lock
// is not held across fills. The fills are stand-ins that block; the stores are real.
func TestKeptPlans_OneFillAKeyAndKeysSideBySide(t *testing.T) {
	tmp, v, inputs := onePlanInputs(t)
	realFill := func() (*plansAt, error) { return fillPlans(context.Background(), v, inputs) }

	k := &keptPlans{max: seatPlansKept}
	release, bDone := make(chan struct{}), make(chan struct{})
	var aFills, bFills int
	var mu sync.Mutex
	fillA := func() (*plansAt, error) {
		mu.Lock()
		aFills++
		mu.Unlock()
		select {
		case <-bDone:
		case <-time.After(20 * time.Second): // a guard against a hang, not a timing
			return nil, errors.New("the fill of another key did not run beside this one")
		}
		<-release
		return realFill()
	}
	var wg sync.WaitGroup
	got := make([]*keptEntry, 2)
	errs := make([]error, 2)
	for i := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got[i], errs[i] = k.get(context.Background(), "a", fillA)
		}()
	}
	// Both asks of a are in: one fills, the other waits on it.
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		k.mu.Lock()
		defer k.mu.Unlock()
		if len(k.entries) != 1 || k.entries[0].refs != 2 {
			return fmt.Errorf("%d entries", len(k.entries))
		}
		return nil
	})
	b, err := k.get(context.Background(), "b", func() (*plansAt, error) { bFills++; return realFill() })
	require.NoError(t, err, "b is filled while a's fill is under way")
	close(bDone)
	close(release)
	wg.Wait()
	require.NoError(t, errs[0])
	require.NoError(t, errs[1])
	require.Same(t, got[0], got[1], "one store for both")
	require.Equal(t, 1, aFills)
	require.Equal(t, 1, bFills)
	require.Len(t, plansDirs(t, tmp), 2)

	// An entry evicted while answers read it is removed once the last of them ends, not under them.
	k.max = 1
	k.mu.Lock()
	drop := k.evictLocked() // a, the least recently used
	k.mu.Unlock()
	removeAll(drop)
	require.Len(t, plansDirs(t, tmp), 2, "a is evicted, and still read")
	k.release(got[0])
	require.Len(t, plansDirs(t, tmp), 2, "a is still read")
	k.release(got[1])
	require.Len(t, plansDirs(t, tmp), 1, "the last read of a removed it")
	k.release(b)
	require.Len(t, plansDirs(t, tmp), 1, "b is kept")
	k.close()
	require.Empty(t, plansDirs(t, tmp))
}
