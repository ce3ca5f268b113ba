package registry

import "time"

// SetRetry shortens the backoff after a failed pass, so a test sees several retries in milliseconds.
func SetRetry(w *Writer, min, max time.Duration) { w.retryMin, w.retryMax = min, max }
