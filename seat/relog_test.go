package seat_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/seat"
	"github.com/novox/mesh-provisioner/store"
)

// firstFillMesh has a few thousand keys.
var firstFillMesh = fixtures.Mesh{Seed: 11, Nodes: 120, Modules: 4, NeedsPerModule: 3, Collections: 4, BadKeys: 3, BadValues: 2}

// startFirstFillSeat opens the state dir as serve does (a generation it creates has no log) and starts a
// seat on it, with hooks set before it starts; stop stops the seat and closes the store, at cleanup too.
func (h *harness) startFirstFillSeat(dir string, hooks func(*seat.Seat)) (*seat.Seat, *store.DB, func()) {
	h.t.Helper()
	nc, js := natstest.Connect(h.t, h.url)
	db, err := store.OpenState(dir, store.Options{FirstFillNoWAL: true})
	require.NoError(h.t, err)
	st, err := seat.StartWith(context.Background(), nc, js, db, seat.Config{WriteRegistry: true,
		Projector: projector.Options{Poll: 50 * time.Millisecond, Verify: 200 * time.Millisecond}}, hooks)
	require.NoError(h.t, err)
	var once sync.Once
	stop := func() {
		once.Do(func() {
			require.NoError(h.t, st.Stop())
			require.NoError(h.t, db.Close())
			nc.Close()
		})
	}
	h.t.Cleanup(stop)
	return st, db, stop
}

// suffixBytes adds up the sizes of the files of dir named with suffix.
func suffixBytes(t *testing.T, dir, suffix string) int64 {
	t.Helper()
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	var n int64
	for _, e := range entries {
		if strings.HasSuffix(e.Name(), suffix) {
			info, err := e.Info()
			require.NoError(t, err)
			n += info.Size()
		}
	}
	return n
}

// killedCopy is what a SIGKILL of the seat would leave of its state dir now, as a state dir of its own:
// the current generation's files as written (store.CopyCurrent: what the memtables hold is not there),
// with no CURRENT (the open finds the only generation).
func killedCopy(t *testing.T, state string) string {
	t.Helper()
	cp, err := store.CopyCurrent(state)
	require.NoError(t, err)
	defer func() { require.NoError(t, store.RemoveCopy(cp)) }()
	to := filepath.Join(t.TempDir(), "state")
	gen := filepath.Join(to, "gen-000001")
	require.NoError(t, os.MkdirAll(gen, 0o755))
	entries, err := os.ReadDir(cp)
	require.NoError(t, err)
	for _, e := range entries {
		if e.IsDir() || strings.HasPrefix(e.Name(), ".") || e.Name() == "LOCK" {
			continue
		}
		src, err := os.Open(filepath.Join(cp, e.Name()))
		require.NoError(t, err)
		dst, err := os.Create(filepath.Join(gen, e.Name()))
		require.NoError(t, err)
		_, err = io.Copy(dst, src)
		require.NoError(t, err)
		require.NoError(t, src.Close())
		require.NoError(t, dst.Close())
	}
	return to
}

// asOfWatch asks the needs of a node the whole time and keeps each as_of, and every error.
type asOfWatch struct {
	stop chan struct{}
	done chan struct{}
	asOf []uint64
	errs []error
}

func (h *harness) watchAsOf(node string) *asOfWatch {
	w := &asOfWatch{stop: make(chan struct{}), done: make(chan struct{})}
	body := []byte(fmt.Sprintf(`{"what":"needs","node":%q}`, node))
	go func() {
		defer close(w.done)
		for {
			select {
			case <-w.stop:
				return
			default:
			}
			a, _, err := natstest.Ask(h.nc, query.Subject, body, false)
			if err != nil {
				w.errs = append(w.errs, err)
				continue
			}
			w.asOf = append(w.asOf, a.AsOf)
		}
	}()
	return w
}

// finish stops the watch and checks that every question was answered and as_of never went back.
func (w *asOfWatch) finish(t *testing.T) {
	t.Helper()
	close(w.stop)
	<-w.done
	require.Empty(t, w.errs, "every question was answered")
	require.NotEmpty(t, w.asOf)
	for i := 1; i < len(w.asOf); i++ {
		require.GreaterOrEqual(t, w.asOf[i], w.asOf[i-1], "as_of went back at answer %d of %d", i, len(w.asOf))
	}
}

// TestSeat_FirstFillWithoutLogThenAnswersFromOneWithIt: a seat on an empty state dir fills its first
// generation with no log (no byte in Pebble's .log files), then answers from a checkpoint of it opened
// with its log: the first generation is gone, CURRENT names the new one, a write after the swap is in
// what a kill would leave (the log), and answers went on throughout, as_of never going back.
func TestSeat_FirstFillWithoutLogThenAnswersFromOneWithIt(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.load(firstFillMesh.Ops())
	dir := t.TempDir()
	first := filepath.Join(dir, "gen-000001")
	type seen struct {
		logBytes, sstBytes int64
		newNoWAL           bool
	}
	atSwap := make(chan seen, 1)
	st, db, _ := h.startFirstFillSeat(dir, func(s *seat.Seat) {
		seat.SetAtCaughtUp(s, func(_ *projector.Projector, ndb *store.DB) {
			select {
			case atSwap <- seen{suffixBytes(t, first, ".log"), suffixBytes(t, first, ".sst"), ndb.NoWAL()}:
			default:
			}
		})
	})
	watch := h.watchAsOf(fixtures.NodeName(5))
	require.Equal(t, first, db.Dir())
	require.True(t, db.NoWAL(), "a generation made for the first fill has no log")

	var at seen
	select {
	case at = <-atSwap:
	case <-time.After(30 * time.Second):
		t.Fatal("the first fill was not checkpointed into a generation with a log")
	}
	require.Zero(t, at.logBytes, "the first fill wrote nothing to a log")
	require.Positive(t, at.sstBytes, "the first fill's memtables were flushed to tables for the checkpoint")
	require.False(t, at.newNoWAL, "the checkpoint is opened with its log")

	natstest.CheckFor(t, 20*time.Second, 10*time.Millisecond, func() error {
		if st.Store() == db {
			return errors.New("not swapped yet")
		}
		return nil
	})
	h.waitCaughtUp(st)
	watch.finish(t)
	live := st.Store()
	require.False(t, live.NoWAL())
	require.Zero(t, st.Rebuilds(), "turning the log on is not a rebuild")
	gens := generations(t, dir)
	require.Equal(t, []string{live.Dir()}, gens, "the first generation is removed")
	cur, err := os.ReadFile(filepath.Join(dir, "CURRENT"))
	require.NoError(t, err)
	require.Equal(t, filepath.Base(live.Dir()), strings.TrimSpace(string(cur)))
	h.checkAll()

	// A write after the swap is in its log: what a kill leaves holds it.
	kv, err := h.js.KeyValue(context.Background(), provisioner.BucketNeeds)
	require.NoError(t, err)
	seq, err := kv.Put(context.Background(), fixtures.NodeName(5)+".mod-x.config.after", []byte{0x80})
	require.NoError(t, err)
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		if have, _ := live.Applied(provisioner.BucketNeeds); have < seq {
			return fmt.Errorf("applied %d of %d", have, seq)
		}
		return nil
	})
	killed := killedCopy(t, dir)
	kdb, err := store.OpenState(killed, store.Options{FirstFillNoWAL: true})
	require.NoError(t, err)
	defer kdb.Close()
	require.False(t, kdb.NoWAL(), "a generation that exists opens with its log")
	have, _ := kdb.Applied(provisioner.BucketNeeds)
	require.GreaterOrEqual(t, have, seq, "the write after the swap was in the log")
}

// TestSeat_KilledDuringFirstFillKeepsWhatWasAnsweredSynced: before the first fill is checkpointed into
// a store with a log, its buckets, each caught up at its stream's end, answer synced: true from the
// store without one; a kill then must not take back what they answered, as it does not with a log
// (the store flushed its memtables before each said synced: store.Options.FirstFillNoWAL). The seat
// started again on what the kill left opens the first generation with its log and reads on, to keys
// written after the kill too.
func TestSeat_KilledDuringFirstFillKeepsWhatWasAnsweredSynced(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.load(testMesh.Ops())
	dir := t.TempDir()
	atRelog, release := make(chan struct{}), make(chan struct{})
	var once, released sync.Once
	unblock := func() { released.Do(func() { close(release) }) }
	st, db, stop := h.startFirstFillSeat(dir, func(s *seat.Seat) {
		seat.SetBeforeRelog(s, func() {
			once.Do(func() { close(atRelog) })
			<-release
		})
	})
	defer unblock()
	select {
	case <-atRelog:
	case <-time.After(30 * time.Second):
		t.Fatal("the first fill did not catch up")
	}
	// Every bucket said synced (the switch waits for it), from the store without a log.
	require.Same(t, db, st.Store(), "still the first fill's store")
	applied := map[string]uint64{}
	for _, sh := range provisioner.ProvisionerShapes {
		seq, synced := db.Applied(sh.Bucket)
		require.True(t, synced, sh.Bucket)
		applied[sh.Bucket] = seq
	}
	require.Positive(t, applied[provisioner.BucketNeeds])
	// What the verb answers synced now, of each bucket.
	answered := func() map[string]uint64 {
		t.Helper()
		asOf := map[string]uint64{}
		for _, sh := range provisioner.ProvisionerShapes {
			a, _, err := natstest.Ask(h.nc, query.Subject, []byte(fmt.Sprintf(`{"what":%q,"limit":1}`, sh.What)), false)
			require.NoError(t, err)
			require.True(t, a.Synced, sh.Bucket)
			asOf[sh.Bucket] = a.AsOf
		}
		return asOf
	}
	asked := answered()

	killed := killedCopy(t, dir)
	kdb, err := store.OpenState(killed, store.Options{})
	require.NoError(t, err)
	for b, seq := range applied {
		kept, _ := kdb.Applied(b)
		// The seat writes the registry once the bucket is synced: each of those batches is committed
		// some ms before the flush that makes it durable, and the kill may come in between; its answers
		// show it only once flushed (store.DB.Answered, the durable state). The buckets loaded before
		// the start are caught up by batches that reach their stream's end, flushed before they say
		// synced.
		require.LessOrEqual(t, asked[b], kept, "the kill took back what %s answered synced", b)
		if b != provisioner.BucketRegistry {
			require.Equal(t, seq, kept, "the kill took back what %s answered synced", b)
		}
	}
	require.NoError(t, kdb.Close())

	// A message to a synced bucket before the switch: answered synced once a kill keeps it, not from
	// its commit, some ms before the flush that makes it durable (before h150 a kill right after the
	// answer took it back).
	for i := range 5 {
		key := fmt.Sprintf("%s.mod-window%d.config.k", fixtures.NodeName(i), i)
		h.load([]fixtures.Op{{Bucket: provisioner.BucketNeeds, Key: key, Op: provisioner.OpPut, Value: []byte{0x80}}})
		seq := h.lastMsg(provisioner.BucketNeeds).Sequence
		body := []byte(`{"what":"needs","limit":1}`)
		var a natstest.Answer
		require.Eventually(t, func() bool {
			a, _, err = natstest.Ask(h.nc, query.Subject, body, false)
			return err == nil && a.AsOf >= seq
		}, 10*time.Second, time.Millisecond)
		require.True(t, a.Synced)
		killed := killedCopy(t, dir)
		kdb, err := store.OpenState(killed, store.Options{})
		require.NoError(t, err)
		kept, _ := kdb.Applied(provisioner.BucketNeeds)
		require.NoError(t, kdb.Close())
		require.GreaterOrEqual(t, kept, a.AsOf, "a kill took back what needs answered synced (message %d)", i)
	}
	unblock()
	stop()

	var more []fixtures.Op
	for i := range 40 {
		more = append(more, fixtures.Op{Bucket: provisioner.BucketNeeds, Key: fmt.Sprintf("%s.mod-late%d.config.k", fixtures.NodeName(i%7), i), Op: provisioner.OpPut, Value: []byte{0x80}})
	}
	h.load(more)
	st2, db2, _ := h.startFirstFillSeat(killed, nil)
	require.False(t, db2.NoWAL(), "the first generation, found, opens with its log")
	h.waitCaughtUp(st2)
	h.checkAll()
	require.Same(t, db2, st2.Store(), "a store with a log is not checkpointed again")
}
