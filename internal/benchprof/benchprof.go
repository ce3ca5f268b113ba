// Package benchprof profiles the timed part of a benchmark alone, without its setup (loading a mesh,
// ingesting it), which go test's -cpuprofile includes.
package benchprof

import (
	"os"
	"runtime/pprof"
	"sync"
	"testing"
)

// Start starts a CPU profile into the file BENCH_PROFILE names, when it names one. The returned stop
// ends it; it may be called more than once, and runs at the benchmark's cleanup in any case.
func Start(b testing.TB) (stop func()) {
	f := os.Getenv("BENCH_PROFILE")
	if f == "" {
		return func() {}
	}
	out, err := os.Create(f)
	if err != nil {
		b.Fatal(err)
	}
	if err := pprof.StartCPUProfile(out); err != nil {
		out.Close()
		b.Fatal(err)
	}
	stop = sync.OnceFunc(func() {
		pprof.StopCPUProfile()
		out.Close()
	})
	b.Cleanup(stop)
	return stop
}
