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
	"github.com/novox/mesh-provisioner/store"
)

// TestProjector_ExpiryDirectGetToAServerThatStops: the server a seat's direct get of expired puts'
// keys went to (a follower of the R3 bucket's stream, through a proxy that holds its answers back)
// stops before the answer reaches the seat: the answer is lost with it, none other comes. The round
// waits out its ask's bound (1 s here), asks the stream's leader over the reconnected connection, and
// applies what the stream holds, no more: the put over an older revision answers that revision again,
// the put that was its key's only message is gone (its marker), a put still held (a longer TTL) and
// a key without TTL stay.
func TestProjector_ExpiryDirectGetToAServerThatStops(t *testing.T) {
	projector.SetExpireAsk(t, time.Second) // not parallel: the bound is the package's
	const bucket = provisioner.BucketNeeds
	c := natstest.RunCluster(t, 3)
	ctx := context.Background()
	nc, js := natstest.Connect(t, c.URLs())
	stream := createR3(t, js, bucket)
	leader := streamLeader(t, c, stream)
	stops := (leader + 1) % 3
	var others []int
	for i := range c.Servers {
		if i != stops {
			others = append(others, i)
		}
	}
	proxy := natstest.RunProxy(t, strings.TrimPrefix(c.URL(stops), "nats://"))
	_, pjs := natstest.Connect(t, proxy.URL()+","+c.URLs(others...), nats.DontRandomize())
	require.Equal(t, c.Servers[stops].ID(), pjs.Conn().ConnectedServerId(), "the seat is connected to the server that stops")

	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	logs := &natstest.LogBuffer{}
	p := projector.New(pjs, db, projector.Options{Buckets: []string{bucket},
		Logger: slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	p.Start(ctx)
	t.Cleanup(func() {
		p.Stop()
		require.NoError(t, db.Close())
	})

	const old, only, later, live = "n1.m1.config.old", "n1.m1.config.only", "n1.m1.config.later", "n1.m1.config.live"
	keys := []string{old, only, later, live}
	v1, v2 := []byte{0x81, 0xa1, 'v', 0x01}, []byte{0x81, 0xa1, 'v', 0x02}
	publish := func(key string, value []byte, ttl time.Duration) uint64 {
		var opts []jetstream.PublishOpt
		if ttl > 0 {
			opts = append(opts, jetstream.WithMsgTTL(ttl))
		}
		ack, err := js.Publish(ctx, provisioner.SubjectPrefix(bucket)+key, value, opts...)
		require.NoError(t, err)
		return ack.Sequence
	}
	oldSeq := publish(old, v1, 0)
	liveSeq := publish(live, v1, 0)
	// The direct gets are seen on their way.
	directSubject := jetstream.DefaultAPIPrefix + "DIRECT.GET." + provisioner.StreamName(bucket)
	spy, err := nc.SubscribeSync(directSubject)
	require.NoError(t, err)
	require.NoError(t, nc.Flush())
	publish(old, v2, 2*time.Second)
	publish(only, v1, 2*time.Second)
	laterSeq := publish(later, v1, time.Minute)
	waitApplied(t, db, bucket, laterSeq)
	require.Equal(t, 3, db.Expiries())

	// Every answer to the seat is held back from now on, before the round (due 2 s after the puts, and
	// asked a second later) sends its direct get.
	proxy.Hold()
	n, _, err := spy.Pending()
	require.NoError(t, err)
	require.Zero(t, n, "no direct get before the hold")
	_, err = spy.NextMsg(10 * time.Second)
	require.NoError(t, err, "the round's direct get")
	asked := time.Now()
	c.Stop(stops)
	proxy.Cut()

	natstest.CheckFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		if n := db.Expiries(); n != 1 {
			return fmt.Errorf("%d pending expiries", n)
		}
		return nil
	})
	took := time.Since(asked)
	require.GreaterOrEqual(t, took, 900*time.Millisecond, "the direct get's bound waited out")
	require.Contains(t, logs.String(), "a direct get of expired puts' keys failed")
	e, ok := db.PendingExpiry(bucket, later)
	require.True(t, ok, "the put the stream still holds")
	require.Equal(t, laterSeq, e.Seq)

	actx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	want, err := held(actx, nc, bucket, keys)
	require.NoError(t, err)
	require.Equal(t, want, projected(t, db, bucket), "the store holds what the stream's leader does")
	require.Equal(t, map[string]string{
		old:   fmt.Sprintf("%x@%d", v1, oldSeq),
		later: fmt.Sprintf("%x@%d", v1, laterSeq),
		live:  fmt.Sprintf("%x@%d", v1, liveSeq),
	}, want)
	t.Logf("applied %v after the direct get was sent; %d asks", took.Round(time.Millisecond), projector.ExpireAsks(p))
}
