package query

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestMicroVersion: whatever the binary was built with, micro gets a SemVer version (it refuses to
// start the service without one), as close to the built one as SemVer allows.
func TestMicroVersion(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"1.4.0", "1.4.0"},
		{"0.1.0-dev", "0.1.0-dev"},
		{"v1.4.0", "1.4.0"},
		{"v1.4.0-3-gca375a6", "1.4.0-3-gca375a6"},
		{"ca375a6", "0.0.0+ca375a6"},
		{"ca375a6-dirty", "0.0.0+ca375a6-dirty"},
		{"1.4", "0.0.0+1.4"},
		{"build 7 / main", "0.0.0+build-7-main"},
		{"..", "0.0.0"},
		{"", "0.0.0"},
	} {
		got := microVersion(tc.in)
		require.Equal(t, tc.want, got, tc.in)
		require.Regexp(t, semVer, got, tc.in)
	}
}
