package store

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/vfs"
)

// ErrLocked is returned when another process holds the state dir.
var ErrLocked = errors.New("store: state dir is in use by another process")

// ErrNoCurrent marks a state dir whose CURRENT is missing, unreadable or names a generation that is
// gone, beside two or more generations that each hold a store: which one was in use cannot be told
// (the other is a rebuild that did not finish, or one a swap replaced), so none is opened and none is
// removed. The operator names the one to keep in CURRENT, or runs `mesh-provisioner rebuild`.
var ErrNoCurrent = errors.New("store: state dir has no CURRENT")

// StateDir is the --state directory: a LOCK file held with flock for as long as a process uses it, a
// CURRENT file naming the generation in use, and one Pebble directory per generation (gen-000001, ...).
// A rebuild fills a new generation beside the current one and swaps CURRENT to it with an atomic
// rename, so a crash at any point leaves a state dir whose CURRENT names a generation that opens.
type StateDir struct {
	path string
	lock *os.File
	log  *slog.Logger // says every generation removed (RemoveGeneration); nil is slog.Default
}

const (
	lockName    = "LOCK"
	currentName = "CURRENT"
	genPrefix   = "gen-"
)

// LockState creates the state dir when it does not exist and takes its lock, waiting at most
// lockGrace for it.
func LockState(path string) (*StateDir, error) {
	if err := os.MkdirAll(path, 0o755); err != nil {
		return nil, fmt.Errorf("create state dir: %w", orAccess(path, err))
	}
	f, err := os.OpenFile(filepath.Join(path, lockName), os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open state dir lock: %w", orAccess(path, err))
	}
	if err := Flock(f); err != nil {
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, fmt.Errorf("%w: %s (stop the other mesh-provisioner, or give this one another --state)", ErrLocked, path)
		}
		return nil, fmt.Errorf("lock state dir: %w", orAccess(path, err))
	}
	_ = f.Truncate(0)
	_, _ = fmt.Fprintf(f, "%d\n", os.Getpid())
	return &StateDir{path: path, lock: f}, nil
}

// A flock belongs to the open file, which a child process this one forks shares from its fork to its
// exec (Go's descriptors are close-on-exec, so no longer): a lock released here, in a process that
// starts others, can stay taken for that long, which a loaded machine makes milliseconds (a store
// closed and opened again in one process, as the tests do beside others that start the binary, was
// refused as "in use by another process"). A lock still taken after lockGrace is another process's.
const (
	lockGrace = 250 * time.Millisecond
	lockRetry = 10 * time.Millisecond
)

// Flock takes an exclusive flock of f, waiting at most lockGrace for it: syscall.EWOULDBLOCK when
// another process holds it.
func Flock(f *os.File) error {
	err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
	for waited := time.Duration(0); errors.Is(err, syscall.EWOULDBLOCK) && waited < lockGrace; waited += lockRetry {
		time.Sleep(lockRetry)
		err = syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
	}
	return err
}

// ErrNotStateDir marks a --state that holds files of its own and no state dir: most likely the parent
// of the one meant.
var ErrNotStateDir = errors.New("store: not a state dir")

// CheckStateDir refuses a file, and a directory that holds other files and no state dir, before anything
// is written in it: a rebuild or a serve there fills a second state dir beside the seat's. A state dir is
// known by a generation (gen-*) or a CURRENT that names one; a CURRENT or LOCK alone is not enough, since
// LevelDB, RocksDB and older Pebble directories hold both, and the start over of a state dir this binary
// cannot read rewrote that CURRENT, breaking the other program's database. A state dir that does not
// exist yet, an empty one, one holding only lost+found (the root of a volume of its own), and one
// holding only what a first start writes before its generation (LOCK, CURRENT) are fine. When a
// subdirectory is a state dir, the error names it.
func CheckStateDir(path string) error {
	if fi, err := os.Stat(path); err == nil && !fi.IsDir() {
		return fmt.Errorf("%w: %s is a file, not a directory: give the state dir", ErrNotStateDir, path)
	}
	entries, err := os.ReadDir(path)
	if err != nil {
		return nil // missing: created; unreadable: LockState says why
	}
	var other []string
	current, hasCurrent := "", false
	for _, e := range entries {
		switch name := e.Name(); {
		case strings.HasPrefix(name, genPrefix):
			return nil
		case name == currentName:
			b, err := os.ReadFile(filepath.Join(path, name))
			if err != nil || strings.HasPrefix(strings.TrimSpace(string(b)), genPrefix) {
				return nil // unreadable: opening it says why
			}
			current, hasCurrent = strings.TrimSpace(string(b)), true
		case name == lockName || name == currentName+".tmp" || name == "lost+found" || strings.HasPrefix(name, ".replay-"):
			// the state dir's own, or a replay's copy (copy.go): no sign of another program's
		default:
			other = append(other, name)
		}
	}
	if len(other) == 0 {
		return nil
	}
	if hasCurrent {
		return fmt.Errorf("%w: %s holds %s and a %s naming %q, not a generation of this program's: it is another program's directory; give the seat's state dir, or a new one%s", ErrNotStateDir, path, strings.Join(other[:min(3, len(other))], ", "), currentName, current, StateDirHint(path))
	}
	return fmt.Errorf("%w: %s holds %s and no %s%s", ErrNotStateDir, path, strings.Join(other[:min(3, len(other))], ", "), currentName, StateDirHint(path))
}

// EnclosingStateDir returns the outermost directory above path (path's own directory included) that
// holds a state dir's CURRENT or LOCK, and whether there is one: a file written there is inside the
// program's state, which a rebuild replaces and an operator may delete whole.
func EnclosingStateDir(path string) (string, bool) {
	dir, err := filepath.Abs(filepath.Dir(path))
	if err != nil {
		return "", false
	}
	found := ""
	for {
		for _, name := range []string{currentName, lockName} {
			if _, err := os.Stat(filepath.Join(dir, name)); err == nil {
				found = dir
			}
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return found, found != ""
		}
		dir = parent
	}
}

// StateDirHint names a subdirectory of path that is a state dir (it holds CURRENT), or the state dir
// path is a generation of, as ": did you mean --state <it>?", or is "".
func StateDirHint(path string) string {
	if parent := filepath.Dir(filepath.Clean(path)); strings.HasPrefix(filepath.Base(filepath.Clean(path)), genPrefix) {
		if _, err := os.Stat(filepath.Join(parent, currentName)); err == nil {
			return fmt.Sprintf(": it is a generation of a state dir: did you mean --state %s?", parent)
		}
	}
	entries, err := os.ReadDir(path)
	if err != nil {
		return ""
	}
	for _, e := range entries {
		sub := filepath.Join(path, e.Name())
		if _, err := os.Stat(filepath.Join(sub, currentName)); err == nil && e.IsDir() {
			return fmt.Sprintf(": did you mean --state %s?", sub)
		}
	}
	return ""
}

// Path is the state dir.
func (s *StateDir) Path() string { return s.path }

// SetLogger gives the logger that says each generation removed; OpenState sets Options.Logger.
func (s *StateDir) SetLogger(log *slog.Logger) { s.log = log }

func (s *StateDir) logger() *slog.Logger {
	if s.log == nil {
		return slog.Default()
	}
	return s.log
}

// RemoveGeneration removes a generation's directory and logs its path and why: a generation holds the
// local event log, which the streams may no longer hold, so no removal goes unsaid. A removal that
// fails is logged as an error and returned.
func (s *StateDir) RemoveGeneration(dir, why string) error {
	log := s.logger()
	if err := os.RemoveAll(dir); err != nil {
		log.Error("could not remove a generation of the state dir", "generation", dir, "why", why, "err", err)
		return err
	}
	log.Info("removed a generation of the state dir", "generation", dir, "why", why)
	return nil
}

// Close releases the lock.
func (s *StateDir) Close() error {
	if s.lock == nil {
		return nil
	}
	err := s.lock.Close() // closing the descriptor releases the flock
	s.lock = nil
	return err
}

// Current returns the directory of the generation CURRENT names, or "" when there is none yet.
func (s *StateDir) Current() (string, error) {
	b, err := os.ReadFile(filepath.Join(s.path, currentName))
	if errors.Is(err, os.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("read %s: %w", currentName, orAccess(filepath.Join(s.path, currentName), err))
	}
	name := strings.TrimSpace(string(b))
	if !strings.HasPrefix(name, genPrefix) || strings.ContainsAny(name, `/\`) {
		return "", fmt.Errorf("%w: %s names %q", ErrCorrupt, currentName, name)
	}
	return filepath.Join(s.path, name), nil
}

// Resolve returns the directory of the current generation. It is the one CURRENT names when that
// exists; else (CURRENT missing, not naming a generation, or naming one that is gone) the only
// complete generation, with lost saying why CURRENT did not name it: the caller opens it and rewrites
// CURRENT (Swap). Two or more
// complete generations are ErrNoCurrent; none is "" with a CURRENT missing (a first start), and
// CURRENT's own error (ErrCorrupt) otherwise. A generation is complete when Pebble has made its store
// there (a manifest it names exists): one NewGeneration made and nothing opened, or whose removal was
// cut short before its manifest, is not.
func (s *StateDir) Resolve() (cur, lost string, err error) {
	cur, curErr := s.Current()
	if curErr != nil && !errors.Is(curErr, ErrCorrupt) {
		return "", "", curErr
	}
	why := ""
	switch {
	case curErr != nil:
		why = curErr.Error()
	case cur == "":
		why = currentName + " is missing"
	default:
		_, err := os.Stat(cur)
		if err == nil {
			return cur, "", nil
		}
		if !errors.Is(err, os.ErrNotExist) {
			return "", "", fmt.Errorf("current generation %s: %w", cur, orAccess(cur, err))
		}
		why = fmt.Sprintf("%s names %s, which does not exist", currentName, filepath.Base(cur))
	}
	complete, err := s.completeGenerations()
	if err != nil {
		return "", "", err
	}
	switch len(complete) {
	case 0:
		if curErr != nil {
			return "", "", curErr
		}
		if cur != "" {
			return "", "", fmt.Errorf("%w: %s (run `mesh-provisioner rebuild`)", ErrCorrupt, why)
		}
		return "", "", nil
	case 1:
		return complete[0], why, nil
	}
	names := make([]string, len(complete))
	for i, g := range complete {
		names[i] = filepath.Base(g)
	}
	return "", "", fmt.Errorf("%w: %s: %s, and it holds %d generations (%s): which one was in use cannot be told, so none is opened or removed; write the one to keep into %s (echo %s > %s), or run `mesh-provisioner rebuild` to build a new one from the streams (it replaces them all)",
		ErrNoCurrent, s.path, why, len(names), strings.Join(names, ", "), filepath.Join(s.path, currentName), names[len(names)-1], filepath.Join(s.path, currentName))
}

// completeGenerations lists the generations in which Pebble has made a store, oldest first.
func (s *StateDir) completeGenerations() ([]string, error) {
	gens, err := s.generations()
	if err != nil {
		return nil, err
	}
	var out []string
	for _, n := range gens {
		dir := filepath.Join(s.path, fmt.Sprintf("%s%06d", genPrefix, n))
		desc, err := pebble.Peek(dir, vfs.Default)
		if a := accessErr(dir, err); a != nil {
			return nil, a
		}
		if err != nil || !desc.Exists {
			continue
		}
		if _, err := os.Stat(desc.ManifestFilename); err == nil {
			out = append(out, dir)
		}
	}
	return out, nil
}

// NewGeneration creates an empty directory for the next generation and returns it.
func (s *StateDir) NewGeneration() (string, error) {
	gens, err := s.generations()
	if err != nil {
		return "", err
	}
	n := 1
	if len(gens) > 0 {
		n = gens[len(gens)-1] + 1
	}
	dir := filepath.Join(s.path, fmt.Sprintf("%s%06d", genPrefix, n))
	if err := os.Mkdir(dir, 0o755); err != nil {
		return "", fmt.Errorf("create generation: %w", err)
	}
	return dir, nil
}

// Swap makes dir the current generation with an atomic rename of CURRENT, then removes every other
// generation.
func (s *StateDir) Swap(dir string) error {
	tmp := filepath.Join(s.path, currentName+".tmp")
	f, err := os.Create(tmp)
	if err != nil {
		return fmt.Errorf("swap generation: %w", err)
	}
	if _, err := fmt.Fprintln(f, filepath.Base(dir)); err != nil {
		f.Close()
		return fmt.Errorf("swap generation: %w", err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return fmt.Errorf("swap generation: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("swap generation: %w", err)
	}
	if err := os.Rename(tmp, filepath.Join(s.path, currentName)); err != nil {
		return fmt.Errorf("swap generation: %w", err)
	}
	if err := syncDir(s.path); err != nil {
		return fmt.Errorf("swap generation: %w", err)
	}
	return s.RemoveOthers(dir, "replaced by "+filepath.Base(dir)+", which CURRENT names now")
}

// RemoveOthers removes every generation but keep, logging each with why: leftovers of a rebuild that
// did not finish, and generations a swap replaced; and the copies of killed readers
// (removeStaleCopies).
func (s *StateDir) RemoveOthers(keep, why string) error {
	removeStaleCopies(s.path)
	entries, err := os.ReadDir(s.path)
	if err != nil {
		return fmt.Errorf("list state dir: %w", err)
	}
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), genPrefix) || e.Name() == filepath.Base(keep) {
			continue
		}
		if err := s.RemoveGeneration(filepath.Join(s.path, e.Name()), why); err != nil {
			return fmt.Errorf("remove old generation: %w", err)
		}
	}
	return nil
}

func (s *StateDir) generations() ([]int, error) {
	entries, err := os.ReadDir(s.path)
	if err != nil {
		return nil, fmt.Errorf("list state dir: %w", orAccess(s.path, err))
	}
	var gens []int
	for _, e := range entries {
		if n, err := strconv.Atoi(strings.TrimPrefix(e.Name(), genPrefix)); err == nil && strings.HasPrefix(e.Name(), genPrefix) {
			gens = append(gens, n)
		}
	}
	sort.Ints(gens)
	return gens, nil
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
