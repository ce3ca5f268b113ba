package seat_test

import (
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go/micro"

	"github.com/novox/mesh-provisioner/internal/natstest"
)

// BenchmarkBareReply is the floor of BenchmarkNodeLookup: a micro endpoint answering a fixed 22 KB
// body, through the same in-process server and client.
func BenchmarkBareReply(b *testing.B) {
	ns := natstest.RunServer(b)
	nc, _ := natstest.Connect(b, ns.ClientURL())
	snc, _ := natstest.Connect(b, ns.ClientURL())
	body := make([]byte, 22<<10)
	svc, err := micro.AddService(snc, micro.Config{Name: "floor", Version: "0.0.1"})
	if err != nil {
		b.Fatal(err)
	}
	defer svc.Stop()
	if err := svc.AddEndpoint("x", micro.HandlerFunc(func(r micro.Request) { _ = r.Respond(body) }), micro.WithEndpointSubject("floor.x")); err != nil {
		b.Fatal(err)
	}
	var ru0 syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru0)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := nc.Request("floor.x", []byte("{}"), 5*time.Second); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	var ru1 syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru1)
	b.ReportMetric(float64((ru1.Utime.Nano()+ru1.Stime.Nano())-(ru0.Utime.Nano()+ru0.Stime.Nano()))/1e3/float64(b.N), "cpu-µs/op")
}
