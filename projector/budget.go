package projector

import (
	"context"
	"sync/atomic"

	provisioner "github.com/novox/mesh-provisioner"
)

// budget bounds the bytes a bucket's reader has handed over to its applier and the applier has not
// applied yet: the channel between them holds up to two batches of messages, and with values near
// NATS's max payload 8192 messages were 8 GB and more, whatever bound the pulls had. The reader takes
// a message's bytes before it hands it over (take), the applier gives a batch's back once it is
// applied (give). A message larger than the whole budget still goes, alone: take lets anything
// through while nothing is held, so no value is too large to be read.
type budget struct {
	max   int64
	held  atomic.Int64
	freed chan struct{} // capacity 1: give wakes a take waiting
}

func newBudget(max int) *budget {
	return &budget{max: int64(max), freed: make(chan struct{}, 1)}
}

// take waits until n more bytes fit in the budget, or nothing is held, and holds them; it reports
// false when ctx ended first. The reader alone takes, so what it saw fit still fits when it adds it.
func (b *budget) take(ctx context.Context, n int64) bool {
	for {
		if h := b.held.Load(); h == 0 || h+n <= b.max {
			b.held.Add(n)
			return true
		}
		select {
		case <-b.freed:
		case <-ctx.Done():
			return false
		}
	}
}

// give hands n bytes back and wakes a take waiting.
func (b *budget) give(n int64) {
	if n == 0 {
		return
	}
	b.held.Add(-n)
	select {
	case b.freed <- struct{}{}:
	default:
	}
}

// size is what a message counts against a budget: its key and its value, which it holds (the
// nats.go message's buffer behind them).
func size(m provisioner.Message) int64 { return int64(len(m.Key) + len(m.Value)) }

// sizeOf is the size of a batch of messages.
func sizeOf(batch []provisioner.Message) int64 {
	var n int64
	for _, m := range batch {
		n += size(m)
	}
	return n
}
