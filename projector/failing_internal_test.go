package projector

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/store"
)

// TestProjector_FailingCountsInARowAndLastsUntilSynced: a bucket's tail is Failing after FailingAfter
// failures in a row, not at the first (often a timeout on a loaded server); a tail that works again
// before that starts the count over; once Failing, a tail that works again stays Failing until the
// bucket is synced, so readiness, which lets go of a Failing composed bucket, does not take it back
// while the bucket catches up.
func TestProjector_FailingCountsInARowAndLastsUntilSynced(t *testing.T) {
	t.Parallel()
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, db.Close()) })
	p := &Projector{db: db}
	const b = "composed-n1"

	for i := 1; i < FailingAfter; i++ {
		p.tailFailed(b)
		require.False(t, p.Failing(b), "after %d failures", i)
	}
	p.tailWorks(b)
	p.tailFailed(b)
	require.False(t, p.Failing(b), "the count starts over once the tail works")
	for i := 1; i < FailingAfter; i++ {
		p.tailFailed(b)
	}
	require.True(t, p.Failing(b), "after %d failures in a row", FailingAfter)

	p.tailWorks(b)
	require.True(t, p.Failing(b), "working again, not caught up yet")
	db.SetSynced(b, true)
	require.False(t, p.Failing(b), "synced")
	p.tailFailed(b)
	require.False(t, p.Failing(b), "a new count")
	require.Empty(t, p.Unreadable())

	// Synced, and its tail fails now (a bucket read before whose stream can no longer be read): not
	// Failing, which readiness asks of the buckets not synced, but Unreadable until it works again.
	for i := 1; i < FailingAfter; i++ {
		p.tailFailed(b)
	}
	require.False(t, p.Failing(b), "synced")
	require.Equal(t, []string{b}, p.Unreadable())
	require.Equal(t, []string{b}, p.Unreadable(), "asking changes nothing")
	p.tailWorks(b)
	require.Empty(t, p.Unreadable(), "works again, synced")

	// Failing, then working and catching up: Unreadable until synced.
	db.SetSynced(b, false)
	for i := 0; i < FailingAfter; i++ {
		p.tailFailed(b)
	}
	p.tailWorks(b)
	require.Equal(t, []string{b}, p.Unreadable())
	db.SetSynced(b, true)
	require.Empty(t, p.Unreadable())
}

// TestProjector_FailuresAfterCatchingUpAreANewRow: a Failing bucket whose tail works again and that
// then catches up is Failing no more, whether or not anyone asked in between (readiness and the
// metrics ask, a seat without them never does). Its next failure is the first of a new row: it was
// counted on top of the old one, so a single failure (a timeout on a loaded server) named the bucket
// Unreadable at once and sent it to the Failing buckets' set-up slots.
func TestProjector_FailuresAfterCatchingUpAreANewRow(t *testing.T) {
	t.Parallel()
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, db.Close()) })
	p := &Projector{db: db, setup: make(chan struct{}, maxSettingUp), retrySetup: make(chan struct{}, maxRetrySettingUp)}
	const b = "composed-n1"

	for range FailingAfter {
		p.tailFailed(b)
	}
	require.True(t, p.settingUp(b) == p.retrySetup, "Failing: its own slots")
	p.tailWorks(b) // not synced yet: still Failing while it catches up
	require.True(t, p.settingUp(b) == p.setup, "working again: the shared slots")
	db.SetSynced(b, true) // caught up, with nobody asking

	p.tailFailed(b)
	require.Empty(t, p.Unreadable(), "one failure after catching up")
	require.True(t, p.settingUp(b) == p.setup, "one failure after catching up: the shared slots")
	for i := 1; i < FailingAfter; i++ {
		p.tailFailed(b)
	}
	require.Equal(t, []string{b}, p.Unreadable(), "a new row of %d", FailingAfter)
	require.True(t, p.settingUp(b) == p.retrySetup)
}
