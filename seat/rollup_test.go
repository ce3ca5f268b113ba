package seat_test

import (
	"context"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/query"
)

// TestSeat_AWildcardPurgeRemovesWhatTheStreamLost: a node's client publishes a purge by hand on
// $KV.<bucket>.n1.m1.*.* (its permissions, <node>.>, allow it; nats.go's KV would refuse the key). The
// server stores it and its Nats-Rollup: sub purges every subject the wildcard matches, in the middle of
// the stream, so the stream's first sequence does not move. The bucket no longer holds those keys;
// the seat answered them still. Now it answers what the bucket holds.
func TestSeat_AWildcardPurgeRemovesWhatTheStreamLost(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	n := provisioner.BucketNeeds
	h.load([]fixtures.Op{
		{Bucket: n, Key: "n2.m1.config.a", Op: provisioner.OpPut, Value: mp(t, "kept")},
		{Bucket: n, Key: "n1.m1.config.a", Op: provisioner.OpPut, Value: mp(t, "purged")},
		{Bucket: n, Key: "n1.m1.secret.b", Op: provisioner.OpPut, Value: []byte{0xc1}}, // with its anomaly
		{Bucket: n, Key: "n1.m2.config.a", Op: provisioner.OpPut, Value: mp(t, "kept")},
	})
	require.NoError(t, fixtures.CreateBuckets(ctx, h.js, provisioner.BucketApplied, provisioner.BucketCollect))
	st, _ := h.startSeat(t.TempDir())
	h.waitCaughtUp(st)

	msg := nats.NewMsg(provisioner.SubjectPrefix(n) + "n1.m1.*.*")
	msg.Header.Set("KV-Operation", "PURGE")
	msg.Header.Set("Nats-Rollup", "sub")
	_, err := h.js.PublishMsg(ctx, msg)
	require.NoError(t, err)
	h.waitCaughtUp(st)
	require.Len(t, h.bucket(n), 2, "the server purged both keys of n1.m1")
	h.checkAnswer(map[string]any{"what": "needs"})
	h.checkAnswer(map[string]any{"what": "needs", "node": "n1"})
	a, _, err := natstest.Ask(h.nc, query.Subject, []byte(`{"what":"needs","node":"n1"}`), false)
	require.NoError(t, err)
	require.Len(t, a.Rows, 1)
	require.Equal(t, "n1.m2.config.a", a.Rows[0]["key"])
}
