package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/metrics/metricstest"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/internal/streaminfo"
	"github.com/novox/mesh-provisioner/query"
)

// TestServe_ReadyzSaysTheDiskIsFull: while a write of the state dir waits for room, /readyz was 503
// with only "not synced yet: <bucket>", the metrics had nothing to alert on but a lag, and `nats micro
// stats` said synced false: nothing told the operator the disk was full. /readyz now says so first,
// naming the state dir, what it has free against what it needs, and what to do;
// mesh_provisioner_state_out_of_room is 1; the micro stats carry out_of_room. Once there is room, all
// three clear and /readyz is 200 again.
func TestServe_ReadyzSaysTheDiskIsFull(t *testing.T) {
	t.Parallel()
	ns, nc, js := smallMeshServer(t)

	db, full, _, log, _ := stateOnAFailingDisk(t, syscall.ENOSPC)

	snc, sjs := natstest.Connect(t, ns.ClientURL()) // the seat's own: its stop drains it
	streams := streaminfo.New(sjs)
	ops, err := startOps(opsFlags{metricsAddr: "127.0.0.1:0", metricsPoll: 200 * time.Millisecond}, streams, log)
	require.NoError(t, err)
	t.Cleanup(func() { ops.stop(log) })
	ctx, cancel := context.WithCancel(context.Background())
	started := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		done <- runSeat(ctx, snc, sjs, db, seatConfig{log: log, registryInterval: time.Hour, registryReplicas: 1, writeRegistry: true,
			stdout: &natstest.LogBuffer{}, ops: ops, streams: streams, started: func() { close(started) }})
	}()
	<-started
	t.Cleanup(func() {
		full.Store(false)
		cancel()
		require.NoError(t, awaitRun(t, done, "the seat to stop"))
		require.NoError(t, db.Close())
	})
	readyz := func() (int, string) {
		code, body, err := metricstest.Get("http://" + ops.addr() + "/readyz")
		require.NoError(t, err)
		return code, body
	}
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if code, body := readyz(); code != http.StatusOK {
			return fmt.Errorf("/readyz %d: %s", code, body)
		}
		return nil
	})

	// The disk fills; updates keep coming.
	full.Store(true)
	more := fixtures.Mesh{Seed: 4, Nodes: 12, Modules: 3, NeedsPerModule: 2, Collections: 2}.Ops()
	require.NoError(t, fixtures.Load(context.Background(), js, more, 256, nil))
	natstest.CheckFor(t, 20*time.Second, 10*time.Millisecond, func() error {
		if !db.WritesHeld() {
			return fmt.Errorf("no write held for room yet")
		}
		return nil
	})

	code, body := readyz()
	require.Equal(t, http.StatusServiceUnavailable, code, body)
	first, _, _ := strings.Cut(body, "\n")
	require.Contains(t, first, "writes held", body)
	require.Contains(t, first, db.Dir(), "names the state dir")
	require.Contains(t, first, "MiB needed", "says what it needs free")
	require.Contains(t, first, "free space on that disk", "says what to do")

	fams, err := metricstest.Scrape(ops.addr())
	require.NoError(t, err)
	v, ok := fams.Value("mesh_provisioner_state_out_of_room")
	require.True(t, ok, "mesh_provisioner_state_out_of_room is served")
	require.Equal(t, 1.0, v)
	v, ok = fams.Value("mesh_provisioner_state_reserve_bytes")
	require.True(t, ok)
	require.Equal(t, float64(1<<20), v)
	_, ok = fams.Value("mesh_provisioner_state_free_bytes")
	require.True(t, ok)

	stats := microStats(t, nc)
	require.False(t, stats.Synced)
	require.Contains(t, stats.OutOfRoom, "writes held")
	require.Contains(t, stats.OutOfRoom, db.Dir())

	// Room again: it catches up, and all three say so.
	full.Store(false)
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if code, body := readyz(); code != http.StatusOK {
			return fmt.Errorf("/readyz %d: %s", code, body)
		}
		return nil
	})
	fams, err = metricstest.Scrape(ops.addr())
	require.NoError(t, err)
	v, _ = fams.Value("mesh_provisioner_state_out_of_room")
	require.Zero(t, v)
	require.Empty(t, microStats(t, nc).OutOfRoom)
}

// roomStats is what TestServe_ReadyzSaysTheDiskIsFull reads of the verb endpoint's $SRV.STATS data.
type roomStats struct {
	Synced    bool   `json:"synced"`
	OutOfRoom string `json:"out_of_room"`
}

// microStats asks $SRV.STATS of the seat, as `nats micro stats` does, for its endpoint's data.
func microStats(t *testing.T, nc *nats.Conn) roomStats {
	t.Helper()
	msg, err := nc.Request("$SRV.STATS."+query.ServiceName, nil, 10*time.Second)
	require.NoError(t, err)
	var ms micro.Stats
	require.NoError(t, json.Unmarshal(msg.Data, &ms))
	require.Len(t, ms.Endpoints, 1)
	var rs roomStats
	require.NoError(t, json.Unmarshal(ms.Endpoints[0].Data, &rs))
	return rs
}
