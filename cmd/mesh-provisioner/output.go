package main

import (
	"io"
	"sync"
)

// cutWriter writes to w until cut: what a command leaves running past its Run (a goroutine left to
// the process's exit, blocked where no stop reaches it) writes nothing to its caller's Stdout or
// Stderr once Run has returned, which a library caller reusing them, or a test reading them, raced.
type cutWriter struct {
	mu  sync.Mutex
	w   io.Writer
	off bool
}

func newCutWriter(w io.Writer) *cutWriter { return &cutWriter{w: w} }

func (c *cutWriter) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.off {
		return len(p), nil
	}
	return c.w.Write(p)
}

// cut ends the writes to w; a write under way finishes first.
func (c *cutWriter) cut() {
	c.mu.Lock()
	c.off = true
	c.mu.Unlock()
}

// Unwrap is the writer written to: a terminal is still told as one (progress.IsTerminal).
func (c *cutWriter) Unwrap() io.Writer { return c.w }
