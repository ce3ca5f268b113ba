// Package faultfs makes the real disk fail writes, for tests of a full or failing state dir: the files
// and Pebble stay real (pebble's errorfs around vfs.Default), and only the writes chosen fail.
package faultfs

import (
	"fmt"
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
