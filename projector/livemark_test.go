package projector_test

import (
	"context"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// TestProjector_LiveMarkOfARecreatedStream: the live check's mark (store.DB.LiveBelow) is a sequence
// of one stream. A composed-<node> bucket's stream deleted and created again while the seat was down
// starts its sequences at 1 again, below the old stream's mark: the new stream's messages there are
// live, and one of them purged (no marker; the stream's first sequence moves past it) must still be
// found, and the bucket read again without it, rather than answered from the projection for good.
func TestProjector_LiveMarkOfARecreatedStream(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	const b = "composed-n0001"
	pub := []byte{0x81, 0xa6, 's', 't', 'a', 't', 'u', 's', 0xa9, 'p', 'u', 'b', 'l', 'i', 's', 'h', 'e', 'd'}
	fill := func(rounds int) {
		kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: b, History: 1})
		require.NoError(t, err)
		for r := 0; r < rounds; r++ {
			for i := 1; i <= 5; i++ {
				_, err := kv.Put(ctx, fmt.Sprintf("m%d.1", i), pub)
				require.NoError(t, err)
			}
		}
	}
	fill(3) // 1..15, the stream starts at 11
	dir := t.TempDir()
	db, err := store.Open(dir, store.Options{})
	require.NoError(t, err)
	run := func(db *store.DB) *projector.Projector {
		p := projector.New(js, db, projector.Options{Buckets: []string{}, Composed: true, Verify: 200 * time.Millisecond, Poll: 20 * time.Millisecond})
		p.Start(ctx)
		return p
	}
	p := run(db)
	waitApplied(t, db, b, 15)
	// The tail's check marks 1..10 free of live messages; asked here too, so the mark is there
	// whatever the check's timing.
	_, live, err := db.LiveBelow(ctx, b, 0, 11)
	require.NoError(t, err)
	require.False(t, live)
	p.Stop()
	require.NoError(t, db.Close())

	// Down: the stream is deleted and created again, and holds 1..5, all live.
	require.NoError(t, js.DeleteKeyValue(ctx, b))
	fill(1)
	db, err = store.Open(dir, store.Options{})
	require.NoError(t, err)
	p = run(db)
	defer func() {
		p.Stop()
		db.Close()
	}()
	forgotten(t, db, b)
	waitApplied(t, db, b, 5)

	// m1.1, message 1, purged without a marker: the stream starts at 2.
	s, err := js.Stream(ctx, "KV_"+b)
	require.NoError(t, err)
	require.NoError(t, s.Purge(ctx, jetstream.WithPurgeSubject("$KV."+b+".m1.1")))
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		v, err := db.View()
		if err != nil {
			return err
		}
		defer v.Close()
		if _, live, err := v.KeyAt(b, "m1.1", math.MaxUint64); err != nil || live {
			return fmt.Errorf("m1.1, purged from the stream, is still answered (%v)", err)
		}
		if _, live, err := v.KeyAt(b, "m2.1", math.MaxUint64); err != nil || !live {
			return fmt.Errorf("m2.1 is not answered (%v)", err)
		}
		return nil
	})
}
