package registry

import "time"

// SetRetry shortens the backoff after a failed pass, so a test sees several retries in milliseconds.
func SetRetry(w *Writer, min, max time.Duration) { w.retryMin, w.retryMax = min, max }

// SetWakeGap shortens the least time between passes that wakes ask for.
func SetWakeGap(w *Writer, d time.Duration) { w.wakeGap = d }

// ErrDisconnected ends a pass whose connection dropped.
var ErrDisconnected = errDisconnected
