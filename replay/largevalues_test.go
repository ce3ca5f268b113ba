package replay_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"path/filepath"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/replay"
)

// TestLargeValues_EveryReaderReadsEveryMessageInOrder: a key's history, a an export and the log read from it
// of a stream whose values go up to the server's max payload (pulls bounded by bytes, each of them
// delivered whatever its size) read every revision, in order, each with its value.
func TestLargeValues_EveryReaderReadsEveryMessageInOrder(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	nc, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.BucketNeeds, History: 64})
	require.NoError(t, err)
	const key = "n1.m.config.k"
	largest := int(nc.MaxPayload()) - 5 - 512 // a bin 32 of the max payload, short of the headers' room
	var want [][]byte
	for i := range 12 {
		size := 256 << 10
		switch {
		case i%3 == 1:
			size = 10
		case i == 10:
			size = largest
		}
		v := make([]byte, 5, 5+size)
		v[0] = 0xc6
		binary.BigEndian.PutUint32(v[1:], uint32(size))
		v = append(v, bytes.Repeat([]byte{byte(i)}, size)...)
		want = append(want, v)
		_, err := kv.Put(ctx, key, v)
		require.NoError(t, err)
	}

	var got [][]byte
	var seqs []uint64
	_, err = replay.EachRevisionInStream(ctx, js, provisioner.BucketNeeds, key, nil, func(r *replay.Revision) error {
		got, seqs = append(got, bytes.Clone(r.Value)), append(seqs, r.Seq)
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, want, got, "the key's history")
	for i, s := range seqs {
		require.Equal(t, uint64(i+1), s)
	}

	out := filepath.Join(t.TempDir(), "large.mph")
	h, err := replay.ExportNATS(ctx, js, []string{provisioner.BucketNeeds}, out, "test", nil)
	require.NoError(t, err)
	require.Equal(t, uint64(len(want)), h.Buckets[0].Messages, "the export holds every message")
	l, err := replay.FromArchive(ctx, out, nil)
	require.NoError(t, err)
	defer l.Close()
	var i int
	_, err = l.EachRevision(ctx, provisioner.BucketNeeds, key, func(r *replay.Revision) error {
		require.Equal(t, uint64(i+1), r.Seq)
		require.Equal(t, want[i], r.Value, fmt.Sprintf("revision %d from the archive", i+1))
		i++
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, len(want), i, "every revision from the archive")
}
