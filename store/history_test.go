package store_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/store"
)

func purge(seq uint64, key string) provisioner.Message {
	return provisioner.Message{Seq: seq, Time: int64(seq) * 1e9, Key: key, Op: provisioner.OpPurge}
}

// recorded is a random sequence of puts, deletes and purges over a few keys, with the state after each
// sequence computed independently.
type recorded struct {
	msgs   []provisioner.Message
	states []map[string]string // states[n]: key -> value as of n
}

func record(seed uint64, n int, keys []string) recorded { return recordPadded(seed, n, keys, 0) }

// recordPadded makes values of pad more bytes (a MessagePack bin).
func recordPadded(seed uint64, n int, keys []string, pad int) recorded {
	r := rand.New(rand.NewPCG(seed, 1))
	rec := recorded{states: []map[string]string{{}}}
	cur := map[string]string{}
	for seq := uint64(1); seq <= uint64(n); seq++ {
		k := keys[r.IntN(len(keys))]
		var m provisioner.Message
		switch x := r.IntN(10); {
		case x < 7:
			m = put(seq, k, []byte{0xa3, 'v', byte('0' + seq%10), byte('0' + seq/10%10)})
			if pad > 0 {
				m.Value = append([]byte{0xc4, byte(pad + 2), byte(seq), byte(seq >> 8)}, make([]byte, pad)...)
			}
			cur[k] = string(m.Value)
		case x < 9:
			m = del(seq, k)
			delete(cur, k)
		default:
			m = purge(seq, k)
			delete(cur, k)
		}
		rec.msgs = append(rec.msgs, m)
		next := make(map[string]string, len(cur))
		for k, v := range cur {
			next[k] = v
		}
		rec.states = append(rec.states, next)
	}
	return rec
}

func stateAt(t *testing.T, db *store.DB, bucket, prefix string, n uint64) map[string]string {
	t.Helper()
	v, err := db.View()
	require.NoError(t, err)
	defer v.Close()
	got := map[string]string{}
	var last string
	require.NoError(t, v.StateAt(bucket, prefix, "", n, func(key []byte, ev *store.Event) bool {
		require.Greater(t, string(key), last, "byte order of raw keys")
		last = string(key)
		require.LessOrEqual(t, ev.Seq, n)
		got[string(key)] = string(ev.Value)
		return true
	}))
	return got
}

func marks(t *testing.T, db *store.DB, bucket string) store.HistoryMarks {
	t.Helper()
	v, err := db.View()
	require.NoError(t, err)
	defer v.Close()
	m, err := v.HistoryMarks(bucket)
	require.NoError(t, err)
	return m
}

var recKeys = []string{"n1.m1.config.a", "n1.m1.config.b", "n1.m2.secret.c", "n10.m1.config.a", "n2.m1.port.d", "n1"}

func TestView_StateAtEqualsRecordedStates(t *testing.T) {
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	rec := record(1, 400, recKeys)
	for i := 0; i < len(rec.msgs); i += 37 {
		require.NoError(t, db.Apply(provisioner.BucketNeeds, rec.msgs[i:min(i+37, len(rec.msgs))], 0, false))
	}
	for n := uint64(0); n <= 400; n++ {
		require.Equal(t, rec.states[n], stateAt(t, db, provisioner.BucketNeeds, "", n), "as of %d", n)
	}
	// A node's prefix: only its keys, not n10's.
	want := map[string]string{}
	for k, v := range rec.states[200] {
		if len(k) > 3 && k[:3] == "n1." {
			want[k] = v
		}
	}
	require.Equal(t, want, stateAt(t, db, provisioner.BucketNeeds, "n1.", 200))
	require.Empty(t, marks(t, db, provisioner.BucketNeeds).Gaps, "a contiguous stream leaves no gap")
}

func TestDB_TrimHistoryKeepsEveryPointFromTheFloor(t *testing.T) {
	for _, batch := range []int{4096, 7} {
		t.Run(fmt.Sprintf("batch %d", batch), func(t *testing.T) {
			defer store.SetTrimBatch(batch)()
			testTrimHistory(t)
		})
	}
}

func testTrimHistory(t *testing.T) {
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	rec := record(2, 600, recKeys)
	require.NoError(t, db.Apply(provisioner.BucketNeeds, rec.msgs, 0, false))
	ctx := context.Background()

	for _, horizon := range []uint64{150, 151, 400, 599} {
		_, err := db.TrimHistory(ctx, provisioner.BucketNeeds, horizon, int64(horizon)*1e9)
		require.NoError(t, err)
		m := marks(t, db, provisioner.BucketNeeds)
		require.Equal(t, horizon, m.Floor)
		require.Equal(t, horizon, m.Trimmed)
		require.ErrorIs(t, m.Check(horizon-1), store.ErrTrimmed)
		require.NoError(t, m.Check(horizon))
		for n := horizon; n <= 600; n++ {
			require.Equal(t, rec.states[n], stateAt(t, db, provisioner.BucketNeeds, "", n), "as of %d after trimming to %d", n, horizon)
		}
		// Below the horizon, at most one event per key is left: the newest, when it is a put.
		v, err := db.View()
		require.NoError(t, err)
		below := map[string]int{}
		require.NoError(t, v.Events(provisioner.BucketNeeds, 0, func(key []byte, ev *store.Event) bool {
			if ev.Seq <= horizon {
				below[string(key)]++
				require.Equal(t, provisioner.OpPut, ev.Op)
				require.Equal(t, rec.states[horizon][string(key)], string(ev.Value))
			}
			return true
		}))
		v.Close()
		require.Len(t, below, len(rec.states[horizon]))
	}
	// Time lookups still land on the floor when its own message was compacted away.
	v, err := db.View()
	require.NoError(t, err)
	defer v.Close()
	n, err := v.SeqAtTime(provisioner.BucketNeeds, 599*1e9+5e8)
	require.NoError(t, err)
	require.EqualValues(t, 599, n)
	n, err = v.SeqAtTime(provisioner.BucketNeeds, 700*1e9)
	require.NoError(t, err)
	require.EqualValues(t, 600, n)
}

func TestView_SeqAtTime(t *testing.T) {
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	rec := record(3, 100, recKeys)
	require.NoError(t, db.Apply(provisioner.BucketNeeds, rec.msgs, 0, false))
	v, err := db.View()
	require.NoError(t, err)
	defer v.Close()
	for _, tc := range []struct {
		t    int64
		want uint64
	}{{0, 0}, {1e9 - 1, 0}, {1e9, 1}, {55e9 + 3, 55}, {100e9, 100}, {1e15, 100}} {
		n, err := v.SeqAtTime(provisioner.BucketNeeds, tc.t)
		require.NoError(t, err)
		require.Equal(t, tc.want, n, "time %d", tc.t)
	}
}

func TestDB_GapsAreRecordedAndClosedWhenCaughtUp(t *testing.T) {
	dir := t.TempDir()
	db, err := store.OpenState(dir, store.Options{})
	require.NoError(t, err)
	b := provisioner.BucketApplied
	// The stream starts at 3: 1 and 2 were removed before they were read.
	require.NoError(t, db.Apply(b, []provisioner.Message{put(3, "n1.a", []byte{1}), put(4, "n1.b", []byte{1})}, 0, false))
	require.NoError(t, db.Apply(b, []provisioner.Message{put(5, "n1.a", []byte{2}), put(8, "n1.c", []byte{1})}, 0, false))
	m := marks(t, db, b)
	require.Equal(t, []store.Gap{{From: 1, To: 0, OpenedAt: 8}}, m.Gaps, "one open gap, extended by the second jump")
	require.ErrorIs(t, m.Check(5), store.ErrGap)

	// Caught up at 5 is not enough: the newest jump is at 8.
	require.NoError(t, db.CaughtUp(b, 5))
	require.Equal(t, []store.Gap{{From: 1, To: 0, OpenedAt: 8}}, marks(t, db, b).Gaps)
	require.NoError(t, db.CaughtUp(b, 8))
	m = marks(t, db, b)
	require.Equal(t, []store.Gap{{From: 1, To: 8, OpenedAt: 8}}, m.Gaps)
	require.ErrorIs(t, m.Check(7), store.ErrGap)
	require.NoError(t, m.Check(8))
	require.NoError(t, m.Check(0), "as of 0 is the empty state")

	// A later jump opens a new gap; it survives a restart and closes after it.
	require.NoError(t, db.Apply(b, []provisioner.Message{put(9, "n1.a", []byte{3}), put(12, "n1.a", []byte{4})}, 0, false))
	require.NoError(t, db.Close())
	db, err = store.OpenState(dir, store.Options{})
	require.NoError(t, err)
	defer db.Close()
	require.NoError(t, db.Apply(b, []provisioner.Message{put(13, "n1.d", []byte{1})}, 0, false))
	require.NoError(t, db.CaughtUp(b, 13))
	m = marks(t, db, b)
	require.Equal(t, []store.Gap{{From: 1, To: 8, OpenedAt: 8}, {From: 10, To: 13, OpenedAt: 12}}, m.Gaps)
	require.NoError(t, m.Check(9))
	require.ErrorIs(t, m.Check(10), store.ErrGap)
	require.NoError(t, m.Check(13))

	// Trimming past a closed gap forgets it.
	_, err = db.TrimHistory(context.Background(), b, 9, 9e9)
	require.NoError(t, err)
	require.Equal(t, []store.Gap{{From: 10, To: 13, OpenedAt: 12}}, marks(t, db, b).Gaps)
}

// TestDB_AWholeStreamRollupClosesAGap: a message with Nats-Rollup: all made the server remove every
// earlier message of the stream, so the state as of it is its own, whatever was removed unread before
// it: the gap closes there, not at the stream's end. It stayed open until a message read with nothing
// pending, so replay from the streams answered 410 at every point from the rollup to the stream's end.
func TestDB_AWholeStreamRollupClosesAGap(t *testing.T) {
	dir := t.TempDir()
	db, err := store.OpenState(dir, store.Options{})
	require.NoError(t, err)
	b := provisioner.BucketApplied
	all := func(m provisioner.Message) provisioner.Message { m.Rollup = provisioner.RollupAll; return m }
	// The stream starts at 5, a rollup of the whole stream: 1 to 4 were removed by it.
	require.NoError(t, db.Apply(b, []provisioner.Message{all(put(5, "n1.a", []byte{1})), put(6, "n1.b", []byte{1})}, 0, false))
	m := marks(t, db, b)
	require.Equal(t, []store.Gap{{From: 1, To: 5, OpenedAt: 5}}, m.Gaps)
	require.ErrorIs(t, m.Check(4), store.ErrGap)
	require.NoError(t, m.Check(5))
	require.NoError(t, m.Check(6))
	require.Equal(t, map[string]string{"n1.a": "\x01"}, stateAt(t, db, b, "", 5))

	// A jump reopens a gap in the same batch as the rollup that closed the last one; a second rollup in
	// a later batch closes it. Both marks outlive a restart.
	require.NoError(t, db.Apply(b, []provisioner.Message{put(9, "n1.c", []byte{1})}, 0, false))
	require.NoError(t, db.Close())
	db, err = store.OpenState(dir, store.Options{})
	require.NoError(t, err)
	defer db.Close()
	require.NoError(t, db.Apply(b, []provisioner.Message{all(put(12, "n1.d", []byte{1})), put(14, "n1.e", []byte{1})}, 0, false))
	m = marks(t, db, b)
	require.Equal(t, []store.Gap{{From: 1, To: 5, OpenedAt: 5}, {From: 7, To: 12, OpenedAt: 12}, {From: 13, To: 0, OpenedAt: 14}}, m.Gaps)
	require.ErrorIs(t, m.Check(11), store.ErrGap)
	require.NoError(t, m.Check(12))
	require.ErrorIs(t, m.Check(14), store.ErrGap, "the jump after the rollup is a gap of its own")
	require.Equal(t, map[string]string{"n1.d": "\x01"}, stateAt(t, db, b, "", 12))
	require.NoError(t, db.CaughtUp(b, 14))
	require.NoError(t, marks(t, db, b).Check(14))
}

func TestRetention_ByAgeWithInjectedClock(t *testing.T) {
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	rec := record(4, 300, recKeys)
	require.NoError(t, db.Apply(provisioner.BucketNeeds, rec.msgs, 0, false))
	regs := []provisioner.Message{put(1, "config", []byte{0x01})}
	regs[0].Time = 10e9
	require.NoError(t, db.Apply(provisioner.BucketRegistry, regs, 0, false))

	now := time.Unix(250, 0)
	r := store.NewRetention(db, store.RetentionOptions{MaxAge: 100 * time.Second, Now: func() time.Time { return now }})
	deleted, err := r.Apply(context.Background())
	require.NoError(t, err)
	require.Positive(t, deleted)
	m := marks(t, db, provisioner.BucketNeeds)
	require.EqualValues(t, 150, m.Floor, "messages stamped at or before now-100s are trimmed")
	for n := uint64(150); n <= 300; n++ {
		require.Equal(t, rec.states[n], stateAt(t, db, provisioner.BucketNeeds, "", n))
	}
	// The registry's only message is older than the horizon: it is kept, as the state at the floor.
	require.Equal(t, map[string]string{"config": "\x01"}, stateAt(t, db, provisioner.BucketRegistry, "", 1))
	require.EqualValues(t, 1, marks(t, db, provisioner.BucketRegistry).Floor)

	// A second round with the same clock has nothing to do.
	deleted, err = r.Apply(context.Background())
	require.NoError(t, err)
	require.Zero(t, deleted)
}

func TestRetention_BySize(t *testing.T) {
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	keys := make([]string, 40)
	for i := range keys {
		keys[i] = fmt.Sprintf("n%d.m.config.k", i)
	}
	rec := recordPadded(5, 4000, keys, 200)
	require.NoError(t, db.Apply(provisioner.BucketNeeds, rec.msgs, 0, false))
	require.NoError(t, db.Pebble().Flush())
	used, err := db.HistoryBytes()
	require.NoError(t, err)
	require.Positive(t, used)

	r := store.NewRetention(db, store.RetentionOptions{MaxBytes: int64(used / 2)})
	deleted, err := r.Apply(context.Background())
	require.NoError(t, err)
	require.Positive(t, deleted)
	after, err := db.HistoryBytes()
	require.NoError(t, err)
	require.Less(t, after, used)
	m := marks(t, db, provisioner.BucketNeeds)
	require.Positive(t, m.Floor)
	require.Less(t, m.Floor, uint64(4000))
	for _, n := range []uint64{m.Floor, m.Floor + 1, (m.Floor + 4000) / 2, 4000} {
		require.Equal(t, rec.states[n], stateAt(t, db, provisioner.BucketNeeds, "", n), "as of %d", n)
	}
}

func TestDB_InterruptedTrimIsExactAndResumes(t *testing.T) {
	defer store.SetTrimBatch(5)()
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	rec := record(6, 300, recKeys)
	require.NoError(t, db.Apply(provisioner.BucketNeeds, rec.msgs, 0, false))

	ctx, cancel := context.WithCancel(context.Background())
	cancel() // stops after the first batch
	_, err = db.TrimHistory(ctx, provisioner.BucketNeeds, 250, 250e9)
	require.ErrorIs(t, err, context.Canceled)
	m := marks(t, db, provisioner.BucketNeeds)
	require.EqualValues(t, 250, m.Floor, "the floor is committed first")
	require.Less(t, m.Trimmed, m.Floor, "the walk stopped part way")
	for n := uint64(250); n <= 300; n++ {
		require.Equal(t, rec.states[n], stateAt(t, db, provisioner.BucketNeeds, "", n), "as of %d, mid-trim", n)
	}
	// The next trim, even to an older horizon, finishes this one.
	_, err = db.TrimHistory(context.Background(), provisioner.BucketNeeds, 100, 100e9)
	require.NoError(t, err)
	m = marks(t, db, provisioner.BucketNeeds)
	require.EqualValues(t, 250, m.Trimmed)
	for n := uint64(250); n <= 300; n++ {
		require.Equal(t, rec.states[n], stateAt(t, db, provisioner.BucketNeeds, "", n))
	}
}

// A stream whose end was removed before it was read leaves the log an open gap from the applied
// sequence on, which survives a reopen, merges with the jump to the next message read, and closes
// at the stream's end as any gap does.
func TestDB_TailRemoved(t *testing.T) {
	dir := t.TempDir()
	db, err := store.OpenState(dir, store.Options{})
	require.NoError(t, err)
	b := provisioner.BucketNeeds
	require.NoError(t, db.Apply(b, []provisioner.Message{put(1, "n1.m.config.a", []byte{1}), put(2, "n1.m.config.b", []byte{2})}, 7, false))
	require.NoError(t, db.TailRemoved(b, 2, 7), "nothing removed past the applied sequence")
	require.Empty(t, marks(t, db, b).Gaps)

	require.NoError(t, db.TailRemoved(b, 10, 7))
	require.Equal(t, []store.Gap{{From: 3, OpenedAt: 11}}, marks(t, db, b).Gaps)
	require.NoError(t, marks(t, db, b).Check(2))
	require.ErrorIs(t, marks(t, db, b).Check(3), store.ErrGap)
	require.Equal(t, int64(7), db.Checkpoint(b).StreamCreated)
	require.NoError(t, db.Close())

	db, err = store.OpenState(dir, store.Options{})
	require.NoError(t, err)
	defer db.Close()
	require.NoError(t, db.Apply(b, []provisioner.Message{put(12, "n1.m.config.c", []byte{3})}, 7, false))
	require.Equal(t, []store.Gap{{From: 3, OpenedAt: 12}}, marks(t, db, b).Gaps, "the jump extends the open gap")
	require.NoError(t, db.CaughtUp(b, 12))
	m := marks(t, db, b)
	require.Equal(t, []store.Gap{{From: 3, To: 12, OpenedAt: 12}}, m.Gaps)
	require.ErrorIs(t, m.Check(11), store.ErrGap)
	require.NoError(t, m.Check(12))

	// A new store learns the stream's creation time from it.
	fresh, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer fresh.Close()
	require.NoError(t, fresh.TailRemoved(b, 100, 42))
	require.Equal(t, int64(42), fresh.Checkpoint(b).StreamCreated)
	require.Equal(t, []store.Gap{{From: 1, OpenedAt: 101}}, marks(t, fresh, b).Gaps)
}

// A stream that removed its last messages before they were read, and has nothing left up to seq,
// moves the checkpoint to seq (a request for it is answered: the projection is as current as the
// stream there), with the log's open gap from the old applied sequence on, as TailRemoved records;
// it wakes what waits on Changed, survives a reopen, and leaves a checkpoint of another stream alone.
func TestDB_SkipRemoved(t *testing.T) {
	dir := t.TempDir()
	db, err := store.OpenState(dir, store.Options{})
	require.NoError(t, err)
	b := provisioner.BucketNeeds
	require.NoError(t, db.Apply(b, []provisioner.Message{put(1, "n1.m.config.a", []byte{1}), put(2, "n1.m.config.b", []byte{2})}, 7, false))
	moved, err := db.SkipRemoved(b, 2, 7)
	require.NoError(t, err)
	require.False(t, moved, "nothing removed past the applied sequence")
	moved, err = db.SkipRemoved(b, 10, 8)
	require.NoError(t, err)
	require.False(t, moved, "another stream's sequence")
	require.Empty(t, marks(t, db, b).Gaps)

	changed := db.Changed(b)
	moved, err = db.SkipRemoved(b, 10, 7)
	require.NoError(t, err)
	require.True(t, moved)
	<-changed
	seq, _ := db.Applied(b)
	require.EqualValues(t, 10, seq)
	require.Equal(t, []store.Gap{{From: 3, OpenedAt: 11}}, marks(t, db, b).Gaps)
	require.ErrorIs(t, marks(t, db, b).Check(10), store.ErrGap)
	require.NoError(t, db.Close())

	db, err = store.OpenState(dir, store.Options{})
	require.NoError(t, err)
	defer db.Close()
	require.EqualValues(t, 10, db.Checkpoint(b).Applied)
	require.EqualValues(t, 7, db.Checkpoint(b).StreamCreated)
	require.NoError(t, db.Apply(b, []provisioner.Message{put(11, "n1.m.config.c", []byte{3})}, 7, false))
	require.NoError(t, db.CaughtUp(b, 11))
	m := marks(t, db, b)
	require.Equal(t, []store.Gap{{From: 3, To: 11, OpenedAt: 11}}, m.Gaps)
	require.ErrorIs(t, m.Check(10), store.ErrGap)
	require.NoError(t, m.Check(11))
}

// RemovedEnd is the end past the checkpoint that TailRemoved was told of, also when the open gap it
// extends was opened before a SkipRemoved moved the checkpoint (a request's min_seq skipped a first
// removal, a parking then recorded a second): the gap then starts below the checkpoint + 1. Before,
// only a gap starting at the checkpoint + 1 counted, and such a bucket never started parked again.
func TestDB_RemovedEndAfterSkipRemoved(t *testing.T) {
	dir := t.TempDir()
	db, err := store.OpenState(dir, store.Options{})
	require.NoError(t, err)
	b := "composed-n1"
	require.NoError(t, db.Apply(b, []provisioner.Message{put(1, "web.1", []byte{1})}, 7, true))
	moved, err := db.SkipRemoved(b, 3, 7)
	require.NoError(t, err)
	require.True(t, moved)
	_, ok := db.RemovedEnd(b)
	require.False(t, ok, "the checkpoint is at the removed end: none past it")

	require.NoError(t, db.TailRemoved(b, 5, 7))
	end, ok := db.RemovedEnd(b)
	require.True(t, ok)
	require.EqualValues(t, 5, end)
	require.Equal(t, []store.Gap{{From: 2, OpenedAt: 6}}, marks(t, db, b).Gaps, "one gap, extended")
	require.NoError(t, db.Close())

	db, err = store.OpenState(dir, store.Options{})
	require.NoError(t, err)
	defer db.Close()
	end, ok = db.RemovedEnd(b)
	require.True(t, ok, "after a reopen")
	require.EqualValues(t, 5, end)

	// A message read past it ends it.
	require.NoError(t, db.Apply(b, []provisioner.Message{put(6, "web.2", []byte{2})}, 7, true))
	_, ok = db.RemovedEnd(b)
	require.False(t, ok)
}

// TestDB_ReachHoldsMinSeqInsideAnOpenGap: a request's min_seq inside an open gap (messages removed
// before they were read, whose remover may not be read yet) is not reached by the applied sequence
// (Reach): a jump holds from its first removed sequence on, until the stream's end is read
// (CaughtUp), the stream is found to hold nothing past the checkpoint (SkipRemoved, StreamEndsAt), or
// the checkpoint reaches the last sequence the stream held when the consumer's count said it ended
// (HoldUntil). A min_seq below the gap is reached as before. Reopened, the store holds from the gap's
// start while a message was read past its newest jump.
func TestDB_ReachHoldsMinSeqInsideAnOpenGap(t *testing.T) {
	dir := t.TempDir()
	db, err := store.OpenState(dir, store.Options{})
	require.NoError(t, err)
	b := provisioner.BucketApplied
	require.NoError(t, db.Apply(b, []provisioner.Message{put(1, "n1.a", []byte{1})}, 0, false))
	require.Equal(t, uint64(1), db.Reach(b))
	// 2 removed unread, by 4 maybe: 3 is read first.
	require.NoError(t, db.Apply(b, []provisioner.Message{put(3, "n1.b", []byte{1})}, 0, false))
	seq, _ := db.Applied(b)
	require.Equal(t, uint64(3), seq)
	require.Equal(t, uint64(1), db.Reach(b), "min_seq 2 and 3 wait for what removed 2")
	held, until := db.Held(b)
	require.Equal(t, [2]uint64{2, 0}, [2]uint64{held, until})

	// The consumer said 3 was the last, the stream held 4: the requests wait for 4.
	db.HoldUntil(b, 2, 4)
	require.Equal(t, uint64(1), db.Reach(b))
	require.NoError(t, db.Apply(b, []provisioner.Message{put(4, "n1.a", []byte{2})}, 0, false))
	require.Equal(t, uint64(4), db.Reach(b))

	// A second jump holds from its own start; the stream's end read releases it.
	require.NoError(t, db.Apply(b, []provisioner.Message{put(6, "n1.c", []byte{1}), put(7, "n1.d", []byte{1})}, 0, false))
	require.Equal(t, uint64(4), db.Reach(b))
	require.NoError(t, db.CaughtUp(b, 7))
	require.Equal(t, uint64(7), db.Reach(b))

	// A skip (the stream holds nothing past the checkpoint) reaches its end.
	require.NoError(t, db.Apply(b, []provisioner.Message{put(9, "n1.e", []byte{1})}, 0, false))
	require.Equal(t, uint64(7), db.Reach(b))
	moved, err := db.SkipRemoved(b, 11, 0)
	require.NoError(t, err)
	require.True(t, moved)
	require.Equal(t, uint64(11), db.Reach(b))

	// A jump, then the stream found to end at the checkpoint.
	require.NoError(t, db.Apply(b, []provisioner.Message{put(13, "n1.f", []byte{1})}, 0, false))
	require.Equal(t, uint64(11), db.Reach(b))
	require.NoError(t, db.Close())
	db, err = store.OpenState(dir, store.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, db.Close()) })
	require.Less(t, db.Reach(b), uint64(12), "reopened: still held")
	db.StreamEndsAt(b, 13)
	require.Equal(t, uint64(13), db.Reach(b))
}

// TestDB_GapClosesOnlyPastWhereTheStreamEndedWhenAsked: the consumer said a message was the stream's
// last, the stream held more (HoldUntil): a CaughtUp at that message does not close the gap, which
// would say the points from it on are exact though what removed the gap's messages may be past it.
func TestDB_GapClosesOnlyPastWhereTheStreamEndedWhenAsked(t *testing.T) {
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, db.Close()) })
	b := provisioner.BucketApplied
	require.NoError(t, db.Apply(b, []provisioner.Message{put(1, "n1.a", []byte{1}), put(3, "n1.b", []byte{1})}, 0, false))
	db.HoldUntil(b, 2, 4)
	require.NoError(t, db.Apply(b, []provisioner.Message{put(4, "n1.a", []byte{2})}, 0, false))
	require.Equal(t, uint64(4), db.Reach(b))
	require.NoError(t, db.CaughtUp(b, 3))
	require.Equal(t, []store.Gap{{From: 2, OpenedAt: 3}}, marks(t, db, b).Gaps, "still open: 4 removed 2")
	require.NoError(t, db.CaughtUp(b, 4))
	require.Equal(t, []store.Gap{{From: 2, To: 4, OpenedAt: 3}}, marks(t, db, b).Gaps)
}

// TestDB_JumpPastWhereTheStreamEndedStartsANewHold: the stream ended at 4 when asked after the jump
// over 2 (HoldUntil), and the next jump (over 6) comes in the batch that reads past 4: what removed 2
// is at or below 4, read, so only min_seq from 6 on wait. Before, the hold from 2 was kept, asked
// again, and ended only once a batch without a jump reached the new end: on a bucket whose batches
// all jump, never.
func TestDB_JumpPastWhereTheStreamEndedStartsANewHold(t *testing.T) {
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, db.Close()) })
	b := provisioner.BucketApplied
	require.NoError(t, db.Apply(b, []provisioner.Message{put(1, "n1.a", []byte{1}), put(3, "n1.b", []byte{1})}, 0, false))
	db.HoldUntil(b, 2, 4)
	require.Equal(t, uint64(1), db.Reach(b))
	require.NoError(t, db.Apply(b, []provisioner.Message{put(4, "n1.a", []byte{2}), put(5, "n1.c", []byte{1}), put(7, "n1.d", []byte{1})}, 0, false))
	held, until := db.Held(b)
	require.Equal(t, [2]uint64{6, 0}, [2]uint64{held, until})
	require.Equal(t, uint64(5), db.Reach(b))

	// A jump at or below where the stream ended extends the hold: what removed 2 may be among the
	// messages it lacks.
	db.HoldUntil(b, 6, 10)
	require.NoError(t, db.Apply(b, []provisioner.Message{put(8, "n1.e", []byte{1}), put(10, "n1.f", []byte{1})}, 0, false))
	held, until = db.Held(b)
	require.Equal(t, [2]uint64{6, 0}, [2]uint64{held, until})
	require.Equal(t, uint64(5), db.Reach(b))
}
