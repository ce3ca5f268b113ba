package replay_test

import (
	"context"
	"path/filepath"
	"testing"

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
