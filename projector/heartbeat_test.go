package projector_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// TestProjector_ComposedPullsHeartbeatLess: the pulls of a composed-<node> bucket ask for an idle
// heartbeat every 5 s, the fixed buckets' every second. Thousands of composed-<node> consumers at a
// heartbeat a second each were more than a loaded seat heard in time, and each late heartbeat cost a
// CONSUMER.INFO, and before that a new consumer; a composed-<node> bucket is answered within a
// listing interval once parked anyway.
func TestProjector_ComposedPullsHeartbeatLess(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	nc, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	composedBuckets(t, js, 1)
	fixed, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "mesh-host_modules", Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	_, err = fixed.Put(ctx, "n0000.web", []byte{0x80})
	require.NoError(t, err)

	var mu sync.Mutex
	heartbeats := map[string]time.Duration{} // stream -> idle_heartbeat of its pulls
	sub, err := nc.Subscribe("$JS.API.CONSUMER.MSG.NEXT.>", func(m *nats.Msg) {
		var req struct {
			Heartbeat time.Duration `json:"idle_heartbeat"`
		}
		if json.Unmarshal(m.Data, &req) != nil {
			return
		}
		stream := strings.Split(strings.TrimPrefix(m.Subject, "$JS.API.CONSUMER.MSG.NEXT."), ".")[0]
		mu.Lock()
		heartbeats[stream] = req.Heartbeat
		mu.Unlock()
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	require.NoError(t, nc.Flush())

	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	_, pjs := natstest.Connect(t, ns.ClientURL())
	p := projector.New(pjs, db, projector.Options{Buckets: []string{"mesh-host_modules"}, Composed: true, ParkAfter: -1})
	p.Start(ctx)
	t.Cleanup(func() {
		p.Stop()
		db.Close()
	})
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		mu.Lock()
		defer mu.Unlock()
		if len(heartbeats) < 2 {
			return fmt.Errorf("pulls seen of %v", heartbeats)
		}
		return nil
	})
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, map[string]time.Duration{"KV_composed-n0000": 5 * time.Second, "KV_mesh-host_modules": time.Second}, heartbeats)
}
