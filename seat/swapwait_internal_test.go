package seat

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/store"
)

// TestReached: when a rebuild's swap stops waiting for a bucket of the new store (swapwait.go).
func TestReached(t *testing.T) {
	t.Parallel()
	c1, c2 := time.Unix(1000, 0), time.Unix(2000, 0)
	listed := func(created time.Time, first, last uint64) *jetstream.StreamInfo {
		return &jetstream.StreamInfo{Created: created, State: jetstream.StreamState{FirstSeq: first, LastSeq: last}}
	}
	old := store.Checkpoint{Applied: 16, StreamCreated: c1.UnixNano()}
	for _, tc := range []struct {
		name string
		cur  store.Checkpoint
		info *jetstream.StreamInfo
		want bool
	}{
		{"applied as much", store.Checkpoint{Applied: 16, StreamCreated: c1.UnixNano()}, nil, true},
		{"applied more", store.Checkpoint{Applied: 20, StreamCreated: c1.UnixNano()}, nil, true},
		{"behind, same stream", store.Checkpoint{Applied: 15, StreamCreated: c1.UnixNano()}, nil, false},
		{"behind, same stream, listed with what is left to read", store.Checkpoint{Applied: 15, StreamCreated: c1.UnixNano()}, listed(c1, 1, 16), false},
		{"behind, nothing read yet", store.Checkpoint{}, nil, false},
		{"another stream: sequences started over", store.Checkpoint{Applied: 3, StreamCreated: c2.UnixNano()}, nil, true},
		{"purged past the old position", store.Checkpoint{Applied: 0, StreamCreated: c1.UnixNano()}, listed(c1, 17, 16), true},
		{"purged, nothing read", store.Checkpoint{}, listed(c1, 17, 16), true},
		{"listed as another stream: not trusted, the listing may predate the old read", store.Checkpoint{Applied: 15, StreamCreated: c1.UnixNano()}, listed(c2, 17, 20), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, reached(old, tc.cur, tc.info))
		})
	}
}
