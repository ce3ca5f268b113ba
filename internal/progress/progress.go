// Package progress shows how long work is going: on a terminal, one line redrawn in place with a bar,
// the count done, the rate and the time left; elsewhere, a plain log line every few seconds. It is for
// long work: rebuild, replay over many messages, export, the demo load.
package progress

import (
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"sync"
	"time"
)

// Bar reports progress of a count towards a total (0 when the total is not known).
type Bar struct {
	mu    sync.Mutex
	w     io.Writer
	log   *slog.Logger
	label string
	unit  string
	total int64
	done  int64
	start time.Time
	last  time.Time
	tty   bool
	every time.Duration
	ended bool
	now   func() time.Time
}

// New returns a Bar writing to w when w is a terminal, and logging to log (at info) otherwise; a nil
// log and a w that is no terminal make it quiet.
func New(w io.Writer, log *slog.Logger, label, unit string, total int64) *Bar {
	b := &Bar{w: w, log: log, label: label, unit: unit, total: total, every: 5 * time.Second, now: time.Now}
	b.tty = IsTerminal(w)
	if b.tty {
		b.every = 200 * time.Millisecond
	}
	b.start = b.now()
	b.last = b.start
	return b
}

// IsTerminal reports whether w is a character device (a terminal), or writes to one (Unwrap).
func IsTerminal(w io.Writer) bool {
	if u, ok := w.(interface{ Unwrap() io.Writer }); ok {
		return IsTerminal(u.Unwrap()) // a writer over another, as errors wrap: what it writes to
	}
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// SetEvery changes how often the bar is drawn, or its line logged.
func (b *Bar) SetEvery(d time.Duration) {
	b.mu.Lock()
	b.every = d
	b.mu.Unlock()
}

// SetTotal changes the total, when it becomes known.
func (b *Bar) SetTotal(total int64) {
	b.mu.Lock()
	b.total = total
	b.mu.Unlock()
}

// Set records the count done so far, and draws when it is time.
func (b *Bar) Set(done int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.done = done
	if now := b.now(); now.Sub(b.last) >= b.every {
		b.last = now
		b.draw(false)
	}
}

// Add adds to the count done.
func (b *Bar) Add(n int64) {
	b.mu.Lock()
	done := b.done + n
	b.mu.Unlock()
	b.Set(done)
}

// Done draws the final state and ends the line.
func (b *Bar) Done() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.ended {
		return
	}
	b.ended = true
	b.draw(true)
}

// Line is the text of the current state: label, bar, count, rate, time left.
func (b *Bar) Line() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.line(b.now())
}

func (b *Bar) line(now time.Time) string {
	el := now.Sub(b.start).Seconds()
	rate := 0.0
	if el > 0 {
		rate = float64(b.done) / el
	}
	var s strings.Builder
	s.WriteString(b.label)
	if b.total > 0 {
		frac := float64(b.done) / float64(b.total)
		if frac > 1 {
			frac = 1
		}
		const width = 24
		n := int(frac * width)
		fmt.Fprintf(&s, " [%s%s] %3.0f%%", strings.Repeat("#", n), strings.Repeat(".", width-n), frac*100)
		fmt.Fprintf(&s, " %d/%d %s", b.done, b.total, b.unit)
	} else {
		fmt.Fprintf(&s, " %d %s", b.done, b.unit)
	}
	fmt.Fprintf(&s, " %.0f/s", rate)
	if b.total > 0 && rate > 0 && b.done < b.total {
		left := time.Duration(float64(b.total-b.done) / rate * float64(time.Second))
		fmt.Fprintf(&s, " %s left", left.Round(time.Second))
	} else if b.ended {
		fmt.Fprintf(&s, " in %s", now.Sub(b.start).Round(time.Millisecond))
	}
	return s.String()
}

func (b *Bar) draw(final bool) {
	now := b.now()
	if b.tty {
		end := ""
		if final {
			end = "\n"
		}
		fmt.Fprintf(b.w, "\r\033[K%s%s", b.line(now), end)
		return
	}
	if b.log != nil {
		b.log.Info(b.line(now))
	}
}
