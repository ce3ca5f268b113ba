package metrics_test

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/faultfs"
	"github.com/novox/mesh-provisioner/internal/metrics"
	"github.com/novox/mesh-provisioner/internal/metrics/metricstest"
	"github.com/novox/mesh-provisioner/store"
)

// TestMetrics_ReadyzSaysFlushesFailing: a store whose flushes keep failing for want of a descriptor
// (Pebble tries them again for good, and writes stall once the memtables are full) makes /readyz
// 503 saying so and what to do, and the failures and the opens are counted; once a flush is done,
// /readyz is 200 again.
func TestMetrics_ReadyzSaysFlushesFailing(t *testing.T) {
	var out atomic.Bool
	db, err := store.Open(t.TempDir(), store.Options{MinFreeBytes: -1, FS: faultfs.NoDescriptors(".sst", &out)})
	require.NoError(t, err)
	defer db.Close()
	require.NoError(t, db.Apply(provisioner.BucketNeeds, []provisioner.Message{{Seq: 1, Time: 1, Key: "n1.m.config.x", Op: provisioner.OpPut, Value: []byte{0xc0}}}, 1, false))
	m := metrics.New(metrics.Options{})
	m.SetSource(storeSource{db})
	defer m.SetSource(nil)
	srv, err := metrics.Listen("127.0.0.1:0", m.Handler(), nil)
	require.NoError(t, err)
	defer srv.Close()
	code, body := readyz(t, srv)
	require.Equal(t, 200, code, body)

	out.Store(true)
	flushed, err := db.Pebble().AsyncFlush()
	require.NoError(t, err)
	for deadline := time.Now().Add(10 * time.Second); db.BackgroundErr() == nil && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
	}
	code, body = readyz(t, srv)
	require.Equal(t, 503, code, body)
	require.Contains(t, body, "store: the state dir's flushes or compactions fail")
	require.Contains(t, body, "LimitNOFILE=")
	fams, err := metricstest.Scrape(srv.Addr())
	require.NoError(t, err)
	for _, name := range []string{"mesh_provisioner_pebble_background_errors_total", "mesh_provisioner_pebble_out_of_fds_total"} {
		n, ok := fams.Value(name)
		require.True(t, ok, name)
		require.GreaterOrEqual(t, n, float64(3), name)
	}

	out.Store(false)
	<-flushed
	code, body = readyz(t, srv)
	require.Equal(t, 200, code, body)
}
