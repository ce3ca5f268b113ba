package seat_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/seat"
	"github.com/novox/mesh-provisioner/store"
)

// TestSeat_MinSeqOfAMessageRemovedUnreadIsReached: CONTRACT section 3, a request with min_seq is
// answered once the projection has applied that stream sequence. A node's write whose message the
// stream removed before the seat read it (its subject purged here; a TTL without a marker leaves the
// same) is a sequence no message will ever bring: the stream holds nothing left up to it, and the
// projection, having read all there is, is as current as the stream there. Such a request is answered
// at once with an as_of at or past it (docs/decisions.md, "min_seq of a message removed unread"), and
// a request for a sequence not yet written still waits for it. Before, the request waited its whole
// wait_ms and was answered 504, though nothing was left to read.
func TestSeat_MinSeqOfAMessageRemovedUnreadIsReached(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.load(prefixMesh(t))
	ctx := context.Background()
	kv, err := h.js.KeyValue(ctx, provisioner.BucketApplied)
	require.NoError(t, err)
	seq, err := kv.Put(ctx, "n9.m", mp(t, "gone"))
	require.NoError(t, err)
	stream, err := h.js.Stream(ctx, provisioner.StreamName(provisioner.BucketApplied))
	require.NoError(t, err)
	require.NoError(t, stream.Purge(ctx, jetstream.WithPurgeSubject(provisioner.SubjectPrefix(provisioner.BucketApplied)+"n9.m")))
	info, err := stream.Info(ctx)
	require.NoError(t, err)
	require.Equal(t, seq, info.State.LastSeq, "the stream's last sequence is no message")

	st, _ := h.startSeat(t.TempDir())
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if applied, synced := st.Store().Applied(provisioner.BucketApplied); !synced || applied < seq-1 {
			return fmt.Errorf("applied %d, synced %v", applied, synced)
		}
		return nil
	})

	a, _, err := natstest.Ask(h.nc, query.Subject, []byte(fmt.Sprintf(`{"what":"applied","node":"n9","min_seq":%d,"wait_ms":2000}`, seq)), false)
	require.NoError(t, err, "min_seq of the removed message")
	require.GreaterOrEqual(t, a.AsOf, seq)
	require.Empty(t, a.Rows)

	// A sequence not written yet is not reached by it.
	_, _, err = natstest.Ask(h.nc, query.Subject, []byte(fmt.Sprintf(`{"what":"applied","node":"n9","min_seq":%d,"wait_ms":300}`, seq+1)), false)
	require.Equal(t, 504, verbCode(err), "%v", err)

	// The next write is read as any other.
	next, err := kv.Put(ctx, "n9.m", mp(t, "here"))
	require.NoError(t, err)
	require.Equal(t, seq+1, next)
	a, _, err = natstest.Ask(h.nc, query.Subject, []byte(fmt.Sprintf(`{"what":"applied","node":"n9","min_seq":%d,"wait_ms":10000}`, next)), false)
	require.NoError(t, err)
	require.Len(t, a.Rows, 1)
	require.GreaterOrEqual(t, a.AsOf, next)
}

// pauseSeatTail pauses the one consumer of a bucket's stream (the seat's tail) until the returned
// resume: the server delivers it nothing meanwhile, as a loaded seat or server does not for a moment.
func pauseSeatTail(t *testing.T, js jetstream.JetStream, bucket string) (resume func()) {
	t.Helper()
	ctx := context.Background()
	name := provisioner.StreamName(bucket)
	stream, err := js.Stream(ctx, name)
	require.NoError(t, err)
	var consumers []string
	for c := range stream.ConsumerNames(ctx).Name() {
		consumers = append(consumers, c)
	}
	require.Len(t, consumers, 1, "the seat's consumer of %s", bucket)
	_, err = js.PauseConsumer(ctx, name, consumers[0], time.Now().Add(time.Hour))
	require.NoError(t, err)
	return func() {
		_, err := js.ResumeConsumer(ctx, name, consumers[0])
		require.NoError(t, err)
	}
}

// TestSeat_MinSeqOfAWriteALaterMessageRemovedWaitsForThatMessage: CONTRACT section 3, min_seq, and
// section 1, deletes and rollups. A node writes a key (sequence A), and a later message removes that
// write from the stream before the seat read it: the key's purge, a put with `Nats-Rollup: sub`, a
// `Nats-Rollup: all` on another key (B). A request with min_seq A is answered once the seat has read
// B, with the stream's state at or past B. Before, the skip over messages removed unread moved the
// checkpoint to B - 1 (the first message still held, less one): the answer said as_of B - 1 without
// the write at A, which the stream held as the key's value up to B - 1.
func TestSeat_MinSeqOfAWriteALaterMessageRemovedWaitsForThatMessage(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.load(prefixMesh(t))
	st, _ := h.startSeat(t.TempDir())
	h.waitCaughtUp(st)
	ctx := context.Background()
	const bucket = provisioner.BucketApplied
	kv, err := h.js.KeyValue(ctx, bucket)
	require.NoError(t, err)
	var gets atomic.Int64
	sub, err := h.nc.Subscribe("$JS.API.STREAM.MSG.GET."+provisioner.StreamName(bucket), func(*nats.Msg) { gets.Add(1) })
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	require.NoError(t, h.nc.Flush())
	rollup := func(key, how string) uint64 {
		ack, err := h.js.PublishMsg(ctx, &nats.Msg{Subject: provisioner.SubjectPrefix(bucket) + key, Data: mp(t, how),
			Header: nats.Header{"Nats-Rollup": []string{how}}})
		require.NoError(t, err)
		return ack.Sequence
	}
	for _, c := range []struct {
		name   string
		remove func(key string) uint64 // removes the write of key; returns its own sequence
		kept   bool                    // the key is there once the removal is read
	}{
		{"purge", func(key string) uint64 {
			require.NoError(t, kv.Purge(ctx, key))
			s, err := h.js.Stream(ctx, provisioner.StreamName(bucket))
			require.NoError(t, err)
			return s.CachedInfo().State.LastSeq
		}, false},
		{"rollup sub", func(key string) uint64 { return rollup(key, "sub") }, true},
		{"rollup all", func(string) uint64 { return rollup("n9.z", "all") }, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			node := "w" + strings.ReplaceAll(c.name, " ", "")
			key := node + ".m"
			resume := pauseSeatTail(t, h.js, bucket)
			write, err := kv.Put(ctx, key, mp(t, "written"))
			require.NoError(t, err)
			removal := c.remove(key)
			require.Greater(t, removal, write)
			asked := gets.Load()
			answered := natstest.AskLater(h.nc, query.Subject, []byte(fmt.Sprintf(`{"what":"applied","node":%q,"min_seq":%d,"wait_ms":10000}`, node, write)))
			// The tail asked the stream twice for what it holds past the checkpoint (each try comes
			// after the one before has done what it does): the request had its chance to be skipped.
			natstest.CheckFor(t, 20*time.Second, 10*time.Millisecond, func() error {
				if n := gets.Load() - asked; n < 2 {
					return fmt.Errorf("%d message gets", n)
				}
				return nil
			})
			resume()
			got := natstest.Receive(t, answered, 20*time.Second, "the answer")
			require.NoError(t, got.Err)
			require.GreaterOrEqual(t, got.A.AsOf, removal, "answered before the message that removed the write was read: the write at min_seq is not in it (%v)", got.A.Rows)
			if c.kept {
				require.Len(t, got.A.Rows, 1)
				require.Equal(t, fmt.Sprint(removal), fmt.Sprint(got.A.Rows[0]["revision"]))
			} else {
				require.Empty(t, got.A.Rows)
			}
		})
	}
}

// TestSeat_MinSeqOfAMessageRemovedUnreadAcrossARebuild: CONTRACT section 3, min_seq. A request waits
// for a write the seat has not read; the write is removed (its subject purged) and the seat rebuilds
// its projection meanwhile (a bucket that could not be resumed). The rebuilt projection has read
// everything the stream holds, which is nothing up to min_seq: the request is answered from it. Before,
// the request had told the replaced projector alone to look for removed messages; the rebuild's never
// looked, and the request was answered 504 after its whole wait_ms. The seat's user may not get
// messages until the rebuild is in, so that the replaced projector cannot skip for it.
func TestSeat_MinSeqOfAMessageRemovedUnreadAcrossARebuild(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServerSeatDenied(t)
	ctx := context.Background()
	nc, js := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("admin", "admin"))
	const bucket = provisioner.BucketApplied
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: bucket})
	require.NoError(t, err)
	first, err := kv.Put(ctx, "n1.a", mp(t, "a"))
	require.NoError(t, err)
	snc, sjs := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("seat", "seat"))
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	st, err := seat.Start(ctx, snc, sjs, db, seat.Config{Projector: projector.Options{Poll: 20 * time.Millisecond, Verify: 100 * time.Millisecond}})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, st.Stop()); require.NoError(t, db.Close()) })
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if applied, synced := st.Store().Applied(bucket); applied != first || !synced {
			return fmt.Errorf("applied %d, synced %v", applied, synced)
		}
		return nil
	})

	natstest.DenySeat(t, ns, "$JS.API.STREAM.MSG.GET.>")
	pauseSeatTail(t, js, bucket)
	write, err := kv.Put(ctx, "n1.b", mp(t, "b"))
	require.NoError(t, err)
	answered := natstest.AskLater(nc, query.Subject, []byte(fmt.Sprintf(`{"what":"applied","node":"n1","min_seq":%d,"wait_ms":10000}`, write)))
	natstest.CheckFor(t, 20*time.Second, 10*time.Millisecond, func() error {
		if n := st.Server.Waiting(); n != 1 {
			return fmt.Errorf("%d waiting", n)
		}
		return nil
	})
	stream, err := js.Stream(ctx, provisioner.StreamName(bucket))
	require.NoError(t, err)
	require.NoError(t, stream.Purge(ctx, jetstream.WithPurgeSubject(provisioner.SubjectPrefix(bucket)+"n1.b")))

	replaced := st.Store()
	seat.RequestRebuild(st, bucket)
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if st.Store() == replaced {
			return errors.New("the rebuild is not swapped in yet")
		}
		return nil
	})
	natstest.DenySeat(t, ns)
	got := natstest.Receive(t, answered, 20*time.Second, "the answer")
	require.NoError(t, got.Err)
	require.GreaterOrEqual(t, got.A.AsOf, write)
	require.Len(t, got.A.Rows, 1, "n1.a alone")
}

// TestPlans_MinSeqAcrossANodesBucketPurgedWhileRequestsWait: CONTRACT sections 3 and 6. A node engine
// writes two compositions and asks its plans with min_seq of each; before the seat read them, its
// composed-<node> bucket's stream is purged whole (an operator resetting the node). The bucket is
// read again from what its stream holds, which is nothing up to either write: both requests are
// answered, as_of past them, none 504.
func TestPlans_MinSeqAcrossANodesBucketPurgedWhileRequestsWait(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.load(fixtures.Plans().Before)
	st, _ := h.startPlansSeat(t.TempDir())
	h.waitPlansCaughtUp(st)
	ctx := context.Background()
	const bucket = provisioner.ComposedPrefix + "edge-1"
	kv, err := h.js.KeyValue(ctx, bucket)
	require.NoError(t, err)
	resume := pauseSeatTail(t, h.js, bucket)
	var writes []uint64
	for _, build := range []string{"3005", "3006"} {
		seq, err := kv.Put(ctx, "db."+build, mp(t, map[string]any{"status": "published", "plan": "db " + build}))
		require.NoError(t, err)
		writes = append(writes, seq)
	}
	type answer struct {
		a   map[string]any
		err error
	}
	answered := make(chan answer, len(writes))
	for _, seq := range writes {
		go func() {
			a, err := h.askPlans(map[string]any{"what": "plans", "node": "edge-1", "module": "db", "min_seq": seq, "wait_ms": 10000}, false)
			answered <- answer{a, err}
		}()
	}
	natstest.CheckFor(t, 20*time.Second, 10*time.Millisecond, func() error {
		if n := st.Server.Waiting(); n != len(writes) {
			return fmt.Errorf("%d waiting", n)
		}
		return nil
	})
	stream, err := h.js.Stream(ctx, provisioner.StreamName(bucket))
	require.NoError(t, err)
	require.NoError(t, stream.Purge(ctx))
	resume()
	for range writes {
		got := natstest.Receive(t, answered, 20*time.Second, "an answer")
		require.NoError(t, got.err)
		asOf, err := strconv.ParseUint(fmt.Sprint(got.a["as_of"].(map[string]any)[bucket]), 10, 64)
		require.NoError(t, err)
		require.GreaterOrEqual(t, asOf, writes[len(writes)-1])
	}
}

// TestSeat_MinSeqInsideAnOpenGapWaitsForWhatRemovedIt: CONTRACT section 3, min_seq. A write at A is
// removed by a later message of its key at B (here the bucket's history of 1) before the seat read
// it, and the seat applies a message between A and B first: it reads 1, then 3, and knows 2 was
// removed unread (the store opens a history gap) but not by what. A request with min_seq 2 is
// answered once the seat has read 4, with the key's value there. Before, it was answered at once at
// as_of 3 with the key at revision 1: an answer that claims to include the write at 2 and does not
// (a lost write).
func TestSeat_MinSeqInsideAnOpenGapWaitsForWhatRemovedIt(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	ctx := context.Background()
	nc, js := natstest.Connect(t, ns.ClientURL())
	const bucket = provisioner.BucketApplied
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: bucket, History: 1})
	require.NoError(t, err)
	first, err := kv.Put(ctx, "n1.a", mp(t, "v0"))
	require.NoError(t, err)
	// The seat's connection goes through a proxy that can hold back what the server sends it; its tail
	// pulls one message at a time, so the server delivers the next only when asked again.
	proxy := natstest.RunProxy(t, ns.Addr().String())
	snc, sjs := natstest.Connect(t, proxy.URL())
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	st, err := seat.Start(ctx, snc, sjs, db, seat.Config{Projector: projector.Options{Poll: 20 * time.Millisecond, Verify: time.Hour, PullMessages: 1}})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, st.Stop()); require.NoError(t, db.Close()) })
	waitApplied := func(want uint64) {
		t.Helper()
		natstest.CheckFor(t, 20*time.Second, 10*time.Millisecond, func() error {
			if applied, _ := st.Store().Applied(bucket); applied != want {
				return fmt.Errorf("applied %d, want %d", applied, want)
			}
			return nil
		})
	}
	waitApplied(first)

	resume := pauseSeatTail(t, js, bucket)
	write, err := kv.Put(ctx, "n1.a", mp(t, "v1"))
	require.NoError(t, err)
	between, err := kv.Put(ctx, "n1.b", mp(t, "j"))
	require.NoError(t, err)
	removal, err := kv.Put(ctx, "n1.a", mp(t, "v2")) // removes the write: the history is 1
	require.NoError(t, err)
	require.Equal(t, []uint64{2, 3, 4}, []uint64{write, between, removal})

	// The server delivers 3 (the write at 2 is gone) and no more: the seat reads it and stalls.
	proxy.Hold()
	resume()
	name := provisioner.StreamName(bucket)
	var consumer string
	natstest.CheckFor(t, 20*time.Second, 10*time.Millisecond, func() error {
		s, err := js.Stream(ctx, name)
		if err != nil {
			return err
		}
		for ci := range s.ListConsumers(ctx).Info() {
			consumer = ci.Name
			if ci.Delivered.Stream != between {
				return fmt.Errorf("delivered up to %d", ci.Delivered.Stream)
			}
			return nil
		}
		return errors.New("no consumer")
	})
	_, err = js.PauseConsumer(ctx, name, consumer, time.Now().Add(time.Hour))
	require.NoError(t, err)
	proxy.Release()
	waitApplied(between)

	answered := natstest.AskLater(nc, query.Subject, []byte(fmt.Sprintf(`{"what":"applied","node":"n1","min_seq":%d,"wait_ms":10000}`, write)))
	// Answered already (the defect), or waiting: then the seat reads on.
	natstest.CheckFor(t, 20*time.Second, 10*time.Millisecond, func() error {
		if len(answered) == 0 && st.Server.Waiting() == 0 {
			return errors.New("neither answered nor waiting")
		}
		return nil
	})
	_, err = js.ResumeConsumer(ctx, name, consumer)
	require.NoError(t, err)
	got := natstest.Receive(t, answered, 20*time.Second, "the answer")
	require.NoError(t, got.Err)
	revs := map[string]string{}
	for _, row := range got.A.Rows {
		revs[fmt.Sprint(row["key"])] = fmt.Sprint(row["revision"])
	}
	if got.A.AsOf < removal {
		v, _ := st.Store().View()
		m, _ := v.HistoryMarks(bucket)
		v.Close()
		ap, _ := st.Store().Applied(bucket)
		t.Logf("reach %d, applied %d, history marks %+v, rebuilds %d", st.Store().Reach(bucket), ap, m, st.Rebuilds())
	}
	require.GreaterOrEqual(t, got.A.AsOf, removal, "answered before the message that removed the write at min_seq was read: %v", revs)
	require.Equal(t, map[string]string{"n1.a": fmt.Sprint(removal), "n1.b": fmt.Sprint(between)}, revs)
}
