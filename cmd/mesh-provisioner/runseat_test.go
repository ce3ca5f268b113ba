package main

import (
	"context"
	"io"
	"log/slog"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/faultfs"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/store"
)

// startSeat runs runSeat in the background, as serve does (the registry written, every hour, one
// replica), with rebuild as the options of a rebuild's new generation, until ctx ends. It returns once
// the seat answers, with the channel runSeat's result comes on.
func startSeat(ctx context.Context, nc *nats.Conn, js jetstream.JetStream, db *store.DB, log *slog.Logger, rebuild store.Options) <-chan error {
	return startSeatCut(ctx, nc, js, db, log, rebuild, nil)
}

// startSeatCut is startSeat with serve's cut of its output (seatConfig.cut).
func startSeatCut(ctx context.Context, nc *nats.Conn, js jetstream.JetStream, db *store.DB, log *slog.Logger, rebuild store.Options, cut func()) <-chan error {
	started := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		done <- runSeat(ctx, nc, js, db, seatConfig{log: log, registryInterval: time.Hour, registryReplicas: 1, writeRegistry: true,
			stdout: io.Discard, started: func() { close(started) }, store: rebuild, cut: cut})
	}()
	<-started
	return done
}

// awaitRun waits up to 20 s for runSeat's result and returns it; waiting says what the test waits for,
// as the failure says when it does not come.
func awaitRun(t *testing.T, done <-chan error, waiting string) error {
	t.Helper()
	return natstest.Receive(t, done, 20*time.Second, waiting)
}

// smallMeshServer starts a NATS server holding a small mesh (12 nodes, 3 modules), for the tests of
// serve's faults, and connects to it.
func smallMeshServer(t *testing.T) (*server.Server, *nats.Conn, jetstream.JetStream) {
	t.Helper()
	ns := natstest.RunServer(t)
	nc, js := natstest.Connect(t, ns.ClientURL())
	mesh := fixtures.Mesh{Seed: 3, Nodes: 12, Modules: 3, NeedsPerModule: 2, Collections: 2}
	require.NoError(t, fixtures.Load(context.Background(), js, mesh.Ops(), 256, nil))
	return ns, nc, js
}

// stateOnAFailingDisk opens a state dir (state, under the test's temp dir) whose every write fails
// with errno while fail is set; the test's cleanup clears it. The store logs to logs through log.
func stateOnAFailingDisk(t *testing.T, errno syscall.Errno) (db *store.DB, fail *atomic.Bool, logs *natstest.LogBuffer, log *slog.Logger, state string) {
	t.Helper()
	fail, logs = new(atomic.Bool), new(natstest.LogBuffer)
	log = slog.New(slog.NewTextHandler(logs, nil))
	state = filepath.Join(t.TempDir(), "state")
	db, err := store.OpenState(state, store.Options{FS: faultfs.Writes(fail.Load, errno), MinFreeBytes: 1 << 20, Logger: log})
	require.NoError(t, err)
	t.Cleanup(func() { fail.Store(false) })
	return db, fail, logs, log, state
}
