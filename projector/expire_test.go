package projector_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// TestProjector_ManyTTLdPutsExpireTogether: many TTL'd puts over older revisions come due together,
// more than one window of asks; every one the server removed is applied (the older revision again,
// with its own revision), and a put the store holds as due whose stream still holds it (here a put
// whose TTL is an hour, written into the store as due now) is kept, asked about again later. The
// store is written as the stream holds it, so the projector's tails have nothing to read: what changes
// is the expiry loop's doing alone. Asked by one direct get of every key, and by the stream's leader
// key by key, the same.
func TestProjector_ManyTTLdPutsExpireTogether(t *testing.T) {
	const n = 300
	const bucket = provisioner.BucketNeeds
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	_, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: bucket, History: 5, LimitMarkerTTL: time.Second})
	require.NoError(t, err)
	stream, err := js.Stream(ctx, provisioner.StreamName(bucket))
	require.NoError(t, err)

	var msgs []provisioner.Message
	publish := func(key string, value []byte, ttl, due time.Duration) uint64 {
		m := putWithTTL(t, ctx, js, bucket, key, value, ttl)
		if ttl > 0 {
			m.Expires = time.Unix(0, m.Time).Add(due).UnixNano()
		}
		msgs = append(msgs, m)
		return m.Seq
	}
	key := func(i int) string { return fmt.Sprintf("n%d.m1.config.k%03d", i%7, i) }
	const kept = "n1.m1.config.kept"
	v1, v2 := []byte{0x81, 0xa1, 'v', 0x01}, []byte{0x81, 0xa1, 'v', 0x02}
	older := map[string]uint64{}
	for i := range n {
		older[key(i)] = publish(key(i), v1, 0, 0)
	}
	older[kept] = publish(kept, v1, 0, 0)
	for i := range n {
		publish(key(i), v2, time.Second, time.Second)
	}
	keptSeq := publish(kept, v2, time.Hour, 0) // the store takes it as due now: the stream keeps it
	// All due together, however long the puts took: once the last is, the server removed every one.
	due := time.Now().Add(time.Second).UnixNano()
	for i := range msgs {
		if msgs[i].Expires > 0 && msgs[i].Key != kept {
			msgs[i].Expires = due
		}
	}

	info, err := stream.Info(ctx)
	require.NoError(t, err)
	// The same store twice: one projector asks by a direct get first, the other the leader alone.
	check := map[string]func(){}
	for _, direct := range []bool{true, false} {
		name := map[bool]string{true: "direct get", false: "leader alone"}[direct]
		db, err := store.Open(t.TempDir(), store.Options{})
		require.NoError(t, err)
		require.NoError(t, db.Apply(bucket, msgs, info.Created.UnixNano(), false))
		require.Equal(t, n+1, db.Expiries())
		p := projector.New(js, db, projector.Options{Buckets: []string{bucket}})
		projector.SetExpireDirect(p, direct)
		p.Start(ctx)
		t.Cleanup(func() {
			p.Stop()
			require.NoError(t, db.Close())
		})
		check[name] = func() {
			natstest.CheckFor(t, 30*time.Second, 20*time.Millisecond, func() error {
				if left := db.Expiries(); left != 1 {
					return fmt.Errorf("%s: %d pending expiries", name, left)
				}
				if e, _ := db.PendingExpiry(bucket, kept); e.Tries == 0 {
					return fmt.Errorf("%s: the kept put not asked about yet", name)
				}
				return nil
			})
			e, ok := db.PendingExpiry(bucket, kept)
			require.True(t, ok, "%s: the put the stream still holds is still pending", name)
			require.Equal(t, keptSeq, e.Seq, name)
			if asks := projector.ExpireAsks(p); direct {
				require.Less(t, asks, int64(n/10), "%s: a few gets of many keys each", name)
			} else {
				require.GreaterOrEqual(t, asks, int64(n), "%s: a get a key", name)
			}

			v, err := db.View()
			require.NoError(t, err)
			defer v.Close()
			rows := map[string]uint64{}
			require.NoError(t, v.Rows(provisioner.Range{Bucket: bucket, Index: provisioner.IndexPrimary}, func(r *provisioner.Row) bool {
				rows[string(r.Key)] = r.Revision
				want := v1
				if string(r.Key) == kept {
					want = v2
				}
				require.Equal(t, want, r.Value, "%s: value of %s", name, r.Key)
				return true
			}))
			want := map[string]uint64{kept: keptSeq}
			for i := range n {
				want[key(i)] = older[key(i)]
			}
			require.Equal(t, want, rows, "%s: every expired put answers its older revision again; the kept one its put", name)
		}
	}
	check["direct get"]()
	check["leader alone"]()
}

// putWithTTL publishes a put of key in bucket (with a per-message TTL when ttl > 0) and returns it as
// the message the projector reads: its sequence, the time just before it was sent, key, value. The
// caller sets Expires, which each test reckons its own way.
func putWithTTL(t testing.TB, ctx context.Context, js jetstream.JetStream, bucket, key string, value []byte, ttl time.Duration) provisioner.Message {
	t.Helper()
	var opts []jetstream.PublishOpt
	if ttl > 0 {
		opts = append(opts, jetstream.WithMsgTTL(ttl))
	}
	now := time.Now()
	ack, err := js.Publish(ctx, provisioner.SubjectPrefix(bucket)+key, value, opts...)
	require.NoError(t, err)
	return provisioner.Message{Seq: ack.Sequence, Time: now.UnixNano(), Key: key, Op: provisioner.OpPut, Value: value}
}

// startProjector starts a projector of db with opts, stopped and db closed (without error) when the
// test ends.
func startProjector(t testing.TB, js jetstream.JetStream, db *store.DB, opts projector.Options) *projector.Projector {
	t.Helper()
	p := projector.New(js, db, opts)
	p.Start(context.Background())
	t.Cleanup(func() {
		p.Stop()
		require.NoError(t, db.Close())
	})
	return p
}
