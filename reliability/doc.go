// Package reliability proves, against real nats-servers, real Pebble stores and the real binary, that
// the seat keeps answering through faults and never answers from a projection that drifted from the
// buckets. It holds tests only:
//
//   - hostile_test.go: requests of 1 MiB and just over, deep MessagePack, huge limits, unknown fields,
//     values that are not MessagePack and keys at the longest subject a server takes, against a running
//     seat: each a 400 or a correct answer, and the seat keeps serving.
//   - faults_test.go: the nats-server restarted mid-ingest; a 3-node JetStream cluster losing the
//     seat's server and then the stream leader; two seats in the queue group, one killed.
//   - load_test.go: 8 clients asking as fast as they can while updates stream in.
//   - graceful_test.go: SIGTERM under load: exit 0, every request taken is answered, and a restart
//     resumes from the checkpoint.
//   - crashloop_test.go: SIGKILL at random points of a seeded random write mix (while tailing, while
//     catching up, while starting; while rebuilding once the binary has `rebuild`), a full comparison
//     with the buckets after each restart.
//   - brokenstate_test.go: a state dir garbled, truncated or emptied file by file, corrupted under a
//     running seat, read-only, or on a disk that fills: serve refuses or stops saying what to do
//     (rebuild, free space, make it writable) or answers correctly; never a panic or a wrong answer.
//
// `make test` runs a short version of each; `make chaos` sets MESH_CHAOS=1 for the full ones (20 kills,
// 100,000 updates). Every comparison with the buckets goes through internal/verbcheck.
package reliability
