// Package faultfs makes the real disk fail writes, for tests of a full or failing state dir: the files
// and Pebble stay real (pebble's errorfs around vfs.Default), and only the writes chosen fail.
package faultfs

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"
)

// Writes wraps the disk so that a write (a close is none) fails with err whenever fail, asked at each
// write, reports true.
func Writes(fail func() bool, err error) vfs.FS {
	return errorfs.Wrap(vfs.Default, errorfs.InjectorFunc(func(op errorfs.Op) error {
		if op.Kind.ReadOrWrite() == errorfs.OpIsWrite && op.Kind != errorfs.OpFileClose && fail() {
			return err
		}
		return nil
	}))
}

// FullOnceLogged wraps the disk so that, once log holds line (a test's log buffer, asked at each
// write: "rebuild started" fills the disk under a rebuild's new generation), every write fails with
// ENOSPC until room is set; the test's cleanup sets it, so that a stop that waits for room ends.
// Syncs go through: a sync that finds the disk full is a failure Pebble does not retry, by design
// (Syncs tests it), and a sync that fell after the line made the tests of held writes fail at random.
func FullOnceLogged(t testing.TB, log fmt.Stringer, line string) (fs vfs.FS, room *atomic.Bool) {
	return fullOnceLogged(t, log, line, false)
}

// FullOnceLoggedButProbe is FullOnceLogged, but the store's test writes (its ROOM-PROBE file) go
// through until a write of another file has failed: the disk fills between the store's look before
// an open and Pebble's first write.
func FullOnceLoggedButProbe(t testing.TB, log fmt.Stringer, line string) (fs vfs.FS, room *atomic.Bool) {
	return fullOnceLogged(t, log, line, true)
}

func fullOnceLogged(t testing.TB, log fmt.Stringer, line string, probe bool) (vfs.FS, *atomic.Bool) {
	var full, refused atomic.Bool
	room := new(atomic.Bool)
	t.Cleanup(func() { room.Store(true) })
	return errorfs.Wrap(vfs.Default, errorfs.InjectorFunc(func(op errorfs.Op) error {
		if op.Kind.ReadOrWrite() != errorfs.OpIsWrite || op.Kind == errorfs.OpFileClose || isSync(op.Kind) || room.Load() {
			return nil
		}
		isProbe := filepath.Base(op.Path) == "ROOM-PROBE"
		if probe && isProbe && !refused.Load() {
			return nil
		}
		if !full.Load() && strings.Contains(log.String(), line) {
			full.Store(true)
		}
		if !full.Load() {
			return nil
		}
		if !isProbe {
			refused.Store(true)
		}
		return syscall.ENOSPC
	})), room
}

// Syncs wraps the disk so that a sync of a file (Sync, SyncData, SyncTo) fails with err whenever fail,
// asked at each sync, reports true; writes go through. A full disk that shows on fsync, not on write
// (NFS, thin volumes).
func Syncs(fail func() bool, err error) vfs.FS {
	return errorfs.Wrap(vfs.Default, errorfs.InjectorFunc(func(op errorfs.Op) error {
		if isSync(op.Kind) && fail() {
			return err
		}
		return nil
	}))
}

// isSync reports whether op is a sync of a file.
func isSync(k errorfs.OpKind) bool {
	return k == errorfs.OpFileSync || k == errorfs.OpFileSyncData || k == errorfs.OpFileSyncTo
}

// Tmpfs mounts a tmpfs of size bytes on a new directory, unmounted at cleanup; it skips the test when
// this process may not mount. A disk whose room statfs says truly: the store's reserve checks read it.
func Tmpfs(t testing.TB, size int) string {
	dir, err := TryTmpfs(t, size)
	if err != nil {
		t.Skipf("cannot mount a tmpfs here (%v): this case needs mount privileges", err)
	}
	return dir
}

// TryTmpfs is Tmpfs for a test that can also run on the shared disk, less steadily: when this process
// may not mount, it returns a new directory there and the mount's error.
func TryTmpfs(t testing.TB, size int) (string, error) {
	dir := t.TempDir()
	if err := syscall.Mount("tmpfs", dir, "tmpfs", 0, fmt.Sprintf("size=%d", size)); err != nil {
		return dir, err
	}
	t.Cleanup(func() {
		if err := syscall.Unmount(dir, syscall.MNT_DETACH); err != nil {
			t.Errorf("unmount %s: %v", dir, err)
		}
	})
	return dir, nil
}

// FilesGrown is "full" once the files its Glob matches hold Min bytes, "" before: a line for
// FullOnceLogged to wait for, so that the disk fills in the middle of a fill, after the open's look at
// its room. Pebble's logs ("gen-*/*.log") grow with every commit; a store without a log (a rebuild's
// generation, store.Options.NoWAL) writes only tables ("gen-*/*.sst"), as its memtables flush.
type FilesGrown struct {
	Glob string
	Min  int64
}

func (w FilesGrown) String() string {
	logs, _ := filepath.Glob(w.Glob)
	var n int64
	for _, l := range logs {
		if fi, err := os.Stat(l); err == nil {
			n += fi.Size()
		}
	}
	if n >= w.Min {
		return "full"
	}
	return ""
}

// FillTo writes the file path until its disk has at most leave bytes free.
func FillTo(t testing.TB, path string, leave int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 1<<20)
	for {
		var st syscall.Statfs_t
		if err := syscall.Statfs(filepath.Dir(path), &st); err != nil {
			t.Fatal(err)
		}
		free := int64(st.Bavail) * st.Bsize
		if free <= leave {
			return
		}
		if _, err := f.Write(buf[:min(int64(len(buf)), free-leave)]); err != nil {
			return // full
		}
	}
}

// NoDescriptors wraps the disk so that a file Pebble creates whose name ends in suffix (".sst" a
// table, ".log" a write-ahead log) fails with EMFILE while out is set, as in a process out of
// descriptors; every other operation goes through.
func NoDescriptors(suffix string, out *atomic.Bool) vfs.FS {
	return noDescriptors{vfs.Default, suffix, out, false}
}

// NoDescriptorsToRead wraps the disk so that opening an existing file whose name ends in suffix
// (".sst": a table a read opens into Pebble's table cache) fails with EMFILE while out is set; every
// other operation goes through.
func NoDescriptorsToRead(suffix string, out *atomic.Bool) vfs.FS {
	return noDescriptors{vfs.Default, suffix, out, true}
}

type noDescriptors struct {
	vfs.FS
	suffix string
	out    *atomic.Bool
	reads  bool // opens of existing files fail, not creates
}

// fails is the error of a create (reads false) or an open (reads true) of name, or nil.
func (fs noDescriptors) fails(name string, reads bool) error {
	if reads == fs.reads && fs.out.Load() && strings.HasSuffix(name, fs.suffix) {
		return &os.PathError{Op: "open", Path: name, Err: syscall.EMFILE}
	}
	return nil
}

func (fs noDescriptors) Create(name string, c vfs.DiskWriteCategory) (vfs.File, error) {
	if err := fs.fails(name, false); err != nil {
		return nil, err
	}
	return fs.FS.Create(name, c)
}

func (fs noDescriptors) Open(name string, opts ...vfs.OpenOption) (vfs.File, error) {
	if err := fs.fails(name, true); err != nil {
		return nil, err
	}
	return fs.FS.Open(name, opts...)
}
