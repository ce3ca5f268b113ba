// Package cheap gives back the C heap's free pages, in a binary built with cgo against glibc (make
// build, the bench's seat), where Pebble's block cache and memtables live: Pebble allocates each
// cached block with C calloc and frees it on eviction; its memtables are mmaps of their own (64 MiB,
// above glibc's mmap threshold), unmapped when freed. Memory freed in the middle of glibc's heap
// stays in the process's RSS until it is trimmed. Without cgo (deploy/Dockerfile) Pebble allocates in
// the Go heap, whose scavenger gives pages back, and Trim does nothing. Its sibling onearena keeps
// glibc to one arena (docs/performance.md, Session 17).
package cheap

// Trim gives the C heap's free pages back to the system (glibc malloc_trim). It walks the heap's free
// chunks under the arena's lock: about a millisecond for a heap of a few hundred MiB.
func Trim() { trim() }

// Free is how many bytes the C heap holds free (glibc mallinfo2's fordblks): freed, not yet reused,
// whether or not a trim gave their pages back already. 0 without cgo.
func Free() int64 { return free() }
