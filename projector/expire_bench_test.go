package projector_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/benchprof"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// BenchmarkExpire: BENCH_EXPIRE_KEYS needs (20,000 by default), each a put then a put with a TTL over
// it, applied by the projector, which stops before the first comes due; once the server removed them all,
// a projector on the same store starts with every one due at once (a seat that was down, or a mesh
// that wrote them in bulk). Measured from its start to the last expiry applied (the store holds no
// pending expiry), in wall time and in this process's CPU time (the projector, Pebble and the embedded
// server that answers the asks), and asks of the stream a key (a direct get of many keys is one).
// Run using: go test ./projector -run x -bench Expire -benchtime 1x (BENCH_PROFILE=cpu.prof profiles
// that part alone; BENCH_EXPIRE_DIRECT=0 asks the stream's leader alone, key by key).
func BenchmarkExpire(b *testing.B) {
	n := 20000
	if v, err := strconv.Atoi(os.Getenv("BENCH_EXPIRE_KEYS")); err == nil && v > 0 {
		n = v
	}
	// Long enough for every put to be applied before the first comes due.
	ttl := 5*time.Second + time.Duration(n)*time.Millisecond
	ctx := context.Background()
	var wall, cpu time.Duration
	var asks int64
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		ns := natstest.RunServer(b)
		_, js := natstest.Connect(b, ns.ClientURL())
		_, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.BucketNeeds, History: 5, LimitMarkerTTL: time.Second})
		if err != nil {
			b.Fatal(err)
		}
		db, err := store.Open(filepath.Join(b.TempDir(), "s"), store.Options{})
		if err != nil {
			b.Fatal(err)
		}
		p := projector.New(js, db, projector.Options{Buckets: []string{provisioner.BucketNeeds}})
		p.Start(ctx)
		key := func(k int) string {
			return fmt.Sprintf("$KV.%s.n%05d.m1.config.k%d", provisioner.BucketNeeds, k/100, k)
		}
		for k := range n {
			if _, err := js.PublishAsync(key(k), []byte{0x01}); err != nil {
				b.Fatal(err)
			}
			if k%1000 == 999 {
				<-js.PublishAsyncComplete()
			}
		}
		<-js.PublishAsyncComplete()
		for k := range n {
			if _, err := js.PublishAsync(key(k), []byte{0x02}, jetstream.WithMsgTTL(ttl)); err != nil {
				b.Fatal(err)
			}
			if k%1000 == 999 {
				<-js.PublishAsyncComplete()
			}
		}
		<-js.PublishAsyncComplete()
		for db.Expiries() < n {
			if e, ok := db.NextExpiry(); ok && time.Now().UnixNano() >= e.Due {
				b.Fatal("the first put came due before the last was applied: a longer TTL is needed")
			}
			time.Sleep(10 * time.Millisecond)
		}
		// All of them due at once: the projector stopped before the first came due starts again once
		// the last one is (with expireSlack, 1 s, after it), as a seat that was down would.
		p.Stop()
		e, ok := db.PendingExpiry(provisioner.BucketNeeds, key(n - 1)[len(provisioner.SubjectPrefix(provisioner.BucketNeeds)):])
		if !ok {
			b.Fatal("no pending expiry for the last put")
		}
		time.Sleep(time.Until(time.Unix(0, e.Due).Add(2 * time.Second)))
		stopProfile := benchprof.Start(b)
		cpu0, t0 := cpuTime(), time.Now()
		b.StartTimer()
		p = projector.New(js, db, projector.Options{Buckets: []string{provisioner.BucketNeeds}})
		projector.SetExpireDirect(p, os.Getenv("BENCH_EXPIRE_DIRECT") != "0")
		p.Start(ctx)
		for db.Expiries() > 0 {
			time.Sleep(time.Millisecond)
		}
		b.StopTimer()
		wall += time.Since(t0)
		cpu += cpuTime() - cpu0
		stopProfile()
		asks += projector.ExpireAsks(p)
		p.Stop()
		if err := db.Close(); err != nil {
			b.Fatal(err)
		}
		ns.Shutdown()
	}
	b.ReportMetric(float64(n)*float64(b.N)/wall.Seconds(), "expiries/s")
	b.ReportMetric(float64(cpu)/1e3/float64(n)/float64(b.N), "cpu-µs/expiry")
	b.ReportMetric(float64(asks)/float64(n)/float64(b.N), "asks/expiry")
}
