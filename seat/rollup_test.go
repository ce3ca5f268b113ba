package seat_test

import (
	"context"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
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
	t.Parallel()
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

// streamKeys lists the keys a bucket's stream holds, read from the stream itself (the KV API, and a
// last-message get, read a subject with a wildcard token as a filter): those whose last message is a
// put.
func streamKeys(t *testing.T, js jetstream.JetStream, bucket string) []string {
	t.Helper()
	ctx := context.Background()
	c, err := js.OrderedConsumer(ctx, provisioner.StreamName(bucket), jetstream.OrderedConsumerConfig{})
	require.NoError(t, err)
	prefix := provisioner.SubjectPrefix(bucket)
	last := map[string]provisioner.Op{}
	for {
		msg, err := c.Next(jetstream.FetchMaxWait(5 * time.Second))
		require.NoError(t, err)
		last[strings.TrimPrefix(msg.Subject(), prefix)] = provisioner.OpOfHeaders(msg.Headers())
		md, err := msg.Metadata()
		require.NoError(t, err)
		if md.NumPending == 0 {
			break
		}
	}
	keys := []string{}
	for k, op := range last {
		if op == provisioner.OpPut {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	return keys
}

// TestSeat_ARollupOnAGreaterThanWithTokensAfterItIsLiteral: a purge published by hand on
// $KV.<bucket>.n1.>.x (n1's permissions allow it) purges nothing but that subject: the server's
// subject tree reads a > that is not the last token as itself. The seat read it as n1.> and removed
// every key of n1 (of the whole bucket for >.x), keys the bucket still holds and answers, until a
// rebuild brought them back. Each pattern is compared with what the stream holds.
func TestSeat_ARollupOnAGreaterThanWithTokensAfterItIsLiteral(t *testing.T) {
	t.Parallel()
	n := provisioner.BucketNeeds
	keys := []string{"n1.m1.config.a", "n1.m1.config.x", "n1.m1.>.x", "n1.m2.config.x", "n1.x", "x", "n2.m1.config.x"}
	for _, pattern := range []string{"n1.>.x", ">.x", "n1.*.>.x", "n1.*.config.>"} {
		t.Run(pattern, func(t *testing.T) {
			h := newHarness(t)
			ctx := context.Background()
			_, err := h.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: n, History: 4})
			require.NoError(t, err)
			require.NoError(t, fixtures.CreateBuckets(ctx, h.js, provisioner.BucketApplied, provisioner.BucketCollect))
			for _, k := range keys {
				_, err := h.js.Publish(ctx, provisioner.SubjectPrefix(n)+k, mp(t, k))
				require.NoError(t, err, k)
			}
			st, _ := h.startSeat(t.TempDir())
			h.waitCaughtUp(st)

			msg := nats.NewMsg(provisioner.SubjectPrefix(n) + pattern)
			msg.Header.Set("KV-Operation", "PURGE")
			msg.Header.Set("Nats-Rollup", "sub")
			_, err = h.js.PublishMsg(ctx, msg)
			require.NoError(t, err)
			h.waitCaughtUp(st)

			a, _, err := natstest.Ask(h.nc, query.Subject, []byte(`{"what":"needs"}`), false)
			require.NoError(t, err)
			got := []string{}
			for _, r := range a.Rows {
				got = append(got, r["key"].(string))
			}
			for _, an := range a.Anomalies { // the out-of-shape keys, which have no row
				if reason := an["reason"].(string); !strings.HasPrefix(reason, "unanswered-kind") {
					got = append(got, an["key"].(string))
				}
			}
			sort.Strings(got)
			require.Equal(t, streamKeys(t, h.js, n), got, "the keys the stream holds after the rollup on %s", pattern)
		})
	}
}
