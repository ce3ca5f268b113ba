package store

// SetTrimBatch sets how many events a trim batch walks, for tests of the multi-batch path.
func SetTrimBatch(n int) (restore func()) {
	old := trimBatch
	trimBatch = n
	return func() { trimBatch = old }
}

// States is how many bucket states the store keeps in memory.
func (db *DB) States() int {
	db.mu.Lock()
	defer db.mu.Unlock()
	return len(db.buckets)
}
