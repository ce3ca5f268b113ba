// Package store is the projection: one Pebble database holding, for every bucket the projector tails,
// the current rows, covering secondary indexes, anomaly rows, the event log and the checkpoint.
//
// # Invariants
//
//   - Apply writes everything one batch of messages produces (rows, index entries, anomaly rows, event
//     log entries and the bucket's checkpoint) in one Pebble batch: a crash never separates a checkpoint
//     from the rows it stands for, and the checkpoint never runs ahead of them. A store without a log
//     (Options.NoWAL, a rebuild's generation) keeps that: Pebble flushes whole memtables oldest first,
//     so a crash leaves it after some earlier batch, and its Close flushes the rest.
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
//	0x01 "schema"                                           -> schema version (decimal text): 1, or 2 once
//	                                                           the event log holds a rollup (store.go)
//	0x01 "composed-anomalies"                               -> uvarint anomaly rows of every
//	                                                           composed-<node> bucket together (nodeanom.go)
//	0x01 "rollup " <bucket>                                 -> the rollup message whose removals in
//	                                                           parts are committed in part: uvarint seq,
//	                                                           varint time, op byte, rollup byte, varint
//	                                                           stream created, uvarint key length, key,
//	                                                           value (rollupmark.go; absent: none)
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
//	0x09 <bucket> 00 01 'f'                                 -> history floor: uvarint floor seq, varint
//	                                                           time of the floor's message, uvarint trimmed
//	0x09 <bucket> 00 01 'g' <from: 8 bytes BE>              -> history gap: uvarint to (0: open),
//	                                                           uvarint opened-at
//	0x09 <bucket> 00 01 'd'                                 -> forgotten: varint Unix ns when the
//	                                                           bucket's history was last forgotten
//	                                                           (forget.go)
//	0x09 <bucket> 00 01 'l'                                 -> uvarint: no event of the bucket below
//	                                                           it is live (LiveBelow, history.go;
//	                                                           absent: 0)
//	0x0a <bucket> 00 01 <node>                              -> uvarint anomaly rows whose raw key's first
//	                                                           token is node (nodeanom.go; absent: none)
//	0x0b <bucket> 00 01 <raw key>                           -> pending expiry: uvarint seq, varint due
//	                                                           (Unix ns) of the key's newest message, a
//	                                                           put with a per-message TTL (expiry.go)
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
// Apply learns which classes a key holds from a set in memory per bucket of 60-bit hashes (maphash,
// seeded per open) of the raw keys that hold anomaly rows, each with the classes of the one key
// holding it, about 12 bytes a key (anomset.go), filled at every open from the anomaly rows: a hash
// not in the set means no anomaly row, exactly; a hash in it is confirmed by reading the key's
// anomaly rows (one Get of a row of the classes it carries, or all of the key's rows once two keys
// have shared the hash), so two keys sharing a hash never mix. The set is the committed rows' keys
// exactly, counting a hash once per key that holds it, and follows them after each commit. The
// per-node counts and the composed buckets' sum are kept beside it (nodeanom.go).
// A rollup finds the out-of-shape keys it removes in the anomaly rows (class 1), in key order.
//
// The event log (0x06 by key, then sequence; 0x07 by sequence) keeps every applied message, so the
// history of one key, or of one node's keys, is one range scan, and the state of a range of keys as of
// sequence n is two seeks per key (the newest event at or below n), whatever the length of the history.
// The op byte's top two bits hold a message's rollup when it removed other keys (a rollup of a subject
// with a wildcard token, or of the whole stream: provisioner.Message.RemovesOthers); each key it
// removed has a purge event of its own at the message's sequence in 0x06, while 0x07 names the
// message's own key. Such a message starts a batch of its own, so the keys it removes are read from
// what is committed. The keys it removes (a rollup of the whole stream: every key of the bucket) are
// purged in batches of 10,000 committed before its own batch, which alone moves the checkpoint; views
// read the state before the first of them until the message's own batch commits (pin.go), so no
// answer holds part of a rollup. The first part's batch writes the rollup's marker (0x01 "rollup "
// <bucket>) and the message's own batch deletes it: Open finds the marker of a rollup a stopped
// process left between two parts and finishes it (the remaining parts and the message's own batch, as
// Apply runs them) before anything reads the store, which then equals one that applied the rollup
// without a stop. A marker at or below its bucket's applied sequence (an older binary, which does not
// know it, finished the rollup by reading the message again) is deleted.
//
// A message on a subject added to the stream by hand (provisioner.Message.Foreign) is no key and is
// not logged, except a rollup of the whole stream: it removes every key as above, and its own event
// (in 0x06 and 0x07, and in its marker) is under the key " " <subject>, op purge, its rollup and its
// data (foreign.go). No key NATS routes holds a space, and a purge of a key is in no answer, so every
// reader, an older one too, answers it as the rollup it was; Event.Message reads it back as the message.
//
// # What the event log can rebuild: floor and gaps
//
// The log rebuilds the state of a bucket as of sequence n (every message with a sequence at or below n
// applied) exactly when n is at or above the bucket's floor and inside no gap; otherwise the answer is
// ErrTrimmed or ErrGap, never a guess.
//
//   - Retention trims by compaction, not by cutting: trimming to a horizon h keeps, of every key, the
//     newest event at or below h when it is a put, and deletes every other event at or below h. The
//     state as of every n >= h is unchanged, so a key last written long before the horizon still
//     answers as of any later point; only points below h are lost, and the floor becomes h. The floor
//     is committed before anything is deleted, and the walk (0x07, in sequence order) commits how far
//     it got with each batch, so an interrupted trim resumes. Trimming runs beside Apply without its
//     lock: it touches only events at or below h, and Apply only writes above the applied sequence.
//     Retention is by the messages' own time (--history-retention) and by Pebble's estimate of the
//     log's size (--history-max-bytes; trimmed to 80% of it, then compacted so the next estimate sees
//     the space freed). One time horizon applies to every bucket, so the registry, which as-of needs
//     answers read too, is kept as far back as the needs.
//   - A key of a composed-<node> bucket (one that fits <module>.<build>) keeps one event more: its
//     newest published composition at or below h since its last purge or TTL marker, and, when it
//     keeps one, its newest event even if that is a delete. Those are the two messages its build
//     record is a fold of (provisioner.PublishesPlan). The plans as of a point are folded again from
//     the log (replay), and a refusal, a pending composition, a value out of shape or a delete after a
//     published composition holds the module at that plan: so the build records as of every n >= h
//     are unchanged too, and plans as of n answer what the live projection answered at n. A purge or a
//     TTL marker makes the fold forget the build, and the trim then drops all of the key, as it drops a
//     key whose newest event is a delete with nothing published: both fold to no record, as nothing
//     does. Except when the build is written differently: m.0042 and m.42 fold into one record, so a
//     delete of one spelling sets the status whatever the other published, and a marker forgets what
//     the other kept. Such a delete or marker is kept (and a key's last marker beside its newer
//     events) when another spelling of the build keeps an event below it; the trim seeks the few
//     spellings that can exist (leading zeros) only for a delete or marker it would otherwise drop. So
//     a key keeps at most three events. What earlier batches or trims kept of a key is read back from
//     the log, so a resumed trim keeps the same. The other buckets, the plans' other inputs among them,
//     keep the rule above. A put or a delete that rolled its own key up (Nats-Rollup) forgets the
//     build before it is folded, so it is kept as a marker is.
//   - A rollup that removed other keys (a wildcard or Nats-Rollup: all): the purges it wrote under the
//     keys it removed have no entry by sequence, so the walk meets them when it meets the rollup (the
//     keys with an event at its sequence, under its literal tokens: two seeks a key of the log) and
//     handles each as that key's event, dropping what they kept from before it (trimBatch keys a
//     batch, committed as the walk below the rollup, so a stop between lots walks it again). The
//     rollup is then an event of its own key like any other, unless one of those keys keeps its purge (a composed build
//     written differently, whose other spelling keeps an event below it): a fill by sequence (plans
//     as of a point, an export) meets that purge only through the rollup, so the rollup is never
//     trimmed while one does (pinned; a later trim reads it back and asks again), the key keeps its
//     event before the purge beside it (the fill applies the rollup, which removes only a key the
//     fill holds: a row, or a delete as its newest event), and its own key
//     keeps its newest event beside it, whatever it is (a rollup that is a put of the key, deleted
//     since, is not the key's state), so such a key keeps more than three events. A log an older
//     binary trimmed keeps its rollups with the purges under the keys they removed: they stay pinned.
//   - A gap is a range of messages the stream removed before the projector read them: Apply sees the
//     next sequence jump past applied + 1 (a KV bucket's history limit or a purge removed superseded
//     revisions while the projector was behind, or a fresh projection starts on a stream whose first
//     sequence is past 1). Such a message was superseded by a later one of the same key that was in the
//     stream when the jump was read, so the gap closes at the first message read afterwards whose
//     NumPending was 0 (CaughtUp): from there on every point is exact again. That count can be short
//     (nats-server now and then says none is pending with one more held): while a gap holds min_seq
//     requests back the projector asks the stream, and one that held more (HoldUntil) has the gap
//     close only at or past its last sequence then. A rollup of the whole
//     stream (Nats-Rollup: all) closes it at its own sequence: the server removed every earlier
//     message as it stored it, so the state as of it is its own. Points before the gap
//     stay exact. A stream emptied before it was read (a purge, an age limit without markers), or
//     whose last messages were removed before they were read (the projector finds its tail at the
//     stream's end below the last sequence, and the leader holding nothing past it), has no next
//     message to jump to: TailRemoved opens the gap from applied + 1 all the same, and replay
//     refuses the points past the applied sequence while it is open, rather than answer them as of
//     the last message read.
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
// being kept. The plans as of a point do: replay folds them again from the log, which is why trimming
// a composed-<node> bucket keeps each key's newest published composition (above). The 'm' index does not cover the rows (a plan can be large); a module's rows are read
// by key.
//
// # Pending expiries
//
// A put with a per-message TTL that the server removes while an older message of its key is still in
// the stream leaves no marker (expiry.go). Apply keeps one 0x0b entry per key whose newest message is
// such a put, in the message's batch, and deletes it with the key's next message; Open reads them into
// a heap by due time. Expire, once the projector has asked the stream, applies the key's last message
// as the stream now holds it: the put's event leaves the log, so every answer from the put's sequence
// on says what the stream says; the applied sequence does not move, and Rewrites counts such commits
// for the caches of answers keyed by applied sequences. A composed-<node> bucket is read again instead.
//
// # Forgetting a bucket
//
// A composed-<node> bucket whose stream was deleted is forgotten (Forget): everything above of it and
// the node's build records are deleted, and the node's plan rows recomputed with none, in one batch,
// so the store equals one that never read the bucket but for the forgotten mark, which the plans as
// of a time before it consult to refuse what the log can no longer rebuild. Forget and TrimHistory of
// one bucket exclude each other (lockHistory). A composed-<node> bucket whose stream still exists but
// cannot be resumed (recreated, purged) is forgotten by ForgetFrom, which in the same batch writes
// its checkpoint at the stream's first sequence - 1: the log starts afresh there with no gap below,
// the messages removed before being part of what was forgotten.
//
// # Writing a catch-up
//
// Apply hands its writes to the batch in key order (sorted.go), so the memtable inserts walk the
// skiplist where the last one ended. While a bucket is CatchUpBehind messages or more behind its stream,
// CatchingUp holds compactions back until it reaches the end, bounded by maxHeldFlushes flushes
// (catchup.go): a catch-up is a bulk load, and compacting L0 into the levels below after every few
// flushes rewrote the same bytes while the projector needed the CPU. BulkLoad holds them until Close,
// for a rebuild's generation.
//
// # The state dir
//
// OpenState uses a directory of its own: LOCK (held with flock by the process that has it open),
// CURRENT (the name of the generation in use) and gen-NNNNNN Pebble directories. A rebuild fills a new
// generation and swaps CURRENT to it with an atomic rename; generations CURRENT does not name are
// leftovers and are removed at open, or resumed by the next rebuild (StateDir.Pending). A seat that
// rebuilds while running hands the state dir and its lock from the old store to the new one (SwapIn).
// ResetState starts a state dir over when it cannot be opened. CopyCurrent makes a private copy of the
// current generation (tables hard-linked) for a reader in another process, since Pebble locks its
// directory even to read it; copies live in .replay-* and belong to whoever made them.
package store
