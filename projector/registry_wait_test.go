package projector_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// The needs wait for the registry; a registry whose bucket does not exist yet is synced at once, and
// the needs must follow at once rather than at the next poll. Before, a seat started ahead of its own
// registry answered needs as empty and unsynced for a whole poll.
func TestProjector_NeedsDoNotWaitAPollForAMissingRegistry(t *testing.T) {
	t.Parallel()
	js, db, needs := twelveNeeds(t)
	ctx := context.Background()
	const poll = time.Minute
	p := projector.New(js, db, projector.Options{Buckets: []string{provisioner.BucketRegistry, provisioner.BucketNeeds}, Poll: poll})
	p.Start(ctx)
	defer p.Stop()
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		if seq, synced := db.Applied(provisioner.BucketNeeds); seq < uint64(len(needs)) || !synced {
			return fmt.Errorf("needs applied %d of %d, synced %v", seq, len(needs), synced)
		}
		return nil
	})
}

// TestProjector_SyncedWhenTheEndIsCountedAfterItsBatch: the reader hands a message over, then its
// pending count. When the count that says the stream's end was read came after the applier had
// committed that message's batch, the applier took the batch for one of a catch-up (unsynced) and
// the bucket stayed unsynced until the next poll: a minute here (a loaded machine made
// TestProjector_NeedsDoNotWaitAPollForAMissingRegistry fail so under the race detector). The test
// holds the last message's count back until its batch is applied.
func TestProjector_SyncedWhenTheEndIsCountedAfterItsBatch(t *testing.T) {
	t.Parallel()
	js, db, needs := twelveNeeds(t)
	ctx := context.Background()
	p := projector.New(js, db, projector.Options{Buckets: []string{provisioner.BucketNeeds}, Poll: time.Minute})
	last := uint64(len(needs))
	held := make(chan struct{})
	projector.SetBeforePending(p, func(bucket string, seq, pending uint64) {
		if seq != last {
			return
		}
		if pending != 0 {
			t.Errorf("the last message had %d pending", pending)
		}
		defer close(held)
		natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
			if seq, _ := db.Applied(provisioner.BucketNeeds); seq < last {
				return fmt.Errorf("applied %d of %d", seq, last)
			}
			return nil
		})
	})
	p.Start(ctx)
	defer p.Stop()
	<-held
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		if _, synced := db.Applied(provisioner.BucketNeeds); !synced {
			return fmt.Errorf("all %d applied, not synced", last)
		}
		return nil
	})
}

// twelveNeeds loads twelve needs into a server of the test's and opens an empty store (closed at the
// test's end).
func twelveNeeds(t *testing.T) (jetstream.JetStream, *store.DB, []fixtures.Op) {
	t.Helper()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	needs := (fixtures.Mesh{Seed: 1, Nodes: 2, Modules: 3, NeedsPerModule: 2}).OpsOf(provisioner.BucketNeeds)
	if err := fixtures.Load(context.Background(), js, needs, 0, nil); err != nil {
		t.Fatal(err)
	}
	db, err := store.Open(t.TempDir(), store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return js, db, needs
}
