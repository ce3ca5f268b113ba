package projector_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// TestProjector_VerifyListsStreamsNotEachBucket: a projector tailing hundreds of composed-<node>
// buckets checks their streams from one listing of every stream per Options.Verify (about 256 infos a
// request), not with one STREAM.INFO request per bucket, and a check made from the listing still
// finds a purge. The JetStream API requests are counted by a plain subscriber of the same
// account, which receives every request the projector's connection sends.
func TestProjector_VerifyListsStreamsNotEachBucket(t *testing.T) {
	t.Parallel()
	const buckets = 300
	// The listing runs every verify. Discovery takes its first listing's names, and the setups its
	// infos, only when it comes within two intervals (listedNames); past that discovery lists the names
	// itself and each setup asks its stream, as designed. At 400 ms the first listing of 300 streams,
	// under the race detector on a loaded machine, was later than that: 77 STREAM.INFO in a 16 s
	// setup. At a second it has 2 s.
	const verify = time.Second
	ns := natstest.RunServer(t)
	nc, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	composedBuckets(t, js, buckets)
	infos, lists := countRequests(t, nc, "$JS.API.STREAM.INFO.>"), countRequests(t, nc, "$JS.API.STREAM.LIST")
	creates := countRequests(t, nc, "$JS.API.CONSUMER.CREATE.>")
	_, pjs := natstest.Connect(t, ns.ClientURL())
	// A bucket whose check finds no listing newer than its last one after 1.5 intervals asks its stream,
	// at most askPerSecond such asks a second in all (mayAsk): on a loaded machine, under the race
	// detector, the listing of 300 streams came that late now and then, and over a setup of 27 s 51
	// asks came, more than the tenth of the buckets allowed for setups. Those asks are bounded by the
	// time that passed, and the setups by a tenth of the buckets.
	const askPerSecond = 1
	started := time.Now()
	reset, db := tailComposed(t, pjs, buckets, projector.Options{Poll: 50 * time.Millisecond, Verify: verify, AskPerSecond: askPerSecond})
	lateAsks := func(since time.Time) int64 { return int64(askPerSecond*time.Since(since).Seconds()) + 1 }
	t.Logf("set up in %v: %d STREAM.INFO requests", time.Since(started).Round(time.Millisecond), infos.Load())
	require.Positive(t, creates.Load(), "the subscriber sees the API requests: each bucket's setup creates a consumer")
	// Each bucket was found by a listing that read its stream's info just before: its setup takes that
	// info rather than ask the stream again (a bucket checked late on a loaded machine may ask).
	require.LessOrEqual(t, infos.Load(), int64(buckets/10)+lateAsks(started), "no stream info per bucket set up: the setups read the listing")

	// Steady state: count the requests over a few verify intervals.
	const intervals = 5
	infos.Store(0)
	lists.Store(0)
	steady := time.Now()
	time.Sleep(intervals * verify)
	gotInfos, gotLists := infos.Load(), lists.Load()
	t.Logf("over %d verify intervals with %d buckets: %d STREAM.INFO, %d STREAM.LIST requests", intervals, buckets, gotInfos, gotLists)
	pages := int64(buckets/256 + 1)
	require.LessOrEqual(t, gotLists, (intervals+2)*pages, "one listing per interval, of about 256 streams a page")
	require.Positive(t, gotLists)
	// One info per bucket per interval would be intervals × buckets (1500). A bucket whose listing came
	// late on a loaded machine asks its own stream when its slot comes, askPerSecond slots a second in
	// all; a slot that came while its bucket's goroutine waited for a core is asked late, so asks
	// bunch: a few buckets may, not a tenth of them, beside those of the time that passed.
	require.LessOrEqual(t, gotInfos, int64(buckets/10)+lateAsks(steady), "no stream info per bucket: the checks read the listing")

	// A check made from the listing finds a purge: the stream's only message is gone while the
	// projection still rests on it. No consumer notices a purge; only the periodic check does.
	stream, err := js.Stream(ctx, "KV_composed-n0007")
	require.NoError(t, err)
	infos.Store(0)
	require.NoError(t, stream.Purge(ctx))
	awaitReread(t, db, reset, "composed-n0007", 10*time.Second)
	t.Logf("STREAM.INFO requests until the purge was found: %d", infos.Load())
}

// TestProjector_AskingStreamsIsBoundedWithoutListing: a user denied $JS.API.STREAM.LIST gets no
// listing, so the checks ask the streams themselves; composed-<node> buckets ask at most
// Options.AskPerSecond times a second in all, not once per bucket per interval, and a purge is still
// found.
func TestProjector_AskingStreamsIsBoundedWithoutListing(t *testing.T) {
	t.Parallel()
	const buckets = 60
	const verify = 200 * time.Millisecond
	const perSecond = 20
	ns := natstest.RunServerDeniedStreamList(t)
	nc, js := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("admin", "admin"))
	ctx := context.Background()
	composedBuckets(t, js, buckets)
	infos := countRequests(t, nc, "$JS.API.STREAM.INFO.>")
	_, pjs := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("seat", "seat"))
	reset, db := tailComposed(t, pjs, buckets, projector.Options{Poll: 20 * time.Millisecond, Verify: verify, AskPerSecond: perSecond})

	// One ask per bucket every 1.5 intervals would be 60 / 0.3 s = 200 a second.
	const window = 2 * time.Second
	infos.Store(0)
	start := time.Now()
	time.Sleep(window)
	got := infos.Load()
	// A loaded machine oversleeps: the bound is of the time that passed, not of the time asked for.
	elapsed := time.Since(start)
	t.Logf("STREAM.INFO over %v with %d buckets and no listing: %d", elapsed, buckets, got)
	require.LessOrEqual(t, got, int64(perSecond*elapsed.Seconds())+2, "the asks are bounded")
	require.Positive(t, got, "the checks still ask")

	stream, err := js.Stream(ctx, "KV_composed-n0007")
	require.NoError(t, err)
	require.NoError(t, stream.Purge(ctx))
	awaitReread(t, db, reset, "composed-n0007", 30*time.Second)
}

// composedBuckets creates n composed-<node> buckets (composed-n0000, ...) of one composition each.
func composedBuckets(t *testing.T, js jetstream.JetStream, n int) {
	t.Helper()
	ctx := context.Background()
	for i := range n {
		kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: fmt.Sprintf("composed-n%04d", i), History: 1, Storage: jetstream.MemoryStorage})
		require.NoError(t, err)
		_, err = kv.Put(ctx, "web.1", []byte{0x80})
		require.NoError(t, err)
	}
}

// countRequests counts the messages on subject that nc's account sees: the JetStream API requests
// every connection of the account sends.
func countRequests(t *testing.T, nc *nats.Conn, subject string) *atomic.Int64 {
	t.Helper()
	var n atomic.Int64
	sub, err := nc.Subscribe(subject, func(*nats.Msg) { n.Add(1) })
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	require.NoError(t, nc.Flush())
	return &n
}

// awaitReread waits until a composed-<node> bucket whose stream was purged is found so: forgotten in
// place (store.DB.ForgetFrom leaves the forgotten mark) and read again, with no reset asked for.
func awaitReread(t *testing.T, db *store.DB, reset <-chan error, bucket string, within time.Duration) {
	t.Helper()
	natstest.CheckFor(t, within, 20*time.Millisecond, func() error {
		v, err := db.View()
		if err != nil {
			return err
		}
		defer v.Close()
		if _, found, err := v.ForgottenAt(bucket); err != nil || !found {
			return fmt.Errorf("the purge of %s was not found (%v)", bucket, err)
		}
		return nil
	})
	select {
	case reason := <-reset:
		t.Fatalf("a purged composed bucket asked for a rebuild: %v", reason)
	default:
	}
	// Read again from the stream, which now holds nothing: its checkpoint is the stream's last sequence.
	natstest.CheckFor(t, within, 20*time.Millisecond, func() error {
		if seq, synced := db.Applied(bucket); seq != 1 || !synced {
			return fmt.Errorf("%s read again: applied %d, synced %v", bucket, seq, synced)
		}
		return nil
	})
}

// tailComposed runs a projector of the composed-<node> buckets only, into a store of its own, until
// it has applied each of the n; the returned channel receives the first reset's reason.
func tailComposed(t *testing.T, js jetstream.JetStream, n int, opts projector.Options) (<-chan error, *store.DB) {
	t.Helper()
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	reset := make(chan error, 1)
	opts.Buckets, opts.Composed = []string{}, true
	opts.OnReset = func(_ string, reason error) {
		select {
		case reset <- reason:
		default:
		}
	}
	p := projector.New(js, db, opts)
	p.Start(context.Background())
	t.Cleanup(func() {
		p.Stop()
		db.Close()
	})
	natstest.CheckFor(t, 60*time.Second, 50*time.Millisecond, func() error {
		for i := range n {
			if seq, synced := db.Applied(fmt.Sprintf("composed-n%04d", i)); seq == 0 || !synced {
				return fmt.Errorf("composed-n%04d: applied %d, synced %v", i, seq, synced)
			}
		}
		return nil
	})
	return reset, db
}
