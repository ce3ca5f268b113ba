package projector

// SetAfterForget has fn called each time a deleted bucket's forgetting has committed, before the
// bucket leaves the tailed ones (forget.go): where a stream created again at that instant used to be
// lost. Set it before Start.
func SetAfterForget(p *Projector, fn func(bucket string)) { p.afterForget = fn }
