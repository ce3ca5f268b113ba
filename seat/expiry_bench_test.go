package seat_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
)

// BenchmarkSeat_ExpiriesWithoutMarkers: TTL_KEYS needs (default 2,000), each a put and then a put with
// a 1 s TTL over it (History 5: the server removes the second without a marker), read by a seat; it
// reports how long after the last put came due (its time + 1 s + the loop's 1 s slack) the seat
// answered every key's older revision again, the rate from the first one due, and the process's CPU
// time per expiry (seat, client and server together).
// Run using: TTL_KEYS=20000 go test ./seat -run x -bench ExpiriesWithoutMarkers -benchtime 1x
func BenchmarkSeat_ExpiriesWithoutMarkers(b *testing.B) {
	n := 2000
	if v, err := strconv.Atoi(os.Getenv("TTL_KEYS")); err == nil && v > 0 {
		n = v
	}
	ctx := context.Background()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		ns := natstest.RunServer(b)
		_, js := natstest.Connect(b, ns.ClientURL())
		kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.BucketNeeds, History: 5, LimitMarkerTTL: time.Second})
		if err != nil {
			b.Fatal(err)
		}
		if err := fixtures.CreateBuckets(ctx, js, provisioner.BucketApplied, provisioner.BucketCollect); err != nil {
			b.Fatal(err)
		}
		st, stop := startBenchSeat(b, ns.ClientURL())
		key := func(j int) string { return fmt.Sprintf("n%04d.m1.config.k%07d", j%4000, j) }
		for j := 0; j < n; j++ {
			if _, err := kv.Put(ctx, key(j), []byte{0x81, 0xa1, 'v', 0x01}); err != nil {
				b.Fatal(err)
			}
		}
		var first, last time.Time
		for j := 0; j < n; j++ {
			if _, err := js.PublishAsync(provisioner.SubjectPrefix(provisioner.BucketNeeds)+key(j), []byte{0x81, 0xa1, 'v', 0x02}, jetstream.WithMsgTTL(time.Second)); err != nil {
				b.Fatal(err)
			}
			if j == 0 {
				first = time.Now()
			}
		}
		select {
		case <-js.PublishAsyncComplete():
		case <-time.After(time.Minute):
			b.Fatal("publishing timed out")
		}
		last = time.Now()
		natstest.CheckFor(b, 5*time.Minute, 10*time.Millisecond, func() error {
			if seq, _ := st.Store().Applied(provisioner.BucketNeeds); seq < uint64(2*n) {
				return fmt.Errorf("applied %d of %d", seq, 2*n)
			}
			return nil
		})
		var ru0 syscall.Rusage
		_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru0)
		b.StartTimer()
		natstest.CheckFor(b, 10*time.Minute, 10*time.Millisecond, func() error {
			if left := st.Store().Expiries(); left > 0 {
				return fmt.Errorf("%d pending", left)
			}
			return nil
		})
		done := time.Now()
		b.StopTimer()
		var ru1 syscall.Rusage
		_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru1)
		cpu := (ru1.Utime.Nano() + ru1.Stime.Nano()) - (ru0.Utime.Nano() + ru0.Stime.Nano())
		slack := 2 * time.Second
		b.ReportMetric(float64(n)/done.Sub(first.Add(slack)).Seconds(), "expiries/s")
		b.ReportMetric(done.Sub(last.Add(slack)).Seconds(), "s-after-last-due")
		b.ReportMetric(float64(cpu)/1e3/float64(n), "cpu-µs/expiry")
		stop()
	}
}
