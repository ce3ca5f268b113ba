package store

import "syscall"

var errWouldBlock error = syscall.EWOULDBLOCK
