package store_test

import (
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/store"
)

// TestDB_ExpireOfAPutOverAnOlderRevision: the store remembers a put with a TTL while it is its key's
// newest (a later message of the key forgets it), keeps what it remembers across a reopen, and Expire
// applies what the stream holds once the put is gone: the older revision is the row again, with its own
// revision and created, and the log says so as of every point from the put on; with nothing left the
// key is gone, its anomaly with it; a put that is no longer its key's newest is left alone.
func TestDB_ExpireOfAPutOverAnOlderRevision(t *testing.T) {
	const b = provisioner.BucketNeeds
	dir := t.TempDir()
	db, err := store.Open(dir, store.Options{})
	require.NoError(t, err)
	t0 := time.Unix(1_700_000_000, 0).UnixNano()
	due := t0 + int64(time.Minute)
	v1, v2 := []byte{0x81, 0xa1, 'v', 0x01}, []byte{0x81, 0xa1, 'v', 0x02}
	older := provisioner.Message{Seq: 1, Time: t0, Key: "n1.m1.config.a", Op: provisioner.OpPut, Value: v1}
	msgs := []provisioner.Message{
		older,
		{Seq: 2, Time: t0 + 2, Key: "n1.m1.config.a", Op: provisioner.OpPut, Value: v2, Expires: due},
		{Seq: 3, Time: t0 + 3, Key: "n1.m1.config.b", Op: provisioner.OpPut, Value: v2, Expires: due},
		{Seq: 4, Time: t0 + 4, Key: "n1.m1.config.b", Op: provisioner.OpPut, Value: v1}, // b's TTL'd put is no longer its newest
		{Seq: 5, Time: t0 + 5, Key: "n1.odd", Op: provisioner.OpPut, Value: v1, Expires: due + 1},
	}
	require.NoError(t, db.Apply(b, msgs, 1, false))
	require.Equal(t, 2, db.Expiries(), "a's and n1.odd's: b's was forgotten by its later put")
	require.NoError(t, db.Close())

	db, err = store.Open(dir, store.Options{})
	require.NoError(t, err)
	defer db.Close()
	require.Equal(t, 2, db.Expiries(), "read again at open")
	first, ok := db.NextExpiry()
	require.True(t, ok)
	require.Equal(t, store.Expiry{Bucket: b, Key: "n1.m1.config.a", Seq: 2, Due: due}, first)

	// A put no longer its key's newest is left alone, whatever the pending entry said.
	changed, err := db.Expire(store.Expiry{Bucket: b, Key: "n1.m1.config.b", Seq: 3}, nil)
	require.NoError(t, err)
	require.False(t, changed)

	changed, err = db.Expire(first, &older)
	require.NoError(t, err)
	require.True(t, changed)
	changed, err = db.Expire(store.Expiry{Bucket: b, Key: "n1.odd", Seq: 5}, nil)
	require.NoError(t, err)
	require.True(t, changed)
	require.Zero(t, db.Expiries())
	seq, _ := db.Applied(b)
	require.Equal(t, uint64(5), seq, "the applied sequence does not move")
	require.Equal(t, uint64(2), db.Rewrites())

	v, err := db.View()
	require.NoError(t, err)
	defer v.Close()
	rows := map[string]string{}
	require.NoError(t, v.Rows(provisioner.Range{Bucket: b, Index: provisioner.IndexPrimary}, func(r *provisioner.Row) bool {
		rows[string(r.Key)] = fmt.Sprintf("rev %d created %d %x", r.Revision, r.Created, r.Value)
		return true
	}))
	require.Equal(t, map[string]string{
		"n1.m1.config.a": fmt.Sprintf("rev 1 created %d %x", t0, v1),
		"n1.m1.config.b": fmt.Sprintf("rev 4 created %d %x", t0+4, v1),
	}, rows)
	var odd []string
	_, err = v.Anomalies(b, "", 10, func(a provisioner.Anomaly) {
		if a.Reason != provisioner.ReasonUnansweredKind { // no registry here: every need's kind is unanswered
			odd = append(odd, a.Key)
		}
	})
	require.NoError(t, err)
	require.Empty(t, odd, "the out-of-shape key is gone, and its anomaly")
	for _, n := range []uint64{2, 5, math.MaxUint64} {
		ev, put, err := v.KeyAt(b, "n1.m1.config.a", n)
		require.NoError(t, err)
		require.True(t, put)
		require.Equal(t, uint64(1), ev.Seq, "as of %d: the older revision, as the stream holds it", n)
		_, put, err = v.KeyAt(b, "n1.odd", n)
		require.NoError(t, err)
		require.False(t, put, "as of %d: the expired key is gone", n)
	}
}

// BenchmarkApply_PendingExpiries applies 100,000 needs to an empty store and reports the CPU time per
// message: plain puts with no pending expiry in the store (the lookup is one atomic load), plain puts
// with 10,000 pending expiries of other keys in it (a lookup under a mutex each), and puts that each
// carry a TTL (an entry written each).
// Run using: go test ./store -run x -bench Apply_PendingExpiries -benchtime 3x
func BenchmarkApply_PendingExpiries(b *testing.B) {
	const n, pending = 100000, 10000
	for _, mode := range []string{"plain", "plain-beside-pending", "ttl"} {
		b.Run(mode, func(b *testing.B) {
			var cpu time.Duration
			for i := 0; i < b.N; i++ {
				db, err := store.Open(b.TempDir(), store.Options{})
				if err != nil {
					b.Fatal(err)
				}
				seq := uint64(0)
				apply := func(count int, key func(j int) string, expires int64) {
					msgs := make([]provisioner.Message, 0, 4096)
					for j := 0; j < count; j++ {
						seq++
						msgs = append(msgs, provisioner.Message{Seq: seq, Time: int64(seq), Key: key(j), Op: provisioner.OpPut,
							Value: []byte{0x81, 0xa1, 'v', 0x01}, Expires: expires})
						if len(msgs) == cap(msgs) || j == count-1 {
							if err := db.Apply(provisioner.BucketNeeds, msgs, 1, false); err != nil {
								b.Fatal(err)
							}
							msgs = msgs[:0]
						}
					}
				}
				if mode == "plain-beside-pending" {
					apply(pending, func(j int) string { return fmt.Sprintf("n9.m9.config.ttl-%07d", j) }, int64(time.Hour))
				}
				expires := int64(0)
				if mode == "ttl" {
					expires = int64(time.Hour)
				}
				c0 := cpuTime()
				apply(n, func(j int) string { return fmt.Sprintf("n%04d.m%02d.config.name-%07d", j%4000, j%25, j) }, expires)
				cpu += cpuTime() - c0
				b.StopTimer()
				if err := db.Close(); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
			b.ReportMetric(float64(cpu)/1e3/float64(n*b.N), "cpu-µs/msg")
		})
	}
}
