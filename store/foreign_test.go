package store_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/store"
)

// foreign is a message on a subject added to a bucket's stream by hand, with a Nats-Rollup.
func foreign(seq uint64, subject string, r provisioner.Rollup, value []byte) provisioner.Message {
	return provisioner.Message{Seq: seq, Time: int64(seq) * 1e9, Key: subject, Foreign: true, Rollup: r, Value: value}
}

// TestDB_AWholeStreamRollupOnAnAddedSubjectRemovesEveryKey: a message on a subject added to a bucket's
// stream by hand with Nats-Rollup: all makes the server purge every other message of the stream, every
// key of the bucket included. The store passed it over and kept every key, so the seat answered rows
// the bucket no longer held. Now it removes every key as a rollup of the whole bucket at its sequence:
// a key whose text is the subject's too (it is no key), rows, anomalies and their counts (per node
// too), and the log keeps it, so that it is read back as the message it was. A Nats-Rollup: sub there
// purged that subject alone: nothing of the bucket, and nothing is logged.
func TestDB_AWholeStreamRollupOnAnAddedSubjectRemovesEveryKey(t *testing.T) {
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	b := provisioner.BucketNeeds
	all := provisioner.Range{Bucket: b, Index: provisioner.IndexPrimary}
	require.NoError(t, db.Apply(b, []provisioner.Message{
		put(1, "n1.m.config.a", []byte{0xc0}),
		put(2, "n1.m.config.b", []byte{0xc1}), // a value anomaly
		put(3, "extra.x", []byte{0xc0}),       // out of shape, with the added subject's text
		put(4, "n2.x", []byte{0xc0}),          // out of shape
		foreign(5, "extra.x", provisioner.RollupSub, nil),
		foreign(6, "extra.y", provisioner.RollupNone, []byte("data")),
	}, 0, false))
	require.Equal(t, []string{"n1.m.config.a", "n1.m.config.b"}, rows(t, db, all), "a rollup of its own subject removes no key")
	_, total := anomalies(t, db, b, "")
	require.EqualValues(t, 5, total)
	require.Equal(t, 1, db.Schema(), "nothing of the two is logged")

	require.NoError(t, db.Apply(b, []provisioner.Message{
		foreign(7, "extra.x", provisioner.RollupAll, []byte("the rollup")),
		put(8, "n3.m.config.c", []byte{0xc0}),
	}, 0, false))
	applied, _ := db.Applied(b)
	require.EqualValues(t, 8, applied)
	require.Equal(t, []string{"n3.m.config.c"}, rows(t, db, all))
	anoms, total := anomalies(t, db, b, "")
	require.Equal(t, []string{"n3.m.config.c unanswered-kind"}, anoms)
	require.EqualValues(t, 1, total, "the anomaly count follows")
	for _, node := range []string{"n1", "n2", "extra"} {
		anoms, total := anomalies(t, db, b, node)
		require.Empty(t, anoms, node)
		require.Zero(t, total, "the count of node %s follows", node)
	}
	require.Equal(t, []string{"extra.x", "n1.m.config.a", "n1.m.config.b", "n2.x"}, keysAt(t, db, b, 6))
	require.Empty(t, keysAt(t, db, b, 7), "as of the rollup")
	require.Equal(t, 2, db.Schema(), "the log holds a rollup that removed other keys")

	v, err := db.View()
	require.NoError(t, err)
	defer v.Close()
	require.Equal(t, []string{"3 PUT", "7 PURGE"}, history(t, db, b, "extra.x"), "the key of the subject's text is purged as the others")
	var got []provisioner.Message
	require.NoError(t, v.Events(b, 1, func(key []byte, ev *store.Event) bool {
		m := ev.Message(key)
		m.Value = append([]byte(nil), m.Value...)
		got = append(got, m)
		return true
	}))
	require.Len(t, got, 6, "one event a sequence read, the rollup's included")
	require.Equal(t, foreign(7, "extra.x", provisioner.RollupAll, []byte("the rollup")), got[4], "read back as the message it was")
	sq, err := v.SeqAtTime(b, 7e9)
	require.NoError(t, err)
	require.EqualValues(t, 7, sq, "a time point at the rollup is the rollup")

	// Applied again (the projector reads it again after a restart): nothing changes.
	before := dump(t, db)
	require.NoError(t, db.Apply(b, []provisioner.Message{foreign(7, "extra.x", provisioner.RollupAll, []byte("the rollup"))}, 0, false))
	require.Equal(t, before, dump(t, db))

	// The stream now starts at the rollup: the projection rests on nothing before it (the stream
	// check finds no purged message to rebuild for), and a trim past it answers the same.
	_, live, err := db.LiveBelow(context.Background(), b, 0, 7)
	require.NoError(t, err)
	require.False(t, live)
	_, err = db.TrimHistory(context.Background(), b, 7, 7e9)
	require.NoError(t, err)
	require.Empty(t, keysAt(t, db, b, 7))
	require.Equal(t, []string{"n3.m.config.c"}, keysAt(t, db, b, 8))
}
