package projector_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/internal/natstest"
)

// TestProjector_StopDeletesItsConsumers: a projector stopped while its buckets still read (a seat
// stopped, a rebuild abandoned or swapped, during a first read of thousands of composed-<node>
// buckets, before they park) deletes their consumers rather than leave each on the server until its
// inactive threshold, 5 minutes later.
func TestProjector_StopDeletesItsConsumers(t *testing.T) {
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	const n = 3
	composedBuckets(t, js, n)
	r := restartable{t: t, url: ns.ClientURL(), dir: t.TempDir(), every: 100 * time.Millisecond, verify: time.Hour}
	p, db, stop := r.start(nil)
	for i := range n {
		b := fmt.Sprintf("composed-n%04d", i)
		waitApplied(t, db, b, 1)
		require.False(t, p.Parked(b), "%s parks only after an hour", b)
		require.Equal(t, 1, consumers(t, js, b), "%s reads through a consumer", b)
	}
	stop()
	for i := range n {
		b := fmt.Sprintf("composed-n%04d", i)
		require.Zero(t, consumers(t, js, b), "%s: its consumer outlived the projector's stop", b)
	}
}

// answerLost is a JetStream whose consumer creations reach the server, which creates the consumer,
// but whose answer the projector never gets before its context ends: a stop while the JetStream API
// is slow to answer. created is told each time one is created.
type answerLost struct {
	jetstream.JetStream
	created chan<- string
}

func (j answerLost) create(ctx context.Context, create func(context.Context) (jetstream.Consumer, error)) (jetstream.Consumer, error) {
	cons, err := create(context.WithoutCancel(ctx))
	if err != nil {
		return nil, err
	}
	j.created <- cons.CachedInfo().Name
	<-ctx.Done()
	return nil, ctx.Err()
}

func (j answerLost) CreateConsumer(ctx context.Context, stream string, cfg jetstream.ConsumerConfig) (jetstream.Consumer, error) {
	return j.create(ctx, func(ctx context.Context) (jetstream.Consumer, error) {
		return j.JetStream.CreateConsumer(ctx, stream, cfg)
	})
}

func (j answerLost) Stream(ctx context.Context, name string) (jetstream.Stream, error) {
	s, err := j.JetStream.Stream(ctx, name)
	if err != nil {
		return nil, err
	}
	return answerLostStream{Stream: s, j: j}, nil
}

type answerLostStream struct {
	jetstream.Stream
	j answerLost
}

func (s answerLostStream) CreateConsumer(ctx context.Context, cfg jetstream.ConsumerConfig) (jetstream.Consumer, error) {
	return s.j.create(ctx, func(ctx context.Context) (jetstream.Consumer, error) { return s.Stream.CreateConsumer(ctx, cfg) })
}

// TestProjector_StopWhileAConsumerIsCreated: a projector stopped while a bucket's consumer is being
// created, the request sent and the consumer created by the server but its answer not yet back,
// deletes that consumer too. Before, the tail knew no name to delete: a stop during a first read of
// thousands of buckets left up to 16 such consumers (as many as are set up at once) to the server's
// inactive threshold, 5 minutes (3 and 11 in two of six stops of 1,000 buckets mid-read).
func TestProjector_StopWhileAConsumerIsCreated(t *testing.T) {
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	composedBuckets(t, js, 1)
	const b = "composed-n0000"
	_, pjs := natstest.Connect(t, ns.ClientURL())
	created := make(chan string, 1)
	p, _, _ := parkingQuiet(t, answerLost{JetStream: pjs, created: created}, pjs, nil, nil)
	select {
	case <-created:
	case <-time.After(30 * time.Second):
		t.Fatal("no consumer created")
	}
	require.Equal(t, 1, consumers(t, js, b))
	p.Stop()
	require.Zero(t, consumers(t, js, b), "the consumer whose creation the stop cut short outlived the projector")
}
