package store

import (
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// ErrNoSpace marks a state dir that has too little room left (or has become read-only) to take the
// next batch: the answer is to free space; applying resumes by itself once there is.
var ErrNoSpace = errors.New("store: no room to write in the state dir")

// A full disk is not an error Pebble can come back from: when its log cannot be written or rotated
// it panics inside its commit pipeline (pebble v2.1.7 db.go commitWrite, rotateWAL; a failed sync
// ends in Logger.Fatalf), a MANIFEST it cannot write is fatal too (version_set.go), and a flush that
// fails is retried at once, forever. So the store does two things.
//
// It stops writing before the disk is full: Apply refuses a batch with ErrNoSpace while less than
// Options.MinFreeBytes is free on the state dir's file system, or while that file system is
// read-only, and the projector retries it with backoff, answering meanwhile from what is committed
// (not synced).
//
// And when a write of Pebble's finds the disk full all the same (another process filled it between
// the check and the commit, a compaction wrote more than the reserve), it never reaches Pebble:
// Pebble writes through vfs.OnDiskFull, whose callback (waitForRoom) holds every write of the store
// until the state dir has room again, and then lets the write that failed be retried. Meanwhile
// reads go on, the bucket whose batch is held answers synced: false, and every other batch is
// refused with ErrNoSpace as above. Nothing is lost either way: a batch carries its checkpoint, so
// what was not written is read again from the stream.
//
// Either way the store logs once that it is out of room, with the state dir and what to do, and once
// that it has room again; the projector does not log each bucket's refusal.

// stRdonly is ST_RDONLY (Linux) and MNT_RDONLY (BSDs, macOS) in statfs flags.
const stRdonly = 0x1

// defaultMinFree is the room kept free when Options.MinFreeBytes is 0: two memtables (a flush writes
// one out while the next fills, and the log holds as much) and room for a compaction's output.
func defaultMinFree(memTable uint64) int64 { return 2*int64(memTable) + 32<<20 }

// Reserve is the room a store opened with o keeps free on its file system: MinFreeBytes, or its
// default for the memtable size; negative: none.
func (o Options) Reserve() int64 {
	if o.MinFreeBytes != 0 {
		return o.MinFreeBytes
	}
	mt := o.MemTableSize
	if mt == 0 {
		mt = 64 << 20
	}
	return defaultMinFree(mt)
}

// probeName is the file waitForRoom writes to learn whether the state dir takes writes again. Pebble
// leaves files it does not know alone.
const probeName = "ROOM-PROBE"

// roomPollMax is the longest waitForRoom waits between two looks.
const roomPollMax = time.Second

// space is what the store knows of the room on its state dir's file system.
type space struct {
	dir     string
	fs      vfs.FS // the file system under Pebble's, which the probe writes to
	minFree int64  // negative: no check
	log     *slog.Logger

	// held counts the writes of Pebble held in waitForRoom (at most one: the callback runs once per
	// full disk, and holds the others).
	held atomic.Int32
	// onHold is called when a write of Pebble's is held: it marks the bucket applying not synced.
	onHold atomic.Pointer[func()]

	mu    sync.Mutex
	full  bool      // said out of room, not yet said room again
	since time.Time // when it was said
	why   error     // what was said: a batch refused, or a write found the disk full (RoomErr)
}

func newSpace(dir string, fs vfs.FS, minFree int64, log *slog.Logger) *space {
	return &space{dir: dir, fs: fs, minFree: minFree, log: log}
}

// check returns ErrNoSpace while a write of Pebble's is held, or while the state dir's file system is
// read-only or has less than the reserve free, with then saying what follows once there is room. A
// file system it cannot ask is let through: Pebble says what is wrong then.
func (s *space) check(then string) error {
	if s.held.Load() > 0 {
		return fmt.Errorf("%w: %s: the disk was full and writes wait for room: free space on that disk (or give --state a larger one); %s", ErrNoSpace, s.dir, then)
	}
	if err := s.room(then); err != nil {
		s.enter(err)
		return err
	}
	s.leave()
	return nil
}

// room is check without the held writes and without a word in the log.
func (s *space) room(then string) error {
	if s.minFree < 0 {
		return nil
	}
	var st syscall.Statfs_t
	if err := syscall.Statfs(s.dir, &st); err != nil {
		return nil
	}
	if int64(st.Flags)&stRdonly != 0 {
		return fmt.Errorf("%w: %s is on a read-only file system: make it writable; %s", ErrNoSpace, s.dir, then)
	}
	free := int64(st.Bavail) * int64(st.Bsize)
	if free < s.minFree {
		return fmt.Errorf("%w: %d MiB free in %s, below the %d MiB kept for Pebble's log, flushes and compactions: free space on that disk (or give --state a larger one); %s",
			ErrNoSpace, free>>20, s.dir, s.minFree>>20, then)
	}
	return nil
}

// waitForRoom is Pebble's disk-full callback (vfs.OnDiskFull): a write of the store found the disk
// full. It returns once the state dir has the reserve free and takes a write again; Pebble holds
// every other write of the store meanwhile, and then retries the one that failed. It does not return
// for a stop: a write let through on a full disk would fail inside Pebble's commit pipeline, which
// panics. A stop waits for room like the write (serve stops without it: cmd/mesh-provisioner).
func (s *space) waitForRoom() {
	// The bucket is said not synced before the write counts as held: whoever sees it held (WritesHeld,
	// a stop, the stats) sees the bucket behind too.
	if f := s.onHold.Load(); f != nil {
		(*f)()
	}
	s.held.Add(1)
	defer s.held.Add(-1)
	heldIn(s.dir, 1)
	defer heldIn(s.dir, -1)
	s.enter(fmt.Errorf("%w: a write to %s failed: %v", ErrNoSpace, s.dir, syscall.ENOSPC))
	wait := 10 * time.Millisecond
	for s.room("") != nil || s.probe() != nil {
		time.Sleep(wait)
		wait = min(2*wait, roomPollMax)
	}
	s.leave()
}

// heldDirs counts the writes of Pebble held in waitForRoom by directory, for a store that is still
// opening, which no caller holds yet (WritesHeldIn).
var heldDirs = struct {
	sync.Mutex
	n map[string]int
}{n: map[string]int{}}

func heldIn(dir string, d int) {
	heldDirs.Lock()
	defer heldDirs.Unlock()
	if heldDirs.n[dir] += d; heldDirs.n[dir] <= 0 {
		delete(heldDirs.n, dir)
	}
}

// WritesHeldIn reports whether a write of a store on dir is held until there is room: DB.WritesHeld
// for a store that is still opening (Open has not returned it), whose open waits for room as a batch
// does. An open tries a write first (roomToOpen), so this is a disk that filled just after.
func WritesHeldIn(dir string) bool {
	heldDirs.Lock()
	defer heldDirs.Unlock()
	return heldDirs.n[dir] > 0
}

// probe writes a small file to the state dir, through the file system under Pebble's, and removes it.
func (s *space) probe() error {
	name := filepath.Join(s.dir, probeName)
	f, err := s.fs.Create(name, vfs.WriteCategoryUnspecified)
	if err != nil {
		return err
	}
	_, err = f.Write(make([]byte, 4096))
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if rerr := s.fs.Remove(name); err == nil {
		err = rerr
	}
	return err
}

// enter says once that the state dir is out of room.
func (s *space) enter(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.full {
		return
	}
	s.full, s.since, s.why = true, time.Now(), err
	if s.log != nil {
		s.log.Error("the state dir is out of room: applying paused, answering from what is committed", "state", s.dir, "err", err,
			"fix", "free space on that disk (or give --state a larger one); applying resumes by itself")
	}
}

// leave says once that the state dir has room again.
func (s *space) leave() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.full {
		return
	}
	s.full = false
	if s.log != nil {
		s.log.Info("the state dir has room again: applying resumes", "state", s.dir, "paused", time.Since(s.since).Round(time.Millisecond))
	}
}

// holdApplying marks the bucket whose batch is being committed not synced: a write of Pebble's is held
// until there is room, and that batch with it (space.waitForRoom). Its projector marks it synced
// again once the batch is in and it has caught up.
func (db *DB) holdApplying() {
	if b := db.applying.Load(); b != nil {
		db.SetSynced(*b, false)
	}
}

// checkRoom returns ErrNoSpace when the store cannot take a batch now (space.check).
func (db *DB) checkRoom() error { return db.space.check("applying resumes by itself") }

// OutOfRoom reports whether the store is out of room on its state dir: a write of Pebble's is held
// until there is room (waitForRoom), or a batch was refused for want of it and none was taken since.
func (db *DB) OutOfRoom() bool {
	if db.space.held.Load() > 0 {
		return true
	}
	db.space.mu.Lock()
	defer db.space.mu.Unlock()
	return db.space.full
}

// RoomErr says why the store is out of room (OutOfRoom), an ErrNoSpace naming the state dir, how much
// its disk has free against the reserve, and what to do; nil when it has room. It is what /readyz and
// the micro stats say while applying is paused for room.
func (db *DB) RoomErr() error {
	s := db.space
	if s.held.Load() > 0 {
		return fmt.Errorf("%w: writes held: a write to %s found the disk full%s: free space on that disk (or give --state a larger one); applying resumes by itself",
			ErrNoSpace, s.dir, s.freeSaid())
	}
	s.mu.Lock()
	full, why := s.full, s.why
	s.mu.Unlock()
	if !full {
		return nil
	}
	if _, ok := s.free(); !ok {
		return why
	}
	// Batches were refused below the reserve: what the disk has free now, not when the first one
	// was, which an operator freeing space would read unchanged; nothing once there is room, though
	// the next batch has not come to say so yet.
	return s.room("applying resumes by itself")
}

// freeSaid is what the state dir's file system has free against the reserve, as " (N MiB free, M MiB
// needed)", or "" when statfs cannot say. A disk that shows the reserve free and still refuses writes
// is a quota or a thin volume: said too.
func (s *space) freeSaid() string {
	free, ok := s.free()
	switch {
	case !ok || s.minFree < 0:
		return ""
	case free < s.minFree:
		return fmt.Sprintf(" (%d MiB free, %d MiB needed)", free>>20, s.minFree>>20)
	}
	return fmt.Sprintf(" (%d MiB shows free, %d MiB needed, yet writes fail with %v: a quota or a thin volume?)", free>>20, s.minFree>>20, syscall.ENOSPC)
}

// free is what statfs says the state dir's file system has free for the seat.
func (s *space) free() (int64, bool) {
	var st syscall.Statfs_t
	if err := syscall.Statfs(s.dir, &st); err != nil {
		return 0, false
	}
	return int64(st.Bavail) * int64(st.Bsize), true
}

// Room is what the state dir's file system has free (statfs) and the reserve the store keeps free on
// it (Options.MinFreeBytes, or its default; negative: none); ok is false when statfs cannot say.
func (db *DB) Room() (free, reserve int64, ok bool) {
	free, ok = db.space.free()
	return free, db.space.minFree, ok
}

// WritesHeld reports whether a write of Pebble's is held until the state dir has room: a Close, and a
// batch being committed, wait for it.
func (db *DB) WritesHeld() bool { return db.space.held.Load() > 0 }

// roomToOpen refuses to open a Pebble directory on a file system with less than minFree free, or
// that refuses a test write (probe) for want of room although statfs shows it: opening writes (a
// replayed log is flushed into a table, a new log, manifest and schema version are made), and a write
// of the open that finds the disk full waits for room (waitForRoom) where nothing can stop it, nor
// say that it waits: the open of a rebuild's new generation held so, and a stop of the seat with it.
// A probe that fails for another reason (the directory does not exist yet) is left to Pebble.
func roomToOpen(dir string, fs vfs.FS, minFree int64) error {
	s := newSpace(dir, fs, minFree, nil)
	if err := s.room("then start again"); err != nil {
		return err
	}
	if minFree < 0 {
		return nil
	}
	if err := s.probe(); errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT) {
		return fmt.Errorf("%w: a test write to %s failed: %v%s: free space on that disk (or give --state a larger one), then start again",
			ErrNoSpace, dir, err, s.freeSaid())
	}
	return nil
}

// openErr says why Pebble could not open a state dir: no room, not writable, or (anything else) a
// broken state that a rebuild replaces.
func openErr(dir string, err error) error {
	if a := accessErr(dir, err); a != nil {
		return a
	}
	switch {
	case errors.Is(err, syscall.ENOSPC):
		return fmt.Errorf("%w: open %s: %v: free space on that disk (or give --state a larger one), then start again", ErrNoSpace, dir, err)
	}
	return fmt.Errorf("%w: open %s: %v (run `mesh-provisioner rebuild`)", ErrCorrupt, dir, err)
}
