package streamread_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/internal/streamread"
)

// consumed is a Consume read one message at a time, as Next reads: its handle hands each message
// over and waits until the test takes it.
type consumed struct {
	msgs  chan consumedMsg
	done  chan struct{} // closed once Consume returned, err
	err   error
	taken atomic.Uint64
	stop  context.CancelFunc
}

type consumedMsg struct {
	msg jetstream.Msg
	md  *jetstream.MsgMetadata
}

// consume starts Consume on cons (pulls as Read's) until the test ends.
func consume(t *testing.T, cons jetstream.Consumer, pull, bytes int) *consumed {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	c := &consumed{msgs: make(chan consumedMsg), done: make(chan struct{}), stop: cancel}
	go func() {
		defer close(c.done)
		c.err = streamread.Consume(ctx, cons, pull, bytes, streamread.Heartbeat, nil, func(msg jetstream.Msg, md *jetstream.MsgMetadata) error {
			kept := *md // md is the next message's once handle returned
			select {
			case c.msgs <- consumedMsg{msg, &kept}:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		})
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-c.done:
		case <-time.After(10 * time.Second):
			t.Error("Consume did not return once its context was cancelled")
		}
	})
	return c
}

// next returns the next message Consume handed over, or the error it returned.
func (c *consumed) next(ctx context.Context) (jetstream.Msg, *jetstream.MsgMetadata, error) {
	select {
	case m := <-c.msgs:
		c.taken.Add(1)
		return m.msg, m.md, nil
	case <-c.done:
		return nil, nil, c.err
	case <-ctx.Done():
		return nil, nil, ctx.Err()
	}
}

// TestConsume_InOrder: Consume reads as Next does (TestReader_InOrder): every message once and in
// order, from the first or from the one after a given sequence, pulled by messages, by bytes, or by
// messages each pull bounded by bytes.
func TestConsume_InOrder(t *testing.T) {
	_, s := stream(t, 250)
	for _, pull := range []struct{ msgs, bytes int }{{msgs: 64}, {bytes: 500}, {msgs: 64, bytes: 500}} {
		for _, after := range []uint64{0, 1, 200, 249} {
			cons, err := streamread.Create(context.Background(), s, "", after)
			require.NoError(t, err)
			c := consume(t, cons, pull.msgs, pull.bytes)
			require.Equal(t, seqs(after+1, 250), readAll(t, c.next, int(250-after)), "after %d, pulls %+v", after, pull)
			c.stop()
			<-c.done
			require.ErrorIs(t, c.err, context.Canceled)
		}
	}
}

// TestConsume_WaitsUntilCancelled: with nothing left to read, Consume waits for the next message and
// hands it over; its context cancelled, it returns the context's error at once.
func TestConsume_WaitsUntilCancelled(t *testing.T) {
	js, s := stream(t, 2)
	cons, err := streamread.Create(context.Background(), s, "", 0)
	require.NoError(t, err)
	c := consume(t, cons, 0, streamread.MaxBytes)
	readAll(t, c.next, 2)
	_, err = js.Publish(context.Background(), "s.2", nil)
	require.NoError(t, err)
	require.Equal(t, []uint64{3}, readAll(t, c.next, 1))
	c.stop()
	select {
	case <-c.done:
		require.ErrorIs(t, c.err, context.Canceled)
	case <-time.After(10 * time.Second):
		t.Fatal("Consume did not return once its context was cancelled")
	}
}

// TestConsume_HandleFails: handle's error ends Consume with that error, and handle is called no more.
func TestConsume_HandleFails(t *testing.T) {
	_, s := stream(t, 10)
	cons, err := streamread.Create(context.Background(), s, "", 0)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	failure := errors.New("failed")
	var calls atomic.Int64
	err = streamread.Consume(ctx, cons, 0, streamread.MaxBytes, streamread.Heartbeat, nil, func(jetstream.Msg, *jetstream.MsgMetadata) error {
		if calls.Add(1) == 3 {
			return failure
		}
		return nil
	})
	require.ErrorIs(t, err, failure)
	time.Sleep(100 * time.Millisecond) // the seven messages left, were they handed on
	require.Equal(t, int64(3), calls.Load())
}

// TestConsume_ReturnsOnceNoHandleRuns: Consume, its context cancelled while handle runs, returns only
// after handle did, and calls it no more: its caller may then close what handle sends to (the
// projector closes the channel its reader hands messages over).
func TestConsume_ReturnsOnceNoHandleRuns(t *testing.T) {
	js, s := stream(t, 1)
	cons, err := streamread.Create(context.Background(), s, "", 0)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	var running, after atomic.Int64
	var returned atomic.Bool
	done := make(chan error, 1)
	go func() {
		done <- streamread.Consume(ctx, cons, 0, streamread.MaxBytes, streamread.Heartbeat, nil, func(jetstream.Msg, *jetstream.MsgMetadata) error {
			if returned.Load() {
				after.Add(1)
			}
			running.Add(1)
			defer running.Add(-1)
			<-ctx.Done()
			time.Sleep(200 * time.Millisecond) // handle is slow to see it
			return ctx.Err()
		})
	}()
	natstest.CheckFor(t, 10*time.Second, time.Millisecond, func() error {
		if running.Load() == 0 {
			return errors.New("handle not called yet")
		}
		return nil
	})
	cancel()
	require.ErrorIs(t, <-done, context.Canceled)
	returned.Store(true)
	require.Equal(t, int64(0), running.Load(), "handle still ran when Consume returned")
	_, err = js.Publish(context.Background(), "s.1", nil)
	require.NoError(t, err)
	time.Sleep(100 * time.Millisecond)
	require.Equal(t, int64(0), after.Load(), "handle called after Consume returned")
}

// TestConsume_ConsumerDeleted: a consumer deleted under Consume ends it with an error, not a wait
// without end; a new consumer created from the last sequence read goes on with the next message.
func TestConsume_ConsumerDeleted(t *testing.T) {
	js, s := stream(t, 3)
	cons, err := streamread.Create(context.Background(), s, "", 0)
	require.NoError(t, err)
	c := consume(t, cons, 0, streamread.MaxBytes)
	readAll(t, c.next, 3)

	require.NoError(t, s.DeleteConsumer(context.Background(), cons.CachedInfo().Name))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, _, err = c.next(ctx)
	require.Error(t, err)
	require.NotErrorIs(t, err, context.DeadlineExceeded, "the loss is said, within two heartbeats")

	_, err = js.Publish(context.Background(), "s.3", nil)
	require.NoError(t, err)
	cons, err = streamread.Create(context.Background(), s, "", 3)
	require.NoError(t, err)
	require.Equal(t, []uint64{4}, readAll(t, consume(t, cons, 0, streamread.MaxBytes).next, 1))
}
