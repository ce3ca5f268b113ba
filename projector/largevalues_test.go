package projector_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// bin32 is a MessagePack bin 32 of n bytes, each b.
func bin32(n int, b byte) []byte {
	v := make([]byte, 5, 5+n)
	v[0] = 0xc6
	binary.BigEndian.PutUint32(v[1:], uint32(n))
	return append(v, bytes.Repeat([]byte{b}, n)...)
}

// TestProjector_LargeValuesInBoundedPulls: values near the server's max payload, among small ones,
// read in pulls and a pipeline bounded by bytes below what a batch of them would hold: every message
// is applied, in order, each row with its value, and the largest message (one whole max payload) goes
// through whatever bound was asked for (Options.PullBytes is raised to it).
func TestProjector_LargeValuesInBoundedPulls(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	nc, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	_, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.BucketNeeds})
	require.NoError(t, err)
	kv, err := js.KeyValue(ctx, provisioner.BucketNeeds)
	require.NoError(t, err)
	const n = 24
	largest := int(nc.MaxPayload()) - 5 - 512 // a bin 32 of the max payload, short of the headers' room
	want := map[string][]byte{}
	for i := range n {
		size := 256 << 10
		switch {
		case i%3 == 1:
			size = 10
		case i == n-2:
			size = largest
		}
		key := fmt.Sprintf("n%02d.m.config.k", i)
		want[key] = bin32(size, byte(i))
		_, err := kv.Put(ctx, key, want[key])
		require.NoError(t, err)
	}

	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	p := projector.New(js, db, projector.Options{Buckets: []string{provisioner.BucketNeeds}, PullBytes: 1, Poll: 50 * time.Millisecond})
	p.Start(ctx)
	defer p.Stop()
	natstest.CheckFor(t, 30*time.Second, 10*time.Millisecond, func() error {
		if seq, synced := db.Applied(provisioner.BucketNeeds); !synced || seq != n {
			return fmt.Errorf("applied %d of %d, synced %v", seq, n, synced)
		}
		return nil
	})
	require.EqualValues(t, n, p.Applied(), "each message applied once")
	v, err := db.RowsView()
	require.NoError(t, err)
	defer v.Close()
	var keys []string
	require.NoError(t, v.Rows(provisioner.Range{Bucket: provisioner.BucketNeeds, Index: provisioner.IndexPrimary}, func(row *provisioner.Row) bool {
		keys = append(keys, string(row.Key))
		require.Equal(t, want[string(row.Key)], row.Value, "value of %s", row.Key)
		require.True(t, row.Msgpack)
		return true
	}))
	require.Len(t, keys, n)
}
