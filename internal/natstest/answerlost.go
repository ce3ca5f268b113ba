package natstest

import (
	"context"

	"github.com/nats-io/nats.go/jetstream"
)

// AnswerLost is a JetStream whose consumer creations reach the server, which creates the consumer,
// but whose answer the reader never gets before its context ends: a stop while the JetStream API
// is slow to answer. Created is told the name of each one created.
type AnswerLost struct {
	jetstream.JetStream
	Created chan<- string
}

func (j AnswerLost) create(ctx context.Context, create func(context.Context) (jetstream.Consumer, error)) (jetstream.Consumer, error) {
	cons, err := create(context.WithoutCancel(ctx))
	if err != nil {
		return nil, err
	}
	j.Created <- cons.CachedInfo().Name
	<-ctx.Done()
	return nil, ctx.Err()
}

func (j AnswerLost) CreateConsumer(ctx context.Context, stream string, cfg jetstream.ConsumerConfig) (jetstream.Consumer, error) {
	return j.create(ctx, func(ctx context.Context) (jetstream.Consumer, error) {
		return j.JetStream.CreateConsumer(ctx, stream, cfg)
	})
}

func (j AnswerLost) Stream(ctx context.Context, name string) (jetstream.Stream, error) {
	s, err := j.JetStream.Stream(ctx, name)
	if err != nil {
		return nil, err
	}
	return answerLostStream{Stream: s, j: j}, nil
}

type answerLostStream struct {
	jetstream.Stream
	j AnswerLost
}

func (s answerLostStream) CreateConsumer(ctx context.Context, cfg jetstream.ConsumerConfig) (jetstream.Consumer, error) {
	return s.j.create(ctx, func(ctx context.Context) (jetstream.Consumer, error) { return s.Stream.CreateConsumer(ctx, cfg) })
}
