package registry_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
)

// TestWriter_StrayWithWildcardTokensIsDeletedLiterally: a key whose text holds the wildcard tokens `*`
// or `>` (published on the raw subject; the KV API refuses to name it) is a stray like any other: a
// pass deletes that key, with one delete marker on its own subject, and leaves every other key alone.
// Its text was used as a filter: the last message of `>` or `gadget.>` was another key's (here a
// delete marker), so the stray was taken for deleted and stayed for ever.
func TestWriter_StrayWithWildcardTokensIsDeletedLiterally(t *testing.T) {
	js, w := startedOnServer(t)
	ctx := context.Background()
	prefix := provisioner.SubjectPrefix(provisioner.BucketRegistry)
	strays := []string{"*", ">", "gadget.*", "gadget.>"}
	for _, k := range strays {
		_, err := js.Publish(ctx, prefix+k, []byte{0x80})
		require.NoError(t, err, k)
	}
	// A plain stray written after them, deleted by the next pass: the newest message of the stream,
	// which a read of `>` or `gadget.>` as a filter finds.
	kv, err := js.KeyValue(ctx, provisioner.BucketRegistry)
	require.NoError(t, err)
	_, err = kv.Put(ctx, "gadget.x", []byte{0x80})
	require.NoError(t, err)
	strays = append(strays, "gadget.x")

	stream, err := js.Stream(ctx, provisioner.StreamName(provisioner.BucketRegistry))
	require.NoError(t, err)
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		for _, k := range strays {
			if op := literalLast(t, stream, prefix+k).Header.Get("KV-Operation"); op != "DEL" {
				return fmt.Errorf("stray %q: last message %q, not deleted", k, op)
			}
		}
		return nil
	})
	waitPasses(t, w, passes(w)+3) // and then some: nothing more is written
	after := messages(t, js)
	for _, k := range strays {
		require.EqualValues(t, 2, after[k], "stray %q: its write and one delete marker", k)
	}
	for _, e := range provisioner.Registry.Entries {
		require.EqualValues(t, 1, after[e.Kind], "kind %q is written once, never judged by a stray's message", e.Kind)
	}
}

// literalLast is the last message on subj itself, even when subj holds wildcard tokens.
func literalLast(t *testing.T, stream jetstream.Stream, subj string) *jetstream.RawStreamMsg {
	t.Helper()
	var last *jetstream.RawStreamMsg
	for seq := uint64(1); ; {
		m, err := stream.GetMsg(context.Background(), seq, jetstream.WithGetMsgSubject(subj))
		if err != nil {
			require.ErrorIs(t, err, jetstream.ErrMsgNotFound)
			break
		}
		if m.Subject == subj {
			last = m
		}
		seq = m.Sequence + 1
	}
	require.NotNil(t, last, "%s has a message", subj)
	return last
}
