package replay_test

import (
	"os"
	"testing"

	"github.com/novox/mesh-provisioner/internal/natstest"
)

// TestMain runs four of the package's parallel tests at once: they mostly wait on their servers and
// consumers rather than compute (natstest.Parallel). Those that set TMPDIR, a package variable or
// replay.SetOnFatal stay sequential.
func TestMain(m *testing.M) {
	natstest.Parallel(4)
	os.Exit(m.Run())
}
