package seat_test

import (
	"context"
	"encoding/json"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/micro"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/seat"
	"github.com/novox/mesh-provisioner/store"
)

// An operator's `nats micro info mesh-provisioner` asks $SRV.INFO and $SRV.STATS: the answers must say
// the version, the schema, the buckets, and per bucket the as_of an answer would carry.
func TestSeat_DiscoveryInfoAndStats(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.load(testMesh.Ops())
	nc, js := natstest.Connect(t, h.url)
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	st, err := seat.Start(context.Background(), nc, js, db, seat.Config{Version: "1.4.0", WriteRegistry: true,
		Projector: projector.Options{Poll: 50 * time.Millisecond}})
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, st.Stop())
		require.NoError(t, db.Close())
	})
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		if passes, _ := st.Registry.Stats(); passes == 0 {
			return fmt.Errorf("registry not written yet")
		}
		return nil
	})
	h.waitCaughtUp(st)

	ask := func(verb micro.Verb, v any) {
		t.Helper()
		subj, err := micro.ControlSubject(verb, query.ServiceName, "")
		require.NoError(t, err)
		msg, err := h.nc.Request(subj, nil, 5*time.Second)
		require.NoError(t, err)
		require.NoError(t, json.Unmarshal(msg.Data, v), string(msg.Data))
	}

	var ping micro.Ping
	ask(micro.PingVerb, &ping)
	require.Equal(t, query.ServiceName, ping.Name)
	require.Equal(t, "1.4.0", ping.Version)

	var info micro.Info
	ask(micro.InfoVerb, &info)
	require.Equal(t, micro.InfoResponseType, info.Type)
	require.Equal(t, query.ServiceName, info.Name)
	require.Equal(t, "1.4.0", info.Version)
	require.Equal(t, fmt.Sprint(store.SchemaVersion), info.Metadata["schema"])
	var own []string
	for _, s := range provisioner.ProvisionerShapes {
		own = append(own, s.Bucket)
	}
	require.ElementsMatch(t, own, strings.Split(info.Metadata["buckets"], ","))
	require.Len(t, info.Endpoints, 1)
	require.Equal(t, query.Subject, info.Endpoints[0].Subject)
	require.Equal(t, "q", info.Endpoints[0].QueueGroup, "the default queue group, so seats share the load")

	// Ask the verb once, so the stats count it.
	_, _, err = natstest.Ask(h.nc, query.Subject, []byte(`{"what":"needs","limit":1}`), false)
	require.NoError(t, err)

	var stats micro.Stats
	ask(micro.StatsVerb, &stats)
	require.Equal(t, micro.StatsResponseType, stats.Type)
	require.Equal(t, "1.4.0", stats.Version)
	require.Len(t, stats.Endpoints, 1)
	ep := stats.Endpoints[0]
	require.Equal(t, 1, ep.NumRequests)
	var data seat.Stats
	require.NoError(t, json.Unmarshal(ep.Data, &data), string(ep.Data))
	require.Equal(t, 1, data.Schema, "the state dir's schema: 1 without a wildcard rollup")
	require.True(t, data.Synced)
	require.Equal(t, len(own), data.BucketsTotal)
	require.Len(t, data.Buckets, len(own))
	var sum uint64
	for _, b := range own {
		bs, ok := data.Buckets[b]
		require.True(t, ok, b)
		require.True(t, bs.Synced, b)
		// as_of is what an answer of that bucket carries.
		what := strings.TrimPrefix(b, "mesh-provisioner_")
		a, _, err := natstest.Ask(h.nc, query.Subject, []byte(`{"what":"`+what+`","limit":1}`), false)
		require.NoError(t, err)
		require.Equal(t, a.AsOf, bs.AsOf, b)
		require.Equal(t, a.AnomaliesTotal, bs.AnomalyRows, b)
		sum += bs.AsOf
	}
	require.EqualValues(t, sum, data.MessagesApplied, "a fresh seat applied every message of every stream")
}

// An answer is counted before it is sent: a client that has its answer finds it in the stats it asks
// for next. It was counted after, and TestSeat_BadRequests failed 1 run in 8 beside other tests, one
// answer short.
func TestSeat_AnswerCountedBeforeItIsSent(t *testing.T) {
	// More Ps than cores, so that the client may run between the seat's send and its count.
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(8))
	h := newHarness(t)
	st, _ := h.startSeat(t.TempDir())
	base := st.Server.Answered()["200"]
	for i := int64(1); i <= 300; i++ {
		_, _, err := natstest.Ask(h.nc, query.Subject, nil, false)
		require.NoError(t, err)
		require.Equal(t, base+i, st.Server.Answered()["200"], "answers counted after the %dth", i)
	}
}

// TestSeat_MicroMetadataNamesNoNode: the micro service's metadata, which every $SRV.PING, INFO and
// STATS reply carries, listed every bucket the projector tailed as the seat started: a seat restarted
// on a state dir of thousands of composed-<node> buckets sent each of their names in every reply (and a
// fresh one none). The composed buckets are "composed-*" there, whatever the seat held.
func TestSeat_MicroMetadataNamesNoNode(t *testing.T) {
	t.Parallel()
	const composed = 200
	ns := natstest.RunServer(t)
	nc, js := natstest.Connect(t, ns.ClientURL())
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	for i := range composed {
		require.NoError(t, db.Apply(fmt.Sprintf("composed-n%04d", i), []provisioner.Message{{Seq: 1, Time: 1, Key: "web.1", Op: provisioner.OpPut, Value: []byte{0x80}}}, 1, false))
	}
	st, err := seat.Start(context.Background(), nc, js, db, seat.Config{Version: "1.4.0", Plans: true,
		Projector: projector.Options{Poll: 50 * time.Millisecond, DiscoverEvery: time.Hour}})
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, st.Stop())
		require.NoError(t, db.Close())
	})
	require.Len(t, st.Projector.Buckets(), len(provisioner.ProvisionerShapes)+2+composed, "the seat tails the composed buckets it held")

	for _, verb := range []micro.Verb{micro.PingVerb, micro.InfoVerb, micro.StatsVerb} {
		subj, err := micro.ControlSubject(verb, query.ServiceName, "")
		require.NoError(t, err)
		msg, err := nc.Request(subj, nil, 5*time.Second)
		require.NoError(t, err)
		var id micro.ServiceIdentity
		require.NoError(t, json.Unmarshal(msg.Data, &id), string(msg.Data))
		buckets := strings.Split(id.Metadata["buckets"], ",")
		require.Contains(t, buckets, provisioner.BucketNeeds, verb)
		require.Contains(t, buckets, "composed-*", verb)
		for _, b := range buckets {
			require.False(t, provisioner.IsComposedBucket(b), "%s names %s", verb, b)
		}
		t.Logf("%s reply: %d bytes", verb, len(msg.Data))
		require.Less(t, len(msg.Data), 4096, "%s: the reply does not grow with the nodes", verb)
	}
}
