package store_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/store"
)

// rewrite applies rounds puts of keys k000..k<keys-1> each, in order, from sequence *seq + 1 on.
func rewrite(tb testing.TB, db *store.DB, bucket string, key func(i int) string, value []byte, keys, rounds int, seq *uint64) {
	tb.Helper()
	var msgs []provisioner.Message
	for r := 0; r < rounds; r++ {
		for i := 0; i < keys; i++ {
			*seq++
			msgs = append(msgs, provisioner.Message{Seq: *seq, Time: int64(*seq), Key: key(i), Op: provisioner.OpPut, Value: value})
		}
	}
	require.NoError(tb, db.Apply(bucket, msgs, 1, true))
}

// TestDB_LiveBelowScansEachEventOnce: the stream check a tail makes as it starts (a seat's every
// start) asks whether any event below the stream's first sequence is still live. Below a first
// sequence that a history of 1 moved past a million superseded revisions, that was a million events
// read at every start of the seat; what was found free of live events is now kept, in the store, and
// not read again, by the same open or a later one. A live event past the kept mark is still found.
func TestDB_LiveBelowScansEachEventOnce(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	db, err := store.Open(dir, store.Options{})
	require.NoError(t, err)
	var seq uint64
	key := func(i int) string { return fmt.Sprintf("n1.m.config.k%03d", i) }
	rewrite(t, db, provisioner.BucketNeeds, key, []byte{0x80}, 100, 10, &seq) // 1..900 superseded, 901..1000 live

	var read int
	defer store.CountLiveBelow(&read)()
	_, live, err := db.LiveBelow(ctx, provisioner.BucketNeeds, 0, 901)
	require.NoError(t, err)
	require.False(t, live)
	require.Equal(t, 900, read, "the first check reads every event below the first sequence")

	read = 0
	_, live, err = db.LiveBelow(ctx, provisioner.BucketNeeds, 0, 901)
	require.NoError(t, err)
	require.False(t, live)
	require.Zero(t, read, "a second check of the same range reads nothing again")

	require.NoError(t, db.Close())
	db, err = store.Open(dir, store.Options{})
	require.NoError(t, err)
	defer db.Close()
	read = 0
	_, live, err = db.LiveBelow(ctx, provisioner.BucketNeeds, 0, 901)
	require.NoError(t, err)
	require.False(t, live)
	require.Zero(t, read, "the check after a restart reads nothing the one before it read")

	// The first sequence moves past a live message: only what lies past the mark is read, and the
	// live message is found.
	read = 0
	got, live, err := db.LiveBelow(ctx, provisioner.BucketNeeds, 0, 951)
	require.NoError(t, err)
	require.True(t, live)
	require.Equal(t, uint64(901), got)
	require.Equal(t, 1, read)

	// A scan that does not start at the mark neither trusts nor moves it.
	read = 0
	_, live, err = db.LiveBelow(ctx, provisioner.BucketApplied, 5, 10)
	require.NoError(t, err)
	require.False(t, live)
	_, live, err = db.LiveBelow(ctx, provisioner.BucketApplied, 0, 5)
	require.NoError(t, err)
	require.False(t, live)
}

// TestDB_LiveBelowMarkGoesWithForget: a forgotten composed-<node> bucket is read again from its
// stream, whose messages below the old mark may be live in the new log: the mark goes with the
// bucket's other history marks, and the check finds them.
func TestDB_LiveBelowMarkGoesWithForget(t *testing.T) {
	ctx := context.Background()
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	bucket := provisioner.ComposedPrefix + "n1"
	pub := []byte{0x81, 0xa6, 's', 't', 'a', 't', 'u', 's', 0xa9, 'p', 'u', 'b', 'l', 'i', 's', 'h', 'e', 'd'}
	key := func(i int) string { return fmt.Sprintf("m%d.1", i) }
	var seq uint64
	rewrite(t, db, bucket, key, pub, 10, 3, &seq) // 1..20 superseded
	_, live, err := db.LiveBelow(ctx, bucket, 0, 21)
	require.NoError(t, err)
	require.False(t, live)

	require.NoError(t, db.ForgetFrom(bucket, 1, store.Checkpoint{Applied: 0, StreamCreated: 2}))
	seq = 0
	rewrite(t, db, bucket, key, pub, 10, 1, &seq) // 1..10 live
	got, live, err := db.LiveBelow(ctx, bucket, 0, 21)
	require.NoError(t, err)
	require.True(t, live, "a live message below the forgotten bucket's old mark is found")
	require.Equal(t, uint64(1), got)
}

// TestDB_LiveBelowStopsWithItsContext: the check a tail makes as it starts may walk a million events
// (seconds of CPU) on the bucket's goroutine, which a stop of the seat waits for. A scan whose
// context has ended stops within a few events and keeps what it found free, so the next check goes
// on from there rather than from 0.
func TestDB_LiveBelowStopsWithItsContext(t *testing.T) {
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	var seq uint64
	key := func(i int) string { return fmt.Sprintf("n1.m.config.k%04d", i) }
	rewrite(t, db, provisioner.BucketNeeds, key, []byte{0x80}, 1000, 5, &seq) // 1..4000 superseded

	var read int
	defer store.CountLiveBelow(&read)()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, _, err = db.LiveBelow(ctx, provisioner.BucketNeeds, 0, 4001)
	require.ErrorIs(t, err, context.Canceled)
	require.LessOrEqual(t, read, 1024, "a scan whose context ended reads no more than one stretch of events")

	// Stopped halfway through (the hook ends the context once the scan has read some): the next scan
	// reads the rest, not the whole range again.
	ctx, cancel = context.WithCancel(context.Background())
	defer cancel()
	read = 0
	stopAfter := store.StopLiveBelowAfter(2000, cancel)
	_, _, err = db.LiveBelow(ctx, provisioner.BucketNeeds, 0, 4001)
	stopAfter()
	require.ErrorIs(t, err, context.Canceled)
	first := read
	require.Less(t, first, 4000)
	read = 0
	_, live, err := db.LiveBelow(context.Background(), provisioner.BucketNeeds, 0, 4001)
	require.NoError(t, err)
	require.False(t, live)
	require.Equal(t, 4000, first+read, "the scan after a stop goes on where the stopped one ended")
}
