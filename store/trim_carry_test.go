package store_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/store"
)

// TestDB_TrimInBatchesEqualsOneBatch: a trim walked in tiny batches, carrying what it kept of each key
// from batch to batch (in generations of a few keys, rotated often), stopped after every batch and
// resumed, leaves exactly the log a trim in one batch leaves, and deletes as many events: composed
// buckets (three events kept per key, builds spelt m.4 and m.004, deletes, purges, markers) and the
// needs bucket alike, over several horizons.
func TestDB_TrimInBatchesEqualsOneBatch(t *testing.T) {
	for seed := uint64(1); seed <= 4; seed++ {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			hist := randomPlanHistory(t, seed, 700)
			r := rand.New(rand.NewPCG(seed, 5))
			var needs []provisioner.Message
			for i := 1; i <= 400; i++ {
				m := provisioner.Message{Seq: uint64(i), Time: int64(i) * 1e9, Key: fmt.Sprintf("n%d.m.config.k%d", r.IntN(3), r.IntN(8)), Op: provisioner.OpPut, Value: []byte{byte(i % 100)}}
				switch r.IntN(6) {
				case 0:
					m.Op, m.Value = provisioner.OpDelete, nil
				case 1:
					m.Op, m.Value, m.Rollup = provisioner.OpPurge, nil, provisioner.RollupSub
				case 2:
					m.Op, m.Value = provisioner.OpExpire, nil
				}
				needs = append(needs, m)
			}
			hist[provisioner.BucketNeeds] = needs
			open := func() *store.DB {
				db, err := store.OpenState(t.TempDir(), store.Options{})
				require.NoError(t, err)
				for b, msgs := range hist {
					require.NoError(t, db.Apply(b, msgs, 1, false))
				}
				return db
			}
			one, many := open(), open()
			defer one.Close()
			defer many.Close()
			for b, msgs := range hist {
				if b != provisioner.BucketNeeds && !provisioner.IsComposedBucket(b) {
					continue
				}
				last := uint64(len(msgs))
				for _, h := range []uint64{last / 5, last / 2, last/2 + 1, last - 3, last} {
					restore := store.SetTrimBatch(1 << 20)
					want, err := one.TrimHistory(context.Background(), b, h, int64(h)*1e9)
					restore()
					require.NoError(t, err)

					batch := 1 + r.IntN(4)
					restoreBatch, restoreCap := store.SetTrimBatch(batch), store.SetTrimKeptCap(1+r.IntN(3))
					got := 0
					if r.IntN(2) == 0 {
						// Stopped after each batch, and resumed by the next trim.
						ctx, cancel := context.WithCancel(context.Background())
						cancel()
						n, err := many.TrimHistory(ctx, b, h, int64(h)*1e9)
						got += n
						for err != nil {
							require.ErrorIs(t, err, context.Canceled)
							n, err = many.TrimHistory(ctx, b, h, int64(h)*1e9)
							got += n
						}
					} else {
						n, err := many.TrimHistory(context.Background(), b, h, int64(h)*1e9)
						require.NoError(t, err)
						got = n
					}
					restoreBatch()
					restoreCap()
					what := fmt.Sprintf("%s trimmed to %d in batches of %d", b, h, batch)
					require.Equal(t, want, got, "%s: events deleted", what)
					require.Equal(t, logged(t, one, b), logged(t, many, b), "%s: the log kept", what)
					require.Equal(t, marks(t, one, b), marks(t, many, b), "%s: marks", what)
				}
			}
		})
	}
}
