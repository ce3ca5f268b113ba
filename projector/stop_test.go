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
	t.Parallel()
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

// TestProjector_StopWhileAConsumerIsCreated: a projector stopped while a bucket's consumer is being
// created, the request sent and the consumer created by the server but its answer not yet back,
// deletes that consumer too. Before, the tail knew no name to delete: a stop during a first read of
// thousands of buckets left up to 16 such consumers (as many as are set up at once) to the server's
// inactive threshold, 5 minutes (3 and 11 in two of six stops of 1,000 buckets mid-read).
func TestProjector_StopWhileAConsumerIsCreated(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	composedBuckets(t, js, 1)
	const b = "composed-n0000"
	_, pjs := natstest.Connect(t, ns.ClientURL())
	created := make(chan string, 1)
	p, _, _ := parkingQuiet(t, natstest.AnswerLost{JetStream: pjs, Created: created}, pjs, nil, nil)
	select {
	case <-created:
	case <-time.After(30 * time.Second):
		t.Fatal("no consumer created")
	}
	require.Equal(t, 1, consumers(t, js, b))
	p.Stop()
	require.Zero(t, consumers(t, js, b), "the consumer whose creation the stop cut short outlived the projector")
}
