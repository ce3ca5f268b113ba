package seat_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/seat"
)

// TestSeat_MinSeqAcrossARebuildSwap: CONTRACT section 3, a request with min_seq is answered only once
// the projection it is answered from has applied min_seq, and as_of says that projection's sequence.
// A rebuild swaps in a store between the request's check of min_seq (on the store it replaces) and the
// view its answer is read from; the new store has applied less (the needs bucket was created again,
// with three messages). The answer used to come from the new store at once, as_of 3 for a min_seq of
// hundreds: the request now waits, within its wait_ms, until the new store has applied min_seq.
func TestSeat_MinSeqAcrossARebuildSwap(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.load(testMesh.Ops())
	st, _ := h.startSeat(t.TempDir())
	h.waitCaughtUp(st)
	minSeq, _ := st.Store().Applied(provisioner.BucketNeeds)
	require.Greater(t, minSeq, uint64(10))

	// The rebuild stops at its swap, its old projector stopped, until released.
	atSwap, releaseSwap := make(chan struct{}), make(chan struct{})
	var swapOnce sync.Once
	seat.SetBeforeSwap(st, func(*projector.Projector) {
		swapOnce.Do(func() {
			close(atSwap)
			<-releaseSwap
		})
	})
	var releaseOnce sync.Once
	release := func() { releaseOnce.Do(func() { close(releaseSwap) }) }
	t.Cleanup(release)

	ctx := context.Background()
	require.NoError(t, h.js.DeleteKeyValue(ctx, provisioner.BucketNeeds))
	_, err := h.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.BucketNeeds, History: 8})
	require.NoError(t, err)
	const node = "n-after"
	put := func(from, to int) {
		var ops []fixtures.Op
		for i := from; i < to; i++ {
			ops = append(ops, fixtures.Op{Bucket: provisioner.BucketNeeds, Key: fmt.Sprintf("%s.mod.config.k%04d", node, i), Op: provisioner.OpPut, Value: []byte{0x01}})
		}
		h.load(ops)
	}
	put(0, 3)
	select {
	case <-atSwap:
	case <-time.After(20 * time.Second):
		t.Fatal("the rebuild did not reach its swap")
	}
	have, _ := st.Store().Applied(provisioner.BucketNeeds)
	require.Equal(t, minSeq, have, "the replaced store still answers, its min_seq reached")

	// The request checks min_seq on the replaced store, then stops before it opens its view.
	atView, releaseView := make(chan struct{}), make(chan struct{})
	var viewOnce sync.Once
	seat.SetBeforeView(st, func() {
		viewOnce.Do(func() {
			close(atView)
			<-releaseView
		})
	})
	answered := natstest.AskLater(h.nc, query.Subject, []byte(fmt.Sprintf(`{"what":"needs","node":%q,"min_seq":%d,"wait_ms":10000}`, node, minSeq)))
	select {
	case <-atView:
	case <-time.After(10 * time.Second):
		t.Fatal("the request did not reach its view")
	}
	release()
	natstest.CheckFor(t, 20*time.Second, 10*time.Millisecond, func() error {
		if st.Rebuilds() == 0 {
			return errors.New("not swapped in yet")
		}
		return nil
	})
	close(releaseView)
	seat.SetBeforeView(st, nil)

	// The new store has applied 3: the request waits again rather than answer from it.
	var early *natstest.Asked
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		select {
		case r := <-answered:
			early = &r
			return nil
		default:
		}
		if st.Server.Waiting() != 1 {
			return errors.New("the request is neither answered nor waiting")
		}
		return nil
	})
	if early != nil {
		require.NoError(t, early.Err)
		require.GreaterOrEqual(t, early.A.AsOf, minSeq, "answered from a store behind min_seq")
	}
	put(3, int(minSeq)) // the new stream reaches min_seq
	r := <-answered
	require.NoError(t, r.Err)
	require.GreaterOrEqual(t, r.A.AsOf, minSeq)
	require.Len(t, r.A.Rows, int(minSeq), "the node's needs as of as_of")
}
