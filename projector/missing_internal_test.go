package projector

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/internal/streaminfo"
	"github.com/novox/mesh-provisioner/store"
)

// A stream-created advisory can come before the stream is found: nats-server sends it before it
// registers the stream with the account. A bucket woken by one that then finds its stream missing
// asks again after Options.Poll. It used to wait for the listing, which had just run: two of its
// intervals, so a seat's registry, created as its projector started, was answered empty for 20 s
// (TestQueryCommand_InboxPrefix failed so, 1 run in 50 beside other tests).
func TestAwaitStream_AdvisoryBeforeTheStreamIsFound(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, db.Close()) })
	poller := streaminfo.New(js)
	natstest.RunPoller(t, poller, time.Minute)
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if poller.Listed().IsZero() {
			return context.DeadlineExceeded
		}
		return nil
	})

	const bucket = "not-yet"
	p := New(js, db, Options{Buckets: []string{bucket}, Poll: 20 * time.Millisecond, Verify: time.Minute, Streams: poller})
	ctx := context.Background()
	missing := p.missingBackoff()
	created := make(chan struct{}, 1)
	created <- struct{}{} // the advisory; its stream is still not found after it
	require.True(t, p.awaitStream(ctx, bucket, &missing, created))

	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	start := time.Now()
	require.True(t, p.awaitStream(ctx, bucket, &missing, created), "asks again within 5 s, not at the listing a minute away")
	t.Logf("asked again after %v", time.Since(start).Round(time.Millisecond))
}
