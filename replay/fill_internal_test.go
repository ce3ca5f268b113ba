package replay

import (
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// SetFillGiveUp sets how long Fill waits on a stream it cannot read, and returns the undo.
func SetFillGiveUp(d time.Duration) func() {
	old := fillGiveUp
	fillGiveUp = d
	return func() { fillGiveUp = old }
}

// DropPlans removes the temporary store of plans a Log keeps, without closing the Log's store: for
// tests that make a Log of a store they go on using (it would otherwise stay in the system's
// temporary directory). The Log keeps none from then on.
func DropPlans(l *Log) { l.plans.close() }

// SetOfflineFS makes the temporary stores of FromNATS and FromArchive write through fs, and returns
// the undo.
func SetOfflineFS(fs vfs.FS) func() {
	old := offlineOptions.FS
	offlineOptions.FS = fs
	return func() { offlineOptions.FS = old }
}

// SetExportPullBytes bounds the pulls of an export to n bytes (exportPullBytes), and returns the undo.
func SetExportPullBytes(n int) func() {
	old := exportPullBytes
	exportPullBytes = n
	return func() { exportPullBytes = old }
}
