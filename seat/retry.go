package seat

import (
	"context"
	"log/slog"
	"time"
)

// retrying is the backoff of a loop that retries a step until it succeeds (rebuildLoop, relogLoop):
// the first failure is logged by the caller; the waits double from 250 ms up to 30 s; the first
// success after a failure logs "recovered".
type retrying struct {
	log     *slog.Logger
	wait    time.Duration
	failing bool
}

func newRetrying(log *slog.Logger) *retrying {
	return &retrying{log: log, wait: 250 * time.Millisecond}
}

// succeeded says the step succeeded.
func (r *retrying) succeeded() {
	if r.failing {
		r.log.Info("recovered")
	}
	r.failing = false
}

// failed says the step failed, calls logFirst the first time (the caller's own log line, which
// docs/operations.md's table of log lines finds at its call: TestDocs_LogMessages), and waits before
// the next try. It returns false when ctx ended first.
func (r *retrying) failed(ctx context.Context, logFirst func()) bool {
	if !r.failing {
		logFirst()
		r.failing = true
	}
	select {
	case <-ctx.Done():
		return false
	case <-time.After(r.wait):
	}
	r.wait = min(r.wait*2, 30*time.Second)
	return true
}
