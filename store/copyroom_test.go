package store

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
)

// fakeDisks makes diskFree say what free says for each directory, on the device dev says, the way a
// nearly full disk would, without filling one.
func fakeDisks(t *testing.T, free map[string]int64, dev map[string]uint64) {
	t.Helper()
	old := diskFree
	diskFree = func(dir string) (int64, uint64, bool) {
		dir = filepath.Clean(dir)
		f, ok := free[dir]
		if !ok {
			return old(dir)
		}
		return f, dev[dir], true
	}
	t.Cleanup(func() { diskFree = old })
}

// stateWithWAL is a stopped seat's state dir whose current generation holds a WAL with what was
// applied (no flush yet).
func stateWithWAL(t *testing.T) string {
	t.Helper()
	state := t.TempDir()
	db, err := OpenState(state, Options{})
	require.NoError(t, err)
	require.NoError(t, db.Apply(provisioner.BucketNeeds, []provisioner.Message{{Seq: 1, Time: 1, Key: "n1.mod.nokind.x", Op: provisioner.OpPut, Value: []byte{0x01}}}, 1, false))
	require.NoError(t, db.Close())
	return state
}

func replayCopies(t *testing.T, dir, pattern string) []string {
	t.Helper()
	m, err := filepath.Glob(filepath.Join(dir, pattern))
	require.NoError(t, err)
	return m
}

// TestCopyCurrent_KeepsTheSeatsReserve: a replay --state on a disk that its copy would take below the
// seat's reserve made the copy there all the same (its WALs copied, then replayed and flushed when
// opened), and the running seat then held its writes for want of room. With the system's temporary
// directory on the same disk, the copy is now refused, saying how much it needs, what the disk has,
// the reserve, and where else to put it; nothing is left behind.
func TestCopyCurrent_KeepsTheSeatsReserve(t *testing.T) {
	state := stateWithWAL(t)
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	free := int64(SeatReserve + 1<<20) // above the reserve, not by what the copy costs
	fakeDisks(t, map[string]int64{state: free, tmp: free}, map[string]uint64{state: 7, tmp: 7})

	cp, err := CopyCurrent(state)
	if err == nil {
		RemoveCopy(cp)
	}
	require.Error(t, err, "the copy was made at %s", cp)
	require.True(t, errors.Is(err, ErrNoSpace), "%v", err)
	for _, want := range []string{state, "MiB free", "160 MiB the seat keeps free", "TMPDIR", tmp} {
		require.Contains(t, err.Error(), want)
	}
	require.NotContains(t, err.Error(), "give --state a larger one")
	require.Empty(t, replayCopies(t, state, ".replay-*"))
	require.Empty(t, replayCopies(t, tmp, tempCopyPrefix+"*"))
}

// TestCopyCurrent_GoesToAnotherDisk: when the copy does not fit beside the state dir above the seat's
// reserve and the temporary directory is on another disk with room for all of it, the copy is made
// there, with its tables copied, and opens without any reserve.
func TestCopyCurrent_GoesToAnotherDisk(t *testing.T) {
	state := stateWithWAL(t)
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	fakeDisks(t, map[string]int64{state: SeatReserve - 1<<20, tmp: 1 << 30}, map[string]uint64{state: 7, tmp: 8})

	cp, err := CopyCurrent(state)
	require.NoError(t, err)
	defer RemoveCopy(cp)
	require.Equal(t, tmp, filepath.Dir(cp))
	require.Empty(t, replayCopies(t, state, ".replay-*"))
	db, err := Open(cp, Options{MinFreeBytes: -1})
	require.NoError(t, err)
	defer db.Close()
	require.Contains(t, db.Buckets(), provisioner.BucketNeeds, "the WAL's batch was read from the copy")

	// Another disk without room for the whole copy: refused, saying how much it needs there.
	fakeDisks(t, map[string]int64{state: SeatReserve - 1<<20, tmp: 1 << 10}, map[string]uint64{state: 7, tmp: 8})
	_, err = CopyCurrent(state)
	require.True(t, errors.Is(err, ErrNoSpace), "%v", err)
	require.Contains(t, err.Error(), "needs")
	require.Contains(t, err.Error(), tmp)
	require.Contains(t, err.Error(), "below the 160 MiB the seat keeps free")
}

// TestCopyCurrent_BesideTheStateWithRoom: with room for the copy above the reserve, it is made beside
// the state dir, its tables linked, as before.
func TestCopyCurrent_BesideTheStateWithRoom(t *testing.T) {
	state := stateWithWAL(t)
	fakeDisks(t, map[string]int64{state: SeatReserve + 1<<30}, map[string]uint64{state: 7})
	cp, err := CopyCurrent(state)
	require.NoError(t, err)
	defer RemoveCopy(cp)
	require.Equal(t, state, filepath.Dir(cp))
	_, err = os.Stat(cp)
	require.NoError(t, err)
}

// TestCopyCurrent_CostCountsWhatTheCopyTakes: what copyCost counts for a copy beside the state dir
// covers the disk blocks the copy takes once opened as a reader opens it (replay.OpenState: no
// reserve, CopyMemTableSize): its WALs copied, then replayed and flushed, a new manifest, and the new
// WAL Pebble preallocates. Only the blocks of files not linked to the state dir's count.
func TestCopyCurrent_CostCountsWhatTheCopyTakes(t *testing.T) {
	state := t.TempDir()
	db, err := OpenState(state, Options{})
	require.NoError(t, err)
	defer db.Close()
	var msgs []provisioner.Message
	for i := 0; i < 20000; i++ {
		msgs = append(msgs, provisioner.Message{Seq: uint64(i + 1), Time: int64(i + 1), Key: fmt.Sprintf("n%05d.mod.nokind.x", i), Op: provisioner.OpPut, Value: []byte{0x01, 0x02, 0x03, 0x04}})
	}
	require.NoError(t, db.Apply(provisioner.BucketNeeds, msgs, 1, true))

	gen, err := readCurrent(state)
	require.NoError(t, err)
	linked, _, err := copyCost(gen)
	require.NoError(t, err)
	cp, err := CopyCurrent(state) // beside the seat, which has the state dir open
	require.NoError(t, err)
	defer RemoveCopy(cp)
	logs, err := filepath.Glob(filepath.Join(cp, "*.log"))
	require.NoError(t, err)
	require.NotEmpty(t, logs, "the copy has no WAL to replay: the test measures nothing")

	rdb, err := Open(cp, Options{MinFreeBytes: -1, MemTableSize: CopyMemTableSize})
	require.NoError(t, err)
	taken := func() int64 {
		var n int64
		require.NoError(t, filepath.WalkDir(cp, func(path string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() {
				return err
			}
			var st syscall.Stat_t
			if err := syscall.Stat(path, &st); err != nil {
				return err
			}
			if st.Nlink == 1 {
				n += st.Blocks * 512
			}
			return nil
		}))
		return n
	}
	opened := taken()
	require.NoError(t, rdb.Close())
	used := max(opened, taken())
	t.Logf("copy: %d bytes counted, %d taken", linked, used)
	require.LessOrEqual(t, used, linked, "the copy takes more of the state dir's disk than counted")
}

// TestSeatReserve_IsServes: the reserve a copy leaves on the state dir's disk is the one serve keeps
// (its store options leave MinFreeBytes and MemTableSize at their defaults).
func TestSeatReserve_IsServes(t *testing.T) {
	db, err := OpenState(t.TempDir(), Options{})
	require.NoError(t, err)
	defer db.Close()
	_, reserve, _ := db.Room()
	require.Equal(t, int64(SeatReserve), reserve)
}

// TestCopyCurrent_CopyOfHeldL0DoesNotCompact: a seat catching up holds its compactions, so its L0
// holds many tables; a copy of it read by replay must not compact them, which writes them all again
// on the live disk (the links keep the seat's), outside what copyCost counts, with no reserve kept.
func TestCopyCurrent_CopyOfHeldL0DoesNotCompact(t *testing.T) {
	state := t.TempDir()
	db, err := OpenState(state, Options{MemTableSize: 1 << 20})
	require.NoError(t, err)
	defer db.Close()
	db.BulkLoad() // as a catch-up holds them: L0 fills
	seq := uint64(0)
	for f := 0; f < 10; f++ {
		var msgs []provisioner.Message
		for i := 0; i < 4000; i++ {
			seq++
			msgs = append(msgs, provisioner.Message{Seq: seq, Time: int64(seq), Key: fmt.Sprintf("n%05d.mod%d.nokind.x", i, f), Op: provisioner.OpPut, Value: make([]byte, 200)})
		}
		require.NoError(t, db.Apply(provisioner.BucketNeeds, msgs, 1, false))
		require.NoError(t, db.Flush())
	}
	cp, err := CopyCurrent(state)
	require.NoError(t, err)
	defer RemoveCopy(cp)
	tables, err := filepath.Glob(filepath.Join(cp, "*.sst"))
	require.NoError(t, err)
	require.GreaterOrEqual(t, len(tables), 8, "the copy's L0 is below the compaction threshold: the test measures nothing")

	// A copy writes as tables the flush of what its WALs hold, which the seat flushed already; a
	// compaction of the held L0 writes it all again.
	var linked int64
	for _, table := range tables {
		info, err := os.Stat(table)
		require.NoError(t, err)
		linked += info.Size()
	}

	rdb, err := Open(cp, CopyOptions(Options{}))
	require.NoError(t, err)
	require.NoError(t, rdb.Close())
	var written int64
	after, err := filepath.Glob(filepath.Join(cp, "*.sst"))
	require.NoError(t, err)
	for _, table := range after {
		var st syscall.Stat_t
		require.NoError(t, syscall.Stat(table, &st))
		if st.Nlink == 1 {
			written += st.Size
		}
	}
	t.Logf("tables linked %d bytes, written by the copy %d bytes", linked, written)
	require.Less(t, written, linked/2, "the copy compacted the seat's tables into new ones on the live disk")
}

// TestCopyCurrent_TMPDIRMissingSaysSo: a copy that must go to $TMPDIR (the state dir's disk nearly
// full) with TMPDIR naming a directory that does not exist was retried as if the store moved under it,
// and refused with "the store kept changing under the copy": the operator was sent after the seat
// instead of TMPDIR.
func TestCopyCurrent_TMPDIRMissingSaysSo(t *testing.T) {
	state := stateWithWAL(t)
	tmp := filepath.Join(t.TempDir(), "missing")
	t.Setenv("TMPDIR", tmp)
	fakeDisks(t, map[string]int64{state: SeatReserve - 1<<20}, map[string]uint64{state: 7})

	cp, err := CopyCurrent(state)
	if err == nil {
		RemoveCopy(cp)
	}
	require.Error(t, err, "the copy was made at %s", cp)
	require.NotContains(t, err.Error(), "kept changing")
	require.Contains(t, err.Error(), tmp)
	require.Contains(t, err.Error(), "TMPDIR")
	require.Empty(t, replayCopies(t, state, ".replay-*"))
}
