package store

import (
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// A seat's descriptors are mostly Pebble's table cache: every sstable a read or a compaction opens
// stays open in it until evicted, up to Options.MaxOpenFiles (pebble v2.1.7: the cache holds
// MaxOpenFiles less 10 tables, at least 64, and Pebble's default is 1000 whatever the limit). The
// rest of the seat takes few and the kernel's limit (RLIMIT_NOFILE) is the process's, so the store
// gives Pebble what the limit leaves once the rest has its share, and the table cache closes tables
// it holds rather than open one past the limit. Go (1.19 on) raises the soft limit to one below the
// hard one when the process starts (syscall/rlimit.go), so the limit read here is in effect the
// hard one: LimitNOFILE= in the unit, or ulimit -Hn.

// seatFDs is how many descriptors are kept for everything but Pebble's table caches, split as the
// constants below say (a stated split, so that a share that grows is seen to take from another).
// Under a limit of 512 or less the share is half the limit.
const seatFDs = 256

// The split of seatFDs.
const (
	// runtimeFDs: standard streams, the runtime's epoll, eventfd and pipe, the state dir's LOCK and
	// the rebuild's, a replay's or export's archive, a config or creds file being read.
	runtimeFDs = 16
	// natsFDs: the process's NATS connections, a socket each (serve holds one, kept across
	// reconnects; the commands one or two).
	natsFDs = 8
	// pebbleOwnFDs: what each store's Pebble opens beside its table cache (its log and the next, the
	// MANIFEST, the directory and its markers, a flush's and the compactions' outputs: about 10,
	// pebble's numNonFileCacheFiles), for storesAtOnce stores.
	pebbleOwnFDs = storesAtOnce * 16
	// MetricsConns is the most connections the metrics listener (--metrics-addr,
	// internal/metrics.Server) serves at once; it holds two more, its listening socket and the
	// connection it accepted to wait for a place. Past them a client waits in the kernel's accept
	// queue, which holds no descriptor of the process.
	MetricsConns = 64
	// embeddedFDs is the rest: an embedded NATS server's listener, its store's lock and what it
	// opens beside its clients and streams. Those two take a file per client connected and per
	// stream written in the last minute or two (thousands each with as many nodes and
	// composed-<node> buckets), which no fixed share holds: KeepForEmbeddedServer gives them a
	// store's share instead, and EmbeddedMaxConn keeps the clients to half of it.
	embeddedFDs = seatFDs - runtimeFDs - natsFDs - pebbleOwnFDs - (MetricsConns + 2)
)

// The split fits in seatFDs, and leaves the embedded server at least 64: this fails to compile
// otherwise.
const _ = uint(embeddedFDs - 64)

// minMaxOpenFiles is the least MaxOpenFiles Pebble honours: a table cache of 64, and its 10.
const minMaxOpenFiles = 64 + 10

// storesAtOnce is how many stores a process holds open at once: a serving seat's, and the new
// generation a rebuild fills while the seat answers from the first (seat/rebuild.go).
const storesAtOnce = 2

// withEmbedded is set when the process runs an embedded NATS server (KeepForEmbeddedServer).
var withEmbedded atomic.Bool

// KeepForEmbeddedServer has the stores opened from now on leave a store's share of the descriptors
// to an embedded NATS server in the same process (serve without --nats calls it before it opens the
// state dir). nats-server's file store holds the last message block of every stream written in the
// last minute or two open (closed at its sync, every 2 minutes, once idle 30 s: filestore.go
// syncBlocks, closeFDsIdle): measured, 2,000 composed-<node> buckets each written once held 2,000
// files until their sync, and none once idle. A share as large as a store's takes the bursts of a
// mesh of thousands of nodes (21,759 of LimitNOFILE=65536), and costs the stores only table cache
// they rarely fill (a third instead of half of what is left: tens of thousands of tables are tens
// of GB of state dir).
func KeepForEmbeddedServer() { withEmbedded.Store(true) }

// minEmbeddedConns is the fewest client connections EmbeddedMaxConn allows an embedded server: as
// many as the split of seatFDs leaves it at least (embeddedFDs), enough for the seat's own connection
// and the commands and clients of a trial, however low the limit.
const minEmbeddedConns = 64

// embeddedMaxConn is EmbeddedMaxConn under a soft RLIMIT_NOFILE of soft: half the embedded server's
// share, which is as large as a store's (maxOpenFiles with KeepForEmbeddedServer), and at least
// minEmbeddedConns. The other half is for its streams' files: a node of a mesh is a client of the
// server and a composed-<node> stream in it, so a mesh that fits in one half fits in the other.
func embeddedMaxConn(soft uint64) int {
	return max(maxOpenFiles(soft, true)/2, minEmbeddedConns)
}

// EmbeddedMaxConn is the most client connections an embedded NATS server in this process (serve
// without --nats) is to hold at once, nats-server's max_connections (its default, 65536, is no bound
// under a limit a seat runs with): past it the server refuses a client ("maximum connections
// exceeded") rather than take a descriptor the stores keep. It is half the share the stores leave
// the server (KeepForEmbeddedServer, the start line's pebble_max_open_files), at least 64: 10,879
// under a soft limit of 65535, 128 under 1024, 64 under 512 or less. Where the limit cannot be read,
// half of Pebble's default share (1000).
func EmbeddedMaxConn() int {
	soft := FileLimit()
	if soft == 0 {
		return 1000 / 2
	}
	return embeddedMaxConn(soft)
}

// maxOpenFiles is the MaxOpenFiles a store gives Pebble under a soft RLIMIT_NOFILE of soft: what
// the limit leaves once seatFDs are kept, shared by storesAtOnce stores (and an embedded server,
// KeepForEmbeddedServer), and never below minMaxOpenFiles (under a limit that low, 128 or so, a
// store with many tables may still run out).
func maxOpenFiles(soft uint64, embedded bool) int {
	const unlimited = 1 << 20 // RLIM_INFINITY, or a limit no kernel grants (Linux's nr_open is 1M)
	if soft > unlimited {
		soft = unlimited
	}
	n := int(soft)
	n -= min(seatFDs, n/2)
	shares := storesAtOnce
	if embedded {
		shares++
	}
	return max(n/shares, minMaxOpenFiles)
}

// MaxOpenFiles is what a store opened now gives Pebble as Options.MaxOpenFiles when Options leaves
// it 0: maxOpenFiles of the process's soft RLIMIT_NOFILE (and of KeepForEmbeddedServer), or Pebble's default (1000) where the
// limit cannot be read.
func MaxOpenFiles() int {
	soft := FileLimit()
	if soft == 0 {
		return 1000
	}
	return maxOpenFiles(soft, withEmbedded.Load())
}

// FileLimit is the process's soft RLIMIT_NOFILE, the descriptors it may hold (after Go raised it to
// the hard limit at start), or 0 where it cannot be read.
func FileLimit() uint64 {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return 0
	}
	return lim.Cur
}

// MaxOpenFiles is the Options.MaxOpenFiles the store gave Pebble: the package's MaxOpenFiles() as of
// its open, unless Options set one.
func (db *DB) MaxOpenFiles() int { return db.maxOpenFiles }

// ErrNoFDs marks a store that Pebble cannot go on with for want of a file descriptor: the process
// (EMFILE) or the system (ENFILE) has none left to create its log, its MANIFEST or a marker
// (Options.OnFatal). The state dir holds every batch committed before; the answer is more
// descriptors and a start again.
var ErrNoFDs = errors.New("store: out of file descriptors")

// Where Pebble (v2.1.7) cannot open a file, it goes on or stops as follows:
//
//   - a table a read opens (its table cache): the read fails with the error (EMFILE beneath, so not
//     taken for a broken store: isAccess);
//   - a flush's or a compaction's output: EventListener.BackgroundError, and the flush or
//     compaction is tried again (a flush at once, for good: it spins while the descriptors are
//     gone), the memtables filling meanwhile until writes stall;
//   - a new MANIFEST or its marker (a flush or compaction done, the MANIFEST rotated): Logger.Fatalf
//     on the goroutine that installed the version (version_set.go UpdateVersionLocked), a panic
//     nothing can recover;
//   - a new log (a memtable rotated, db.go rotateWAL): a panic with its mutex released, which the
//     unlock deferred above it turns into a fatal error of the runtime.
//
// The first two are errors Pebble lives with; the last two end the process whatever is done. So the
// store watches the files Pebble creates (fdFS): once open, a log, MANIFEST or marker that cannot be
// created for want of a descriptor is said to Options.OnFatal before Pebble sees it, as is a
// Logger.Fatalf whose message is one; OnFatal (serve's) logs one line saying what ran out and what
// to do and exits with its own code, instead of a panic's stack. The open itself is not watched:
// there Pebble returns the error, an ErrAccess (fdsToOpen).

// fdWatch is what a store knows of Pebble's opens that failed for want of a descriptor.
type fdWatch struct {
	fatal func(error) // Options.OnFatal
	armed atomic.Bool // the store is open: a log or MANIFEST it cannot create is fatal to Pebble
	out   atomic.Int64
}

// failed takes an open of Pebble's that failed with err, of the file name.
func (w *fdWatch) failed(name string, err error) {
	a := accessOf(err)
	if a == nil || (a.errno != syscall.EMFILE && a.errno != syscall.ENFILE) {
		return
	}
	w.out.Add(1)
	if w.armed.Load() && fatalToPebble(name) {
		w.die(fdsErr(a.errno, "cannot create "+name, err))
	}
}

// die says err to OnFatal, if there is one. When it returns, so does die, and Pebble panics.
func (w *fdWatch) die(err error) {
	if w.fatal != nil {
		w.fatal(err)
	}
}

// fatalToPebble reports whether Pebble stops the process when it cannot create the file name: its
// log (NNNNNN.log), a MANIFEST, or a marker (of the MANIFEST, or of the format version).
func fatalToPebble(name string) bool {
	base := filepath.Base(name)
	return strings.HasSuffix(base, ".log") || strings.HasPrefix(base, "MANIFEST-") || strings.HasPrefix(base, "marker.")
}

// fdsText reports whether a message of Pebble's says a descriptor ran out, and which errno.
func fdsText(msg string) (syscall.Errno, bool) {
	for _, e := range []syscall.Errno{syscall.EMFILE, syscall.ENFILE} {
		if strings.Contains(msg, e.Error()) {
			return e, true
		}
	}
	return 0, false
}

// fdsErr is the ErrNoFDs of errno, saying what failed (what), Pebble's error, the limits and what to do.
func fdsErr(errno syscall.Errno, what string, err error) error {
	if errno == syscall.ENFILE {
		return fmt.Errorf("%w: the system has no file descriptor left (ENFILE): Pebble %s (%v): %s, then start again (the state dir keeps every batch committed)", ErrNoFDs, what, err, fixENFILE)
	}
	var lim syscall.Rlimit
	_ = syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim)
	return fmt.Errorf("%w: the process has no file descriptor left (EMFILE, limit %d, hard limit %d): Pebble %s (%v): %s, then start again (the state dir keeps every batch committed)",
		ErrNoFDs, lim.Cur, lim.Max, what, err, fixEMFILE)
}

// fdFS is the file system Pebble writes through, watching the opens that fail for want of a
// descriptor (fdWatch).
type fdFS struct {
	vfs.FS
	w *fdWatch
}

func (fs fdFS) Create(name string, c vfs.DiskWriteCategory) (vfs.File, error) {
	f, err := fs.FS.Create(name, c)
	if err != nil {
		fs.w.failed(name, err)
	}
	return f, err
}

func (fs fdFS) ReuseForWrite(oldname, newname string, c vfs.DiskWriteCategory) (vfs.File, error) {
	f, err := fs.FS.ReuseForWrite(oldname, newname, c)
	if err != nil {
		fs.w.failed(newname, err)
	}
	return f, err
}

func (fs fdFS) OpenReadWrite(name string, c vfs.DiskWriteCategory, opts ...vfs.OpenOption) (vfs.File, error) {
	f, err := fs.FS.OpenReadWrite(name, c, opts...)
	if err != nil {
		fs.w.failed(name, err)
	}
	return f, err
}

func (fs fdFS) Open(name string, opts ...vfs.OpenOption) (vfs.File, error) {
	f, err := fs.FS.Open(name, opts...)
	if err != nil {
		fs.w.failed(name, err)
	}
	return f, err
}

func (fs fdFS) OpenDir(name string) (vfs.File, error) {
	f, err := fs.FS.OpenDir(name)
	if err != nil {
		fs.w.failed(name, err)
	}
	return f, err
}

// OutOfFDs counts Pebble's opens of files that failed for want of a file descriptor (EMFILE, ENFILE)
// since the store opened: table reads, flush and compaction outputs (which Pebble tries again).
func (db *DB) OutOfFDs() int64 { return db.fds.out.Load() }

// IsOutOfFDs reports whether err is a failure for want of a file descriptor (EMFILE, ENFILE): a read
// that could not open a table of the state dir, say. Such a read may work when asked again, once
// descriptors are back; the state dir is fine.
func IsOutOfFDs(err error) bool {
	return errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) || errors.Is(err, ErrNoFDs)
}
