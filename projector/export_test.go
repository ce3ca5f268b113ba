package projector

import (
	"testing"
	"time"
)

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

// SetBeforeParkRead has fn called each time an idle bucket that parks has registered as parked,
// before it reads its stream's info (park.go): a message written there is in that info. Set it before
// Start.
func SetBeforeParkRead(p *Projector, fn func(bucket string)) { p.beforeParkRead = fn }

// SetAged has fn's duration added to how long each bucket's stream has taken no message, as its tail
// reads it (park.go, quietSince): a test of a stream quiet for longer than a long ParkAfter does not
// wait for it. Set it before Start.
func SetAged(p *Projector, fn func(bucket string) time.Duration) { p.aged = fn }

// ExpireAsks is how many times expireLoop asked a stream for a key's last message.
func ExpireAsks(p *Projector) int64 { return p.expireAsks.Load() }

// ExpireBehind is how many of expireLoop's direct gets were answered by a replica behind the projection
// (an up-to sequence below the applied one), and not used.
func ExpireBehind(p *Projector) int64 { return p.expireBehind.Load() }

// SetExpireDirect has the expire loop ask about many keys by one direct get first (on, the default), or
// ask the streams' leaders alone. Set it before Start.
func SetExpireDirect(p *Projector, on bool) { p.expireDirectOff = !on }

// RefreshListing has the stream listing the Projector reads run now rather than at its next interval
// (streaminfo.Poller.Refresh): a test whose listing runs every hour, so that no stall of a loaded
// machine looks like a listing that stopped (listingRuns), asks for the next listing when it needs it.
func RefreshListing(p *Projector) { p.streams.Refresh() }

// SetExpireAsk bounds each ask of every Projector's expire loop by d rather than 5 s until the test
// ends: a test of a direct get never answered does not wait 5 s for it. The bound is the package's:
// not for a test that runs in parallel.
func SetExpireAsk(t testing.TB, d time.Duration) {
	old := expireAsk
	expireAsk = d
	t.Cleanup(func() { expireAsk = old })
}
