package embedded_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/internal/embedded"
)

// openFDs counts the process's descriptors, and those under dir.
func openFDs(t *testing.T, dir string) (all, under int) {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	for _, e := range ents {
		if p, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name())); err == nil && strings.HasPrefix(p, dir) {
			under++
		}
	}
	return len(ents), under
}

// The embedded server's descriptors with many streams: a measurement, not run under -short
// (EMBEDDED_FD_BUCKETS buckets; EMBEDDED_FD_IDLE waits for the idle files to close; EMBEDDED_FD_SYNC,
// a duration, is the --embedded-config's jetstream sync_interval, 2m unless set).
// It logs what it counts; it asserts only what the docs rely on: a file per stream written, closed
// once idle when asked to wait.
func TestStart_StreamDescriptors(t *testing.T) {
	if testing.Short() {
		t.Skip("a measurement of minutes")
	}
	if os.Getenv("EMBEDDED_FD_BUCKETS") == "" {
		t.Skip("set EMBEDDED_FD_BUCKETS (e.g. 2000) to measure")
	}
	buckets, err := strconv.Atoi(os.Getenv("EMBEDDED_FD_BUCKETS"))
	require.NoError(t, err)
	store := t.TempDir()
	var conf string
	if sync := os.Getenv("EMBEDDED_FD_SYNC"); sync != "" {
		conf = filepath.Join(t.TempDir(), "nats.conf")
		require.NoError(t, os.WriteFile(conf, []byte("jetstream { sync_interval: "+sync+" }\n"), 0o600))
	}
	all0, _ := openFDs(t, store)
	ns, err := embedded.Start(embedded.Config{Listen: "127.0.0.1:0", StoreDir: store, ConfigFile: conf})
	require.NoError(t, err)
	defer ns.Shutdown()
	nc, err := nats.Connect(ns.ClientURL())
	require.NoError(t, err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	ctx := context.Background()
	all1, under1 := openFDs(t, store)
	t.Logf("before the server %d; started, one client: %d (%d under the store)", all0, all1, under1)
	start := time.Now()
	kvs := make([]jetstream.KeyValue, buckets)
	for i := range kvs {
		kvs[i], err = js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: fmt.Sprintf("composed-n%d", i), History: 1})
		require.NoError(t, err)
	}
	all2, under2 := openFDs(t, store)
	t.Logf("%d buckets created in %v: %d (%d under the store)", buckets, time.Since(start).Round(time.Millisecond), all2, under2)
	for i, kv := range kvs {
		_, err := kv.Put(ctx, "k", []byte(strconv.Itoa(i)))
		require.NoError(t, err)
	}
	all3, under3 := openFDs(t, store)
	t.Logf("each written once: %d (%d under the store)", all3, under3)
	require.GreaterOrEqual(t, under3, buckets, "a file per stream written")
	if os.Getenv("EMBEDDED_FD_IDLE") == "" {
		return
	}
	idle := time.Now()
	for {
		time.Sleep(5 * time.Second)
		all, under := openFDs(t, store)
		t.Logf("idle %v: %d (%d under the store)", time.Since(idle).Round(time.Second), all, under)
		if under < 10 || time.Since(idle) > 4*time.Minute {
			require.Less(t, under, 10, "closed once idle")
			return
		}
	}
}
