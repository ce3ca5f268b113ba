package store

// Measurements of session 8 (docs/performance.md, "Session 8: start, catch-up and stop"), not tests of
// a property: they log figures and assert nothing about them. Run with
//
//	MP_SCALE=1 go test ./store -run 'TestScale_' -v -count=1
//
// MP_FLUSH=1 flushes the memtables before the measured open (no log to replay); MP_BIG=1 runs the
// catch-up at 400k and 800k.

import (
	"fmt"
	"os"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
)

// cpuNow is the process's CPU time so far, user and system.
func cpuNow() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// buildScale fills a store with n needs (1 in 10 of an unanswered kind), n/4 applied, and
// composed-<node> buckets with plans.
func buildScale(t *testing.T, dir string, n int) {
	t.Helper()
	db, err := Open(dir, Options{})
	require.NoError(t, err)
	val := []byte{0x81, 0xa1, 'v', 0x01}
	var seq uint64
	require.NoError(t, db.Apply(provisioner.BucketRegistry, []provisioner.Message{{Seq: 1, Time: 1, Key: "config", Op: provisioner.OpPut, Value: val}}, 1, true))
	msgs := make([]provisioner.Message, 0, 10000)
	flush := func(b string) {
		require.NoError(t, db.Apply(b, msgs, 1, false))
		msgs = msgs[:0]
	}
	for i := 0; i < n; i++ {
		seq++
		kind := "config"
		if i%10 == 0 {
			kind = "nokind"
		}
		msgs = append(msgs, provisioner.Message{Seq: seq, Time: int64(seq), Key: fmt.Sprintf("n%05d.m%03d.%s.x", i/100, i%100, kind), Op: provisioner.OpPut, Value: val})
		if len(msgs) == cap(msgs) {
			flush(provisioner.BucketNeeds)
		}
	}
	flush(provisioner.BucketNeeds)
	seq = 0
	for i := 0; i < n/4; i++ {
		seq++
		msgs = append(msgs, provisioner.Message{Seq: seq, Time: int64(seq), Key: fmt.Sprintf("n%05d.m%03d", i/25, i%25), Op: provisioner.OpPut, Value: val})
		if len(msgs) == cap(msgs) {
			flush(provisioner.BucketApplied)
		}
	}
	flush(provisioner.BucketApplied)
	pub := []byte{0x82, 0xa6, 's', 't', 'a', 't', 'u', 's', 0xa9, 'p', 'u', 'b', 'l', 'i', 's', 'h', 'e', 'd', 0xa4, 'p', 'l', 'a', 'n', 0x01}
	nodes := n / 1000
	seq = 0
	for i := 0; i < nodes; i++ {
		seq++
		msgs = append(msgs, provisioner.Message{Seq: seq, Time: int64(seq), Key: fmt.Sprintf("c%04d.m1", i), Op: provisioner.OpPut, Value: []byte{0x81, 0xa4, 'w', 'a', 'n', 't', 0xa1, '1'}})
	}
	flush(provisioner.BucketHostModules)
	for i := 0; i < nodes; i++ {
		msgs = append(msgs, provisioner.Message{Seq: 1, Time: 1, Key: "m1.1", Op: provisioner.OpPut, Value: pub}, provisioner.Message{Seq: 2, Time: 2, Key: "bad", Op: provisioner.OpPut, Value: pub})
		flush(fmt.Sprintf("composed-c%04d", i))
	}
	require.NoError(t, db.Close())
}

// TestScale_Open measures store.Open of an existing state: CPU, allocations and the live heap it adds,
// then Close and a second open.
func TestScale_Open(t *testing.T) {
	if os.Getenv("MP_SCALE") == "" {
		t.Skip("MP_SCALE unset")
	}
	for _, n := range []int{100000, 200000, 400000} {
		dir := t.TempDir()
		buildScale(t, dir, n)
		if os.Getenv("MP_FLUSH") != "" {
			db, err := Open(dir, Options{})
			require.NoError(t, err)
			require.NoError(t, db.pdb.Flush())
			require.NoError(t, db.Close())
		}
		runtime.GC()
		var m0, m1 runtime.MemStats
		runtime.ReadMemStats(&m0)
		c0 := cpuNow()
		db, err := Open(dir, Options{})
		require.NoError(t, err)
		c1 := cpuNow()
		runtime.ReadMemStats(&m1)
		runtime.GC()
		var m2 runtime.MemStats
		runtime.ReadMemStats(&m2)
		t.Logf("n=%d open cpu=%v mallocs=%d alloc=%dKiB liveheap=%dKiB", n, c1-c0, m1.Mallocs-m0.Mallocs, (m1.TotalAlloc-m0.TotalAlloc)>>10, int64(m2.HeapAlloc>>10)-int64(m0.HeapAlloc>>10))
		c0 = cpuNow()
		require.NoError(t, db.Close())
		c1 = cpuNow()
		db, err = Open(dir, Options{})
		require.NoError(t, err)
		c2 := cpuNow()
		require.NoError(t, db.Close())
		t.Logf("n=%d close cpu=%v reopen cpu=%v", n, c1-c0, c2-c1)
	}
}

// TestScale_CatchUp applies n updates of existing keys in batches of 4,096, as the projector does
// while catching up, and reads the peak heap in use and the CPU. MP_SCALE=1 to run.
func TestScale_CatchUp(t *testing.T) {
	if os.Getenv("MP_SCALE") == "" {
		t.Skip("MP_SCALE unset")
	}
	sizes := []int{100000, 200000, 400000}
	if os.Getenv("MP_BIG") != "" {
		sizes = []int{400000, 800000}
	}
	for _, n := range sizes {
		dir := t.TempDir()
		buildScale(t, dir, n)
		db, err := Open(dir, Options{})
		require.NoError(t, err)
		cp := db.Checkpoint(provisioner.BucketNeeds)
		seq := cp.Applied
		runtime.GC()
		var m0, m runtime.MemStats
		runtime.ReadMemStats(&m0)
		var peak uint64
		c0 := cpuNow()
		val := []byte{0x81, 0xa1, 'v', 0x02}
		msgs := make([]provisioner.Message, 0, 4096)
		for i := 0; i < n; i++ {
			seq++
			kind := "config"
			if i%10 == 0 {
				kind = "nokind"
			}
			msgs = append(msgs, provisioner.Message{Seq: seq, Time: int64(seq), Key: fmt.Sprintf("n%05d.m%03d.%s.x", i/100, i%100, kind), Op: provisioner.OpPut, Value: val})
			if len(msgs) == cap(msgs) || i == n-1 {
				db.CatchingUp(provisioner.BucketNeeds, uint64(n-i))
				require.NoError(t, db.Apply(provisioner.BucketNeeds, msgs, 1, false))
				msgs = msgs[:0]
				if (i/4096)%8 == 0 {
					runtime.ReadMemStats(&m)
					peak = max(peak, m.HeapInuse)
				}
			}
		}
		db.CatchingUp(provisioner.BucketNeeds, 0)
		c1 := cpuNow()
		runtime.ReadMemStats(&m)
		t.Logf("n=%d catch-up: cpu=%v (%.1f µs/msg) mallocs/msg=%.1f peak heap in use=%dMiB (before %dMiB)", n, c1-c0, float64((c1-c0).Microseconds())/float64(n), float64(m.Mallocs-m0.Mallocs)/float64(n), peak>>20, m0.HeapInuse>>20)
		require.NoError(t, db.Close())
	}
}
