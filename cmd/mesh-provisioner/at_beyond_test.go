package main

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/query"
)

// TestQuery_AtBeyondTheNewest: an at past the newest message (a sequence beyond the applied one, a
// time in the future) is no point the log was trimmed past: it answers as of the applied sequence, the
// live answer, with as_of saying which, never 410 (docs/decisions.md, at beyond the newest).
func TestQuery_AtBeyondTheNewest(t *testing.T) {
	s := demoSeat(t)
	s.waitReady(t)
	nc, _ := natstest.Connect(t, s.natsURL)
	live := map[string]any{"what": "needs", "node": fixtures.NodeName(7)}
	want, wantLast, err := natstest.AskAll(nc, query.Subject, live, false)
	require.NoError(t, err)
	require.NotEmpty(t, want)
	for _, at := range []string{"seq:18446744073709551614", "2999-01-01T00:00:00Z", "9999-12-31T23:59:59.999999999Z"} {
		req := map[string]any{"what": "needs", "node": fixtures.NodeName(7), "at": at}
		got, last, err := natstest.AskAll(nc, query.Subject, req, false)
		require.NoError(t, err, at)
		require.Equal(t, wantLast.AsOf, last.AsOf, "%s: as of the applied sequence", at)
		require.Equal(t, len(want), len(got), at)
		for i := range want {
			require.Equal(t, want[i]["key"], got[i]["key"], "%s row %d", at, i)
			require.Equal(t, want[i]["revision"], got[i]["revision"], "%s row %d", at, i)
		}
	}
}
