package replay_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/replay"
)

// keyHistory is a key's history as a source tells it: its revisions, and the floor and gaps.
func keyHistory(t *testing.T, each func(fn func(*replay.Revision) error) (replay.KeyHistory, error)) ([]replay.Revision, replay.KeyHistory) {
	t.Helper()
	var revs []replay.Revision
	h, err := each(func(r *replay.Revision) error {
		c := *r
		c.Value = append([]byte(nil), r.Value...)
		revs = append(revs, c)
		return nil
	})
	require.NoError(t, err)
	return revs, h
}

// TestEachRevisionInStream_AnAnswerLateBeyondItsFetchIsNotLost: a pull with no wait is given up by
// nats.go after a second without a message, and what the server sends it later goes to an inbox nobody
// listens to. The read took that for the end (nothing was pending any more: it had all been sent),
// so a server or link slow for a second cut the stream's sequences short: the gaps a history from the
// streams said were not the stream's (a message removed later not seen, the gap closed too early).
// It now sees that the consumer delivered more than it read, and reads on from the last message it read.
func TestEachRevisionInStream_AnAnswerLateBeyondItsFetchIsNotLost(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	admin, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	b := provisioner.BucketNeeds
	var ops []fixtures.Op
	for i := 0; i < 6000; i++ {
		ops = append(ops, fixtures.Op{Bucket: b, Key: fmt.Sprintf("n1.m.config.k%04d", i), Op: provisioner.OpPut, Value: []byte{1}})
	}
	require.NoError(t, fixtures.Load(ctx, js, ops, 0, nil))
	// The first message, and one past the first 4096 read, removed unread: the sequences are read.
	s, err := js.Stream(ctx, provisioner.StreamName(b))
	require.NoError(t, err)
	for _, k := range []string{"n1.m.config.k0000", "n1.m.config.k5000"} {
		require.NoError(t, s.Purge(ctx, jetstream.WithPurgeSubject(provisioner.SubjectPrefix(b)+k)))
	}
	key := "n1.m.config.k5999"

	fromNATS, err := replay.FromNATS(ctx, js, []string{b}, "nats", nil)
	require.NoError(t, err)
	defer fromNATS.Close()
	wantRevs, want := keyHistory(t, func(fn func(*replay.Revision) error) (replay.KeyHistory, error) {
		return fromNATS.EachRevision(ctx, b, key, fn)
	})
	require.NotEmpty(t, want.Gaps)

	// Through a link that holds what the server sends once the first 4096 sequences are read, until
	// the read, its fetch given up, asks the consumer what is left.
	var infos atomic.Int64
	sub, err := admin.Subscribe("$JS.API.CONSUMER.INFO."+provisioner.StreamName(b)+".>", func(*nats.Msg) { infos.Add(1) })
	require.NoError(t, err)
	defer sub.Unsubscribe()
	require.NoError(t, admin.Flush())
	proxy := natstest.RunProxy(t, ns.Addr().String())
	_, pjs := natstest.Connect(t, proxy.URL())
	var hold sync.Once
	var wg sync.WaitGroup
	defer wg.Wait()
	progress := func(done, _ int64) {
		if done < 4096 {
			return
		}
		hold.Do(func() {
			proxy.Hold()
			seen := infos.Load()
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer proxy.Release()
				natstest.CheckFor(t, 30*time.Second, 10*time.Millisecond, func() error {
					if infos.Load() == seen {
						return errors.New("the consumer not asked yet")
					}
					return nil
				})
			}()
		})
	}
	gotRevs, got := keyHistory(t, func(fn func(*replay.Revision) error) (replay.KeyHistory, error) {
		return replay.EachRevisionInStream(ctx, pjs, b, key, progress, fn)
	})
	wg.Wait()
	require.Equal(t, wantRevs, gotRevs)
	require.Equal(t, want, got, "the gaps of the stream's sequences, all of them read")
	require.Zero(t, consumers(t, s), "the consumer given up on and the one read on with are deleted")
}

// consumers counts the consumers on a stream.
func consumers(t *testing.T, s jetstream.Stream) int {
	t.Helper()
	n := 0
	l := s.ListConsumers(context.Background())
	for range l.Info() {
		n++
	}
	require.NoError(t, l.Err())
	return n
}

// TestEachRevisionInStream_StoppedLeavesNoConsumer: stopped while it reads the key's revisions, or the
// stream's sequences, or by an error of its caller, the read deletes its consumer: none is left on the
// server for its inactive threshold (five minutes).
func TestEachRevisionInStream_StoppedLeavesNoConsumer(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	b, key := provisioner.BucketNeeds, "n1.m.config.k5"
	var ops []fixtures.Op
	for i := 0; i < 6000; i++ {
		ops = append(ops, fixtures.Op{Bucket: b, Key: fmt.Sprintf("n1.m.config.k%d", i), Op: provisioner.OpPut, Value: []byte{1}})
	}
	for i := 0; i < 10; i++ { // two more than the bucket keeps: the stream's sequences are read
		ops = append(ops, fixtures.Op{Bucket: b, Key: key, Op: provisioner.OpPut, Value: []byte{1}})
	}
	require.NoError(t, fixtures.Load(ctx, js, ops, 0, nil))
	s, err := js.Stream(ctx, provisioner.StreamName(b))
	require.NoError(t, err)
	boom := errors.New("boom")
	for name, c := range map[string]struct {
		progress func(context.CancelFunc) replay.Progress
		fn       func(context.CancelFunc) error
		want     error
	}{
		"cancelled in the revisions": {fn: func(cancel context.CancelFunc) error { cancel(); return nil }, want: context.Canceled},
		"cancelled in the sequences": {progress: func(cancel context.CancelFunc) replay.Progress {
			return func(done, total int64) {
				if done < total {
					cancel()
				}
			}
		}, want: context.Canceled},
		"the caller's error": {fn: func(context.CancelFunc) error { return boom }, want: boom},
	} {
		t.Run(name, func(t *testing.T) {
			cctx, cancel := context.WithCancel(ctx)
			defer cancel()
			var progress replay.Progress
			if c.progress != nil {
				progress = c.progress(cancel)
			}
			_, err := replay.EachRevisionInStream(cctx, js, b, key, progress, func(*replay.Revision) error {
				if c.fn != nil {
					return c.fn(cancel)
				}
				return nil
			})
			require.ErrorIs(t, err, c.want)
			require.Zero(t, consumers(t, s))
		})
	}
}

// TestEachRevisionInStream_AStreamRecreatedMeanwhileIsRefused: a bucket deleted and made again while
// its key's history was read from the stream gave the revisions of the one and the gaps of the other,
// with no word of it. Read as the store reads it (Fill), such a stream is refused; so is it here.
func TestEachRevisionInStream_AStreamRecreatedMeanwhileIsRefused(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	b, key := provisioner.BucketNeeds, "n1.m.config.a"
	var ops []fixtures.Op
	for i := 0; i < 10; i++ { // two more than the bucket keeps: the stream lacks its first two
		ops = append(ops, fixtures.Op{Bucket: b, Key: key, Op: provisioner.OpPut, Value: []byte{byte(i)}})
	}
	require.NoError(t, fixtures.Load(ctx, js, ops, 0, nil))
	n := 0
	_, err := replay.EachRevisionInStream(ctx, js, b, key, nil, func(*replay.Revision) error {
		if n++; n == 1 {
			require.NoError(t, js.DeleteStream(ctx, provisioner.StreamName(b)))
			require.NoError(t, fixtures.Load(ctx, js, ops[:1], 0, nil))
		}
		return nil
	})
	require.ErrorContains(t, err, "was recreated while it was read")
}
