package main

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// The wide floor's replier answers exactly the pages the seat gave, in their order.
func TestPages_RoundTrip(t *testing.T) {
	file := filepath.Join(t.TempDir(), "pages")
	pages := [][]byte{[]byte("first page"), {}, make([]byte, 70000)}
	pages[2][69999] = 7
	require.NoError(t, writePages(file, pages))
	got, err := readPages(file)
	require.NoError(t, err)
	require.Equal(t, pages, got)

	// A file cut short, or empty, is refused rather than answered short.
	buf, err := os.ReadFile(file)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(file, buf[:len(buf)-1], 0o600))
	_, err = readPages(file)
	require.ErrorContains(t, err, "cut short")
	require.NoError(t, os.WriteFile(file, nil, 0o600))
	_, err = readPages(file)
	require.ErrorContains(t, err, "no pages")
}
