package reliability_test

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nats.go/micro"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/seat"
)

// TestSoak_SeatStaysBounded runs a seat with plans for MESH_SOAK_FOR (default 3m) under churn:
// composed-<node> buckets created, written (some compositions with a TTL) and deleted, needs put,
// deleted and expiring through per-key TTLs with markers, and clients asking. After each round it
// samples goroutines, the projector's per-bucket entries, open file descriptors and the live heap;
// at the end, with every churned bucket deleted and forgotten, each must be back near what it was
// after the first round. It runs only with MESH_SOAK set (`make soak`): minutes are not for make test.
func TestSoak_SeatStaysBounded(t *testing.T) {
	if os.Getenv("MESH_SOAK") == "" {
		t.Skip("set MESH_SOAK=1 (make soak) to run the soak")
	}
	length := 3 * time.Minute
	if v := os.Getenv("MESH_SOAK_FOR"); v != "" {
		d, err := time.ParseDuration(v)
		require.NoError(t, err, "MESH_SOAK_FOR")
		length = d
	}
	url := runServer(t, "")
	ctx := context.Background()
	_, js := natstest.Connect(t, url)
	nc, _ := natstest.Connect(t, url)
	needs, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.BucketNeeds, History: 1, LimitMarkerTTL: time.Second})
	require.NoError(t, err)
	require.NoError(t, fixtures.CreateBuckets(ctx, js, provisioner.BucketApplied, provisioner.BucketCollect,
		provisioner.BucketHostModules, provisioner.BucketIndexerBuilds))
	s := startSeatWith(t, url, t.TempDir(), seat.Config{WriteRegistry: true, Plans: true,
		Projector: projector.Options{Verify: 500 * time.Millisecond, DiscoverEvery: time.Second}})

	type sample struct{ goroutines, entries, fds, heapMiB int }
	take := func() sample {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		fds, _ := os.ReadDir("/proc/self/fd")
		n := 0
		for _, v := range s.Current().BucketEntries() {
			n += v
		}
		return sample{runtime.NumGoroutine(), n, len(fds), int(ms.HeapAlloc >> 20)}
	}
	const perRound = 6
	ask := func(what string) {
		msg, err := nc.Request(query.Subject, []byte(fmt.Sprintf(`{"what":%q}`, what)), 10*time.Second)
		require.NoError(t, err, "ask %s", what)
		require.Empty(t, msg.Header.Get(micro.ErrorCodeHeader), "ask %s: %s", what, msg.Data)
	}
	round := func(r int) {
		for i := range perRound {
			node := fmt.Sprintf("s%d-%d", r%50, i)
			kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.ComposedPrefix + node, History: 2, LimitMarkerTTL: time.Second})
			require.NoError(t, err)
			_, err = kv.Put(ctx, "web.1", []byte{0x81, 0xa6, 's', 't', 'a', 't', 'u', 's', 0xa9, 'p', 'u', 'b', 'l', 'i', 's', 'h', 'e', 'd'})
			require.NoError(t, err)
			_, err = kv.Create(ctx, "web.2", []byte{0x80}, jetstream.KeyTTL(time.Second))
			require.NoError(t, err)
			key := fmt.Sprintf("%s.web.config.c%d", node, r)
			_, err = needs.Create(ctx, key, []byte{0x80}, jetstream.KeyTTL(time.Second))
			require.NoError(t, err)
			_, err = needs.Put(ctx, key+"-kept", []byte{0x80})
			require.NoError(t, err)
			require.NoError(t, needs.Delete(ctx, key+"-kept"))
		}
		ask("needs")
		ask("plans")
		time.Sleep(time.Second) // the buckets are read, and their TTLs run out
		for i := range perRound {
			require.NoError(t, js.DeleteKeyValue(ctx, provisioner.ComposedPrefix+fmt.Sprintf("s%d-%d", r%50, i)))
		}
		ask("plans")
	}
	// settle waits until no churned bucket is tailed any more and the samples hold still.
	settle := func(what string) sample {
		var last sample
		natstest.CheckFor(t, time.Minute, 500*time.Millisecond, func() error {
			for _, b := range s.Current().Buckets() {
				if provisioner.IsComposedBucket(b) {
					return fmt.Errorf("%s: %s still tailed", what, b)
				}
			}
			prev := last
			last = take()
			if last.entries != prev.entries || last.goroutines != prev.goroutines {
				return fmt.Errorf("%s: still moving: %+v, then %+v", what, prev, last)
			}
			return nil
		})
		return last
	}
	round(0)
	base := settle("after the first round")
	t.Logf("after the first round: %+v", base)
	end := time.Now().Add(length)
	r := 1
	for ; time.Now().Before(end); r++ {
		round(r)
		if r%10 == 0 {
			t.Logf("round %d: %+v", r, take())
		}
	}
	got := settle("at the end")
	t.Logf("after %d rounds (%d composed buckets created and deleted): %+v", r, r*perRound, got)
	require.LessOrEqual(t, got.entries, base.entries, "the projector's per-bucket entries")
	require.LessOrEqual(t, got.goroutines, base.goroutines+20, "goroutines")
	require.LessOrEqual(t, got.fds, base.fds+20, "open file descriptors")
	require.LessOrEqual(t, got.heapMiB, 2*base.heapMiB+32, "live heap, MiB")
}
