package replay_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/replay"
	"github.com/novox/mesh-provisioner/store"
)

// TestOpenState_ReaderKeepsNoReserve: the copy a replay or export --state reads was opened with the
// seat's reserve (160 MiB), so on a disk below it every replay was refused ("free space on that disk
// (or give --state a larger one)"), just when an operator in an incident needed it. A reader keeps no
// reserve: where its copy goes already leaves the seat's (store.CopyCurrent).
func TestOpenState_ReaderKeepsNoReserve(t *testing.T) {
	t.Parallel()
	l := openStateOfOneNeed(t)
	_, reserve, _ := l.DB.Room()
	require.Negative(t, reserve, "the copy is opened keeping a writer's reserve of %d bytes", reserve)
}

// TestOpenState_CopyHoldsCompactions: a seat catching up holds its compactions back, and a replay
// --state in that incident opened a copy that compacted the held L0 at once, writing it all again on
// the live disk, which the copy's cost did not count and with no reserve kept. The copy only reads.
func TestOpenState_CopyHoldsCompactions(t *testing.T) {
	t.Parallel()
	l := openStateOfOneNeed(t)
	require.True(t, l.DB.CompactionsHeld(), "the copy compacts what the seat held back")
}

// openStateOfOneNeed opens, as replay --state does, a state dir holding one need, closed after the test.
func openStateOfOneNeed(t *testing.T) *replay.Log {
	t.Helper()
	dir := t.TempDir()
	db, err := store.OpenState(dir, store.Options{})
	require.NoError(t, err)
	require.NoError(t, db.Apply(provisioner.BucketNeeds, []provisioner.Message{{Seq: 1, Time: 1, Key: "n1.mod.nokind.x", Op: provisioner.OpPut, Value: []byte{0x01}}}, 1, false))
	require.NoError(t, db.Close())
	l, err := replay.OpenState(dir)
	require.NoError(t, err)
	t.Cleanup(func() { l.Close() })
	return l
}
