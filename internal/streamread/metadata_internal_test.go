package streamread

import (
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
)

// natsMetadata is nats.go's reading of reply (its legacy API's Metadata, which jetstream's calls the
// same parser for).
func natsMetadata(reply string) (*nats.MsgMetadata, error) {
	return (&nats.Msg{Reply: reply, Sub: &nats.Subscription{}}).Metadata()
}

// sameMetadata fails unless parseMetadata reads reply as nats.go does: an error for the same subjects,
// the same fields otherwise.
func sameMetadata(t *testing.T, reply string) {
	t.Helper()
	want, werr := natsMetadata(reply)
	var got jetstream.MsgMetadata
	err := parseMetadata(reply, &got)
	if werr != nil {
		require.Error(t, err, "%q: nats.go says %v", reply, werr)
		require.ErrorIs(t, err, jetstream.ErrNotJSMessage)
		return
	}
	require.NoError(t, err, "%q", reply)
	require.Equal(t, want.Sequence.Stream, got.Sequence.Stream, "%q", reply)
	require.Equal(t, want.Sequence.Consumer, got.Sequence.Consumer, "%q", reply)
	require.Equal(t, want.NumDelivered, got.NumDelivered, "%q", reply)
	require.Equal(t, want.NumPending, got.NumPending, "%q", reply)
	require.True(t, want.Timestamp.Equal(got.Timestamp), "%q: %v, %v", reply, want.Timestamp, got.Timestamp)
	require.Equal(t, want.Timestamp.UnixNano(), got.Timestamp.UnixNano(), "%q", reply)
	require.Equal(t, want.Stream, got.Stream, "%q", reply)
	require.Equal(t, want.Consumer, got.Consumer, "%q", reply)
	require.Equal(t, want.Domain, got.Domain, "%q", reply)
}

var metadataSeeds = []string{
	// An older server's.
	"$JS.ACK.KV_mesh-provisioner_needs.abc123.1.4711.4711.1764681600123456789.995299",
	// A newer one's: no domain ("_"), the account's hash, a random token after the pending count.
	"$JS.ACK._.ABCDEFGHIJKLMNOPQRSTUV.KV_mesh-provisioner_needs.abc123.1.4711.4711.1764681600123456789.995299.Xq3z",
	// With a domain; without the token after the pending count; with two.
	"$JS.ACK.hub.HASH.S.C.2.10.9.1764681600000000000.0.tok",
	"$JS.ACK.hub.HASH.S.C.2.10.9.1764681600000000000.0",
	"$JS.ACK.hub.HASH.S.C.2.10.9.1764681600000000000.0.tok.more",
	// Numbers that are not all digits, empty, past uint64, a timestamp past int64.
	"$JS.ACK.S.C.1x.-2.+3.1e9.",
	"$JS.ACK.S.C..99999999999999999999999.18446744073709551616.18446744073709551615.1",
	"$JS.ACK.S.C.1.٣.3.4.5",
	// Not a JetStream message's: too few tokens, 10, another prefix, none.
	"$JS.ACK.S.C.1.2.3.4",
	"$JS.ACK.d.h.S.C.1.2.3.4.5",
	"$JS.NAK.S.C.1.2.3.4.5",
	"$JS.ACK",
	"$JS.ACK.",
	"",
	"_INBOX.abc",
	"$JS.ACK........",
	"$JS.ACK..........",
}

// TestParseMetadata: the subjects of both forms, and ones nats.go refuses, are read as nats.go reads
// them; the fuzz test below tries more.
func TestParseMetadata(t *testing.T) {
	for _, s := range metadataSeeds {
		sameMetadata(t, s)
	}
	var md jetstream.MsgMetadata
	require.NoError(t, parseMetadata(metadataSeeds[1], &md))
	require.Equal(t, uint64(4711), md.Sequence.Stream)
	require.Equal(t, uint64(995299), md.NumPending)
	require.Equal(t, "KV_mesh-provisioner_needs", md.Stream)
	require.Equal(t, "", md.Domain)
}

// FuzzParseMetadata: parseMetadata reads any subject as nats.go does (go test -fuzz FuzzParseMetadata).
func FuzzParseMetadata(f *testing.F) {
	for _, s := range metadataSeeds {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, reply string) { sameMetadata(t, reply) })
}

// BenchmarkMetadata: one reply subject of the newer form read by nats.go and by parseMetadata.
func BenchmarkMetadata(b *testing.B) {
	reply := metadataSeeds[1]
	b.Run("nats.go", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := natsMetadata(reply); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("parseMetadata", func(b *testing.B) {
		b.ReportAllocs()
		var md jetstream.MsgMetadata
		for b.Loop() {
			if err := parseMetadata(reply, &md); err != nil {
				b.Fatal(err)
			}
		}
	})
}
