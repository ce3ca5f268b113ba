// Package store is the projection: one Pebble database holding, for every bucket the projector tails,
// the current rows, covering secondary indexes, anomaly rows, the event log and the checkpoint.
//
// # Invariants
//
//   - Apply writes everything one batch of messages produces (rows, index entries, anomaly rows, event
//     log entries and the bucket's checkpoint) in one Pebble batch: a crash never separates a checkpoint
//     from the rows it stands for, and the checkpoint never runs ahead of them.
//   - Apply skips a message at or below the bucket's applied sequence: delivering it twice changes
//     nothing.
//   - Applies are serialised (one writer); reads go through a View, a Pebble snapshot, so one answer
//     sees one committed state, and its as_of is exactly that state's applied sequence.
//   - An anomaly row lives as long as its key: a later put that fits, or a delete, removes it.
//
// # Key layout
//
// Every key starts with one byte saying what it holds. Variable components are escaped so that byte
// order and prefixes are kept: a 0x00 byte inside a component is written 0x00 0xff, and a component
// that is followed by another ends with the terminator 0x00 0x01. A raw key at the end of a store key is
// escaped but not terminated, so a prefix of raw keys ("n1." for a node) is a prefix of store keys.
//
//	0x01 "schema"                                           -> schema version (decimal text)
//	0x02 <bucket>                                           -> checkpoint: uvarint applied seq,
//	                                                           varint stream created (Unix ns),
//	                                                           varint anomaly rows
//	0x03 <bucket> 00 01 <raw key>                           -> row
//	0x04 <bucket> 00 01 <index> <value> 00 01 <raw key>     -> row (covering index entry)
//	0x05 <bucket> 00 01 <raw key> 00 01 <class>             -> anomaly: uvarint revision, reason text
//	0x06 <bucket> 00 01 <raw key> 00 01 <seq: 8 bytes BE>   -> event: op byte, varint time, value
//	0x07 <bucket> 00 01 <seq: 8 bytes BE>                   -> raw key of the event at seq
//	0x08 'r' <node>.<module>                                -> plan row (plans.go)
//	0x08 'm' <module> 00 01 <node>.<module>                 -> (empty) plan rows by module
//	0x08 'b' <node> 00 01 <module> 00 01 <build: 8 bytes BE> -> build record: the status of the
//	                                                           build's newest composition and its
//	                                                           most recently published revision
//
// A row (and each covering index entry) is: a flags byte (bit 0: the value is one complete MessagePack
// object), uvarint revision (the stream sequence of the put), varint created (Unix ns), then the value
// as written.
//
// The secondary indexes, each one bounded range scan per lookup (provisioner.Index):
//
//	needs    'm' module, 'k' kind           (by node and node+module: a prefix of the primary rows)
//	applied  'm' module                     (by node: a prefix of the primary rows)
//	collect  'c' decoded collection name,   (by node: a prefix of the primary rows; by node+collection:
//	         't' contributor                 a prefix of raw keys inside 'c')
//
// Anomaly classes: 1 key shape (token-count, bad-token, bad-escape, bad-build), 2 value
// (value-not-msgpack, bad-value), 4 unanswered-kind. Anomalies by node are the raw keys equal to the
// node or starting with "<node>.".
//
// The event log (0x06 by key, then sequence; 0x07 by sequence) keeps every applied message, so the
// history of one key, or of one node's keys, is one range scan.
//
// # Plans
//
// The plans (CONTRACT section 6) are a projection of projections, kept under 0x08 and written in the
// batch of the input message, so they are exactly as consistent as the rows they come from. A
// message of composed-<node> folds into its build record (provisioner.BuildRecord.Fold) and
// recomputes the one row of its node and module; a message of mesh-host_modules recomputes its own
// row; one of mesh-indexer_builds the rows of its module, found by the 'm' index, and of those only
// the newest entry, which is all a newest build changes. Each touched row is recomputed once per batch
// (provisioner.ComputePlan), from the host row, the module's newest build and the build records; what
// the batch itself changed of those is read from memory, the rest from the committed state. The build records are the "last plan kept" state: a fold of the bucket's
// history, so a rebuild from the streams finds the same one, and they do not depend on the event log
// being kept. The 'm' index does not cover the rows (a plan can be large); a module's rows are read
// by key.
//
// # The state dir
//
// OpenState uses a directory of its own: LOCK (held with flock by the process that has it open),
// CURRENT (the name of the generation in use) and gen-NNNNNN Pebble directories. A rebuild fills a new
// generation and swaps CURRENT to it with an atomic rename; generations CURRENT does not name are
// leftovers and are removed at open.
package store
