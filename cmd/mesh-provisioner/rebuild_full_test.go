package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/faultfs"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/store"
)

// TestServe_SignalWhileARebuildWaitsForRoom: a rebuild fills a new generation through a store of its
// own, whose writes a full disk holds like the current one's (store/space.go); rebuilding is when the
// disk is likeliest to fill, two generations on it. A SIGTERM then hung: serve asked only the current
// store whether a write was held, so it went on to the clean stop, which waited for the rebuild's
// projector, stuck in the held write, for as long as the disk stayed full. It stops as a kill would
// instead, naming the new generation; the operator was told it is out of room; and the next start
// opens the state dir, removes the generation left behind and rebuilds: nothing is lost. The seat so
// left ran on once there was room, tailing, answering and logging to serve's Stderr after its Run had
// returned: its stop is begun, and ends it then, and it writes nothing more to the caller's streams.
func TestServe_SignalWhileARebuildWaitsForRoom(t *testing.T) {
	t.Parallel()
	ns, nc, js := smallMeshServer(t)

	var logs natstest.LogBuffer
	cw := newCutWriter(&logs) // serve's Stderr, as its Run wraps it
	log := slog.New(slog.NewTextHandler(cw, nil))
	// The disk fills once the rebuild's new generation is open: every write of its store fails with
	// ENOSPC from then on, until room is set. The current generation is on the disk as it is.
	fs, room := faultfs.FullOnceLogged(t, &logs, "rebuild started")
	state := filepath.Join(t.TempDir(), "state")
	db, err := store.OpenState(state, store.Options{Logger: log})
	require.NoError(t, err)
	current := db.Dir()

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := startSeatCut(ctx, nc, js, db, log, store.Options{FS: fs, MinFreeBytes: 1 << 20}, cw.cut)
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if seq, synced := db.Applied(provisioner.BucketApplied); !synced || seq == 0 {
			return fmt.Errorf("applied not caught up yet")
		}
		return nil
	})

	// The applied bucket is created again: the seat rebuilds, and the new generation's first write
	// finds the disk full.
	require.NoError(t, js.DeleteKeyValue(context.Background(), provisioner.BucketApplied))
	_, err = js.CreateKeyValue(context.Background(), jetstream.KeyValueConfig{Bucket: provisioner.BucketApplied, History: 8})
	require.NoError(t, err)
	var fresh []fixtures.Op
	for i := range 30 {
		fresh = append(fresh, fixtures.Op{Bucket: provisioner.BucketApplied, Key: fmt.Sprintf("%s.mod-new%d", fixtures.NodeName(i%5), i), Op: provisioner.OpPut, Value: []byte{0x01}})
	}
	require.NoError(t, fixtures.Load(context.Background(), js, fresh, 256, nil))
	natstest.CheckFor(t, 20*time.Second, 10*time.Millisecond, func() error {
		if !strings.Contains(logs.String(), "the state dir is out of room") {
			return fmt.Errorf("the rebuild's store has not found the disk full yet")
		}
		return nil
	})
	out := logs.String()
	gen := out[strings.Index(out, "rebuild started"):]
	gen = gen[strings.Index(gen, "generation=")+len("generation="):]
	gen = gen[:strings.IndexAny(gen, " \n")]
	require.NotEqual(t, current, gen)
	require.Contains(t, out[strings.Index(out, "the state dir is out of room"):], "state="+gen, "the operator is told which dir is out of room")

	cancel() // the first SIGTERM
	stopErr := awaitRun(t, done, "the seat waits for room to stop")
	require.ErrorIs(t, stopErr, context.Canceled, "main says: stopped by SIGTERM before it finished")
	require.ErrorIs(t, stopErr, errNotDrained)
	require.Contains(t, stopErr.Error(), gen)
	require.Contains(t, logs.String(), "stopping without draining: the state dir is out of room")
	require.NotContains(t, logs.String(), "panic")
	said := logs.String()

	// The process exits: the seat left running goes with it. Here it runs on, so room comes back for
	// its held write, and its rebuild, stopped by the signal, removes the generation it filled; the
	// current store is closed, as the exit would release it.
	room.Store(true)
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if _, err := os.Stat(gen); !os.IsNotExist(err) {
			return fmt.Errorf("the abandoned generation %s is still there (%v)", gen, err)
		}
		return nil
	})
	// The seat's stop, begun at the signal, ends it: its connection drained and closed.
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if !nc.IsClosed() {
			return fmt.Errorf("the seat left at the signal still runs, its connection %v", nc.Status())
		}
		return nil
	})
	require.NoError(t, db.Close())
	require.Equal(t, said, logs.String(), "nothing written to serve's Stderr after its Run returned")
	nc.Close()

	// The next start opens the state dir, rebuilds, and answers the recreated bucket whole.
	log = slog.New(slog.NewTextHandler(&logs, nil))
	db, err = store.OpenState(state, store.Options{Logger: log})
	require.NoError(t, err)
	nc2, js2 := natstest.Connect(t, ns.ClientURL())
	ctx2, cancel2 := context.WithCancel(context.Background())
	done2 := startSeat(ctx2, nc2, js2, db, log, store.Options{})
	natstest.CheckFor(t, 30*time.Second, 20*time.Millisecond, func() error {
		rows, a, err := natstest.AskAll(nc2, query.Subject, map[string]any{"what": "applied"}, false)
		if err != nil {
			return err
		}
		if !a.Synced || len(rows) != len(fresh) {
			return fmt.Errorf("applied answers %d rows, synced %v; want %d synced", len(rows), a.Synced, len(fresh))
		}
		for _, r := range rows {
			if !strings.Contains(r["module"].(string), "mod-new") {
				return fmt.Errorf("a row of the deleted bucket: %v", r["key"])
			}
		}
		return nil
	})
	cancel2()
	require.NoError(t, <-done2)
}
