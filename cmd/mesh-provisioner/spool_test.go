package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestSpool_MemoryThenFile: a spool holds what fits in spoolMem in memory and makes no file; past
// that it moves to a temporary file under TMPDIR, removed on close. Either way it reads back, and
// copies out, every byte in order, with the JSON elements' commas.
func TestSpool_MemoryThenFile(t *testing.T) {
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	files := func() int {
		entries, err := os.ReadDir(tmp)
		require.NoError(t, err)
		return len(entries)
	}
	for _, tc := range []struct {
		name   string
		lines  int
		inFile bool
	}{
		{"none", 0, false},
		{"a few", 3, false},
		{"past spoolMem", 3 * spoolMem / 20, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lines, elements := newSpool(), newSpool()
			var wantLines, wantElements strings.Builder
			for i := range tc.lines {
				require.NoError(t, lines.line("added\t%s\t%d\n", "n1.m1.config.a", i))
				fmt.Fprintf(&wantLines, "added\t%s\t%d\n", "n1.m1.config.a", i)
				e := fmt.Sprintf(`{"key":"n1.m1.config.a","revision":%d}`, i)
				require.NoError(t, elements.element([]byte(e)))
				if i > 0 {
					wantElements.WriteByte(',')
				}
				wantElements.WriteString(e)
			}
			require.Equal(t, tc.inFile, lines.inFile())
			require.Equal(t, tc.inFile, elements.inFile())
			wantFiles := 0
			if tc.inFile {
				wantFiles = 2
			}
			require.Equal(t, wantFiles, files(), "temporary files under TMPDIR")
			require.Equal(t, tc.lines, lines.n)

			r, err := lines.reader()
			require.NoError(t, err)
			got, err := io.ReadAll(r)
			require.NoError(t, err)
			require.Equal(t, wantLines.String(), string(got))
			var out bytes.Buffer
			require.NoError(t, elements.copyTo(context.Background(), &out))
			require.Equal(t, wantElements.String(), out.String())

			lines.close()
			elements.close()
			require.Zero(t, files(), "close removes the temporary files")
		})
	}
}

// inFile reports whether the spool outgrew memory: false for what fits in spoolMem.
func (s *spool) inFile() bool { return s.f != nil }
