package streamread_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/internal/streamread"
)

// stream creates a stream on subject s.> holding n messages, s.0 to s.<n-1> at sequences 1 to n.
func stream(t *testing.T, n int) (jetstream.JetStream, jetstream.Stream) {
	t.Helper()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	s, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "S", Subjects: []string{"s.>"}, Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	for i := range n {
		_, err := js.Publish(ctx, fmt.Sprintf("s.%d", i), nil)
		require.NoError(t, err)
	}
	return js, s
}

// readAll reads n messages with next (a Reader's Next, or a consumed's next) and returns their stream
// sequences, checking each message's subject.
func readAll(t *testing.T, next func(context.Context) (jetstream.Msg, *jetstream.MsgMetadata, error), n int) []uint64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var seqs []uint64
	for range n {
		msg, md, err := next(ctx)
		require.NoError(t, err)
		require.Equal(t, fmt.Sprintf("s.%d", md.Sequence.Stream-1), msg.Subject())
		seqs = append(seqs, md.Sequence.Stream)
	}
	return seqs
}

func seqs(from, to uint64) []uint64 {
	var s []uint64
	for q := from; q <= to; q++ {
		s = append(s, q)
	}
	return s
}

// TestReader_InOrder: a stream is read from its first message, or from the one after a given
// sequence, every message once and in order, in pulls smaller than the stream; Delivered counts what
// Next returned.
// Pulls counted in messages or bounded by bytes (a few messages' worth) read the same.
func TestReader_InOrder(t *testing.T) {
	_, s := stream(t, 250)
	for _, pull := range []struct{ msgs, bytes int }{{msgs: 64}, {bytes: 500}} {
		for _, after := range []uint64{0, 1, 200, 249} {
			cons, err := streamread.Create(context.Background(), s, "", after)
			require.NoError(t, err)
			r, err := streamread.Read(cons, pull.msgs, pull.bytes)
			require.NoError(t, err)
			require.Equal(t, seqs(after+1, 250), readAll(t, r.Next, int(250-after)), "after %d, pulls %+v", after, pull)
			require.Equal(t, 250-after, r.Delivered())
			r.Stop()
		}
	}
}

// TestReader_WaitsUntilCancelled: with nothing left to read, Next waits for the next message and
// returns it; cancelled meanwhile, it returns the context's error at once, and the Reader still reads
// afterwards.
func TestReader_WaitsUntilCancelled(t *testing.T) {
	js, s := stream(t, 2)
	cons, err := streamread.Create(context.Background(), s, "", 0)
	require.NoError(t, err)
	r, err := streamread.Read(cons, 0, streamread.MaxBytes)
	require.NoError(t, err)
	defer r.Stop()
	readAll(t, r.Next, 2)

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, _, err := r.Next(ctx)
		done <- err
	}()
	cancel()
	select {
	case err := <-done:
		require.ErrorIs(t, err, context.Canceled)
	case <-time.After(10 * time.Second):
		t.Fatal("Next did not return once its context was cancelled")
	}

	_, err = js.Publish(context.Background(), "s.2", nil)
	require.NoError(t, err)
	require.Equal(t, []uint64{3}, readAll(t, r.Next, 1), "the Reader reads on after a cancelled Next")
}

// TestReader_ConsumerDeleted: a consumer deleted under the reader is an error of Next, not a wait
// without end; a new consumer created from the last sequence read goes on with the next message.
func TestReader_ConsumerDeleted(t *testing.T) {
	js, s := stream(t, 3)
	cons, err := streamread.Create(context.Background(), s, "", 0)
	require.NoError(t, err)
	r, err := streamread.Read(cons, 0, streamread.MaxBytes)
	require.NoError(t, err)
	defer r.Stop()
	readAll(t, r.Next, 3)

	require.NoError(t, s.DeleteConsumer(context.Background(), cons.CachedInfo().Name))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, _, err = r.Next(ctx)
	require.Error(t, err)
	require.NotErrorIs(t, err, context.DeadlineExceeded, "the loss is said, within two heartbeats")

	_, err = js.Publish(context.Background(), "s.3", nil)
	require.NoError(t, err)
	cons, err = streamread.Create(context.Background(), s, "", 3)
	require.NoError(t, err)
	r2, err := streamread.Read(cons, 0, streamread.MaxBytes)
	require.NoError(t, err)
	defer r2.Stop()
	require.Equal(t, []uint64{4}, readAll(t, r2.Next, 1))
}

// TestReader_StopEndsAWaitingNext: Stop, from another goroutine, ends a Next waiting for a message.
func TestReader_StopEndsAWaitingNext(t *testing.T) {
	_, s := stream(t, 0)
	cons, err := streamread.Create(context.Background(), s, "", 0)
	require.NoError(t, err)
	r, err := streamread.Read(cons, 0, streamread.MaxBytes)
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() {
		_, _, err := r.Next(context.Background())
		done <- err
	}()
	time.Sleep(50 * time.Millisecond) // let Next start waiting; it must end either way
	r.Stop()
	select {
	case err := <-done:
		require.True(t, errors.Is(err, jetstream.ErrMsgIteratorClosed), "%v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("Next did not return once the Reader was stopped")
	}
}

// TestCreate_UnderTheCallersContext: the consumer is created under the caller's context, so a create
// on a context already ended sends nothing and fails at once, and the consumer created is the ordered
// consumer's kind: no acks, one replica in memory, going by itself once left behind.
func TestCreate_UnderTheCallersContext(t *testing.T) {
	_, s := stream(t, 1)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := streamread.Create(ctx, s, "", 0)
	require.ErrorIs(t, err, context.Canceled)

	cons, err := streamread.Create(context.Background(), s, "", 0)
	require.NoError(t, err)
	cfg := cons.CachedInfo().Config
	require.Equal(t, jetstream.AckNonePolicy, cfg.AckPolicy)
	require.True(t, cfg.MemoryStorage)
	require.Equal(t, 1, cfg.Replicas)
	require.Equal(t, 5*time.Minute, cfg.InactiveThreshold)
}

// TestReader_LateHeartbeatsOfAConsumerStillThere: heartbeats that come late (the client heard nothing
// from its server for more than two of them, a loaded process) are confirmed with one CONSUMER.INFO,
// and the Reader reads on from the same consumer, without an error that has its caller create another
// one: with thousands of idle consumers, each late heartbeat cost a CONSUMER.CREATE.
//
// Consume confirms them the same way, on its own goroutine while nats.go reads on.
func TestReader_LateHeartbeatsOfAConsumerStillThere(t *testing.T) {
	for _, consumeIt := range []bool{false, true} {
		name := map[bool]string{false: "Next", true: "Consume"}[consumeIt]
		t.Run(name+", nothing in flight", func(t *testing.T) { lateHeartbeats(t, false, consumeIt) })
		// The message was delivered while the client heard nothing: it comes behind the late
		// heartbeats, after the consumer's info says it was delivered.
		t.Run(name+", a message in flight", func(t *testing.T) { lateHeartbeats(t, true, consumeIt) })
	}
}

func lateHeartbeats(t *testing.T, inFlight, consumeIt bool) {
	ns := natstest.RunServer(t)
	admin, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	_, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "S", Subjects: []string{"s.>"}, Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	_, err = js.Publish(ctx, "s.0", nil)
	require.NoError(t, err)
	infos := countAPI(t, admin, "$JS.API.CONSUMER.INFO.>")
	creates := countAPI(t, admin, "$JS.API.CONSUMER.CREATE.>")

	proxy := natstest.RunProxy(t, ns.Addr().String())
	_, pjs := natstest.Connect(t, proxy.URL())
	s, err := pjs.Stream(ctx, "S")
	require.NoError(t, err)
	cons, err := streamread.Create(ctx, s, "", 0)
	require.NoError(t, err)
	next, _ := reader(t, cons, 0, streamread.MaxBytes, consumeIt)
	readAll(t, next, 1)

	type result struct {
		seq uint64
		err error
	}
	done := make(chan result, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		_, md, err := next(ctx)
		if err != nil {
			done <- result{err: err}
			return
		}
		done <- result{seq: md.Sequence.Stream}
	}()
	// Silence from the server until the Reader has missed two heartbeats and asks whether its consumer
	// is still there (the old Reader gave up instead).
	proxy.Hold()
	if inFlight {
		_, err = js.Publish(ctx, "s.1", nil)
		require.NoError(t, err)
	}
	natstest.CheckFor(t, 30*time.Second, 10*time.Millisecond, func() error {
		if infos.Load() == 0 && len(done) == 0 {
			return errors.New("no heartbeat missed yet")
		}
		return nil
	})
	proxy.Release()
	if !inFlight {
		_, err = js.Publish(ctx, "s.1", nil)
		require.NoError(t, err)
	}
	res := <-done
	require.NoError(t, res.err, "late heartbeats of a consumer still there are no loss")
	require.Equal(t, uint64(2), res.seq)
	require.Equal(t, int64(1), creates.Load(), "read on from the same consumer")
}

// countAPI counts the JetStream API requests on subject that nc's account sends.
func countAPI(t *testing.T, nc *nats.Conn, subject string) *atomic.Int64 {
	t.Helper()
	var n atomic.Int64
	sub, err := nc.Subscribe(subject, func(*nats.Msg) { n.Add(1) })
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	require.NoError(t, nc.Flush())
	return &n
}

// largeStream creates a stream on subject s.> holding sizes[i] bytes at s.<i>, sequence i+1, on a
// server taking messages up to maxPayload bytes (0: NATS's default, 1 MB).
func largeStream(t *testing.T, maxPayload int, sizes []int) (*nats.Conn, jetstream.Stream) {
	t.Helper()
	var ns interface{ ClientURL() string }
	if maxPayload == 0 {
		ns = natstest.RunServer(t)
	} else {
		conf := filepath.Join(t.TempDir(), "nats.conf")
		require.NoError(t, os.WriteFile(conf, fmt.Appendf(nil, "max_payload: %d\n", maxPayload), 0o644))
		ns = natstest.RunServerAt(t, "127.0.0.1:-1", t.TempDir(), conf)
	}
	nc, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	s, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "S", Subjects: []string{"s.>"}, Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	for i, n := range sizes {
		data := bytes.Repeat([]byte{byte(i)}, n)
		_, err := js.Publish(ctx, fmt.Sprintf("s.%d", i), data)
		require.NoError(t, err)
	}
	return nc, s
}

// TestReader_BoundedByBytes: a read of large values holds no more than its bound of messages pulled
// and not yet read, where a pull of 4096 messages held the whole stream (every value of it, to be
// read one at a time), and reads every message in order. The messages the consumer delivered and the
// Reader has not returned are what the client holds (in nats.go's buffer, or on their way to it): the
// server's count says so without sampling a heap shared with the server.
//
// Consume holds no more: what its handle has not taken (here, one message at a time) is what nats.go
// holds.
func TestReader_BoundedByBytes(t *testing.T) {
	t.Run("Next", func(t *testing.T) { boundedByBytes(t, false) })
	t.Run("Consume", func(t *testing.T) { boundedByBytes(t, true) })
}

// reader reads cons with Next (Read) or with Consume, one message a call of next; read is how many
// next returned.
func reader(t *testing.T, cons jetstream.Consumer, pull, bytes int, consumeIt bool) (next func(context.Context) (jetstream.Msg, *jetstream.MsgMetadata, error), read func() uint64) {
	t.Helper()
	if consumeIt {
		c := consume(t, cons, pull, bytes)
		return c.next, c.taken.Load
	}
	r, err := streamread.Read(cons, pull, bytes)
	require.NoError(t, err)
	t.Cleanup(r.Stop)
	return r.Next, r.Delivered
}

func boundedByBytes(t *testing.T, consumeIt bool) {
	const n, size, bound = 24, 256 << 10, 1 << 20 // 6 MiB of values, read 1 MiB at most at a time
	sizes := make([]int, n)
	for i := range sizes {
		sizes[i] = size
	}
	_, s := largeStream(t, 0, sizes)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cons, err := streamread.Create(ctx, s, "", 0)
	require.NoError(t, err)
	next, read := reader(t, cons, 0, bound, consumeIt)

	held := func() int {
		ci, err := cons.Info(ctx)
		require.NoError(t, err)
		return int(ci.Delivered.Consumer - read())
	}
	for i := range n {
		msg, md, err := next(ctx)
		require.NoError(t, err)
		require.Equal(t, uint64(i+1), md.Sequence.Stream)
		require.Equal(t, fmt.Sprintf("s.%d", i), msg.Subject())
		require.Equal(t, bytes.Repeat([]byte{byte(i)}, size), msg.Data())
		if i == 0 {
			// Once the pulls the Reader made are done with (cut short by their bytes), or the stream is
			// delivered to its end: nothing more comes until the Reader reads on.
			natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
				ci, err := cons.Info(ctx)
				require.NoError(t, err)
				if ci.NumWaiting != 0 && ci.NumPending != 0 {
					return fmt.Errorf("a pull still delivering: %d delivered", ci.Delivered.Consumer)
				}
				return nil
			})
		}
		require.LessOrEqual(t, held()*size, bound, "messages delivered and not read after %d read", i+1)
	}
}

// TestPullBytes_LargerThanTheBound: a message larger than the bound asked for, which the server's max
// payload lets through, is pulled all the same (PullBytes raises the bound to that max payload), and
// so are those around it: a pull bounded below it would never deliver it, and the read would wait for
// ever.
func TestPullBytes_LargerThanTheBound(t *testing.T) {
	t.Run("Next", func(t *testing.T) { largerThanTheBound(t, false) })
	t.Run("Consume", func(t *testing.T) { largerThanTheBound(t, true) })
}

func largerThanTheBound(t *testing.T, consumeIt bool) {
	const asked, maxPayload = 1 << 20, 2 << 20
	sizes := []int{10, asked + 512<<10, 20, maxPayload, 30}
	nc, s := largeStream(t, maxPayload, sizes)
	bound := streamread.PullBytes(nc, asked)
	require.Greater(t, bound, maxPayload)
	require.Equal(t, streamread.MaxBytes, streamread.PullBytes(nc, 0), "the default bound holds a max payload")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cons, err := streamread.Create(ctx, s, "", 0)
	require.NoError(t, err)
	next, _ := reader(t, cons, 0, bound, consumeIt)
	for i, n := range sizes {
		msg, md, err := next(ctx)
		require.NoError(t, err, "message %d", i+1)
		require.Equal(t, uint64(i+1), md.Sequence.Stream)
		require.Len(t, msg.Data(), n)
	}
}

// TestReader_ConsumerLostWhileAway: a consumer deleted while the client was cut off from its server
// (the deletion's notice lost with the connection) is found lost by its missed heartbeats once the
// client is back: an error, within two heartbeats and a CONSUMER.INFO, not a wait without end. Next
// and Consume alike.
func TestReader_ConsumerLostWhileAway(t *testing.T) {
	for _, consumeIt := range []bool{false, true} {
		t.Run(map[bool]string{false: "Next", true: "Consume"}[consumeIt], func(t *testing.T) {
			ns := natstest.RunServer(t)
			_, js := natstest.Connect(t, ns.ClientURL())
			ctx := context.Background()
			s, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "S", Subjects: []string{"s.>"}, Storage: jetstream.MemoryStorage})
			require.NoError(t, err)
			_, err = js.Publish(ctx, "s.0", nil)
			require.NoError(t, err)
			proxy := natstest.RunProxy(t, ns.Addr().String())
			_, pjs := natstest.Connect(t, proxy.URL())
			ps, err := pjs.Stream(ctx, "S")
			require.NoError(t, err)
			cons, err := streamread.Create(ctx, ps, "", 0)
			require.NoError(t, err)
			next, _ := reader(t, cons, 0, streamread.MaxBytes, consumeIt)
			readAll(t, next, 1)

			proxy.Hold()
			require.NoError(t, s.DeleteConsumer(ctx, cons.CachedInfo().Name))
			time.Sleep(100 * time.Millisecond) // the server's notice to the pull, held back
			proxy.Cut()
			proxy.Release()
			rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			_, _, err = next(rctx)
			require.Error(t, err)
			require.NotErrorIs(t, err, context.DeadlineExceeded, "the loss is said")
		})
	}
}
