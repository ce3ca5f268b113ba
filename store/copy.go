package store

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
)

// CopyCurrent makes a private copy of a state dir's current generation that Open can open, without
// taking the state dir's lock, so it works while a serve (or a rebuild) has the state dir open. Pebble
// locks its directory even to read it, so reading the live one is not possible.
//
// The copy hard-links the immutable .sst files (so it costs no space and little time) and copies the
// rest: the MANIFEST, its marker, OPTIONS and the WAL files (a WAL caught mid-append ends in a torn
// record, which Pebble's recovery treats as the end of the log). A flush or compaction that changes the
// manifest or the set of files while copying would make the copy inconsistent, so the file list is
// compared before and after and the copy made again when it moved.
//
// The copy lives in <state>/.replay-* (same filesystem, so links work), or in the system's temporary
// directory with the .sst files copied when the state dir is not writable, or when the copy would take
// its disk below the seat's reserve (CopyCurrentKeeping). A copy in the state dir is
// held with a flock from before anything is written in it (lockCopy). The caller removes it
// (RemoveCopy, which lets the flock go) when done.
func CopyCurrent(stateDir string) (string, error) { return CopyCurrentKeeping(stateDir, SeatReserve) }

// CopyMemTableSize is the memtable a copy is to be opened with (replay.OpenState): it is read, not
// written, and Pebble preallocates the WAL an open makes to 110% of it, which the copy's cost counts
// (copyCost); with the seat's 64 MiB memtables that was 70 MiB more on a nearly full disk.
const CopyMemTableSize = 4 << 20

// CopyOptions are base made fit to open a copy CopyCurrent made: no reserve (where the copy went
// left the seat's), CopyMemTableSize memtables, and compactions held (BulkLoad): a catching-up seat
// holds its L0 back, and a copy compacting it would write all of it again on the live disk, which
// copyCost does not count.
func CopyOptions(base Options) Options {
	base.MinFreeBytes = -1
	base.MemTableSize = CopyMemTableSize
	base.BulkLoad = true
	return base
}

// SeatReserve is the room a seat keeps free on its state dir's disk: serve opens its store with the
// default reserve of its 64 MiB memtables (defaultMinFree).
const SeatReserve = 2*64<<20 + 32<<20

// CopyCurrentKeeping is CopyCurrent leaving reserve bytes free on the state dir's disk for the seat
// that may be running on it. A copy in the state dir costs its WALs, MANIFEST and OPTIONS copied,
// and as much again when the copy is opened (the WALs replayed are flushed into a table, a new
// manifest is written): copyCost. When that would take the state dir's disk below reserve, the copy
// goes to the system's temporary directory instead if that is on another disk with room for all of
// it (its tables copied too, since links cannot cross disks), and is refused otherwise, saying how
// much it needs and where: a reader's copy never makes the seat hold its writes.
func CopyCurrentKeeping(stateDir string, reserve int64) (string, error) {
	var lastErr error
	for attempt := 0; attempt < 20; attempt++ {
		gen, err := readCurrent(stateDir)
		if errors.Is(err, ErrCorrupt) {
			return "", fmt.Errorf("%w (run `mesh-provisioner rebuild`)", err)
		}
		if err != nil {
			return "", err
		}
		if gen == "" {
			hint := StateDirHint(stateDir)
			if gens, err := (&StateDir{path: stateDir}).generations(); err == nil && len(gens) > 0 {
				hint = ": a rebuild that did not finish left a generation; run mesh-provisioner rebuild again to finish it"
			}
			return "", fmt.Errorf("store: %s holds no projection yet (no %s)%s", stateDir, currentName, hint)
		}
		dir, err := copyGeneration(stateDir, gen, reserve)
		if err == nil {
			return dir, nil
		}
		lastErr = err
		if errors.Is(err, os.ErrNotExist) {
			// A swap removes the generation CURRENT named a moment ago; one that CURRENT still names
			// and that does not exist is a broken state dir.
			if now, cerr := readCurrent(stateDir); cerr == nil && now == gen {
				if _, serr := os.Stat(gen); errors.Is(serr, os.ErrNotExist) {
					return "", fmt.Errorf("%w: %s names %s, which does not exist (run `mesh-provisioner rebuild`)", ErrCorrupt, currentName, gen)
				}
			}
		}
		if !errors.Is(err, errCopyMoved) && !errors.Is(err, errCopyTaken) && !errors.Is(err, os.ErrNotExist) {
			return "", err
		}
	}
	return "", fmt.Errorf("copy %s: the store kept changing under the copy: %w", stateDir, lastErr)
}

var errCopyMoved = errors.New("store: files changed while copying")

// errCopyTaken: a remover of stale copies took the copy's directory as it was made (lockCopy).
var errCopyTaken = errors.New("store: the copy's directory was taken by a remover of stale copies")

// readCurrent is the generation dir CURRENT names, read without the lock.
func readCurrent(stateDir string) (string, error) {
	s := &StateDir{path: stateDir}
	return s.Current()
}

// signature lists what must not change while copying: every file but the WALs' sizes (they grow).
func signature(dir string) ([]string, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var sig []string
	for _, e := range entries {
		name := e.Name()
		if name == "LOCK" || name == probeName || e.IsDir() { // the probe comes and goes (space.go)
			continue
		}
		if strings.HasSuffix(name, ".log") || strings.HasSuffix(name, ".sst") {
			sig = append(sig, name)
			continue
		}
		info, err := e.Info()
		if err != nil {
			return nil, err
		}
		sig = append(sig, fmt.Sprintf("%s %d", name, info.Size()))
	}
	return sig, nil
}

func copyGeneration(stateDir, gen string, reserve int64) (string, error) {
	before, err := signature(gen)
	if err != nil {
		return "", err
	}
	removeStaleCopies(stateDir)
	linked, whole, err := copyCost(gen)
	if err != nil {
		return "", fmt.Errorf("copy state: %w", err)
	}
	inState, err := copyFits(stateDir, linked, reserve)
	if err != nil {
		return "", err
	}
	var tmp string
	err = errNoRoomHere
	if inState {
		tmp, err = os.MkdirTemp(stateDir, ".replay-")
	}
	link := err == nil
	if link {
		if copyDirMade != nil {
			copyDirMade(tmp)
		}
		if err := lockCopy(tmp); err != nil {
			// Another process's remover took it between the mkdir and the flock: it is the
			// remover's to remove. Nothing was written in it; another one is made.
			return "", err
		}
	}
	if err != nil {
		if err := tempFits(stateDir, linked, whole, reserve, inState); err != nil {
			return "", err
		}
		if tmp, err = os.MkdirTemp("", tempCopyPrefix); err != nil {
			// Not wrapped: a TMPDIR that does not exist is not a generation removed by a swap, to be
			// retried as if the store moved.
			return "", fmt.Errorf("copy state: the copy of %s cannot go beside it, and TMPDIR %s cannot take it (%v): point TMPDIR at a writable directory on another disk", stateDir, os.TempDir(), err)
		}
		if copyDirMade != nil {
			copyDirMade(tmp)
		}
		// Held as a copy beside the state dir is: a killed reader's is removed by the next one.
		if err := lockCopy(tmp); err != nil {
			return "", err
		}
	}
	fail := func(err error) (string, error) {
		RemoveCopy(tmp)
		return "", err
	}
	entries, err := os.ReadDir(gen)
	if err != nil {
		return fail(err)
	}
	// Metadata first, then the tables it names, then the WALs.
	slices.SortFunc(entries, func(a, b os.DirEntry) int { return copyOrder(a.Name()) - copyOrder(b.Name()) })
	for _, e := range entries {
		name := e.Name()
		if name == "LOCK" || name == probeName || e.IsDir() { // the probe comes and goes (space.go)
			continue
		}
		src, dst := filepath.Join(gen, name), filepath.Join(tmp, name)
		if strings.HasSuffix(name, ".sst") && link {
			if err := os.Link(src, dst); err == nil {
				continue
			} else if errors.Is(err, os.ErrNotExist) {
				return fail(err)
			}
		}
		if err := copyFile(src, dst); err != nil {
			return fail(err)
		}
	}
	after, err := signature(gen)
	if err != nil {
		return fail(err)
	}
	if !slices.Equal(before, after) {
		return fail(errCopyMoved)
	}
	// Open makes a fresh store in a directory without one: a generation without a manifest would be
	// read as a projection of empty buckets. CURRENT never names one before Open has made it.
	if !slices.ContainsFunc(before, func(f string) bool { return strings.HasPrefix(f, "MANIFEST-") }) {
		return fail(fmt.Errorf("%w: the current generation %s holds no store (run `mesh-provisioner rebuild`)", ErrCorrupt, gen))
	}
	return tmp, nil
}

var errNoRoomHere = errors.New("store: no room for the copy in the state dir")

// copyCost is what a copy of the generation gen costs on disk, opened: linked beside the state dir
// (its tables hard-linked), whole elsewhere (its tables copied). What is copied besides the tables
// (WALs, up to two memtables, MANIFEST, OPTIONS) counts twice, since opening the copy flushes the WALs
// it replays into a table and writes a new manifest; and the new WAL the open makes, which Pebble
// preallocates to 110% of the memtable (db.go walPreallocateSize), with 1 MiB for what else it writes.
func copyCost(gen string) (linked, whole int64, err error) {
	entries, err := os.ReadDir(gen)
	if err != nil {
		return 0, 0, err
	}
	var tables, rest int64
	for _, e := range entries {
		if e.Name() == "LOCK" || e.Name() == probeName || e.IsDir() {
			continue
		}
		info, err := e.Info()
		if errors.Is(err, os.ErrNotExist) {
			continue // removed by a compaction: the signature check makes the copy again
		}
		if err != nil {
			return 0, 0, err
		}
		if strings.HasSuffix(e.Name(), ".sst") {
			tables += info.Size()
		} else {
			rest += info.Size()
		}
	}
	linked = 2*rest + CopyMemTableSize + CopyMemTableSize/10 + 1<<20
	return linked, linked + tables, nil
}

// diskFree is what statfs says dir's file system has free, and its device; ok is false when it
// cannot say.
var diskFree = func(dir string) (free int64, dev uint64, ok bool) {
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
		return 0, 0, false
	}
	var fi syscall.Stat_t
	if err := syscall.Stat(dir, &fi); err != nil {
		return 0, 0, false
	}
	return int64(st.Bavail) * int64(st.Bsize), uint64(fi.Dev), true
}

// copyFits says whether a copy costing cost fits in the state dir leaving reserve free. A state dir
// that is not writable is left to MkdirTemp to find out (the copy goes to the temporary directory).
func copyFits(stateDir string, cost, reserve int64) (bool, error) {
	free, _, ok := diskFree(stateDir)
	if !ok || reserve < 0 {
		return true, nil
	}
	return free-cost >= reserve, nil
}

// tempFits says why the system's temporary directory cannot take a whole copy, or nil when it can:
// on the state dir's disk it must leave the seat's reserve free too.
func tempFits(stateDir string, linked, whole, reserve int64, stateHadRoom bool) error {
	tmp := os.TempDir()
	free, dev, ok := diskFree(tmp)
	if !ok {
		return nil
	}
	need := whole
	if sfree, sdev, sok := diskFree(stateDir); sok && sdev == dev && reserve > 0 {
		need += reserve
		if !stateHadRoom {
			return fmt.Errorf("%w: a copy of %s to read it needs %d MiB (its WALs and manifest, copied and replayed) and its disk has %d MiB free, below the %d MiB the seat keeps free there, and %s is on the same disk: free space on that disk, or point TMPDIR at another disk with %d MiB free (the copy's tables are copied there too)",
				ErrNoSpace, stateDir, mib(linked), mib(sfree), mib(reserve), tmp, mib(whole))
		}
	}
	if free < need {
		why := "it is not writable"
		if !stateHadRoom {
			why = fmt.Sprintf("it would take its disk below the %d MiB the seat keeps free there", mib(reserve))
		}
		return fmt.Errorf("%w: a copy of %s to read it cannot go beside it (%s) and needs %d MiB in %s, which has %d MiB free: free space there, or point TMPDIR at another disk with %d MiB free",
			ErrNoSpace, stateDir, why, mib(need), tmp, mib(free), mib(whole))
	}
	return nil
}

// mib rounds up to whole MiB, so that a need is never said as 0.
func mib(n int64) int64 { return (n + 1<<20 - 1) >> 20 }

func copyOrder(name string) int {
	switch {
	case strings.HasSuffix(name, ".sst"):
		return 1
	case strings.HasSuffix(name, ".log"):
		return 2
	}
	return 0
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.Create(dst)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// copyLocks hold a flock on each copy this process made in a state dir, for as long as it is used:
// a copy nobody holds is a leftover of a reader that was killed (a second Ctrl-C, a kill, an OOM),
// and removeStaleCopies removes it. Left, each kept hard links to tables the seat has since
// compacted away, and copies of its WALs, on the state dir's disk for good.
var copyLocks = struct {
	sync.Mutex
	m map[string]*os.File
}{m: map[string]*os.File{}}

// copyDirMade, when set (tests), is called with each copy's directory once made, before it is held.
var copyDirMade func(dir string)

// lockCopy takes the flock that says dir, a copy, is in use by this process, before anything is
// written in it. A remover (removeStaleCopies) may take a new copy's flock in the moment after its
// mkdir: the copy is then the remover's, and lockCopy says errCopyTaken (or os.ErrNotExist once
// removed), for CopyCurrent to make another; without the lock the copy was read unheld, removed under
// its reader by the next remover, or emptied file by file as it was made by the one holding it. A
// file system without flock leaves the copy unheld: no remover can take it there either.
func lockCopy(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("copy state: %w", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return errCopyTaken
		}
		return nil
	}
	copyLocks.Lock()
	copyLocks.m[dir] = f
	copyLocks.Unlock()
	return nil
}

// RemoveCopy removes a copy CopyCurrent made, and releases its lock.
func RemoveCopy(dir string) error {
	err := os.RemoveAll(dir)
	copyLocks.Lock()
	f := copyLocks.m[dir]
	delete(copyLocks.m, dir)
	copyLocks.Unlock()
	if f != nil {
		f.Close()
	}
	return err
}

// tempCopyPrefix names a copy in the system's temporary directory; it is not the prefix of the stores
// replay fills from the streams (tempStorePrefix), which MakeTempStore holds and removes alike.
const tempCopyPrefix = "mesh-provisioner-copy-"

// tempStorePrefix names a temporary store replay fills from the streams or an archive (MakeTempStore).
// Older binaries named theirs mesh-provisioner-replay-* and held no flock: a prefix of its own keeps
// the sweep (removeStale) off the store of an older replay still running beside a newer one.
const tempStorePrefix = "mesh-provisioner-read-"

// MakeTempStore makes an empty directory for a temporary store in the system's temporary directory,
// held by this process as a copy is (lockCopy) until RemoveCopy. It first removes the ones no process
// holds: left by a reader that was killed, or that stopped while a write of its store waited for room
// (replay's closeUnlessHeld), each of them on a disk that may be full.
func MakeTempStore() (string, error) {
	removeStale(os.TempDir(), tempStorePrefix)
	for {
		dir, err := os.MkdirTemp("", tempStorePrefix)
		if err != nil {
			return "", fmt.Errorf("temporary store: %w", err)
		}
		err = lockCopy(dir)
		if errors.Is(err, errCopyTaken) || errors.Is(err, os.ErrNotExist) {
			continue // another reader's removal took it as it was made: it removes it
		}
		if err != nil {
			os.RemoveAll(dir)
			return "", fmt.Errorf("temporary store: %w", err)
		}
		return dir, nil
	}
}

// removeStaleCopies removes the copies in stateDir, and in the system's temporary directory, that no
// process holds (lockCopy): those of readers that were killed before they removed them. A copy held
// by a reader still running, of this state dir or another sharing the temporary directory, is left
// alone.
func removeStaleCopies(stateDir string) {
	removeStale(stateDir, ".replay-")
	removeStale(os.TempDir(), tempCopyPrefix)
}

func removeStale(parent, prefix string) {
	entries, err := os.ReadDir(parent)
	if err != nil {
		return
	}
	for _, e := range entries {
		if !e.IsDir() || !strings.HasPrefix(e.Name(), prefix) {
			continue
		}
		dir := filepath.Join(parent, e.Name())
		f, err := os.Open(dir)
		if err != nil {
			continue
		}
		if syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB) == nil {
			os.RemoveAll(dir)
		}
		f.Close()
	}
}
