package main

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestLazyBar_FollowsAGrowingTotal: a read whose total grows as it goes (a rebuild's composed-<node>
// buckets, counted once listed) ends at its last total, not past its first ("100% 12973/12948").
func TestLazyBar_FollowsAGrowingTotal(t *testing.T) {
	var stderr bytes.Buffer
	report, end := lazyBar(&stderr, "rebuild")
	report(10, 12948)
	report(12973, 12973)
	end()
	require.Contains(t, stderr.String(), "12973/12973 messages")
	require.NotContains(t, stderr.String(), "12973/12948")
}
