package projector_test

import (
	"os"
	"testing"

	"github.com/novox/mesh-provisioner/internal/natstest"
)

// TestMain runs four of the package's parallel tests at once: they mostly wait on their servers, polls
// and timeouts rather than compute (natstest.Parallel).
func TestMain(m *testing.M) {
	natstest.Parallel(4)
	os.Exit(m.Run())
}
