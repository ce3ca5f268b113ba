package replay

import "time"

// SetFillGiveUp sets how long Fill waits on a stream it cannot read, and returns the undo.
func SetFillGiveUp(d time.Duration) func() {
	old := fillGiveUp
	fillGiveUp = d
	return func() { fillGiveUp = old }
}
