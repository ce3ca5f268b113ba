package seat_test

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/replay"
)

// TestSeat_ASubjectAddedToABucketsStreamIsPassedOver: an operator adds a subject to a bucket's stream
// (nats stream edit) and something publishes on it. Such a message is no key of the bucket, and the
// KV never reads it; the seat stopped at it for good: nothing after it was applied, every min_seq was
// 504 and the bucket never synced, and replay and export of the streams failed the same way. Now it
// is passed over, and every path answers what follows it.
func TestSeat_ASubjectAddedToABucketsStreamIsPassedOver(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	n := provisioner.BucketNeeds
	require.NoError(t, fixtures.CreateBuckets(ctx, h.js, n, provisioner.BucketApplied, provisioner.BucketCollect))
	s, err := h.js.Stream(ctx, provisioner.StreamName(n))
	require.NoError(t, err)
	cfg := s.CachedInfo().Config
	cfg.Subjects = append(cfg.Subjects, "extra.>")
	_, err = h.js.UpdateStream(ctx, cfg)
	require.NoError(t, err)
	st, _ := h.startSeat(t.TempDir())

	publish := func(subject string) uint64 {
		m := nats.NewMsg(subject)
		m.Data = mp(t, subject)
		ack, err := h.js.PublishMsg(ctx, m)
		require.NoError(t, err)
		return ack.Sequence
	}
	publish(provisioner.SubjectPrefix(n) + "n1.m1.config.a")
	publish("extra.x")
	last := publish(provisioner.SubjectPrefix(n) + "n1.m1.config.b")

	a, _, err := natstest.Ask(h.nc, query.Subject, []byte(fmt.Sprintf(`{"what":"needs","min_seq":%d,"wait_ms":5000}`, last)), false)
	require.NoError(t, err)
	require.Len(t, a.Rows, 2)
	h.waitCaughtUp(st)
	h.checkAnswer(map[string]any{"what": "needs"})

	keys := func(l *replay.Log, at string) []string {
		b, err := l.Ask([]byte(fmt.Sprintf(`{"what":"needs","at":%q}`, at)))
		require.NoError(t, err, "%s at %s", l.Source, at)
		a := decodeAnswer(t, b, false)
		var out []string
		for _, r := range a.Rows {
			out = append(out, r.Key)
		}
		return out
	}
	fromNATS, err := replay.FromNATS(ctx, h.js, nil, "nats", nil)
	require.NoError(t, err)
	defer fromNATS.Close()
	out := filepath.Join(t.TempDir(), "nats.mph")
	_, err = replay.ExportNATS(ctx, h.js, nil, out, "test", nil)
	require.NoError(t, err)
	fromArchive, err := replay.FromArchive(ctx, out, nil)
	require.NoError(t, err)
	defer fromArchive.Close()
	for _, l := range []*replay.Log{fromNATS, fromArchive} {
		require.Equal(t, []string{"n1.m1.config.a"}, keys(l, "seq:2"), l.Source)
		require.Equal(t, []string{"n1.m1.config.a", "n1.m1.config.b"}, keys(l, fmt.Sprintf("seq:%d", last)), l.Source)
	}
}
