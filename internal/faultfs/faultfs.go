// Package faultfs makes the real disk fail writes, for tests of a full or failing state dir: the files
// and Pebble stay real (pebble's errorfs around vfs.Default), and only the writes chosen fail.
package faultfs

import (
	"fmt"
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
func FullOnceLogged(t testing.TB, log fmt.Stringer, line string) (fs vfs.FS, room *atomic.Bool) {
	var full atomic.Bool
	room = new(atomic.Bool)
	t.Cleanup(func() { room.Store(true) })
	return Writes(func() bool {
		if room.Load() {
			return false
		}
		if !full.Load() && strings.Contains(log.String(), line) {
			full.Store(true)
		}
		return full.Load()
	}, syscall.ENOSPC), room
}

// Syncs wraps the disk so that a sync of a file (Sync, SyncData, SyncTo) fails with err whenever fail,
// asked at each sync, reports true; writes go through. A full disk that shows on fsync, not on write
// (NFS, thin volumes).
func Syncs(fail func() bool, err error) vfs.FS {
	return errorfs.Wrap(vfs.Default, errorfs.InjectorFunc(func(op errorfs.Op) error {
		switch op.Kind {
		case errorfs.OpFileSync, errorfs.OpFileSyncData, errorfs.OpFileSyncTo:
			if fail() {
				return err
			}
		}
		return nil
	}))
}
