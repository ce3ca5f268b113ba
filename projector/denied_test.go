package projector_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/internal/denied"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// TestProjector_DeniedConsumerFailsAtOnce: a composed-<node> bucket whose consumer the seat's user may
// not create ($JS.API.CONSUMER.CREATE.KV_composed-<node>.> not granted, as when the controller has not
// yet written the new node's lines) got no answer to the creation, which NATS drops: each try waited
// out the JetStream API's 5 s timeout, so the bucket took three of them to count as failing (readiness
// waited on it, about 16 s) and its warn line said "context deadline exceeded". Each try fails as soon
// as NATS reports the violation, with the subject refused and what to grant; the other buckets read
// on, and once the grant is there the bucket is read whole.
func TestProjector_DeniedConsumerFailsAtOnce(t *testing.T) {
	t.Parallel()
	// Three tries take three round trips and the backoff between them (0.1 s, then 0.2 s): far less
	// than one 5 s timeout, however loaded the machine.
	deniedComposedN0001(t, "$JS.API.CONSUMER.CREATE.KV_composed-n0001.>", 30*time.Second, func(logs string) {
		require.Contains(t, logs, "grant this NATS user publish on $JS.API.CONSUMER.CREATE.KV_composed-n0001.>", "the warn line names what to grant")
		require.NotContains(t, logs, "deadline exceeded")
	})
}

// TestProjector_DeniedPullFails: a composed-<node> bucket whose pulls the seat's user may not send
// ($JS.API.CONSUMER.MSG.NEXT.KV_composed-<node>.* not granted) has its consumer created, then waits for
// messages its pulls never ask for: the server drops each pull, the heartbeats never come, and the
// consumer, asked after two missed ones, is still there, so the tail read on for ever. It never
// failed, and readiness, which lets a failing composed bucket go, waited on it for good. The tail fails
// once heartbeats are missed with the pull refused, naming the grant, and is retried like any failure.
func TestProjector_DeniedPullFails(t *testing.T) {
	t.Parallel()
	deniedComposedN0001(t, "$JS.API.CONSUMER.MSG.NEXT.KV_composed-n0001.*", 120*time.Second, nil)
}

// deniedComposedN0001 runs a projector over composed-n0000 and composed-n0001, the seat's user refused
// deny: composed-n0000 is read, composed-n0001 becomes Failing within failingIn, every failure of its
// tail is the refusal with deny as the grant to give, and the log passes check (when set). Then deny is
// granted, and composed-n0001 is read.
func deniedComposedN0001(t *testing.T, deny string, failingIn time.Duration, check func(logs string)) {
	t.Helper()
	ns := natstest.RunServerSeatDenied(t, deny)
	_, admin := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("admin", "admin"))
	composedBuckets(t, admin, 2)
	_, js := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("seat", "seat"))
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })

	var logs natstest.LogBuffer
	var mu sync.Mutex
	var errs []error
	p := projector.New(js, db, projector.Options{Buckets: []string{"composed-n0000", "composed-n0001"}, Poll: 20 * time.Millisecond,
		DiscoverEvery: time.Hour, Logger: slog.New(slog.NewTextHandler(&logs, nil)),
		OnTailError: func(bucket string, err error) {
			mu.Lock()
			defer mu.Unlock()
			if bucket == "composed-n0001" {
				errs = append(errs, err)
			}
		}})
	p.Start(context.Background())
	t.Cleanup(p.Stop)
	waitApplied(t, db, "composed-n0000", 1)
	natstest.CheckFor(t, failingIn, 10*time.Millisecond, func() error {
		if !p.Failing("composed-n0001") {
			return fmt.Errorf("composed-n0001 not failing yet")
		}
		return nil
	})
	mu.Lock()
	for _, err := range errs {
		var de *denied.Error
		require.True(t, errors.As(err, &de), "a try failed otherwise than refused: %v", err)
		require.Equal(t, deny, denied.Grant(de.Subject))
	}
	mu.Unlock()
	if check != nil {
		check(logs.String())
	}

	natstest.DenySeat(t, ns) // granted
	waitApplied(t, db, "composed-n0001", 1)
}
