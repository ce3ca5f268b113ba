package projector_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/msgget"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/store"
)

// TestProjector_ExpiryNotTakenFromAMirror: a KV bucket that mirrors the projected one (nats.go makes a
// KV mirror with MirrorDirect) answers the projected bucket's direct gets once caught up. Its sequences
// are the origin's, so its up-to sequence passes the check against the applied one, but what it holds
// of a key is not what the origin holds: its removals are its own. Made as nats.go makes it (History 1,
// no per-message TTLs) it keeps an expired put for ever (the expired row would stay); given TTLs, it
// removes the put and, keeping one message a subject, holds nothing of the key where the origin holds
// its older revision (the row would be removed). Either way the loop asks the leader instead: the
// expired put answers its older revision again, the put the stream still holds (TTL an hour, written
// into the store as due now) is kept. The origin answers no direct get here, so the mirror answers
// every one (with both, each request goes to one of them at random).
func TestProjector_ExpiryNotTakenFromAMirror(t *testing.T) {
	for _, mirrorTTLs := range []bool{false, true} {
		t.Run(fmt.Sprintf("mirror TTLs %v", mirrorTTLs), func(t *testing.T) {
			const bucket = provisioner.BucketNeeds
			ns := natstest.RunServer(t)
			nc, js := natstest.Connect(t, ns.ClientURL())
			ctx := context.Background()
			_, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: bucket, History: 5, LimitMarkerTTL: time.Second})
			require.NoError(t, err)
			origin := provisioner.StreamName(bucket)
			_, err = js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "mirror", Mirror: &jetstream.StreamSource{Name: origin}})
			require.NoError(t, err)
			mirror, err := js.Stream(ctx, "KV_mirror")
			require.NoError(t, err)
			require.True(t, mirror.CachedInfo().Config.MirrorDirect)
			if mirrorTTLs {
				cfg := mirror.CachedInfo().Config
				cfg.AllowMsgTTL = true
				_, err := js.UpdateStream(ctx, cfg)
				require.NoError(t, err)
			}

			var msgs []provisioner.Message
			publish := func(key string, value []byte, ttl time.Duration, due time.Time) uint64 {
				m := putWithTTL(t, ctx, js, bucket, key, value, ttl)
				if ttl > 0 {
					m.Expires = due.UnixNano()
				}
				msgs = append(msgs, m)
				return m.Seq
			}
			const gone, kept = "n1.m1.config.gone", "n1.m1.config.kept"
			v1, v2 := []byte{0x81, 0xa1, 'v', 0x01}, []byte{0x81, 0xa1, 'v', 0x02}
			goneOlder := publish(gone, v1, 0, time.Time{})
			keptOlder := publish(kept, v1, 0, time.Time{})
			// Both due together, one round asks about both: the kept one makes the mirror's answer one
			// with a message (one with none is a 404, which says no up-to sequence, and does not stand).
			due := time.Now().Add(time.Second)
			publish(gone, v2, time.Second, due)
			keptSeq := publish(kept, v2, time.Hour, due) // the store takes it as due with the other: the stream keeps it

			// The mirror holds every message and answers the origin's direct gets; the origin none.
			natstest.CheckFor(t, 10*time.Second, 20*time.Millisecond, func() error {
				info, err := mirror.Info(ctx)
				if err != nil {
					return err
				}
				if info.State.LastSeq != keptSeq {
					return fmt.Errorf("mirror at %d, origin at %d", info.State.LastSeq, keptSeq)
				}
				return nil
			})
			natstest.NoDirectGets(t, js, origin)
			subjects := []string{provisioner.SubjectPrefix(bucket) + gone, provisioner.SubjectPrefix(bucket) + kept}
			natstest.CheckFor(t, 10*time.Second, 20*time.Millisecond, func() error {
				l, err := msgget.LastOfMany(ctx, nc, jetstream.DefaultAPIPrefix, origin, subjects, 0)
				if err != nil {
					return err
				}
				if l.Stream != "KV_mirror" || l.UpTo < keptSeq {
					return fmt.Errorf("answered by %q up to %d", l.Stream, l.UpTo)
				}
				return nil
			})

			info, err := js.Stream(ctx, origin)
			require.NoError(t, err)
			db, err := store.Open(t.TempDir(), store.Options{})
			require.NoError(t, err)
			require.NoError(t, db.Apply(bucket, msgs, info.CachedInfo().Created.UnixNano(), false))
			require.Equal(t, 2, db.Expiries())
			startProjector(t, js, db, projector.Options{Buckets: []string{bucket}})

			natstest.CheckFor(t, 10*time.Second, 20*time.Millisecond, func() error {
				if _, ok := db.PendingExpiry(bucket, gone); ok {
					return errors.New("the expired put still pending")
				}
				if e, _ := db.PendingExpiry(bucket, kept); e.Tries == 0 {
					return errors.New("the kept put not asked about yet")
				}
				return nil
			})
			if mirrorTTLs {
				l, err := msgget.LastOfMany(ctx, nc, jetstream.DefaultAPIPrefix, origin, subjects, 0)
				require.NoError(t, err)
				require.Len(t, l.Msgs, 1, "the mirror holds nothing of the expired put's key")
			}
			e, ok := db.PendingExpiry(bucket, kept)
			require.True(t, ok)
			require.Equal(t, keptSeq, e.Seq)

			v, err := db.View()
			require.NoError(t, err)
			defer v.Close()
			rows := map[string]uint64{}
			require.NoError(t, v.Rows(provisioner.Range{Bucket: bucket, Index: provisioner.IndexPrimary}, func(r *provisioner.Row) bool {
				rows[string(r.Key)] = r.Revision
				return true
			}))
			require.Equal(t, map[string]uint64{gone: goneOlder, kept: keptSeq}, rows,
				"the expired put answers its older revision (%d) again, as the origin holds it; the kept one its put (older %d)", goneOlder, keptOlder)
		})
	}
}
