package natstest

import (
	"bytes"
	"sync"
)

// LogBuffer is a log destination that a server's or seat's goroutines write to while a test reads
// it: a bytes.Buffer behind a mutex.
type LogBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *LogBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// String is what was written so far.
func (l *LogBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
