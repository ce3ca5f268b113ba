package replay_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/faultfs"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/replay"
	"github.com/novox/mesh-provisioner/store"
)

// fullNow is a log that holds "full" from the start: the disk fills just after the store's look at its
// room before the open (faultfs.FullOnceLoggedButProbe), and Pebble's first write finds it full.
type fullNow struct{}

func (fullNow) String() string { return "full" }

// TestTempStore_AWriteHeldForRoomEndsTheRead: another process fills TMPDIR after the temporary
// store's look at its room, and a write of the store waits for room (store/space.go), which no stop
// reaches. replay --nats hung there, a first Ctrl-C too (the read stopped its projector and closed
// the store, both waiting for that write), for as long as the disk stayed full; in the open, the
// same. The read ends at once, naming TMPDIR; the store is left to a goroutine that removes it once
// there is room.
func TestTempStore_AWriteHeldForRoomEndsTheRead(t *testing.T) {
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	mesh := fixtures.Mesh{Seed: 5, Nodes: 60, Modules: 4, NeedsPerModule: 4, Collections: 3}
	require.NoError(t, fixtures.Load(context.Background(), js, mesh.Ops(), 256, nil))
	fromNATS := func() (*replay.Log, error) { return replay.FromNATS(context.Background(), js, nil, "nats", nil) }
	for name, full := range map[string]func(tmp string) fmt.Stringer{
		"in the fill": func(tmp string) fmt.Stringer {
			return faultfs.FilesGrown{Glob: filepath.Join(tmp, "mesh-provisioner-read-*", "*.log"), Min: 32 << 10}
		},
		"in the open": func(string) fmt.Stringer { return fullNow{} },
	} {
		t.Run(name, func(t *testing.T) { requireHeldWriteEndsTheRead(t, fromNATS, full) })
	}
	// replay --archive reads into a temporary store alike: it hung too, in the read or in the close
	// after it. The disk fills once every record is read (4096 of them: the last progress of the loop),
	// before the last batch is written: Pebble writes its log behind it, so the write held may be the
	// store's close, once the read has returned.
	_, js = natstest.Connect(t, natstest.RunServer(t).ClientURL())
	var ops []fixtures.Op
	for i := range 4096 {
		ops = append(ops, fixtures.Op{Bucket: provisioner.BucketNeeds, Key: fmt.Sprintf("n%d.mod.config.x", i), Value: []byte{0x80}, Op: provisioner.OpPut})
	}
	require.NoError(t, fixtures.Load(context.Background(), js, ops, 0, nil))
	archive := filepath.Join(t.TempDir(), "incident.mph")
	h, err := replay.ExportNATS(context.Background(), js, []string{provisioner.BucketNeeds}, archive, "test", nil)
	require.NoError(t, err)
	require.Equal(t, uint64(4096), h.Buckets[0].Messages)
	var read atomic.Bool
	readAll := func(done, total int64) {
		if done == total {
			read.Store(true)
		}
	}
	t.Run("from an archive", func(t *testing.T) {
		requireHeldWriteEndsTheRead(t, func() (*replay.Log, error) { return replay.FromArchive(context.Background(), archive, readAll) },
			func(string) fmt.Stringer { return flagged{&read} })
	})
}

// flagged is "full" once its flag is set.
type flagged struct{ full *atomic.Bool }

func (f flagged) String() string {
	if f.full.Load() {
		return "full"
	}
	return ""
}

func requireHeldWriteEndsTheRead(t *testing.T, read func() (*replay.Log, error), full func(tmp string) fmt.Stringer) {
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	fs, room := faultfs.FullOnceLoggedButProbe(t, full(tmp), "full")
	defer replay.SetOfflineFS(fs)()

	done := make(chan error, 1)
	go func() {
		l, err := read()
		if err == nil {
			l.Close()
		}
		done <- err
	}()
	err := natstest.Receive(t, done, 60*time.Second, "the read still waits for room in TMPDIR")
	require.ErrorIs(t, err, store.ErrNoSpace)
	require.ErrorContains(t, err, "no room for the temporary store that reads the streams, in "+tmp)
	require.ErrorContains(t, err, "set TMPDIR to a larger disk")
	held := false
	for _, d := range must(filepath.Glob(filepath.Join(tmp, "mesh-provisioner-read-*"))) {
		held = held || store.WritesHeldIn(d)
	}
	require.True(t, held, "the read ended on a write held for room, not on a batch refused")

	// Room back (in a process, its exit comes first): the store left is closed and removed.
	room.Store(true)
	natstest.CheckFor(t, 30*time.Second, 20*time.Millisecond, func() error {
		if left := must(filepath.Glob(filepath.Join(tmp, "mesh-provisioner-read-*"))); len(left) > 0 {
			return fmt.Errorf("the temporary store is still there: %v", left)
		}
		return nil
	})
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// TestFromNATS_RemovesTheStoresOfReadsThatDidNotEnd: a read that ended while a write of its store
// waited for room leaves the store in TMPDIR to the process's exit (closeUnlessHeld), as a kill of
// the reader does: on the disk that was full, for good. The next read removes those no process holds,
// and leaves another reader's alone.
func TestFromNATS_RemovesTheStoresOfReadsThatDidNotEnd(t *testing.T) {
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	require.NoError(t, fixtures.Load(context.Background(), js, fixtures.Demo().Ops(), 0, nil))
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	left, running := filepath.Join(tmp, "mesh-provisioner-read-1"), filepath.Join(tmp, "mesh-provisioner-read-2")
	// An older binary's replay held no flock on its store, under a prefix of its own.
	older := filepath.Join(tmp, "mesh-provisioner-replay-1")
	for _, d := range []string{left, running, older} {
		require.NoError(t, os.Mkdir(d, 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(d, "000002.log"), make([]byte, 1<<20), 0o644))
	}
	f, err := os.Open(running)
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB))

	l, err := replay.FromNATS(context.Background(), js, nil, "nats", nil)
	require.NoError(t, err)
	require.NoError(t, l.Close())
	require.NoDirExists(t, left, "the store of a read that did not end is removed")
	require.DirExists(t, running, "the store of a read still running is left alone")
	require.DirExists(t, older, "the store of an older binary's replay, which holds no flock, is left alone")
}
