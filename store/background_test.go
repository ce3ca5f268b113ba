package store_test

import (
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/faultfs"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/store"
)

// A flush that cannot create its table is tried again by Pebble, at once and for good: the store
// counts the failures, logs the first, says them (BackgroundErr, the seat's /readyz) once they
// persist, with what to do, and logs once that they are over when the flush is done.
func TestDB_BackgroundErrorsAreSaid(t *testing.T) {
	var out atomic.Bool
	var logs natstest.LogBuffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	db, err := store.Open(t.TempDir(), store.Options{MinFreeBytes: -1, Logger: log, FS: faultfs.NoDescriptors(".sst", &out)})
	require.NoError(t, err)
	defer db.Close()
	require.NoError(t, db.Apply(provisioner.BucketNeeds, []provisioner.Message{put(1, "n1.m.config.x", []byte{0xc0})}, 1, false))
	require.NoError(t, db.BackgroundErr())

	out.Store(true)
	flushed, err := db.Pebble().AsyncFlush()
	require.NoError(t, err)
	deadline := time.Now().Add(10 * time.Second)
	for db.BackgroundErr() == nil && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	err = db.BackgroundErr()
	require.ErrorIs(t, err, store.ErrBackground)
	require.Contains(t, err.Error(), "too many open files")
	require.Contains(t, err.Error(), "LimitNOFILE=")
	require.GreaterOrEqual(t, db.BackgroundErrors(), int64(3))

	out.Store(false)
	<-flushed
	require.NoError(t, db.BackgroundErr())
	require.Equal(t, 1, strings.Count(logs.String(), "a flush or compaction of the state dir failed"), "%s", logs.String())
	require.Equal(t, 1, strings.Count(logs.String(), "flushes and compactions are done again"), "%s", logs.String())
	require.NoError(t, db.Apply(provisioner.BucketNeeds, []provisioner.Message{put(2, "n1.m.config.y", []byte{0xc0})}, 1, false))
}
