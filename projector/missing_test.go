package projector_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/internal/streaminfo"
	"github.com/novox/mesh-provisioner/projector"
)

// TestProjector_MissingBucketsWaitOnTheListing: buckets whose streams do not exist do not ask for them
// every Options.Poll (STREAM.INFO, counted by a subscriber on the account). While the shared listing
// runs they ask nothing: each listing looks for them. Without one (a user denied $JS.API.STREAM.LIST)
// they ask with a backoff up to the listing's interval. Either way a bucket created later is tailed.
func TestProjector_MissingBucketsWaitOnTheListing(t *testing.T) {
	t.Parallel()
	const poll = 20 * time.Millisecond
	const every = 200 * time.Millisecond
	const intervals = 6
	missing := []string{provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect}

	run := func(t *testing.T, ns *server.Server, admin, seat []nats.Option, listDelay ...time.Duration) (asked int64) {
		nc, js := natstest.Connect(t, ns.ClientURL(), admin...)
		_, pjs := natstest.Connect(t, ns.ClientURL(), seat...)
		var streams *streaminfo.Poller
		if len(listDelay) > 0 {
			streams = streaminfo.New(slowListing{JetStream: pjs, delay: listDelay[0]})
			natstest.RunPoller(t, streams, every)
		}
		ctx, cancel := context.WithCancel(context.Background())
		_, db := startWithListing(t, ctx, cancel, pjs, every, projector.Options{Buckets: missing, Poll: poll, Verify: every, Streams: streams})
		if streams != nil {
			// Until a first listing completes the buckets ask for themselves, as they must.
			natstest.CheckFor(t, 10*time.Second, poll, func() error {
				if streams.Listed().IsZero() {
					return fmt.Errorf("not listed yet")
				}
				return nil
			})
		}
		natstest.CheckFor(t, 10*time.Second, poll, func() error {
			for _, b := range missing {
				if _, synced := db.Applied(b); !synced {
					return fmt.Errorf("%s: not synced", b)
				}
			}
			return nil
		})

		infos := countRequests(t, nc, "$JS.API.STREAM.INFO.>")
		time.Sleep(intervals * every) // a window to count in, not a wait for a condition
		asked = infos.Load()
		t.Logf("STREAM.INFO over %d listing intervals of %v with %d buckets missing, Poll %v: %d", intervals, every, len(missing), poll, asked)

		kv, err := js.CreateKeyValue(context.Background(), jetstream.KeyValueConfig{Bucket: provisioner.BucketApplied, Storage: jetstream.MemoryStorage})
		require.NoError(t, err)
		seq, err := kv.Put(context.Background(), "n1.web", []byte{0x80})
		require.NoError(t, err)
		natstest.CheckFor(t, 10*time.Second, poll, applied(db, provisioner.BucketApplied, seq))
		return asked
	}

	// One ask per bucket every Poll would be intervals × every / poll × 3 = 180. While the listing
	// runs, each bucket asks once, Poll after it found its stream missing (the window may catch it),
	// and once more if a listing came two intervals late on a loaded machine.
	t.Run("listed", func(t *testing.T) {
		asked := run(t, natstest.RunServer(t), nil, nil)
		require.LessOrEqual(t, asked, int64(2*len(missing)), "the listing looks for the missing buckets")
	})
	t.Run("listed slower than its interval", func(t *testing.T) {
		// A listing that takes longer than its interval (thousands of streams, a loaded cluster) still
		// runs: the buckets wait on it rather than each asking for itself as if it had stopped.
		asked := run(t, natstest.RunServer(t), nil, nil, 300*time.Millisecond)
		require.LessOrEqual(t, asked, int64(2*len(missing)), "the listing looks for the missing buckets")
	})
	t.Run("listed, no advisories", func(t *testing.T) {
		// The bucket created is found by the listing alone.
		ns := natstest.RunServerSeatNoAdvisories(t)
		admin := []nats.Option{nats.UserInfo("admin", "admin")}
		seat := []nats.Option{nats.UserInfo("seat", "seat"), nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {})}
		asked := run(t, ns, admin, seat)
		require.LessOrEqual(t, asked, int64(2*len(missing)), "the listing looks for the missing buckets")
	})
	t.Run("no listing", func(t *testing.T) {
		admin := []nats.Option{nats.UserInfo("admin", "admin")}
		seat := []nats.Option{nats.UserInfo("seat", "seat"), nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {})}
		asked := run(t, natstest.RunServerDeniedStreamList(t), admin, seat)
		// Each bucket asks after poll, 2 poll, ... (5 asks up to every), then once an interval.
		const ramp = 5
		require.LessOrEqual(t, asked, int64(len(missing)*(ramp+intervals+1)), "at most one ask per bucket per listing interval")
		require.Positive(t, asked, "they ask for themselves")
	})
}
