package projector

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestBudget_TakeWaitsForGive: a take that does not fit waits until the applier gives back, and a
// message larger than the whole budget goes once nothing is held, never waits for ever.
func TestBudget_TakeWaitsForGive(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := newBudget(100)
	require.True(t, b.take(ctx, 60))
	require.True(t, b.take(ctx, 40), "fits exactly")

	took := make(chan bool, 1)
	go func() { took <- b.take(ctx, 500) }() // larger than the budget
	select {
	case <-took:
		t.Fatal("taken while the budget was full")
	case <-time.After(20 * time.Millisecond):
	}
	b.give(60)
	select {
	case <-took:
		t.Fatal("a message larger than the budget taken while other bytes were held")
	case <-time.After(20 * time.Millisecond):
	}
	b.give(40)
	require.True(t, <-took, "a message larger than the budget goes alone")

	cctx, cancel := context.WithCancel(ctx)
	cancel()
	require.False(t, b.take(cctx, 1), "a full budget's take ends with its context")
	b.give(500)
	require.True(t, b.take(cctx, 1), "fits: no wait")
}
