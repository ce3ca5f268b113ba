// Package replay answers forensics questions from the store's event log: what a bucket held as of a
// point, every revision of one key, and what changed between two points. It never rebuilds the
// projection to answer: the state of a range of keys as of a point is read from the event log with two
// seeks per key (store.View.StateAt), so a question narrowed to one node costs that node's history, not
// the mesh's.
//
// # What "as of" means
//
// A point is a stream sequence of the asked bucket (seq:<n>) or an RFC 3339 time.
//
//   - As of seq:n, a bucket holds what it holds after every message with a sequence at or below n was
//     applied, and nothing after. The answer's as_of is n; a point past what the projection has applied
//     answers as of the applied sequence, and as_of says so.
//   - As of a time T is as of the last sequence whose message is stamped at or before T (JetStream
//     stamps a stream's messages in sequence order). A time before the bucket's first message is the
//     empty state, as_of 0.
//   - Rows and anomalies are those the live projection would have answered at that point: a key's row
//     is its newest put at or below the point (deleted, purged or expired keys have none), anomaly rows
//     are derived again from the key and value with the same rules and texts, and an anomaly's revision
//     is the sequence of the put that carries it.
//   - unanswered-kind needs the registry as of the same moment. The registry is another stream, so the
//     moment is a time: T for a time point; for seq:n of the needs, the last moment the needs were in
//     that state (just before the next message's time, or now when n is the newest applied), so that the
//     newest point answers exactly what the live projection answers.
//
// A point the log cannot rebuild exactly, because retention compacted the log past it or the stream had
// removed messages around it before they were read (store/doc.go: floor and gaps), is refused with
// query.Gone (410) and the nearest points that can be answered; it is never guessed.
//
// # Sources
//
// A Log is an event log to ask: a private copy of a state dir's current generation (it never takes the
// state dir's lock, so it works beside a running serve), a temporary store filled from the streams'
// own history, or a temporary store filled from an archive written by export. All three answer with the
// same code.
package replay
