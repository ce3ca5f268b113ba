package store

import "github.com/cockroachdb/pebble/v2"

// PebbleMetrics returns Pebble's own figures (disk use, compactions, block cache), or ErrClosed once
// the store is closed. The owner must stop asking before it closes the store: the check and Close are
// not atomic.
func (db *DB) PebbleMetrics() (*pebble.Metrics, error) {
	if db.closed.Load() {
		return nil, ErrClosed
	}
	return db.pdb.Metrics(), nil
}
