package main

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/faultfs"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/store"
)

// TestServe_DiskFillsDuringTheStop: serve asked once, at the signal, whether a write waits for room;
// a disk that filled after that (the last batch, the final sync) held the clean stop for as long as it
// stayed full: `stopping: draining the verb` and nothing more, until systemd's SIGKILL. It stops
// without draining as soon as a write is held, naming the state dir, as for a signal that finds one
// held; nothing is lost, and the next start reads on from what was committed.
func TestServe_DiskFillsDuringTheStop(t *testing.T) {
	t.Parallel()
	_, nc, js := smallMeshServer(t)

	var logs natstest.LogBuffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	// The disk fills as the clean stop begins: its last writes find it full.
	fs, room := faultfs.FullOnceLogged(t, &logs, "stopping: draining the verb")
	state := filepath.Join(t.TempDir(), "state")
	db, err := store.OpenState(state, store.Options{FS: fs, MinFreeBytes: 1 << 20, Logger: log})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := startSeat(ctx, nc, js, db, log, store.Options{})
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if seq, synced := db.Applied(provisioner.BucketNeeds); !synced || seq == 0 {
			return fmt.Errorf("needs not caught up yet")
		}
		return nil
	})
	applied, _ := db.Applied(provisioner.BucketNeeds)

	cancel() // SIGTERM: nothing is held yet
	stopErr := awaitRun(t, done, "the stop waits for room")
	require.ErrorIs(t, stopErr, errNotDrained)
	require.ErrorIs(t, stopErr, context.Canceled)
	require.Contains(t, stopErr.Error(), db.Dir())
	out := logs.String()
	require.Contains(t, out, "stopping without draining: the state dir is out of room")
	require.Less(t, strings.Index(out, "stopping: draining the verb"), strings.Index(out, "stopping without draining"))

	// The process exits here; in the test room comes back, the stop left running ends, and the store
	// closes as the exit would release it. What was committed is there.
	room.Store(true)
	require.NoError(t, db.Close())
	db, err = store.OpenState(state, store.Options{})
	require.NoError(t, err)
	defer db.Close()
	seq, _ := db.Applied(provisioner.BucketNeeds)
	require.Equal(t, applied, seq)
}
