package seat_test

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/seat"
	"github.com/novox/mesh-provisioner/store"
)

// TestSeat_StopWhileAConsumerCreateGoesUnanswered: a bucket whose consumer is lost while the JetStream
// API does not answer consumer creates (a cluster without quorum, a permission taken away; here the
// seat's user may no longer publish to $JS.API.CONSUMER.CREATE.>, so the server drops each create)
// asks for a new consumer that never comes. Stop still returns at once, not when nats.go's own 10 s
// request timeout runs out, and leaves no goroutine of the projector running.
func TestSeat_StopWhileAConsumerCreateGoesUnanswered(t *testing.T) {
	ns := natstest.RunServerSeatDenied(t)
	url := ns.ClientURL()
	ctx := context.Background()
	_, ajs := natstest.Connect(t, url, nats.UserInfo("admin", "admin"))
	require.NoError(t, fixtures.Load(ctx, ajs, testMesh.Ops(), 256, nil))

	denied := make(chan error, 16)
	nc, js := natstest.Connect(t, url, nats.UserInfo("seat", "seat"), nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
		if errors.Is(err, nats.ErrPermissionViolation) && strings.Contains(err.Error(), "CONSUMER.CREATE") {
			select {
			case denied <- err:
			default:
			}
		}
	}))
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, db.Close()) })
	st, err := seat.Start(ctx, nc, js, db, seat.Config{Projector: projector.Options{Poll: 50 * time.Millisecond, Verify: 200 * time.Millisecond}})
	require.NoError(t, err)
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			require.NoError(t, st.Stop())
		}
	})
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		for _, s := range provisioner.ProvisionerShapes {
			if seq, synced := db.Applied(s.Bucket); !synced {
				return fmt.Errorf("%s: applied %d, not synced", s.Bucket, seq)
			}
		}
		if seq, _ := db.Applied(provisioner.BucketNeeds); seq == 0 {
			return errors.New("no need applied")
		}
		return nil
	})

	stream, err := ajs.Stream(ctx, provisioner.StreamName(provisioner.BucketNeeds))
	require.NoError(t, err)
	dropConsumers := func() {
		t.Helper()
		names := stream.ConsumerNames(ctx)
		n := 0
		for name := range names.Name() {
			if err := stream.DeleteConsumer(ctx, name); !errors.Is(err, jetstream.ErrConsumerNotFound) {
				require.NoError(t, err) // not found: one the seat gave up on and deleted meanwhile
				n++
			}
		}
		require.NoError(t, names.Err())
		require.Positive(t, n, "the seat reads the needs through a consumer")
	}

	// A consumer lost is created again, from the checkpoint: a need written after reaches the seat.
	dropConsumers()
	kv, err := ajs.KeyValue(ctx, provisioner.BucketNeeds)
	require.NoError(t, err)
	seq, err := kv.Put(ctx, fixtures.NodeName(1)+".mod-late.config.k", []byte{0x80})
	require.NoError(t, err)
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if have, _ := db.Applied(provisioner.BucketNeeds); have < seq {
			return fmt.Errorf("needs: applied %d of %d", have, seq)
		}
		return nil
	})

	// Consumer creates go unanswered from now on, and the needs bucket loses its consumer again.
	natstest.DenySeat(t, ns, "$JS.API.CONSUMER.CREATE.>")
	dropConsumers()
	select {
	case err := <-denied:
		t.Logf("the seat asked for a new consumer: %v", err)
	case <-time.After(20 * time.Second):
		t.Fatal("the seat did not ask for a new consumer")
	}

	start := time.Now()
	done := make(chan error, 1)
	go func() { done <- st.Stop() }()
	// nats.go's ordered consumer asks for its new consumer with a 10 s timeout of its own, holding the
	// lock its Stop needs: a Stop that waits for it takes that long. Half of it is a hang, not a slow stop.
	select {
	case err := <-done:
		stopped = true
		require.NoError(t, err)
	case <-time.After(5 * time.Second):
		t.Fatal("Stop waits for the unanswered consumer create")
	}
	t.Logf("Stop took %v with a consumer create unanswered", time.Since(start).Round(time.Millisecond))
	require.Empty(t, ourGoroutines("mesh-provisioner/projector.", "mesh-provisioner/internal/streaminfo."), "goroutines still running after Stop")
}

// ourGoroutines returns the stacks of the running goroutines that have a frame in any of the packages.
func ourGoroutines(pkgs ...string) []string {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		for _, p := range pkgs {
			if strings.Contains(g, p) {
				out = append(out, g)
				break
			}
		}
	}
	return out
}
