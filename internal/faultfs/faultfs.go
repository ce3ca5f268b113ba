// Package faultfs makes the real disk fail writes, for tests of a full or failing state dir: the files
// and Pebble stay real (pebble's errorfs around vfs.Default), and only the writes chosen fail.
package faultfs

import (
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
