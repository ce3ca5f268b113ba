package projector_test

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/internal/faultfs"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/internal/streaminfo"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// TestProjector_SkipOutOfRoomSaysNothing: a request waits for the sequence of a message removed unread
// while the state dir is out of room. The skip over it cannot be recorded, and is tried again at each
// Poll for as long as the request may wait; the store says it is out of room, once (store/space.go),
// as applying does. Before, every try logged a warning of its own (one a Poll, for each such request,
// for up to 10 s), and so did each parking after that failed to record the removed end (one a
// ParkAfter, for each such bucket, for as long as the disk stayed full). Once there is room the skip
// is recorded: nothing is lost.
func TestProjector_SkipOutOfRoomSaysNothing(t *testing.T) {
	t.Parallel()
	root := faultfs.Tmpfs(t, 256<<20)
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	_, pjs := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	const bucket = "composed-n0000"
	composedBuckets(t, js, 1)

	poller := streaminfo.New(pjs)
	natstest.RunPoller(t, poller, time.Hour) // parked, the bucket is woken by requests alone
	db, err := store.Open(filepath.Join(root, "state"), store.Options{MemTableSize: 4 << 20, MinFreeBytes: 32 << 20})
	require.NoError(t, err)
	logs := &natstest.LogBuffer{}
	p := projector.New(pjs, db, projector.Options{Buckets: []string{}, Composed: true, Poll: 20 * time.Millisecond,
		Verify: time.Hour, DiscoverEvery: time.Hour, ParkAfter: 200 * time.Millisecond, Streams: poller,
		Logger: slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	p.Start(ctx)
	t.Cleanup(func() {
		p.Stop()
		db.Close()
	})
	waitApplied(t, db, bucket, 1)
	waitParked(t, p, js, bucket)

	kv, err := js.KeyValue(ctx, bucket)
	require.NoError(t, err)
	seq, err := kv.Put(ctx, "web.2", []byte{0x80})
	require.NoError(t, err)
	stream, err := js.Stream(ctx, "KV_"+bucket)
	require.NoError(t, err)
	require.NoError(t, stream.Purge(ctx, jetstream.WithPurgeSubject("$KV."+bucket+".web.2")))

	fill := filepath.Join(root, "other")
	faultfs.FillTo(t, fill, 16<<20)
	p.Wake(bucket)
	// The tail tries the skip at each Poll: a good many tries.
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if !strings.Contains(logs.String(), "tailing again") {
			return os.ErrNotExist
		}
		return nil
	})
	// Tries at each Poll, and parkings each ParkAfter that record the removed end (removedUnread):
	// none says more than the store.
	time.Sleep(time.Second)
	seqNow, _ := db.Applied(bucket)
	require.EqualValues(t, 1, seqNow, "the skip recorded on a full disk")
	require.NotContains(t, logs.String(), "recording the messages removed before they were read failed")
	require.NotContains(t, logs.String(), "the projection could not follow it")

	// With room, the request asked again is reached (its first wait may have ended: ParkAfter is
	// shorter than a wait_ms here, and the bucket parked meanwhile).
	require.NoError(t, os.Remove(fill))
	p.Wake(bucket)
	waitApplied(t, db, bucket, seq)
}
