package projector_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
)

// TestProjector_SaysAWholeStreamRollupOnAnAddedSubject: a Nats-Rollup: all on a subject added to a
// bucket's stream empties the bucket (docs/decisions.md). The projector said only, once per tail and
// for the first such message, that messages on added subjects "are passed over": an operator reading
// the log during the incident learned nothing of the rollup that emptied the bucket, and was told it
// was passed over when it came first. Each such rollup is now said, with its subject and sequence.
func TestProjector_SaysAWholeStreamRollupOnAnAddedSubject(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	b := provisioner.BucketNeeds
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: b, Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	s, err := js.Stream(ctx, provisioner.StreamName(b))
	require.NoError(t, err)
	cfg := s.CachedInfo().Config
	cfg.Subjects = append(cfg.Subjects, "extra.>")
	_, err = js.UpdateStream(ctx, cfg)
	require.NoError(t, err)
	_, err = kv.Put(ctx, "n1.m.config.a", []byte{0xc0})
	require.NoError(t, err)
	publish := func(subject, rollup string) uint64 {
		m := nats.NewMsg(subject)
		if rollup != "" {
			m.Header.Set(provisioner.HeaderRollup, rollup)
		}
		ack, err := js.PublishMsg(ctx, m)
		require.NoError(t, err)
		return ack.Sequence
	}
	plain := publish("extra.plain", "")

	var logs natstest.LogBuffer
	cctx, cancel := context.WithCancel(context.Background())
	_, db := startWithListing(t, cctx, cancel, js, time.Second, projector.Options{Buckets: []string{b},
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, applied(db, b, plain))
	roll := publish("extra.roll", "all") // after a message on an added subject was read and said
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, applied(db, b, roll))
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		for _, line := range strings.Split(logs.String(), "\n") {
			if strings.Contains(line, "extra.roll") && strings.Contains(line, fmt.Sprintf("seq=%d", roll)) {
				require.NotContains(t, line, "passed over", "the rollup is not passed over")
				return nil
			}
		}
		return fmt.Errorf("the rollup is not said:\n%s", logs.String())
	})
}
