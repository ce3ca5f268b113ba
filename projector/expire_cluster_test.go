package projector_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/msgget"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// createR3 creates a bucket at three replicas whose puts may carry a TTL, as the mesh writes them (the
// cluster's meta leader may still be elected).
func createR3(t *testing.T, js jetstream.JetStream, bucket string) jetstream.Stream {
	t.Helper()
	ctx := context.Background()
	natstest.CheckFor(t, 30*time.Second, 100*time.Millisecond, func() error {
		_, err := js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: bucket, History: 5, Replicas: 3, LimitMarkerTTL: time.Second})
		return err
	})
	s, err := js.Stream(ctx, provisioner.StreamName(bucket))
	require.NoError(t, err)
	return s
}

// streamLeader is the index of the server that leads a stream, once it has a leader.
func streamLeader(t *testing.T, c *natstest.Cluster, s jetstream.Stream) int {
	t.Helper()
	var leader int
	natstest.CheckFor(t, 30*time.Second, 50*time.Millisecond, func() error {
		info, err := s.Info(context.Background())
		if err != nil {
			return err
		}
		if info.Cluster == nil || info.Cluster.Leader == "" {
			return errors.New("no leader")
		}
		leader = c.Index(info.Cluster.Leader)
		return nil
	})
	return leader
}

// replicaLast is the last sequence a server's replica of a stream holds.
func replicaLast(ns *server.Server, stream string) uint64 {
	jsz, err := ns.Jsz(&server.JSzOptions{Accounts: true, Streams: true})
	if err != nil {
		return 0
	}
	for _, a := range jsz.AccountDetails {
		for _, s := range a.Streams {
			if s.Name == stream {
				return s.State.LastSeq
			}
		}
	}
	return 0
}

// remoteMembers is how many routes of a server carry the other end's interest in subject.
func remoteMembers(t *testing.T, ns *server.Server, subject string) int {
	t.Helper()
	rz, err := ns.Routez(&server.RoutezOptions{Subscriptions: true})
	require.NoError(t, err)
	n := 0
	for _, r := range rz.Routes {
		if slices.Contains(r.Subs, subject) {
			n++
		}
	}
	return n
}

// projected is a bucket's rows in the store: value and revision by key.
func projected(t *testing.T, db *store.DB, bucket string) map[string]string {
	t.Helper()
	v, err := db.View()
	require.NoError(t, err)
	defer v.Close()
	rows := map[string]string{}
	require.NoError(t, v.Rows(provisioner.Range{Bucket: bucket, Index: provisioner.IndexPrimary}, func(r *provisioner.Row) bool {
		rows[string(r.Key)] = fmt.Sprintf("%x@%d", r.Value, r.Revision)
		return true
	}))
	return rows
}

// held is what the stream's leader holds of keys now, as the store's rows would say it: the value and
// revision of each key whose last message is a put.
func held(ctx context.Context, nc *nats.Conn, bucket string, keys []string) (map[string]string, error) {
	rows := map[string]string{}
	for _, key := range keys {
		m, found, err := msgget.Get(ctx, nc, jetstream.DefaultAPIPrefix, provisioner.StreamName(bucket), msgget.Request{Last: provisioner.SubjectPrefix(bucket) + key})
		if err != nil {
			return nil, err
		}
		if !found {
			continue
		}
		var h nats.Header
		if len(m.Header) > 0 {
			if h, err = nats.DecodeHeadersMsg(m.Header); err != nil {
				return nil, err
			}
		}
		if provisioner.OpOfHeaders(h) == provisioner.OpPut && h.Get("Nats-Marker-Reason") == "" {
			rows[key] = fmt.Sprintf("%x@%d", m.Data, m.Seq)
		}
	}
	return rows, nil
}

// TestProjector_ExpiryAskedOfALaggingReplica: a direct get of expired puts' keys answered by a replica
// behind what the projection applied is not used; the stream's leader is asked, and each key settles
// as the stream holds it. S-3's raft traffic from the others is held back (its routes' system account
// traffic), so its replica of an R3 bucket misses two TTL'd puts: one over an older revision of its
// key, one of a new key. The other replicas stop answering direct gets (the stream's config, which
// S-3 does not hear of), so S-3's stale replica is the one that answers them, deterministically: it
// names the older revision as the first key's last and nothing for the new one. A seat connected to S-3
// alone, whose store holds both puts as the stream does (read through another server) and due now, must
// keep both (the stream holds them) rather than restore the older revision or remove the new key; once
// S-3 hears from the others again the leader answers, and when the server removes the puts the store
// follows: the older revision again, the new key gone (its marker).
func TestProjector_ExpiryAskedOfALaggingReplica(t *testing.T) {
	t.Parallel()
	const bucket = provisioner.BucketNeeds
	const lagging = 2
	c := natstest.RunClusterHeld(t, 3, lagging)
	ctx := context.Background()
	nc, js := natstest.Connect(t, c.URLs(0, 1))
	stream := createR3(t, js, bucket)
	require.False(t, c.Servers[lagging].JetStreamIsLeader(), "the meta leader is not the lagging server")
	natstest.CheckFor(t, 30*time.Second, 100*time.Millisecond, func() error {
		if l := streamLeader(t, c, stream); l == lagging {
			_, err := nc.Request(jetstream.DefaultAPIPrefix+"STREAM.LEADER.STEPDOWN."+provisioner.StreamName(bucket), nil, 5*time.Second)
			return fmt.Errorf("the lagging server leads the stream (stepdown: %v)", err)
		}
		return nil
	})
	directSubject := jetstream.DefaultAPIPrefix + "DIRECT.GET." + provisioner.StreamName(bucket)
	natstest.CheckFor(t, 30*time.Second, 50*time.Millisecond, func() error {
		// nats-server adds a follower to a stream's direct get queue group once it is caught up (and
		// the leader as it leads): S-3 answers them, and knows of another server that does.
		sz, err := c.Servers[lagging].Subsz(&server.SubszOptions{Subscriptions: true, Account: "$G", Test: directSubject})
		if err != nil || sz.Total == 0 {
			return fmt.Errorf("S-3 does not answer direct gets yet (%v)", err)
		}
		if n := remoteMembers(t, c.Servers[lagging], directSubject); n == 0 {
			return errors.New("S-3 knows no other server answers direct gets")
		}
		return nil
	})

	const old, fresh = "n1.m1.config.old", "n1.m1.config.fresh"
	v1, v2 := []byte{0x81, 0xa1, 'v', 0x01}, []byte{0x81, 0xa1, 'v', 0x02}
	var msgs []provisioner.Message
	publish := func(key string, value []byte, ttl time.Duration) uint64 {
		m := putWithTTL(t, ctx, js, bucket, key, value, ttl)
		if ttl > 0 {
			m.Expires = time.Unix(0, m.Time).Add(-2 * time.Second).UnixNano() // due in the store now; the stream holds it for ttl
		}
		msgs = append(msgs, m)
		return m.Seq
	}
	oldSeq := publish(old, v1, 0)
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		if last := replicaLast(c.Servers[lagging], provisioner.StreamName(bucket)); last != oldSeq {
			return fmt.Errorf("S-3's replica holds up to %d, not the older revision at %d yet", last, oldSeq)
		}
		return nil
	})
	c.HoldSystemRoutes()
	released := false
	defer func() {
		if !released {
			c.ReleaseRoutes()
		}
	}()
	putSeq := publish(old, v2, 2*time.Second)
	freshSeq := publish(fresh, v1, 2*time.Second)
	info, err := stream.Info(ctx)
	require.NoError(t, err)
	cfg := info.Config
	cfg.AllowDirect = false
	_, err = js.UpdateStream(ctx, cfg)
	require.NoError(t, err)

	// S-3 hears that the others left the direct get's queue group (the client account's routes flow):
	// its own replica is the one member it knows of.
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		if n := remoteMembers(t, c.Servers[lagging], directSubject); n > 0 {
			return fmt.Errorf("S-3 knows %d other servers answer direct gets", n)
		}
		return nil
	})
	// S-3 answers a direct get, from before both puts.
	nc3, js3 := natstest.Connect(t, c.URL(lagging))
	subjects := []string{provisioner.SubjectPrefix(bucket) + old, provisioner.SubjectPrefix(bucket) + fresh}
	natstest.CheckFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		actx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		l, err := msgget.LastOfMany(actx, nc3, jetstream.DefaultAPIPrefix, provisioner.StreamName(bucket), subjects, 0)
		if err != nil {
			return err
		}
		if l.UpTo >= putSeq || len(l.Msgs) != 1 || l.Msgs[0].Seq != oldSeq {
			return fmt.Errorf("answered up to %d, %d messages: not S-3's stale replica", l.UpTo, len(l.Msgs))
		}
		return nil
	})

	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	require.NoError(t, db.Apply(bucket, msgs, info.Created.UnixNano(), false))
	require.Equal(t, 2, db.Expiries())
	before := projected(t, db, bucket)
	require.Equal(t, map[string]string{old: fmt.Sprintf("%x@%d", v2, putSeq), fresh: fmt.Sprintf("%x@%d", v1, freshSeq)}, before)
	p := startProjector(t, js3, db, projector.Options{Buckets: []string{bucket}})

	// The round: S-3's answer turned down, the leader asked about both keys (its answers held back).
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		if asks := projector.ExpireAsks(p); asks < 3 && db.Expiries() == 2 {
			return fmt.Errorf("%d asks", asks)
		}
		return nil
	})
	require.Equal(t, before, projected(t, db, bucket), "nothing applied from the lagging replica's answer")
	require.Equal(t, 2, db.Expiries())
	require.EqualValues(t, 1, projector.ExpireBehind(p), "the direct get was answered, by S-3, and turned down")

	c.ReleaseRoutes()
	released = true
	// The stream removes both puts: the older revision answers again, the new key's marker removes it.
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if n := db.Expiries(); n != 0 {
			return fmt.Errorf("%d pending expiries", n)
		}
		actx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		want, err := held(actx, nc, bucket, []string{old, fresh})
		if err != nil {
			return err
		}
		if got := projected(t, db, bucket); fmt.Sprint(got) != fmt.Sprint(want) {
			return fmt.Errorf("store %v, stream %v", got, want)
		}
		return nil
	})
	require.Equal(t, map[string]string{old: fmt.Sprintf("%x@%d", v1, oldSeq)}, projected(t, db, bucket))
}

// TestProjector_ExpiriesAcrossALeaderChange: TTL'd puts of an R3 bucket come due over a few seconds,
// half of them over an older revision of their key (removed without a marker: the older revision
// answers again), half the only message of theirs (removed by a marker); the stream's leader is stopped
// once the expire loop has begun asking. Nothing is lost and nothing wrong is applied: once a new
// leader has removed every put, the store holds what the stream does, key by key, and no expiry is
// pending. The puts that come due later are asked about while a new leader is elected, or once it is.
func TestProjector_ExpiriesAcrossALeaderChange(t *testing.T) {
	t.Parallel()
	const bucket = provisioner.BucketNeeds
	const n = 40
	c := natstest.RunCluster(t, 3)
	ctx := context.Background()
	_, js := natstest.Connect(t, c.URLs())
	stream := createR3(t, js, bucket)

	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	_, pjs := natstest.Connect(t, c.URLs())
	p := startProjector(t, pjs, db, projector.Options{Buckets: []string{bucket}})

	v1, v2 := []byte{0x81, 0xa1, 'v', 0x01}, []byte{0x81, 0xa1, 'v', 0x02}
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("n%d.m1.config.k%02d", i%5, i)
		if i%2 == 0 {
			_, err := js.Publish(ctx, provisioner.SubjectPrefix(bucket)+keys[i], v1)
			require.NoError(t, err)
		}
	}
	// TTLs of 3 s at least: every put is read before the first marker comes (with 1 s, a loaded CI
	// machine applied the markers before the test saw the puts applied: 80 applied, 60 wanted).
	var last uint64
	for i, key := range keys {
		ack, err := js.Publish(ctx, provisioner.SubjectPrefix(bucket)+key, v2, jetstream.WithMsgTTL(time.Duration(3+i%4)*time.Second))
		require.NoError(t, err)
		last = ack.Sequence
	}
	waitApplied(t, db, bucket, last)
	require.Equal(t, n, db.Expiries())

	leader := streamLeader(t, c, stream)
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		if projector.ExpireAsks(p) == 0 {
			return errors.New("no expiry asked about yet")
		}
		return nil
	})
	asked := projector.ExpireAsks(p)
	c.Stop(leader)
	stopped := time.Now()
	var survivors []int
	for i := range c.Servers {
		if i != leader {
			survivors = append(survivors, i)
		}
	}
	nc2, _ := natstest.Connect(t, c.URLs(survivors...))
	natstest.CheckFor(t, 30*time.Second, 50*time.Millisecond, func() error {
		if n := db.Expiries(); n != 0 {
			return fmt.Errorf("%d pending expiries", n)
		}
		actx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		want, err := held(actx, nc2, bucket, keys)
		if err != nil {
			return err
		}
		if got := projected(t, db, bucket); fmt.Sprint(got) != fmt.Sprint(want) {
			return fmt.Errorf("store %v, stream %v", got, want)
		}
		return nil
	})
	t.Logf("the store held what the stream does %v after the leader stopped", time.Since(stopped).Round(time.Millisecond))
	got := projected(t, db, bucket)
	require.Len(t, got, n/2, "the keys with an older revision answer it again; the others are gone")
	for i, key := range keys {
		if i%2 == 0 {
			require.Contains(t, got[key], fmt.Sprintf("%x@", v1), key)
		}
	}
	require.NotEqual(t, leader, streamLeader(t, c, stream), "a new leader")
	require.Greater(t, projector.ExpireAsks(p), asked, "asked again after the leader stopped")
	t.Logf("%d asks, %d direct gets turned down", projector.ExpireAsks(p), projector.ExpireBehind(p))
}
