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
// directory with the .sst files copied when the state dir is not writable. A copy in the state dir is
// held with a flock from before anything is written in it (lockCopy). The caller removes it
// (RemoveCopy, which lets the flock go) when done.
func CopyCurrent(stateDir string) (string, error) {
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
		dir, err := copyGeneration(stateDir, gen)
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

func copyGeneration(stateDir, gen string) (string, error) {
	before, err := signature(gen)
	if err != nil {
		return "", err
	}
	removeStaleCopies(stateDir)
	tmp, err := os.MkdirTemp(stateDir, ".replay-")
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
		if tmp, err = os.MkdirTemp("", "mesh-provisioner-replay-"); err != nil {
			return "", fmt.Errorf("copy state: %w", err)
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

// removeStaleCopies removes the copies in stateDir that no process holds (lockCopy): those of readers
// that were killed before they removed them. A copy held by a reader still running is left alone.
func removeStaleCopies(stateDir string) {
	entries, err := os.ReadDir(stateDir)
	if err != nil {
		return
	}
	for _, e := range entries {
		if !e.IsDir() || !strings.HasPrefix(e.Name(), ".replay-") {
			continue
		}
		dir := filepath.Join(stateDir, e.Name())
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
