package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"text/tabwriter"

	"github.com/novox/mesh-provisioner/internal/ctxio"
)

// spool is one part of an answer written in pieces (the rows a diff added, say), kept in memory up to
// spoolMem and in a temporary file past that, until the parts before it are printed, so that a long
// answer is never held in memory. A diff writes five of them: each made its temporary file at once,
// and a diff of a few rows (a node's, as a test asks thousands of) spent most of its time creating and
// removing five empty files.
type spool struct {
	mem []byte   // what was written, while it fits in spoolMem
	f   *os.File // once it did not
	w   *bufio.Writer
	n   int // pieces written
}

// spoolMem is how much a spool holds in memory before it writes to a temporary file, and the size of
// that file's buffer.
const spoolMem = 1 << 16

func newSpool() *spool { return &spool{} }

// write adds b, moving what was written to a temporary file the first time it outgrows spoolMem.
func (s *spool) write(b []byte) error {
	if s.f == nil {
		if len(s.mem)+len(b) <= spoolMem {
			s.mem = append(s.mem, b...)
			return nil
		}
		f, err := os.CreateTemp("", "mesh-provisioner-replay-")
		if err != nil {
			return fmt.Errorf("temporary file: %w", err)
		}
		s.f, s.w = f, bufio.NewWriterSize(f, spoolMem)
		if _, err := s.w.Write(s.mem); err != nil {
			return err
		}
		s.mem = nil
	}
	_, err := s.w.Write(b)
	return err
}

// element writes one element of a JSON array, with the comma before it.
func (s *spool) element(b []byte) error {
	if s.n > 0 {
		if err := s.write([]byte{','}); err != nil {
			return err
		}
	}
	s.n++
	return s.write(b)
}

// line writes one line of a table.
func (s *spool) line(format string, args ...any) error {
	s.n++
	return s.write(fmt.Appendf(nil, format, args...))
}

// copyTo writes what was spooled to w, and stops with ctx's error once ctx is done.
func (s *spool) copyTo(ctx context.Context, w io.Writer) error {
	if s.f == nil {
		_, err := io.Copy(w, ctxio.Reader{Ctx: ctx, R: bytes.NewReader(s.mem)})
		return err
	}
	if err := s.w.Flush(); err != nil {
		return err
	}
	if _, err := s.f.Seek(0, io.SeekStart); err != nil {
		return err
	}
	_, err := io.Copy(w, ctxio.Reader{Ctx: ctx, R: s.f})
	return err
}

// reader reads back what was spooled.
func (s *spool) reader() (*bufio.Reader, error) {
	if s.f == nil {
		return bufio.NewReader(bytes.NewReader(s.mem)), nil
	}
	if err := s.w.Flush(); err != nil {
		return nil, err
	}
	if _, err := s.f.Seek(0, io.SeekStart); err != nil {
		return nil, err
	}
	return bufio.NewReaderSize(s.f, spoolMem), nil
}

func (s *spool) close() {
	if s.f != nil {
		s.f.Close()
		os.Remove(s.f.Name())
	}
}

// tableChunk is how many lines a table aligns at a time: tabwriter holds what it aligns, so a table of
// millions of lines is aligned in chunks of this many.
const tableChunk = 1024

// printSpooled prints a table's header and the lines of each spool, aligned in chunks, and stops with
// ctx's error once ctx is done (asked at each chunk): a diff of a whole bucket prints millions of
// lines once its walk is done, and Ctrl-C printed them all.
func printSpooled(ctx context.Context, w io.Writer, header string, parts ...*spool) error {
	tw := newTable(w)
	io.WriteString(tw, header)
	n := 0
	for _, sp := range parts {
		r, err := sp.reader()
		if err != nil {
			return err
		}
		for {
			line, err := r.ReadString('\n')
			if line != "" {
				io.WriteString(tw, line)
				if n++; n%tableChunk == 0 {
					if err := tw.Flush(); err != nil {
						return err
					}
					if err := ctx.Err(); err != nil {
						return err
					}
				}
			}
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				return err
			}
		}
	}
	return tw.Flush()
}

func newTable(w io.Writer) *tabwriter.Writer { return tabwriter.NewWriter(w, 2, 4, 2, ' ', 0) }

// jsonString is s as a JSON string.
func jsonString(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}
