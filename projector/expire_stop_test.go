package projector_test

import (
	"context"
	"fmt"
	"log/slog"
	"runtime"
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
	p := startProjector(t, pjs, db, projector.Options{Buckets: []string{bucket},
		Logger: slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})

	const old, only, later, live = "n1.m1.config.old", "n1.m1.config.only", "n1.m1.config.later", "n1.m1.config.live"
	keys := []string{old, only, later, live}
	v1, v2 := []byte{0x81, 0xa1, 'v', 0x01}, []byte{0x81, 0xa1, 'v', 0x02}
	publish := func(key string, value []byte, ttl time.Duration) uint64 {
		return putWithTTL(t, ctx, js, bucket, key, value, ttl).Seq
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
	// The ask failed (its bound ran out): not timed here, since the bound starts before the spy sees
	// the get, by as long as a loaded machine likes (877 ms was seen against the bound's 1 s).
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

// TestProjector_StopInsideAnExpiryRound: the Projector is stopped while a round asks the stream's
// leader about more due keys than one window of asks (the seat's connection holds the answers back):
// Stop returns at once, not when the asks' bound runs out, with no goroutine of the loop left, and
// nothing applied: each key's row is its put, its expiry still pending (before the round's commit).
// A Projector started again on the same store, connected straight to the server, applies every one.
func TestProjector_StopInsideAnExpiryRound(t *testing.T) {
	t.Parallel()
	const bucket = provisioner.BucketNeeds
	const n = 64 // two windows of asks
	ns := natstest.RunServer(t)
	nc, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	_, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: bucket, History: 5, LimitMarkerTTL: time.Second})
	require.NoError(t, err)
	proxy := natstest.RunProxy(t, strings.TrimPrefix(ns.ClientURL(), "nats://"))
	_, pjs := natstest.Connect(t, proxy.URL())

	getSubject := jetstream.DefaultAPIPrefix + "STREAM.MSG.GET." + provisioner.StreamName(bucket)
	spy, err := nc.SubscribeSync(getSubject)
	require.NoError(t, err)
	require.NoError(t, nc.Flush())
	v1, v2 := []byte{0x81, 0xa1, 'v', 0x01}, []byte{0x81, 0xa1, 'v', 0x02}
	keys := make([]string, n)
	older, puts := map[string]uint64{}, map[string]uint64{}
	var msgs []provisioner.Message
	publish := func(key string, value []byte, ttl time.Duration) uint64 {
		m := putWithTTL(t, ctx, js, bucket, key, value, ttl)
		msgs = append(msgs, m)
		return m.Seq
	}
	for i := range keys {
		keys[i] = fmt.Sprintf("n%d.m1.config.k%02d", i%5, i)
		older[keys[i]] = publish(keys[i], v1, 0)
	}
	for _, key := range keys {
		puts[key] = publish(key, v2, time.Second)
	}
	// The store holds what the stream does, every put due now: one round takes them all. The puts'
	// TTL is a second: the server has removed them when they are asked about again.
	for i := range msgs[n:] {
		msgs[n+i].Expires = time.Now().Add(-time.Second).UnixNano()
	}
	info, err := js.Stream(ctx, provisioner.StreamName(bucket))
	require.NoError(t, err)
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, db.Close()) })
	require.NoError(t, db.Apply(bucket, msgs, info.CachedInfo().Created.UnixNano(), false))
	require.Equal(t, n, db.Expiries())

	// The round's asks go out (a window of them); their answers are held back.
	proxy.Hold()
	p := projector.New(pjs, db, projector.Options{Buckets: []string{bucket}})
	projector.SetExpireDirect(p, false)
	p.Start(ctx)
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			p.Stop()
		}
	})
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if pending, _, _ := spy.Pending(); pending < 32 {
			return fmt.Errorf("%d asks in flight", pending)
		}
		return nil
	})

	began := time.Now()
	p.Stop()
	stopped = true
	took := time.Since(began)
	// Well under the asks' 5 s bound, which a Stop that waited them out would take, with room for a
	// loaded machine.
	require.Less(t, took, 3*time.Second, "Stop does not wait out the asks' bound (5 s)")
	stacks := make([]byte, 1<<20)
	stacks = stacks[:runtime.Stack(stacks, true)]
	// This Projector's frames (their receiver p; other tests' Projectors run beside this one).
	for _, fn := range []string{"expireLoop", "expireDue", "askLasts", "lastOfKey"} {
		frame := fmt.Sprintf("projector.(*Projector).%s(%p", fn, p)
		require.NotContains(t, string(stacks), frame, "a goroutine of the expiry loop left after Stop")
	}
	proxy.Release()

	// Each key as the round found it: its put, its expiry pending.
	rows := projected(t, db, bucket)
	require.Len(t, rows, n)
	for _, key := range keys {
		e, ok := db.PendingExpiry(bucket, key)
		require.True(t, ok, key)
		require.Equal(t, puts[key], e.Seq, key)
		require.Equal(t, fmt.Sprintf("%x@%d", v2, puts[key]), rows[key], key)
	}

	p2 := projector.New(js, db, projector.Options{Buckets: []string{bucket}})
	p2.Start(ctx)
	t.Cleanup(p2.Stop)
	want := map[string]string{}
	for _, key := range keys {
		want[key] = fmt.Sprintf("%x@%d", v1, older[key])
	}
	natstest.CheckFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		if n := db.Expiries(); n != 0 {
			return fmt.Errorf("%d pending expiries", n)
		}
		return nil
	})
	require.Equal(t, want, projected(t, db, bucket), "every put expired: its older revision again")
	t.Logf("Stop took %v", took.Round(time.Millisecond))
}
