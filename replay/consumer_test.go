package replay_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/replay"
)

// archived is one record of an archive as written: [bucket, seq, time ns, subject, headers, data].
type archived struct {
	_msgpack struct{} `msgpack:",as_array"`
	Bucket   int
	Seq      uint64
	Time     int64
	Subject  string
	Headers  map[string][]string
	Data     []byte
}

// archiveRecords reads every record of an archive, up to its end record.
func archiveRecords(t *testing.T, path string) []archived {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	zr, err := zstd.NewReader(f)
	require.NoError(t, err)
	defer zr.Close()
	dec := msgpack.NewDecoder(zr)
	var h replay.ArchiveHeader
	require.NoError(t, dec.Decode(&h))
	var out []archived
	for {
		var r archived
		require.NoError(t, dec.Decode(&r))
		if r.Bucket == -1 {
			require.Equal(t, uint64(len(out)), r.Seq, "the end counts the records")
			return out
		}
		out = append(out, r)
	}
}

// requireArchiveIsStream asserts that an archive of one stream holds the stream's messages, each once,
// in order, with subject, headers, data and time as stored. The stream is read here in one pass of a
// consumer of its own that nothing disturbs.
func requireArchiveIsStream(t *testing.T, path string, s jetstream.Stream) {
	t.Helper()
	ctx := context.Background()
	info, err := s.Info(ctx)
	require.NoError(t, err)
	recs := archiveRecords(t, path)
	require.Len(t, recs, int(info.State.Msgs), "one record per message of the stream")
	cons, err := s.CreateConsumer(ctx, jetstream.ConsumerConfig{AckPolicy: jetstream.AckNonePolicy})
	require.NoError(t, err)
	defer s.DeleteConsumer(ctx, cons.CachedInfo().Name)
	i := 0
	for i < len(recs) {
		batch, err := cons.Fetch(len(recs)-i, jetstream.FetchMaxWait(5*time.Second))
		require.NoError(t, err)
		n := 0
		for m := range batch.Messages() {
			n++
			md, err := m.Metadata()
			require.NoError(t, err)
			r := recs[i]
			i++
			seq := md.Sequence.Stream
			require.Equal(t, seq, r.Seq, "record %d", i)
			require.Equal(t, m.Subject(), r.Subject, "seq %d", seq)
			require.Equal(t, m.Data(), r.Data, "seq %d", seq)
			require.Equal(t, md.Timestamp.UnixNano(), r.Time, "seq %d", seq)
			require.Equal(t, len(m.Headers()), len(r.Headers), "seq %d: %v", seq, r.Headers)
			for k, v := range m.Headers() {
				require.Equal(t, v, r.Headers[k], "seq %d header %s", seq, k)
			}
		}
		require.NoError(t, batch.Error())
		require.Positive(t, n, "the stream has %d messages, read %d", len(recs), i)
	}
}

// needsWithHistory writes each of n/2 needs twice, some deletes among them, into a bucket keeping one
// revision: a stream of n/2 messages, after a hole where the newer revisions replaced the older.
func needsWithHistory(t *testing.T, js jetstream.JetStream, n int) jetstream.Stream {
	t.Helper()
	ctx := context.Background()
	_, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.BucketNeeds})
	require.NoError(t, err)
	var ops []fixtures.Op
	for i := 0; i < n; i++ {
		key := fmt.Sprintf("n%d.m.config.k", i%(n/2))
		if i%97 == 0 {
			ops = append(ops, fixtures.Op{Bucket: provisioner.BucketNeeds, Key: key, Op: provisioner.OpDelete})
			continue
		}
		ops = append(ops, fixtures.Op{Bucket: provisioner.BucketNeeds, Key: key, Op: provisioner.OpPut, Value: mp(i)})
	}
	require.NoError(t, fixtures.Load(ctx, js, ops, 0, nil))
	s, err := js.Stream(ctx, provisioner.StreamName(provisioner.BucketNeeds))
	require.NoError(t, err)
	return s
}

// consumersCreated counts the consumers created on the needs' stream from now on, by their advisories.
func consumersCreated(t *testing.T, nc *nats.Conn) *atomic.Int64 {
	t.Helper()
	var n atomic.Int64
	sub, err := nc.Subscribe("$JS.EVENT.ADVISORY.CONSUMER.CREATED."+provisioner.StreamName(provisioner.BucketNeeds)+".*", func(*nats.Msg) { n.Add(1) })
	require.NoError(t, err)
	require.NoError(t, nc.Flush())
	t.Cleanup(func() { sub.Unsubscribe() })
	return &n
}

// An export whose consumer is lost midway (deleted; its server restarted) reads on through a new one
// from the message after the last it read: the archive is still the stream, message for message,
// none missing and none twice.
func TestExport_AConsumerLostMidwayIsReadAgainFromWhereItStopped(t *testing.T) {
	// Pulls of a few thousand small messages, so that the export is midway after its first.
	defer replay.SetExportPullBytes(512 << 10)()
	ctx := context.Background()
	t.Run("deleted", func(t *testing.T) {
		ns := natstest.RunServer(t)
		nc, js := natstest.Connect(t, ns.ClientURL())
		s := needsWithHistory(t, js, 24000)
		created := consumersCreated(t, nc)
		out := filepath.Join(t.TempDir(), "lost.mph")
		lost := false
		_, err := replay.ExportNATS(ctx, js, []string{provisioner.BucketNeeds}, out, "test", func(done, total int64) {
			if done > 0 && done < total && !lost {
				lost = true
				for name := range s.ConsumerNames(ctx).Name() {
					require.NoError(t, s.DeleteConsumer(ctx, name))
				}
			}
		})
		require.NoError(t, err)
		require.True(t, lost, "the consumer was deleted while the export read")
		natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
			if n := created.Load(); n < 2 {
				return fmt.Errorf("%d consumers created, want 2", n)
			}
			return nil
		})
		requireArchiveIsStream(t, out, s)
	})
	t.Run("server restarted", func(t *testing.T) {
		listen := fmt.Sprintf("127.0.0.1:%d", natstest.FreePort(t))
		dir := t.TempDir()
		ns := natstest.RunServerAt(t, listen, dir, "")
		_, js := natstest.Connect(t, ns.ClientURL())
		s := needsWithHistory(t, js, 24000)
		out := filepath.Join(t.TempDir(), "restart.mph")
		restarted := false
		_, err := replay.ExportNATS(ctx, js, []string{provisioner.BucketNeeds}, out, "test", func(done, total int64) {
			if done > 0 && done < total && !restarted {
				restarted = true
				ns.Shutdown()
				ns.WaitForShutdown()
				ns = natstest.RunServerAt(t, listen, dir, "")
			}
		})
		require.NoError(t, err)
		require.True(t, restarted, "the server restarted while the export read")
		requireArchiveIsStream(t, out, s)
	})
}

// A cancelled export (the operator's Ctrl-C) ends at once, also while its consumer is lost and the
// server leaves the request for a new one unanswered (here the user may no longer create consumers, so
// the server drops each create; a cluster without quorum does the same). nats.go's ordered consumer,
// which export read with, retried that create with a 10 s request no context reached, for ever.
func TestExport_CancelWhileAConsumerCreateGoesUnanswered(t *testing.T) {
	// Pulls of a few thousand small messages, so that the export is midway after its first.
	defer replay.SetExportPullBytes(512 << 10)()
	ns := natstest.RunServerSeatDenied(t)
	url := ns.ClientURL()
	_, ajs := natstest.Connect(t, url, nats.UserInfo("admin", "admin"))
	s := needsWithHistory(t, ajs, 24000)
	denied := make(chan error, 16)
	_, js := natstest.Connect(t, url, nats.UserInfo("seat", "seat"), nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
		if errors.Is(err, nats.ErrPermissionViolation) && strings.Contains(err.Error(), "CONSUMER.CREATE") {
			select {
			case denied <- err:
			default:
			}
		}
	}))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	out := filepath.Join(t.TempDir(), "cancelled.mph")
	done := make(chan error, 1)
	var lost atomic.Bool
	go func() {
		_, err := replay.ExportNATS(ctx, js, []string{provisioner.BucketNeeds}, out, "test", func(done, total int64) {
			if done > 0 && done < total && !lost.Load() {
				lost.Store(true)
				natstest.DenySeat(t, ns, "$JS.API.CONSUMER.CREATE.>")
				for name := range s.ConsumerNames(context.Background()).Name() {
					_ = s.DeleteConsumer(context.Background(), name)
				}
			}
		})
		done <- err
	}()
	select {
	case err := <-denied:
		t.Logf("the export asked for a new consumer: %v", err)
	case err := <-done:
		t.Fatalf("the export ended before it asked for a new consumer: %v", err)
	case <-time.After(20 * time.Second):
		t.Fatal("the export did not ask for a new consumer")
	}
	require.ErrorIs(t, endsOnCancel(t, cancel, done, "the export"), context.Canceled)
	_, serr := os.Stat(out)
	require.ErrorIs(t, serr, os.ErrNotExist, "no archive of a cancelled export")
	entries, rerr := os.ReadDir(filepath.Dir(out))
	require.NoError(t, rerr)
	require.Empty(t, entries, "nothing left where the archive would be")
}

// replay --nats reads the streams with the seat's projector, whose consumers are created and read
// under the command's context too: cancelled while the server leaves every consumer create unanswered,
// it ends at once.
func TestFromNATS_CancelWhileConsumerCreatesGoUnanswered(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServerSeatDenied(t, "$JS.API.CONSUMER.CREATE.>")
	url := ns.ClientURL()
	_, ajs := natstest.Connect(t, url, nats.UserInfo("admin", "admin"))
	needsWithHistory(t, ajs, 200)
	denied := make(chan error, 16)
	_, js := natstest.Connect(t, url, nats.UserInfo("seat", "seat"), nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
		if errors.Is(err, nats.ErrPermissionViolation) && strings.Contains(err.Error(), "CONSUMER.CREATE") {
			select {
			case denied <- err:
			default:
			}
		}
	}))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		l, err := replay.FromNATS(ctx, js, []string{provisioner.BucketNeeds}, "nats", nil)
		if err == nil {
			l.Close()
		}
		done <- err
	}()
	select {
	case <-denied:
	case err := <-done:
		t.Fatalf("replay read the streams without a consumer: %v", err)
	case <-time.After(20 * time.Second):
		t.Fatal("replay did not ask for a consumer")
	}
	require.ErrorIs(t, endsOnCancel(t, cancel, done, "replay"), context.Canceled)
}

// endsOnCancel cancels a read and returns what it ended with, failing the test when it has not ended
// within 5 s: nats.go's consumer create waits 10 s, and half of that is a hang, not a slow stop.
func endsOnCancel(t *testing.T, cancel context.CancelFunc, done <-chan error, what string) error {
	t.Helper()
	cancel()
	return natstest.Receive(t, done, 5*time.Second, what+" still runs after its context was cancelled")
}

// replay --nats (and rebuild) read until every stream is caught up; a stream that cannot be read (here
// its consumers are capped at one, which another holds: every create is refused, as for a user
// denied consumers) is given up on with the failure, once nothing was read for a while, rather than
// retried for ever without a word.
func TestFromNATS_AStreamThatCannotBeReadIsSaid(t *testing.T) {
	defer replay.SetFillGiveUp(300 * time.Millisecond)()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	s, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: provisioner.StreamName(provisioner.BucketNeeds),
		Subjects: []string{provisioner.SubjectPrefix(provisioner.BucketNeeds) + ">"}, MaxConsumers: 1, AllowDirect: true})
	require.NoError(t, err)
	_, err = js.Publish(ctx, provisioner.SubjectPrefix(provisioner.BucketNeeds)+"n1.m.config.a", []byte{0x80})
	require.NoError(t, err)
	_, err = s.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: "other", AckPolicy: jetstream.AckNonePolicy})
	require.NoError(t, err)

	done := make(chan error, 1)
	go func() {
		l, err := replay.FromNATS(ctx, js, []string{provisioner.BucketNeeds}, "nats", nil)
		if err == nil {
			l.Close()
		}
		done <- err
	}()
	ferr := natstest.Receive(t, done, 20*time.Second, "replay still waits on a stream it cannot read")
	require.Error(t, ferr)
	require.Contains(t, ferr.Error(), "maximum consumers limit reached")
	require.Contains(t, ferr.Error(), provisioner.BucketNeeds)
}

// A cancelled export deletes the consumer it was reading through: it was left to its inactive
// threshold, five minutes on the server for each Ctrl-C.
func TestExport_CancelDeletesItsConsumer(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	s := needsWithHistory(t, js, 24000)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	out := filepath.Join(t.TempDir(), "cancelled.mph")
	_, err := replay.ExportNATS(ctx, js, []string{provisioner.BucketNeeds}, out, "test", func(done, total int64) {
		if done > 0 && done < total {
			cancel() // mid-read, its consumer created
		}
	})
	require.ErrorIs(t, err, context.Canceled)
	noConsumersLeft(t, s)
}

// An export cancelled while its consumer's creation has no answer yet deletes that consumer too, by
// the name it gave it: the server may have created it (natstest.AnswerLost: it did).
func TestExport_CancelWhileTheCreationIsUnansweredDeletesTheConsumer(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	s := needsWithHistory(t, js, 100)
	created := make(chan string, 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := replay.ExportNATS(ctx, natstest.AnswerLost{JetStream: js, Created: created}, []string{provisioner.BucketNeeds},
			filepath.Join(t.TempDir(), "cancelled.mph"), "test", nil)
		done <- err
	}()
	natstest.Receive(t, created, 30*time.Second, "no consumer created")
	require.ErrorIs(t, endsOnCancel(t, cancel, done, "the export"), context.Canceled)
	noConsumersLeft(t, s)
}

// noConsumersLeft waits a little for a stream to hold no consumer: one deleted as its reader ended.
func noConsumersLeft(t *testing.T, s jetstream.Stream) {
	t.Helper()
	natstest.CheckFor(t, 3*time.Second, 50*time.Millisecond, func() error {
		var names []string
		for name := range s.ConsumerNames(context.Background()).Name() {
			names = append(names, name)
		}
		if len(names) > 0 {
			return fmt.Errorf("consumers left on the stream: %v", names)
		}
		return nil
	})
}
