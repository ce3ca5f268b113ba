package replay

import (
	"sync"

	provisioner "github.com/novox/mesh-provisioner"
)

// An answer with at carries the anomalies of its bucket as of the point, narrowed by node, and how
// many they are: the log keeps no anomaly rows, so they are derived from every key of the state (of
// the node's keys when narrowed), and counting them read the whole state on every page. A walk of a
// node's 20,000 needs at limit 100 cost 13.6 ms a page, twice the 3.8 ms of a node of 5,000, and a
// walk of a module at 100,000 keys 59 ms a page for 100 rows. The state as of a point the log can
// rebuild never changes (trims keep every point from the floor on, and a point they pass is refused
// before this is read), so the anomalies of a point are derived once and kept for the pages after
// it, in a small cache: its first page reads the state, the next ones what they list.

// anomalyCacheSize is how many answers' anomalies the cache keeps: each holds at most
// query.MaxAnomalies rows.
const anomalyCacheSize = 8

// anomalyKey is what the anomalies of a state depend on: the store read (a rebuild makes another,
// whose sequences may be of a recreated stream), the bucket, the point, the registry's kinds as of
// the moment (their sequence), and the node narrowed by.
type anomalyKey struct {
	store       uint64 // store.DB.ID
	rewrites    uint64 // store.View.Rewrites: an expired put's event left the log since
	bucket      string
	seq         uint64
	registrySeq uint64
	node        string
}

type anomalyEntry struct {
	key   anomalyKey
	total int64
	rows  []provisioner.Anomaly // the first of them, as many as the answer that derived them listed
}

// anomalyCache keeps the anomalies of the last few states answered, newest first.
type anomalyCache struct {
	mu      sync.Mutex
	entries []*anomalyEntry
}

// get returns the anomalies of a state when kept, and at least max of its rows (or all of them).
func (c *anomalyCache) get(k anomalyKey, max int) (*anomalyEntry, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, e := range c.entries {
		if e.key == k && (len(e.rows) >= max || int64(len(e.rows)) == e.total) {
			copy(c.entries[1:i+1], c.entries[:i])
			c.entries[0] = e
			return e, true
		}
	}
	return nil, false
}

func (c *anomalyCache) put(e *anomalyEntry) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, old := range c.entries {
		if old.key == e.key {
			c.entries = append(c.entries[:i], c.entries[i+1:]...)
			break
		}
	}
	if len(c.entries) == anomalyCacheSize {
		c.entries = c.entries[:anomalyCacheSize-1]
	}
	c.entries = append([]*anomalyEntry{e}, c.entries...)
}
