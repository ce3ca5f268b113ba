package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"text/tabwriter"

	"github.com/novox/mesh-provisioner/internal/ctxio"
)

// spool is one part of an answer written in pieces (the rows a diff added, say), kept in a temporary
// file until the parts before it are printed, so that a long answer is never held in memory.
type spool struct {
	f *os.File
	w *bufio.Writer
	n int // pieces written
}

func newSpool() (*spool, error) {
	f, err := os.CreateTemp("", "mesh-provisioner-replay-")
	if err != nil {
		return nil, fmt.Errorf("temporary file: %w", err)
	}
	return &spool{f: f, w: bufio.NewWriterSize(f, 1<<16)}, nil
}

// element writes one element of a JSON array, with the comma before it.
func (s *spool) element(b []byte) error {
	if s.n > 0 {
		s.w.WriteByte(',')
	}
	s.n++
	_, err := s.w.Write(b)
	return err
}

// line writes one line of a table.
func (s *spool) line(format string, args ...any) error {
	s.n++
	_, err := fmt.Fprintf(s.w, format, args...)
	return err
}

// copyTo writes what was spooled to w, and stops with ctx's error once ctx is done.
func (s *spool) copyTo(ctx context.Context, w io.Writer) error {
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
	if err := s.w.Flush(); err != nil {
		return nil, err
	}
	if _, err := s.f.Seek(0, io.SeekStart); err != nil {
		return nil, err
	}
	return bufio.NewReaderSize(s.f, 1<<16), nil
}

func (s *spool) close() {
	s.f.Close()
	os.Remove(s.f.Name())
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
