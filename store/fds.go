package store

import "syscall"

// A seat's descriptors are mostly Pebble's table cache: every sstable a read or a compaction opens
// stays open in it until evicted, up to Options.MaxOpenFiles (pebble v2.1.7: the cache holds
// MaxOpenFiles less 10 tables, at least 64, and Pebble's default is 1000 whatever the limit). The
// rest of the seat takes few and the kernel's limit (RLIMIT_NOFILE) is the process's, so the store
// gives Pebble what the limit leaves once the rest has its share, and the table cache closes tables
// it holds rather than open one past the limit. Go (1.19 on) raises the soft limit to one below the
// hard one when the process starts (syscall/rlimit.go), so the limit read here is in effect the
// hard one: LimitNOFILE= in the unit, or ulimit -Hn.

// seatFDs is how many descriptors are kept for everything but Pebble's table caches: the NATS
// connection, the metrics listener and its clients, the state dir's LOCK, standard streams, the
// runtime's own (epoll, pipes), and what Pebble opens beside its cache (its log, the MANIFEST, the
// directory, a flush's and each compaction's outputs: about 10, pebble's numNonFileCacheFiles). An
// embedded NATS server (serve without --nats) opens files of its own for each stream and a socket
// per client: it is for trying things, and is not budgeted here. Under a limit of 512 or less the
// share is half the limit.
const seatFDs = 256

// minMaxOpenFiles is the least MaxOpenFiles Pebble honours: a table cache of 64, and its 10.
const minMaxOpenFiles = 64 + 10

// storesAtOnce is how many stores a process holds open at once: a serving seat's, and the new
// generation a rebuild fills while the seat answers from the first (seat/rebuild.go).
const storesAtOnce = 2

// maxOpenFiles is the MaxOpenFiles a store gives Pebble under a soft RLIMIT_NOFILE of soft: what
// the limit leaves once seatFDs are kept, shared by storesAtOnce stores, and never below
// minMaxOpenFiles (under a limit that low, 128 or so, a store with many tables may still run out).
func maxOpenFiles(soft uint64) int {
	const unlimited = 1 << 20 // RLIM_INFINITY, or a limit no kernel grants (Linux's nr_open is 1M)
	if soft > unlimited {
		soft = unlimited
	}
	n := int(soft)
	n -= min(seatFDs, n/2)
	return max(n/storesAtOnce, minMaxOpenFiles)
}

// MaxOpenFiles is what a store opened now gives Pebble as Options.MaxOpenFiles when Options leaves
// it 0: maxOpenFiles of the process's soft RLIMIT_NOFILE, or Pebble's default (1000) where the
// limit cannot be read.
func MaxOpenFiles() int {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return 1000
	}
	return maxOpenFiles(lim.Cur)
}
