package main

import (
	"io"
	"log/slog"
	"time"

	"github.com/novox/mesh-provisioner/internal/progress"
)

// progressEvery is how often a command logs its progress on a stderr that is no terminal; 0 is the
// progress package's 5 s. A variable for tests.
var progressEvery time.Duration

// newBar is the progress of a one-shot command's long read (export, replay from the streams or an
// archive): drawn in place on a terminal, else logged on stderr every few seconds, as rebuild's is. It
// was drawn on a terminal only, so an export or replay run by a script, through kubectl exec or with
// stderr redirected said nothing for the minutes a large mesh takes.
func newBar(stderr io.Writer, label, unit string, total int64) *progress.Bar {
	b := progress.New(stderr, slog.New(slog.NewTextHandler(stderr, nil)), label, unit, total)
	if progressEvery > 0 {
		b.SetEvery(progressEvery)
	}
	return b
}

// lazyBar is the progress callback of a read whose total is known only once it reports (newBar): the
// bar starts at the first report. end ends it, when it started.
func lazyBar(stderr io.Writer, label string) (report func(done, total int64), end func()) {
	var bar *progress.Bar
	report = func(done, total int64) {
		if bar == nil {
			bar = newBar(stderr, label, "messages", total)
		}
		// A total may grow as the read goes (composed-<node> buckets counted once listed): the bar
		// follows it rather than end past it ("12973/12948 messages").
		bar.SetTotal(total)
		bar.Set(done)
	}
	end = func() {
		if bar != nil {
			bar.Done()
		}
	}
	return report, end
}
