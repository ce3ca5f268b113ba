// Package ctxio reads until a context is done: a long copy (a spool into an answer or an archive)
// asks its context at each read, so Ctrl-C stops it.
package ctxio

import (
	"context"
	"io"
)

// Reader reads r until ctx is done, then fails with ctx's error.
type Reader struct {
	Ctx context.Context
	R   io.Reader
}

func (c Reader) Read(p []byte) (int, error) {
	if err := c.Ctx.Err(); err != nil {
		return 0, err
	}
	return c.R.Read(p)
}
