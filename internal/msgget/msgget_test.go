package msgget_test

import (
	"context"
	"errors"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/internal/msgget"
	"github.com/novox/mesh-provisioner/internal/natstest"
)

// TestGet: a message by sequence, the next of a subject from a sequence and the last of a subject,
// with its headers and data; a message the stream does not hold is not found, no error; a stream that
// is not there is an APIError.
func TestGet(t *testing.T) {
	ns := natstest.RunServer(t)
	nc, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "b", History: 5, Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	for _, put := range []struct{ key, value string }{{"x", "1"}, {"y", "2"}, {"x", "3"}} {
		_, err := kv.PutString(ctx, put.key, put.value)
		require.NoError(t, err)
	}
	require.NoError(t, kv.Delete(ctx, "y"))
	get := func(req msgget.Request) (msgget.Msg, bool) {
		t.Helper()
		m, found, err := msgget.Get(ctx, nc, jetstream.DefaultAPIPrefix, "KV_b", req)
		require.NoError(t, err)
		return m, found
	}

	m, found := get(msgget.Request{Seq: 2})
	require.True(t, found)
	require.Equal(t, "$KV.b.y", m.Subject)
	require.Equal(t, uint64(2), m.Seq)
	require.Equal(t, "2", string(m.Data))
	require.False(t, m.Time.IsZero())

	m, found = get(msgget.Request{Seq: 2, Next: "$KV.b.x"})
	require.True(t, found)
	require.Equal(t, uint64(3), m.Seq)
	require.Equal(t, "3", string(m.Data))

	m, found = get(msgget.Request{Last: "$KV.b.y"})
	require.True(t, found)
	require.Equal(t, uint64(4), m.Seq)
	h, err := nats.DecodeHeadersMsg(m.Header)
	require.NoError(t, err)
	require.Equal(t, "DEL", h.Get("KV-Operation"))

	_, found = get(msgget.Request{Seq: 5, Next: ">"})
	require.False(t, found, "nothing past the last message")
	_, found = get(msgget.Request{Last: "$KV.b.z"})
	require.False(t, found, "a subject never written")

	_, found, err = msgget.Get(ctx, nc, jetstream.DefaultAPIPrefix, "KV_gone", msgget.Request{Seq: 1})
	require.False(t, found)
	var ae *msgget.APIError
	require.True(t, errors.As(err, &ae), "%v", err)
	require.Equal(t, 404, ae.Code)
	require.Equal(t, int(jetstream.JSErrCodeStreamNotFound), ae.ErrCode)
}

// TestLastOfMany: the last message of each subject asked about, with its headers, data, sequence and
// time; a subject never written is not in the answer, which is complete and says the stream's last
// sequence; cut by max bytes it says it is not complete; none of the subjects written is an empty
// complete answer; a stream that does not allow direct gets is an error.
func TestLastOfMany(t *testing.T) {
	ns := natstest.RunServer(t)
	nc, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "b", History: 5, Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	for _, put := range []struct{ key, value string }{{"x", "1"}, {"y", "2"}, {"x", "3"}, {"w", "4"}} {
		_, err := kv.PutString(ctx, put.key, put.value)
		require.NoError(t, err)
	}
	require.NoError(t, kv.Delete(ctx, "y"))
	api := jetstream.DefaultAPIPrefix

	l, err := msgget.LastOfMany(ctx, nc, api, "KV_b", []string{"$KV.b.x", "$KV.b.y", "$KV.b.z"}, 0)
	require.NoError(t, err)
	require.True(t, l.Complete)
	require.Equal(t, uint64(5), l.UpTo)
	require.Equal(t, "KV_b", l.Stream, "the stream that answered")
	require.Len(t, l.Msgs, 2)
	require.Equal(t, "$KV.b.x", l.Msgs[0].Subject)
	require.Equal(t, uint64(3), l.Msgs[0].Seq)
	require.Equal(t, "3", string(l.Msgs[0].Data))
	require.False(t, l.Msgs[0].Time.IsZero())
	require.Equal(t, "$KV.b.y", l.Msgs[1].Subject)
	require.Equal(t, uint64(5), l.Msgs[1].Seq)
	require.Equal(t, "DEL", l.Msgs[1].Header.Get("KV-Operation"))

	l, err = msgget.LastOfMany(ctx, nc, api, "KV_b", []string{"$KV.b.x", "$KV.b.y", "$KV.b.w"}, 1)
	require.NoError(t, err)
	require.False(t, l.Complete, "cut after the first message")
	require.Len(t, l.Msgs, 1)

	l, err = msgget.LastOfMany(ctx, nc, api, "KV_b", []string{"$KV.b.z"}, 0)
	require.NoError(t, err)
	require.True(t, l.Complete)
	require.Empty(t, l.Msgs)
	require.Empty(t, l.Stream, "no message, no stream named")

	_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: "nodirect", Subjects: []string{"nd.>"}, Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	_, err = msgget.LastOfMany(ctx, nc, api, "nodirect", []string{"nd.x"}, 0)
	require.ErrorIs(t, err, nats.ErrNoResponders)
}
