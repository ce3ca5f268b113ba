package projector_test

// Measurements of session 8 (docs/performance.md, "Session 8: start, catch-up and stop"), not tests of
// a property: they log figures and assert nothing about them. Run with
//
//	MP_SCALE=1 go test ./projector -run 'TestScale' -v -count=1
//
// MP_N=1 runs TestScaleComposed_Restart at 1,000 buckets only.

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// cpuNow is the process's CPU time so far, user and system.
func cpuNow() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// publishNeeds writes n needs, one in ten of a kind no registry entry answers, with a value of round.
func publishNeeds(t *testing.T, js jetstream.JetStream, n, round int) {
	t.Helper()
	val := []byte{0x81, 0xa1, 'v', byte(round)}
	for i := 0; i < n; i++ {
		kind := "config"
		if i%10 == 0 {
			kind = "nokind"
		}
		_, err := js.PublishAsync(fmt.Sprintf("$KV.%s.n%05d.m%03d.%s.x", provisioner.BucketNeeds, i/100, i%100, kind), val)
		require.NoError(t, err)
		if i%2000 == 1999 {
			<-js.PublishAsyncComplete()
		}
	}
	<-js.PublishAsyncComplete()
}

// runUntilSynced runs a projector of the four buckets until each is synced, and stops it.
func runUntilSynced(t *testing.T, js jetstream.JetStream, db *store.DB) {
	t.Helper()
	p := projector.New(js, db, projector.Options{Poll: 20 * time.Millisecond})
	p.Start(context.Background())
	natstest.CheckFor(t, 10*time.Minute, 20*time.Millisecond, func() error {
		for _, s := range provisioner.ProvisionerShapes {
			if _, ok := db.Applied(s.Bucket); !ok {
				return fmt.Errorf("%s not synced", s.Bucket)
			}
		}
		return nil
	})
	p.Stop()
}

// TestScale_Restart measures a projector's start on a store already caught up (nothing new in the
// streams), and its catch-up after n updates written while it was down. MP_SCALE=1 to run.
func TestScale_Restart(t *testing.T) {
	if os.Getenv("MP_SCALE") == "" {
		t.Skip("MP_SCALE unset")
	}
	for _, n := range []int{100000, 200000, 400000} {
		ns := natstest.RunServer(t)
		_, js := natstest.Connect(t, ns.ClientURL())
		ctx := context.Background()
		_, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.BucketNeeds, History: 1})
		require.NoError(t, err)
		_, err = js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.BucketRegistry, History: 1})
		require.NoError(t, err)
		_, err = js.Publish(ctx, "$KV."+provisioner.BucketRegistry+".config", []byte{0x80})
		require.NoError(t, err)
		publishNeeds(t, js, n, 1)
		dir := t.TempDir()
		db, err := store.OpenState(dir, store.Options{})
		require.NoError(t, err)
		runUntilSynced(t, js, db)
		require.NoError(t, db.Close())

		// Catch-up: n updates written while down (the first round is superseded: the stream starts
		// past n, the store's log holds both rounds).
		publishNeeds(t, js, n, 2)
		runtime.GC()
		var m0 runtime.MemStats
		runtime.ReadMemStats(&m0)
		c0 := cpuNow()
		db, err = store.OpenState(dir, store.Options{})
		require.NoError(t, err)
		done, exited := make(chan struct{}), make(chan struct{})
		var peak uint64
		go func() {
			defer close(exited)
			var m runtime.MemStats
			for {
				select {
				case <-done:
					return
				case <-time.After(50 * time.Millisecond):
				}
				runtime.ReadMemStats(&m)
				peak = max(peak, m.HeapInuse)
			}
		}()
		runUntilSynced(t, js, db)
		close(done)
		<-exited
		c1 := cpuNow()
		require.NoError(t, db.Close())
		t.Logf("n=%d catch-up of %d updates: cpu=%v peak heap in use=%dMiB (before %dMiB)", n, n, c1-c0, peak>>20, m0.HeapInuse>>20)

		for i := 0; i < 3; i++ {
			c0 := cpuNow()
			db, err = store.OpenState(dir, store.Options{})
			require.NoError(t, err)
			c1 := cpuNow()
			runUntilSynced(t, js, db)
			c2 := cpuNow()
			require.NoError(t, db.Close())
			t.Logf("n=%d restart %d: open cpu=%v start-to-synced cpu=%v", n, i, c1-c0, c2-c1)
		}
		ns.Shutdown()
	}
}

// TestScaleComposed_Restart measures a start on a store holding n composed-<node> buckets, all
// caught up: CPU and JetStream API requests until every bucket is synced. MP_SCALE=1 to run.
func TestScaleComposed_Restart(t *testing.T) {
	if os.Getenv("MP_SCALE") == "" {
		t.Skip("MP_SCALE unset")
	}
	sizes := []int{250, 500, 1000}
	if os.Getenv("MP_N") != "" {
		sizes = []int{1000}
	}
	for _, n := range sizes {
		ns := natstest.RunServer(t)
		nc, js := natstest.Connect(t, ns.ClientURL())
		composedBuckets(t, js, n)
		dir := t.TempDir()
		run := func() (time.Duration, int64, int64) {
			infos, creates := countRequests(t, nc, "$JS.API.STREAM.INFO.>"), countRequests(t, nc, "$JS.API.CONSUMER.CREATE.>")
			_, pjs := natstest.Connect(t, ns.ClientURL())
			c0 := cpuNow()
			db, err := store.OpenState(dir, store.Options{})
			require.NoError(t, err)
			p := projector.New(pjs, db, projector.Options{Buckets: []string{}, Composed: true})
			p.Start(context.Background())
			natstest.CheckFor(t, 2*time.Minute, 20*time.Millisecond, func() error {
				if !p.Discovered() {
					return fmt.Errorf("not discovered")
				}
				for i := range n {
					if _, synced := db.Applied(fmt.Sprintf("composed-n%04d", i)); !synced {
						return fmt.Errorf("composed-n%04d not synced", i)
					}
				}
				return nil
			})
			c1 := cpuNow()
			p.Stop()
			require.NoError(t, db.Close())
			return c1 - c0, infos.Load(), creates.Load()
		}
		run()
		for i := 0; i < 2; i++ {
			cpu, infos, creates := run()
			t.Logf("n=%d restart %d: cpu=%v STREAM.INFO=%d CONSUMER.CREATE=%d", n, i, cpu, infos, creates)
		}
		ns.Shutdown()
	}
}

// TestScaleStop_DuringCatchUp stops a projector in the middle of a catch-up and reads how many
// messages it applied after Stop was called. MP_SCALE=1 to run.
func TestScaleStop_DuringCatchUp(t *testing.T) {
	if os.Getenv("MP_SCALE") == "" {
		t.Skip("MP_SCALE unset")
	}
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	_, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.BucketNeeds, History: 1})
	require.NoError(t, err)
	publishNeeds(t, js, 200000, 1)
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	for i := 0; i < 3; i++ {
		p := projector.New(js, db, projector.Options{Buckets: []string{provisioner.BucketNeeds}})
		p.Start(ctx)
		from := p.Applied()
		natstest.CheckFor(t, time.Minute, time.Millisecond, func() error {
			if p.Applied() < from+20000 {
				return fmt.Errorf("applied %d", p.Applied())
			}
			return nil
		})
		at := p.Applied()
		c0 := cpuNow()
		p.Stop()
		c1 := cpuNow()
		seq, _ := db.Applied(provisioner.BucketNeeds)
		t.Logf("stop %d: applied %d at Stop, %d after it (checkpoint %d); stop cpu=%v", i, at, p.Applied()-at, seq, c1-c0)
	}
}
