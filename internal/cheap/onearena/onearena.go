// Package onearena, imported for its effect, makes glibc's malloc keep every thread's allocations in
// one arena (mallopt M_ARENA_MAX 1) in a binary built with cgo against glibc: cmd/mesh-provisioner
// imports it. Pebble allocates each cached block with C calloc and frees it on eviction; with an arena
// per thread that met contention (up to eight a core), a block freed on one thread went back to its
// arena and the next block read on another thread grew another one. After walking every index once, a
// seat with a 128 MiB cache held 195 MiB in six arenas (docs/performance.md, Session 17).
//
// It must take effect before the Go runtime starts its threads, which allocate through cgo: a call
// from main or an init function comes too late (glibc has fixed its arena limit by then), so it is a C
// constructor, run when the program loads. MALLOC_ARENA_MAX or GLIBC_TUNABLES in the environment, set
// by an operator, are left to rule. Without cgo, or on another libc, it does nothing.
package onearena
