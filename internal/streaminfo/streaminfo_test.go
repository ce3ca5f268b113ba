package streaminfo_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/internal/streaminfo"
)

// TestPoller_ListAndRead: a listing keeps every stream's info and says when it started; a stream read
// on its own is kept beside the listed ones, newest first; a stream deleted since is forgotten by the
// next listing, or by a read that finds it gone.
func TestPoller_ListAndRead(t *testing.T) {
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	for _, b := range []string{"a", "b"} {
		_, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: b, Storage: jetstream.MemoryStorage})
		require.NoError(t, err)
	}
	p := streaminfo.New(js)
	require.True(t, p.Listed().IsZero(), "nothing listed yet")

	listed, err := p.List(ctx)
	require.NoError(t, err)
	require.Equal(t, listed, p.Listed())
	info, read, ok := p.Info("KV_a")
	require.True(t, ok)
	require.Equal(t, listed, read)
	require.Zero(t, info.State.LastSeq)

	// A read after the listing is newer: every reader sees it.
	kv, err := js.KeyValue(ctx, "a")
	require.NoError(t, err)
	_, err = kv.Put(ctx, "k", []byte("v"))
	require.NoError(t, err)
	got, err := p.Read(ctx, "KV_a")
	require.NoError(t, err)
	require.EqualValues(t, 1, got.State.LastSeq)
	info, read, ok = p.Info("KV_a")
	require.True(t, ok)
	require.True(t, read.After(listed))
	require.EqualValues(t, 1, info.State.LastSeq)
	require.Equal(t, listed, p.Listed(), "a read is not a listing")

	// Deleted streams are forgotten: by a read that finds it gone, and by the next listing.
	require.NoError(t, js.DeleteKeyValue(ctx, "a"))
	require.NoError(t, js.DeleteKeyValue(ctx, "b"))
	_, err = p.Read(ctx, "KV_a")
	require.True(t, errors.Is(err, jetstream.ErrStreamNotFound), err)
	_, _, ok = p.Info("KV_a")
	require.False(t, ok)
	_, _, ok = p.Info("KV_b")
	require.True(t, ok, "not listed again yet")
	_, err = p.List(ctx)
	require.NoError(t, err)
	_, _, ok = p.Info("KV_b")
	require.False(t, ok)
	require.Zero(t, p.Failures())
}

// TestPoller_Run: Run lists at once and every interval, says its interval while it runs, and returns
// when its context ends; a listing that fails is counted.
func TestPoller_Run(t *testing.T) {
	ns := natstest.RunServer(t)
	nc, js := natstest.Connect(t, ns.ClientURL())
	p := streaminfo.New(js)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		p.Run(ctx, 20*time.Millisecond, nil)
	}()
	var first time.Time
	natstest.CheckFor(t, 5*time.Second, 5*time.Millisecond, func() error {
		if first = p.Listed(); first.IsZero() {
			return errors.New("not listed yet")
		}
		return nil
	})
	require.Equal(t, 20*time.Millisecond, p.Every())
	natstest.CheckFor(t, 5*time.Second, 5*time.Millisecond, func() error {
		if !p.Listed().After(first) {
			return errors.New("not listed again yet")
		}
		return nil
	})
	// A closed connection: every listing fails.
	nc.Close()
	natstest.CheckFor(t, 5*time.Second, 5*time.Millisecond, func() error {
		if p.Failures() == 0 {
			return errors.New("no failure counted")
		}
		return nil
	})
	cancel()
	wg.Wait()
	require.Zero(t, p.Every(), "Run has returned")
}

// TestPoller_DeniedListingFailsAtOnce: a user denied $JS.API.STREAM.LIST gets no answer to a listing
// (the server drops the request and tells the connection). The listing fails at once with
// ErrUnanswered, naming the permissions violation, instead of waiting out its 30 s timeout; Run asks
// again now and then, not every interval, and lists again once the permission is granted.
func TestPoller_DeniedListingFailsAtOnce(t *testing.T) {
	const every = 50 * time.Millisecond
	ns := natstest.RunServerDeniedStreamList(t)
	ctx := context.Background()
	_, ajs := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("admin", "admin"))
	_, err := ajs.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "a", Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	_, sjs := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("seat", "seat"))
	p := streaminfo.New(sjs)

	start := time.Now()
	_, err = p.List(ctx)
	t.Logf("a denied listing failed after %v: %v", time.Since(start).Round(time.Millisecond), err)
	require.ErrorIs(t, err, streaminfo.ErrUnanswered)
	require.ErrorIs(t, err, nats.ErrPermissionViolation, "told by the server, not by a timeout")
	require.True(t, p.Unanswered())
	require.EqualValues(t, 1, p.Failures())

	natstest.RunPoller(t, p, every)
	// Each listing fails at once: three of them take three retries, not three 30 s timeouts.
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		if n := p.Failures(); n < 4 {
			return fmt.Errorf("%d listings failed", n)
		}
		return nil
	})
	// And they are retried now and then: one every interval would be 40 over 40 intervals.
	from := p.Failures()
	natstest.CheckFor(t, 10*time.Second, every, func() error {
		if time.Since(start) < 40*every {
			return errors.New("still counting")
		}
		return nil
	})
	retries := p.Failures() - from
	t.Logf("denied: %d listings tried over %v at an interval of %v", p.Failures(), time.Since(start).Round(time.Millisecond), every)
	require.Less(t, retries, int64(20), "retried with backoff, not every interval")
	require.True(t, p.Listed().IsZero())

	// The permission is granted: the next retry lists.
	natstest.DenySeat(t, ns)
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		if _, _, ok := p.Info("KV_a"); !ok {
			return errors.New("not listed yet")
		}
		return nil
	})
	require.False(t, p.Unanswered())
}

// TestPoller_GoSaysItRunsAtOnce: a Poller started with Go says it runs (Every) as Go returns, before
// its goroutine has listed, so a reader that looks at once (a projector's discovery, which lets the
// buckets left caught up start parked only on a running listing) does not take it for one nothing
// runs; it lists, and stops with its context, counted in the owner's WaitGroup.
func TestPoller_GoSaysItRunsAtOnce(t *testing.T) {
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	p := streaminfo.New(js)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	p.Go(ctx, &wg, time.Hour, nil)
	require.Equal(t, time.Hour, p.Every())
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		if p.Listed().IsZero() {
			return errors.New("not listed yet")
		}
		return nil
	})
	cancel()
	wg.Wait()
	require.Zero(t, p.Every(), "stopped")
}

// TestPoller_DeniedListingFailsAtOnceAmongOtherRefusals: as above, while the connection's other
// requests are refused too (the pulls of nodes' buckets the seat may not read yet). nats.go keeps only
// the last error, which was theirs when the listing looked: it waited out its first page's 5 s and
// failed as unanswered, naming no permission. It names the refusal of the listing.
func TestPoller_DeniedListingFailsAtOnceAmongOtherRefusals(t *testing.T) {
	ns := natstest.RunServerSeatDenied(t, "$JS.API.STREAM.LIST", "$KV.other.>")
	nc, sjs := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("seat", "seat"), nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}))
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			case <-time.After(100 * time.Microsecond):
			}
			_ = nc.Publish("$KV.other.x", nil)
		}
	}()
	defer func() { close(stop); wg.Wait() }()
	p := streaminfo.New(sjs)
	for range 3 {
		_, err := p.List(context.Background())
		require.ErrorIs(t, err, streaminfo.ErrUnanswered)
		require.ErrorIs(t, err, nats.ErrPermissionViolation, "told by the server, not by a timeout")
		require.Contains(t, err.Error(), "STREAM.LIST", "the listing's own refusal")
	}
}
