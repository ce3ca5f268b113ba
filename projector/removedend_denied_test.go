package projector_test

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// TestProjector_RemovedEndCheckRefusedIsNotAskedEachPoll: a seat whose user may not get a stream's
// messages ($JS.API.STREAM.MSG.GET not granted; docs/accounts.md: without it a min_seq the stream
// removed unread is answered 504) reads a bucket whose last message was purged unread. The tail's
// check of that end (tailRemoved) asked the leader, got no answer (NATS drops a refused request),
// waited out its second, and asked again at the next poll, for as long as the tail ran: a permissions
// violation each poll, and the applier stalled a second each time. A refusal ends the check for the
// tail at once.
func TestProjector_RemovedEndCheckRefusedIsNotAskedEachPoll(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServerSeatDenied(t, "$JS.API.STREAM.MSG.GET.>")
	_, admin := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("admin", "admin"))
	ctx := context.Background()
	bucket := provisioner.BucketApplied
	kv, err := admin.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: bucket})
	require.NoError(t, err)
	for _, k := range []string{"n1.a", "n1.b", "n1.c"} {
		_, err := kv.Put(ctx, k, []byte{0x01})
		require.NoError(t, err)
	}
	s, err := admin.Stream(ctx, provisioner.StreamName(bucket))
	require.NoError(t, err)
	require.NoError(t, s.Purge(ctx, jetstream.WithPurgeSubject(provisioner.SubjectPrefix(bucket)+"n1.c")))

	var refused atomic.Int64
	_, js := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("seat", "seat"),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			if strings.Contains(err.Error(), "STREAM.MSG.GET") {
				refused.Add(1)
			}
		}))
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	p := projector.New(js, db, projector.Options{Buckets: []string{bucket}, Poll: 20 * time.Millisecond})
	p.Start(ctx)
	t.Cleanup(p.Stop)
	waitApplied(t, db, bucket, 2)
	natstest.CheckFor(t, 20*time.Second, 10*time.Millisecond, func() error {
		if refused.Load() == 0 {
			return fmt.Errorf("the end not checked yet")
		}
		return nil
	})
	// A window to count in, not a wait for a condition: 150 polls, three of the old check's seconds.
	time.Sleep(3 * time.Second)
	require.EqualValues(t, 1, refused.Load(), "the removed end was asked of the stream again after NATS refused it")

	// The tail reads on: a write after it is applied.
	seq, err := kv.Put(ctx, "n1.d", []byte{0x01})
	require.NoError(t, err)
	waitApplied(t, db, bucket, seq)
}
