package projector

// SetAfterForget has fn called each time a deleted bucket's forgetting has committed, before the
// bucket leaves the tailed ones (forget.go): where a stream created again at that instant used to be
// lost. Set it before Start.
func SetAfterForget(p *Projector, fn func(bucket string)) { p.afterForget = fn }

// SetAfterParkRead has fn called each time an idle bucket that parks has read its stream's info
// (park.go), and each time a bucket that starts parked has found the listing shows it unchanged
// (parkstart.go): where a request's Wake, with a message written after that read, used to be lost.
// Set it before Start.
func SetAfterParkRead(p *Projector, fn func(bucket string)) { p.afterParkRead = fn }

// SetBeforeRun has fn called as a bucket's goroutine starts, before it does anything: a test holds it
// there to stage what comes before it runs. Set it before Start.
func SetBeforeRun(p *Projector, fn func(bucket string)) { p.beforeRun = fn }

// SetBeforePending has fn called as the reader has handed a message over to the applier, before it
// hands over the message's pending count: a test holds it there until the message's batch is applied.
// Set it before Start.
func SetBeforePending(p *Projector, fn func(bucket string, seq, pending uint64)) {
	p.beforePending = fn
}
