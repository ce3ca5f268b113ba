package projector_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/internal/natstest"
)

// TestProjector_StopDeletesItsConsumers: a projector stopped while its buckets still read (a seat
// stopped, a rebuild abandoned or swapped, during a first read of thousands of composed-<node>
// buckets, before they park) deletes their consumers rather than leave each on the server until its
// inactive threshold, 5 minutes later.
func TestProjector_StopDeletesItsConsumers(t *testing.T) {
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	const n = 3
	composedBuckets(t, js, n)
	r := restartable{t: t, url: ns.ClientURL(), dir: t.TempDir(), every: 100 * time.Millisecond, verify: time.Hour}
	p, db, stop := r.start(nil)
	for i := range n {
		b := fmt.Sprintf("composed-n%04d", i)
		waitApplied(t, db, b, 1)
		require.False(t, p.Parked(b), "%s parks only after an hour", b)
		require.Equal(t, 1, consumers(t, js, b), "%s reads through a consumer", b)
	}
	stop()
	for i := range n {
		b := fmt.Sprintf("composed-n%04d", i)
		require.Zero(t, consumers(t, js, b), "%s: its consumer outlived the projector's stop", b)
	}
}
