package projector_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// TestProjector_DeletedStreamIsConfirmedThenForgotten: a composed-<node> bucket whose stream stays
// deleted is forgotten (the store no longer holds it, its consumer ends, no reset asks for a
// rebuild). One whose stream is found missing once and then found again before a second check
// Options.Verify later is not forgotten as deleted: a single "not found" proves nothing. A transient
// "not found" of the same stream cannot be produced on demand with a real server (a restarting server
// answers no request at all), so the stream is deleted and created again between the checks: the check
// then finds the stream recreated, and the bucket is forgotten and read again from the new stream's
// first message, by the same consumer goroutine, with no reset either.
func TestProjector_DeletedStreamIsConfirmedThenForgotten(t *testing.T) {
	const verify = 800 * time.Millisecond
	ns := natstest.RunServer(t)
	nc, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	composedBuckets(t, js, 2)
	b0, b1 := "composed-n0000", "composed-n0001"
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	resets := make(chan error, 4)
	_, pjs := natstest.Connect(t, ns.ClientURL())
	p := projector.New(pjs, db, projector.Options{Buckets: []string{}, Composed: true, Poll: 50 * time.Millisecond,
		Verify: verify, DiscoverEvery: time.Hour, OnReset: func(bucket string, reason error) {
			resets <- fmt.Errorf("%s: %w", bucket, reason)
		}})
	p.Start(ctx)
	t.Cleanup(func() {
		p.Stop()
		db.Close()
	})
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		for _, b := range []string{b0, b1} {
			if seq, synced := db.Applied(b); seq == 0 || !synced {
				return fmt.Errorf("%s: applied %d, synced %v", b, seq, synced)
			}
		}
		return nil
	})

	// Deleted for good: forgotten, without a reset.
	require.NoError(t, js.DeleteKeyValue(ctx, b1))
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if p.Tails(b1) || slices.Contains(db.Buckets(), b1) {
			return fmt.Errorf("%s not forgotten yet", b1)
		}
		return nil
	})
	select {
	case err := <-resets:
		t.Fatalf("a deleted composed bucket asked for a rebuild: %v", err)
	default:
	}
	require.True(t, p.Tails(b0))

	// Found missing once, then found again: kept.
	infos := countRequests(t, nc, "$JS.API.STREAM.INFO.KV_"+b0)
	require.NoError(t, js.DeleteKeyValue(ctx, b0))
	infos.Store(0)
	natstest.CheckFor(t, 20*time.Second, 5*time.Millisecond, func() error {
		if infos.Load() == 0 {
			return fmt.Errorf("the stream of %s not asked for since its delete", b0)
		}
		return nil
	})
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: b0, History: 1, Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	_, err = kv.Put(ctx, "web.2", []byte{0x80})
	require.NoError(t, err)
	info, err := js.Stream(ctx, "KV_"+b0)
	require.NoError(t, err)
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if cp := db.Checkpoint(b0); cp.Applied != 1 || cp.StreamCreated != info.CachedInfo().Created.UnixNano() {
			return fmt.Errorf("%s not read again from the recreated stream: %+v", b0, cp)
		}
		return nil
	})
	v, err := db.View()
	require.NoError(t, err)
	_, found, err := v.ForgottenAt(b0)
	v.Close()
	require.NoError(t, err)
	require.True(t, found, "the old stream's history is forgotten, with its mark")
	require.True(t, p.Tails(b0), "still tailed")
	require.Equal(t, []string{b0}, p.Buckets(), "tailed once; the deleted one not at all")
	select {
	case err := <-resets:
		t.Fatalf("a recreated composed bucket asked for a rebuild: %v", err)
	default:
	}
	// Still followed: a later message is read.
	_, err = kv.Put(ctx, "web.3", []byte{0x80})
	require.NoError(t, err)
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if seq, _ := db.Applied(b0); seq != 2 {
			return fmt.Errorf("%s: applied %d, want 2", b0, seq)
		}
		return nil
	})
}
