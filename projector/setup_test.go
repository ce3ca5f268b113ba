package projector_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
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

// TestProjector_FailingBucketsLeaveSetUpToTheOthers: at most 16 buckets set their consumer up at once.
// A composed-<node> bucket whose stream the seat cannot read (a permission missing, a stream without a
// leader) sets up again and again, and each try's request gets no answer until the JetStream API's
// timeout: twenty such nodes took every slot in turn, and every other node's bucket that had to set up
// (woken by a change, read again, or new) waited behind them, for ever here, where the requests that
// get no answer wait for an hour. Once Failing, they set up in slots of their own.
func TestProjector_FailingBucketsLeaveSetUpToTheOthers(t *testing.T) {
	t.Parallel()
	const failing = 20
	ns := natstest.RunServerSeatDenied(t)
	url := ns.ClientURL()
	ctx := context.Background()
	_, ajs := natstest.Connect(t, url, nats.UserInfo("admin", "admin"))
	name := func(i int) string { return fmt.Sprintf("composed-n%04d", i) }
	// Streams that take one consumer, which someone else holds: each try to read them is refused at once.
	for i := range failing {
		s, err := ajs.CreateStream(ctx, jetstream.StreamConfig{Name: "KV_" + name(i), Subjects: []string{"$KV." + name(i) + ".>"},
			MaxMsgsPerSubject: 1, AllowRollup: true, DenyDelete: true, AllowDirect: true, Storage: jetstream.MemoryStorage, MaxConsumers: 1})
		require.NoError(t, err)
		_, err = ajs.Publish(ctx, "$KV."+name(i)+".web.1", []byte{0x80})
		require.NoError(t, err)
		_, err = s.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: "other"})
		require.NoError(t, err)
	}

	// The seat's requests that get no answer wait an hour.
	var violations atomic.Int64
	snc, _ := natstest.Connect(t, url, nats.UserInfo("seat", "seat"), nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
		if errors.Is(err, nats.ErrPermissionViolation) && strings.Contains(err.Error(), "CONSUMER.CREATE") {
			violations.Add(1)
		}
	}))
	sjs, err := jetstream.New(snc, jetstream.WithDefaultTimeout(time.Hour))
	require.NoError(t, err)
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	var mu sync.Mutex
	failures := map[string]int{}
	p := projector.New(sjs, db, projector.Options{Buckets: []string{}, Composed: true, Poll: 20 * time.Millisecond,
		DiscoverEvery: time.Hour, OnTailError: func(bucket string, _ error) {
			mu.Lock()
			defer mu.Unlock()
			failures[bucket]++
		}})
	p.Start(ctx)
	t.Cleanup(func() {
		p.Stop()
		require.NoError(t, db.Close())
	})
	natstest.CheckFor(t, 30*time.Second, 20*time.Millisecond, func() error {
		mu.Lock()
		defer mu.Unlock()
		for i := range failing {
			if failures[name(i)] < projector.FailingAfter {
				return fmt.Errorf("%s failed %d times", name(i), failures[name(i)])
			}
		}
		return nil
	})
	for i := range failing {
		require.True(t, p.Failing(name(i)), name(i))
	}
	// From now on their tries get no answer at all.
	var deny []string
	for i := range failing {
		deny = append(deny, "$JS.API.CONSUMER.CREATE.KV_"+name(i)+".>")
	}
	natstest.DenySeat(t, ns, deny...)
	natstest.CheckFor(t, 30*time.Second, 10*time.Millisecond, func() error {
		if v := violations.Load(); v < 4 {
			return fmt.Errorf("%d tries without an answer", v)
		}
		return nil
	})

	// A node added: its bucket is read.
	kv, err := ajs.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "composed-n9999", Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	_, err = kv.Put(ctx, "web.1", []byte{0x80})
	require.NoError(t, err)
	natstest.CheckFor(t, 30*time.Second, 20*time.Millisecond, func() error {
		if seq, synced := db.Applied("composed-n9999"); seq != 1 || !synced {
			return fmt.Errorf("composed-n9999: applied %d, synced %v (%d tries of the failing without an answer)", seq, synced, violations.Load())
		}
		return nil
	})
	t.Logf("%d tries of the failing buckets without an answer", violations.Load())
}
