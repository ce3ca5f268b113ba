package replay_test

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/replay"
	"github.com/novox/mesh-provisioner/store"
)

// A state dir rebuilt (Fill) from a stream whose last message was removed before it was read (its
// subject purged) refuses a point among the removed messages, as the streams' own read and their
// archive do: it answered seq:3 with two keys, as if the third put had never been written.
func TestFill_RecordsTheStreamsRemovedEnd(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.BucketApplied})
	require.NoError(t, err)
	for _, k := range []string{"n1.a", "n1.b", "n1.c"} {
		_, err := kv.Put(ctx, k, []byte{0x01})
		require.NoError(t, err)
	}
	s, err := js.Stream(ctx, provisioner.StreamName(provisioner.BucketApplied))
	require.NoError(t, err)
	require.NoError(t, s.Purge(ctx, jetstream.WithPurgeSubject(provisioner.SubjectPrefix(provisioner.BucketApplied)+"n1.c")))

	dir := filepath.Join(t.TempDir(), "state")
	db, err := store.OpenState(dir, store.Options{})
	require.NoError(t, err)
	unread, err := replay.Fill(ctx, js, db, projector.Options{Buckets: []string{provisioner.BucketApplied}}, nil)
	require.NoError(t, err)
	require.Empty(t, unread)
	require.NoError(t, db.Close())
	l, err := replay.OpenState(dir)
	require.NoError(t, err)
	defer l.Close()
	_, err = l.State(query.Request{What: "applied", Node: "n1"}, replay.Point{Seq: 2})
	require.NoError(t, err)
	_, err = l.State(query.Request{What: "applied", Node: "n1"}, replay.Point{Seq: 3})
	require.ErrorIs(t, err, store.ErrGap, "seq:3 held n1.c, which the log never read")
}

// A fill of the plans' inputs (rebuild --plans, the whole --nats read) records the removed end of a
// composed-<node> bucket too: those buckets are found by listing, not named in the options, and the
// fill stops as soon as each has read what its stream holds, before its tail's own check of the end
// (projector.tailRemoved) had a poll to run: seq:2 of composed-n1, a composition whose subject was
// purged unread, was answered as if it had never been written.
func TestFill_RecordsAComposedBucketsRemovedEnd(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	const bucket = "composed-n1"
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: bucket})
	require.NoError(t, err)
	for _, k := range []string{"web.1", "db.1"} {
		_, err := kv.Put(ctx, k, []byte{0x80})
		require.NoError(t, err)
	}
	s, err := js.Stream(ctx, provisioner.StreamName(bucket))
	require.NoError(t, err)
	require.NoError(t, s.Purge(ctx, jetstream.WithPurgeSubject(provisioner.SubjectPrefix(bucket)+"db.1")))

	// A poll far longer than the fill: what records the end is the fill's own look at the streams.
	opts := projector.Options{Buckets: []string{provisioner.BucketHostModules}, Composed: true, Poll: time.Minute}
	check := func(t *testing.T, db *store.DB) {
		t.Helper()
		v, err := db.View()
		require.NoError(t, err)
		defer v.Close()
		marks, err := v.HistoryMarks(bucket)
		require.NoError(t, err)
		require.NoError(t, marks.Check(1))
		require.ErrorIs(t, marks.Check(2), store.ErrGap, "seq:2 held db.1, which the log never read")
	}
	t.Run("Fill", func(t *testing.T) {
		db, err := store.OpenState(filepath.Join(t.TempDir(), "state"), store.Options{})
		require.NoError(t, err)
		defer db.Close()
		unread, err := replay.Fill(ctx, js, db, opts, nil)
		require.NoError(t, err)
		require.Empty(t, unread)
		check(t, db)
	})
	t.Run("FromNATS", func(t *testing.T) {
		l, err := replay.FromNATS(ctx, js, nil, "nats", nil)
		require.NoError(t, err)
		defer l.Close()
		check(t, l.DB)
	})
}
