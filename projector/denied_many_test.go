package projector_test

import (
	"context"
	"errors"
	"fmt"
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

// TestProjector_DeniedBucketsFailTogether: several composed-<node> buckets NATS refuses at once, as
// when the controller has not yet written the lines of several new nodes: some may not create their
// consumer, others may not pull. nats.go keeps only the connection's last error, which the refusals
// took in turn: a setup watched it every 10 ms and missed a refusal followed by another bucket's
// within them (it waited out the API's 5 s timeout, "deadline exceeded"), and a tail whose pulls were
// refused found another bucket's refusal at each missed heartbeat and read on for ever (never Failing:
// /readyz held at 503 for good). Every refusal the connection reports is seen: each bucket fails at
// once, naming its own grant, and is read whole once granted.
func TestProjector_DeniedBucketsFailTogether(t *testing.T) {
	t.Parallel()
	const n = 9
	var buckets, deny []string
	want := map[string]string{} // bucket -> the grant its refusal names
	for i := range n {
		b := fmt.Sprintf("composed-n%04d", i)
		buckets = append(buckets, b)
		switch {
		case i == 0: // read as any other
		case i%2 == 1:
			want[b] = "$JS.API.CONSUMER.CREATE.KV_" + b + ".>"
		default:
			want[b] = "$JS.API.CONSUMER.MSG.NEXT.KV_" + b + ".*"
		}
		if want[b] != "" {
			deny = append(deny, want[b])
		}
	}
	ns := natstest.RunServerSeatDenied(t, deny...)
	_, admin := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("admin", "admin"))
	composedBuckets(t, admin, n)
	_, js := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("seat", "seat"))
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })

	var mu sync.Mutex
	errs := map[string][]error{}
	p := projector.New(js, db, projector.Options{Buckets: buckets, Poll: 20 * time.Millisecond, DiscoverEvery: time.Hour,
		OnTailError: func(bucket string, err error) {
			mu.Lock()
			defer mu.Unlock()
			errs[bucket] = append(errs[bucket], err)
		}})
	p.Start(context.Background())
	t.Cleanup(p.Stop)
	waitApplied(t, db, "composed-n0000", 1)
	natstest.CheckFor(t, 120*time.Second, 20*time.Millisecond, func() error {
		for b := range want {
			if !p.Failing(b) {
				return fmt.Errorf("%s not failing yet", b)
			}
		}
		return nil
	})
	mu.Lock()
	for b, grant := range want {
		require.NotEmpty(t, errs[b], b)
		for _, err := range errs[b] {
			var de *denied.Error
			require.True(t, errors.As(err, &de), "%s: a try failed otherwise than refused: %v", b, err)
			require.Equal(t, grant, denied.Grant(de.Subject), "%s: the refusal named is its own", b)
		}
	}
	require.Empty(t, errs["composed-n0000"])
	mu.Unlock()

	natstest.DenySeat(t, ns) // granted
	for b := range want {
		waitApplied(t, db, b, 1)
	}
}
