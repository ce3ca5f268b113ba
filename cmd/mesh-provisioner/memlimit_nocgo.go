//go:build !cgo

package main

import (
	"os"
	"runtime/debug"
)

// nocgoMemoryLimit is the Go runtime's soft memory limit of a binary built without cgo (deploy/Dockerfile),
// where Pebble's cache (256 MiB as Pebble counts it: blocks and memtables) is allocated in the Go heap and
// the garbage collector's goal of twice the live heap counts it: at 1,000,000 keys such a seat peaked at
// 473 MiB RSS during ingest and 632 MiB after a restart that walked every index and took writes
// (docs/performance.md, Session 17). 340 MiB of Go memory plus the binary's 31 MiB keeps issue 7's 400 MB.
// GOMEMLIMIT in the environment rules over it.
const nocgoMemoryLimit = 340 << 20

func init() {
	if os.Getenv("GOMEMLIMIT") == "" {
		debug.SetMemoryLimit(nocgoMemoryLimit)
	}
}
