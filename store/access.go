package store

import (
	"errors"
	"fmt"
	"os"
	"syscall"
)

// ErrAccess marks a state dir this process may not use as it is: permission denied (EACCES, EPERM), a
// read-only file system (EROFS), or no file descriptor left (EMFILE for the process, ENFILE for the
// system). None of these is a fault of the state dir, which holds what it held: it is never taken for
// a broken one (NeedsRebuild says no), so never started over nor rebuilt over; the error names the
// path, the errno and what to fix.
var ErrAccess = errors.New("store: state dir cannot be accessed")

// accessErrno is an errno ErrAccess covers, with its name and what the operator fixes.
type accessErrno struct {
	errno syscall.Errno
	name  string
	fix   string
}

// accessErrnos are the errnos ErrAccess covers.
var accessErrnos = []accessErrno{
	{syscall.EACCES, "EACCES", "the state dir must be writable by the seat: give its user read and write access to it and everything in it (chown, chmod), or give another --state"},
	{syscall.EPERM, "EPERM", "the state dir must be writable by the seat: give its user read and write access to it and everything in it (chown, chmod, chattr -i), or give another --state"},
	{syscall.EROFS, "EROFS", "the state dir must be writable by the seat, and its file system is mounted read-only: remount it read-write (or fix the unit's ReadWritePaths=), or give another --state"},
	{syscall.EMFILE, "EMFILE", "the process is out of file descriptors: " + fixEMFILE + ", then start again"},
	{syscall.ENFILE, "ENFILE", "the system is out of file descriptors: " + fixENFILE + ", then start again"},
}

// What to do when file descriptors run out, said by an open (accessErrnos), a failing flush (bgFix)
// and Pebble stopping for want of one (fdsErr). The hard limit is what counts: Go raises the soft
// limit to it at start (docs/decisions.md, h124), so `ulimit -n` alone changes nothing.
const (
	fixEMFILE = "raise LimitNOFILE= in the systemd unit (the hard limit: Go raises the soft one to it), or ulimit -Hn"
	fixENFILE = "raise fs.file-max, or stop what holds them"
)

// accessOf is the entry of accessErrnos that err carries, or nil.
func accessOf(err error) *accessErrno {
	if err == nil {
		return nil
	}
	for i := range accessErrnos {
		if errors.Is(err, accessErrnos[i].errno) {
			return &accessErrnos[i]
		}
	}
	return nil
}

// accessErr returns err as an ErrAccess on path when err is one of accessErrnos, else nil.
func accessErr(path string, err error) error {
	if errors.Is(err, ErrAccess) {
		return nil
	}
	if a := accessOf(err); a != nil {
		return fmt.Errorf("%w: %s: %s (%v): %s; the state dir is left as it is", ErrAccess, path, a.name, err, a.fix)
	}
	return nil
}

// orAccess is accessErr(path, err) when err is an access error, else err.
func orAccess(path string, err error) error {
	if a := accessErr(path, err); a != nil {
		return a
	}
	return err
}

// isAccess reports whether err is, or carries, an access error.
func isAccess(err error) bool {
	return errors.Is(err, ErrAccess) || accessOf(err) != nil
}

// corruptRead is a read of the store that failed: an ErrCorrupt, saying Pebble's details
// (damage), that keeps the error read beneath it, so that one for want of access or of a file
// descriptor is told from a broken store (isAccess) rather than started over.
type corruptRead struct{ err error }

func (e corruptRead) Error() string {
	if a := accessOf(e.err); a != nil {
		// Not broken, and not to be said so: the read wanted a descriptor, or access.
		return ErrAccess.Error() + ": " + a.name + " (" + damage(e.err) + "): " + a.fix + "; the state dir is left as it is"
	}
	return ErrCorrupt.Error() + ": " + damage(e.err)
}
func (e corruptRead) Unwrap() []error { return []error{ErrCorrupt, e.err} }

// readErr is a failed read of the store (corruptRead).
func readErr(err error) error { return corruptRead{err} }

// minFreeFDs is how many file descriptors an open wants free before it starts: Pebble's open flushes
// the log it replays and writes a new manifest, and a manifest write that fails for want of a
// descriptor is fatal to Pebble (it panics on a goroutine of its own, taking the process down), so an
// open that would run out part way is refused before it begins. An open takes about a dozen.
const minFreeFDs = 32

// fdsToOpen refuses, as an EMFILE ErrAccess, to open dir when fewer than minFreeFDs descriptors are
// left under the process's RLIMIT_NOFILE. Where the open descriptors cannot be counted (no
// /proc/self/fd) it says nothing, and Pebble finds out.
func fdsToOpen(dir string) error {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil || lim.Cur > 1<<30 {
		return nil
	}
	open, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return nil
	}
	if free := int64(lim.Cur) - int64(len(open)); free < minFreeFDs {
		return accessErr(dir, fmt.Errorf("%d of %d file descriptors in use, an open wants %d free: %w", len(open), lim.Cur, minFreeFDs, syscall.EMFILE))
	}
	return nil
}
