package seat_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/query"
)

// TestSeat_MinSeqOfAMessageRemovedUnreadIsReached: CONTRACT section 3, a request with min_seq is
// answered once the projection has applied that stream sequence. A node's write whose message the
// stream removed before the seat read it (its subject purged here; a TTL without a marker leaves the
// same) is a sequence no message will ever bring: the stream holds nothing left up to it, and the
// projection, having read all there is, is as current as the stream there. Such a request is answered
// at once with an as_of at or past it (docs/decisions.md, "min_seq of a message removed unread"), and
// a request for a sequence not yet written still waits for it. Before, the request waited its whole
// wait_ms and was answered 504, though nothing was left to read.
func TestSeat_MinSeqOfAMessageRemovedUnreadIsReached(t *testing.T) {
	h := newHarness(t)
	h.load(prefixMesh(t))
	ctx := context.Background()
	kv, err := h.js.KeyValue(ctx, provisioner.BucketApplied)
	require.NoError(t, err)
	seq, err := kv.Put(ctx, "n9.m", mp(t, "gone"))
	require.NoError(t, err)
	stream, err := h.js.Stream(ctx, provisioner.StreamName(provisioner.BucketApplied))
	require.NoError(t, err)
	require.NoError(t, stream.Purge(ctx, jetstream.WithPurgeSubject(provisioner.SubjectPrefix(provisioner.BucketApplied)+"n9.m")))
	info, err := stream.Info(ctx)
	require.NoError(t, err)
	require.Equal(t, seq, info.State.LastSeq, "the stream's last sequence is no message")

	st, _ := h.startSeat(t.TempDir())
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if applied, synced := st.Store().Applied(provisioner.BucketApplied); !synced || applied < seq-1 {
			return fmt.Errorf("applied %d, synced %v", applied, synced)
		}
		return nil
	})

	a, _, err := natstest.Ask(h.nc, query.Subject, []byte(fmt.Sprintf(`{"what":"applied","node":"n9","min_seq":%d,"wait_ms":2000}`, seq)), false)
	require.NoError(t, err, "min_seq of the removed message")
	require.GreaterOrEqual(t, a.AsOf, seq)
	require.Empty(t, a.Rows)

	// A sequence not written yet is not reached by it.
	_, _, err = natstest.Ask(h.nc, query.Subject, []byte(fmt.Sprintf(`{"what":"applied","node":"n9","min_seq":%d,"wait_ms":300}`, seq+1)), false)
	require.Equal(t, 504, verbCode(err), "%v", err)

	// The next write is read as any other.
	next, err := kv.Put(ctx, "n9.m", mp(t, "here"))
	require.NoError(t, err)
	require.Equal(t, seq+1, next)
	a, _, err = natstest.Ask(h.nc, query.Subject, []byte(fmt.Sprintf(`{"what":"applied","node":"n9","min_seq":%d,"wait_ms":10000}`, next)), false)
	require.NoError(t, err)
	require.Len(t, a.Rows, 1)
	require.GreaterOrEqual(t, a.AsOf, next)
}
