package replay

import "time"

// SetFillGiveUp sets how long Fill waits on a stream it cannot read, and returns the undo.
func SetFillGiveUp(d time.Duration) func() {
	old := fillGiveUp
	fillGiveUp = d
	return func() { fillGiveUp = old }
}

// DropPlans removes the temporary store of plans a Log keeps, without closing the Log's store: for
// tests that make a Log of a store they go on using (it would otherwise stay in the system's
// temporary directory). The Log keeps none from then on.
func DropPlans(l *Log) { l.plans.close() }
