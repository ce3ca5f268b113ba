package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/faultfs"
	"github.com/novox/mesh-provisioner/internal/natstest"
)

// TestReplay_FromNATSWithTooLittleTempRoom: replay --nats reads the streams into a temporary store
// under TMPDIR, which keeps Pebble's reserve free (160 MiB). On a TMPDIR just above it, the open
// passed, its first batches were refused below the reserve, and the projector retried them without
// end: "reading streams 0%" every 5 s, no word of room, for as long as the disk stayed full. Below
// the reserve at open it said "the state dir" and "give --state a larger one", which replay --nats
// has not, and which changes what it reads. It fails at once, naming TMPDIR and what to do, and
// leaves no temporary store behind.
func TestReplay_FromNATSWithTooLittleTempRoom(t *testing.T) {
	url, _ := smallMesh(t)
	tmp := faultfs.Tmpfs(t, 200<<20)
	t.Setenv("TMPDIR", tmp)
	for _, leave := range []int64{162 << 20, 150 << 20} { // above the reserve at open; below it
		faultfs.FillTo(t, filepath.Join(tmp, "other"), leave)
		done := make(chan error, 1)
		var out, errb bytes.Buffer
		go func() {
			done <- NewMain(&out, &errb).Run(context.Background(), []string{"replay", "state", "needs", "--at", "seq:5", "--nats", url})
		}()
		err := natstest.Receive(t, done, 60*time.Second, "replay --nats on a TMPDIR without room")
		require.Equal(t, exitFailure, exitCode(err, &errb), "%d MiB left: %s", leave>>20, errb.String())
		require.ErrorContains(t, err, "no room for the temporary store that reads the streams, in "+tmp)
		require.ErrorContains(t, err, "set TMPDIR to a larger disk")
		require.NotContains(t, err.Error(), "--state")
		entries, rerr := os.ReadDir(tmp)
		require.NoError(t, rerr)
		require.Len(t, entries, 1, "only the other file is left in TMPDIR")
	}
}

// TestExport_OutOnAFullDisk: export --nats whose --out is on a full disk took the failed write of its
// spool for a lost consumer and read the stream again, and again, a message further each time (the
// one the failed write held counted as read): it went on for many minutes, saying nothing. It fails
// at once, naming the write and the disk's error, and leaves nothing beside --out.
func TestExport_OutOnAFullDisk(t *testing.T) {
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	require.NoError(t, fixtures.Load(context.Background(), js, fixtures.Demo().Ops(), 0, nil))
	dir := faultfs.Tmpfs(t, 4<<20)
	faultfs.FillTo(t, filepath.Join(dir, "other"), 0)

	done := make(chan error, 1)
	var out, errb bytes.Buffer
	go func() {
		done <- NewMain(&out, &errb).Run(context.Background(), []string{"export", "--nats", ns.ClientURL(), "--out", filepath.Join(dir, "incident.mph")})
	}()
	err := natstest.Receive(t, done, 60*time.Second, "export to a full disk")
	require.Equal(t, exitFailure, exitCode(err, &errb), errb.String())
	require.ErrorIs(t, err, syscall.ENOSPC)
	require.ErrorContains(t, err, "write the archive beside "+filepath.Join(dir, "incident.mph"))
	entries, rerr := os.ReadDir(dir)
	require.NoError(t, rerr)
	require.Len(t, entries, 1, "only the other file is left beside --out")
}
