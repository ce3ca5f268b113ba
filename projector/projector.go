// Package projector tails the history of NATS JetStream key-value buckets into the store: one ordered
// consumer per bucket on its stream KV_<bucket>, from the first message on a fresh state dir and from the
// checkpoint + 1 after a restart. Messages are applied in batches, each batch with the bucket's
// checkpoint in one Pebble batch, so the checkpoint never runs ahead of the rows; a message delivered
// twice is skipped by its sequence.
//
// Each bucket's consumer is one goroutine reading the stream and one applying batches; both are owned by
// the Projector and stopped by Stop. A bucket that does not exist yet is waited for.
//
// With Options.Composed it also tails every composed-<node> bucket, those there at start and those
// created later, found by a discovery goroutine of its own (discover.go).
package projector

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/denied"
	"github.com/novox/mesh-provisioner/internal/msgget"
	"github.com/novox/mesh-provisioner/internal/streaminfo"
	"github.com/novox/mesh-provisioner/internal/streamread"
	"github.com/novox/mesh-provisioner/store"
)

// Options tune a Projector. The zero value is usable.
type Options struct {
	// Buckets to tail; nil means the four provisioner buckets.
	Buckets []string
	// BatchSize is the most messages applied in one Pebble batch; 0 means 4096.
	BatchSize int
	// PullMessages, when set, is how many messages the consumer asks the server for at once, with no
	// bound in bytes on the pulls (tests that pull a message at a time). 0 bounds the pulls by PullBytes.
	PullMessages int
	// PullBytes bounds by bytes what a bucket's tail holds in memory: the messages its consumer pulled
	// and the reader has not read (streamread.ReadIdle), and the values and keys the reader handed over
	// and the applier has not applied yet. 0 means streamread.PullBytes of the connection, raised to
	// one message of the server's max payload when it is set below: a message larger than the bound
	// would never be pulled.
	PullBytes int
	// Poll is how often an unsynced bucket asks its consumer whether anything is pending, and how soon
	// a missing bucket first asks for its stream again (missing.go); 0 means one second.
	Poll time.Duration
	// Logger receives the projector's log lines; nil discards them.
	Logger *slog.Logger
	// Verify is how often each bucket's stream is checked against the projection while it runs (it
	// was recreated, or purged; see verify.go), and how often the streams' infos are listed for it
	// when the Projector lists them itself; 0 means DefaultVerify.
	Verify time.Duration
	// Streams, when set, is a listing of every stream's info that the owner runs and shares with the
	// Projector (a seat's, shared with its other projector during a rebuild and with its lag metric),
	// listing at least every Verify; the Projector then lists nothing itself. Nil: the Projector lists
	// the streams every Verify on a goroutine of its own.
	Streams *streaminfo.Poller
	// OnReset is called when a bucket's stream can no longer be resumed from the checkpoint (it was
	// recreated or deleted, or messages past the checkpoint were removed before they were read). The
	// consumer of that bucket stops; the owner rebuilds. Nil logs and keeps waiting. A composed-<node>
	// bucket never calls it: it is forgotten in place, and read again from its stream's first message
	// when the stream still exists (forget.go).
	OnReset func(bucket string, reason error)
	// OnTailError, when set, is told each failure of a bucket's tail that is retried with backoff (a
	// consumer that cannot be created or read: permissions, NATS unreachable), so an owner that must
	// end (a command) can give up and say why. A stream not created yet is not one.
	OnTailError func(bucket string, err error)
	// Composed tails every composed-<node> bucket too: those found at start, those created later
	// (discover.go), and those the projection holds, so that one deleted meanwhile is found so.
	Composed bool
	// DiscoverEvery is how often the streams are listed for new composed-<node> buckets; 0 means 30
	// seconds. Stream-created advisories pick a new bucket up at once in between.
	DiscoverEvery time.Duration
	// AskPerSecond bounds the STREAM.INFO requests the stream checks of composed-<node> buckets send
	// when the listing has nothing new for them (it fails, say for a user without
	// $JS.API.STREAM.LIST): at most this many a second, so that thousands of buckets do not mean
	// hundreds of requests a second; 0 means DefaultAskPerSecond. The other buckets always ask.
	AskPerSecond int
	// ParkAfter is how long a composed-<node> bucket stays idle (synced, nothing new read, or its
	// stream taking no message) before it gives its consumer up and waits on the stream listing for
	// its stream to change (park.go): a bucket read from a stream quiet that long already parks once
	// it has read it. 0 means DefaultParkAfter, negative never.
	ParkAfter time.Duration
}

// DefaultParkAfter is Options.ParkAfter when it is 0.
const DefaultParkAfter = 30 * time.Second

// DefaultAskPerSecond is Options.AskPerSecond when it is 0: with 4,000 composed-<node> buckets and no
// listing, each is checked about every 200 s.
const DefaultAskPerSecond = 20

// DefaultVerify is how often each bucket's stream is checked when Options.Verify is 0.
const DefaultVerify = 10 * time.Second

// ErrCannotResume says a bucket's stream no longer holds what the checkpoint follows on from.
var ErrCannotResume = errors.New("projector: cannot resume from checkpoint")

// Projector tails buckets into a store.
type Projector struct {
	js   jetstream.JetStream
	db   *store.DB
	opts Options
	log  *slog.Logger

	cancel context.CancelFunc
	wg     sync.WaitGroup

	applied atomic.Int64 // messages applied since New, over all buckets

	mu         sync.Mutex
	tailed     map[string]bool          // buckets with a consumer, so Add starts each once
	asks       map[string]chan struct{} // of each tailed bucket, capacity 1: a request waits on it (Wake, skipRemoved)
	askedAt    map[string]time.Time     // of each bucket, when a request last waited on it (Wake, TakeAsked): skipRemoved is tried until askedFor after
	ends       map[string]streamEnd     // of each bucket, the end its newest tail's stream info said as it started (RemovedEnds)
	waiting    map[string]chan struct{} // missing buckets, woken by a stream-created advisory (missing.go)
	found      chan string              // streams created, from the advisories, for discover
	discovered atomic.Bool              // the streams were listed once (always true without Composed)
	setup      chan struct{}            // bounds consumers being set up at once: a mesh starts thousands
	retrySetup chan struct{}            // the same, for the buckets whose tail is failing (settingUp)

	streams    *streaminfo.Poller // every stream's info, listed every Verify or shared, for verify
	ownStreams bool               // streams is the Projector's own: Start runs it

	askMu   sync.Mutex
	lastAsk time.Time // the last slot a composed-<node> bucket's check reserved to ask its stream (mayAsk)

	missing sync.Map // bucket -> when its stream was first found missing, not found since (forget.go)
	failing sync.Map // bucket -> *failures: its tail's failures in a row; see Failing
	// expiredUnmarked holds the composed-<node> buckets to read again for a TTL'd put that expired
	// without a marker (expire.go).
	expiredUnmarked sync.Map
	// expireAsks counts the asks of expireLoop (ExpireAsks, for tests and benchmarks): a direct get of
	// many keys is one.
	expireAsks atomic.Int64
	// expireBehind counts the direct gets of expireLoop whose answer was not used: the replica that gave
	// it said it had not stored every message the projection applied (ExpireBehind, for tests).
	expireBehind atomic.Int64
	// expireNoDirect holds, by bucket, until when its stream is asked by its leader alone (expire.go);
	// the expire loop's alone.
	expireNoDirect map[string]time.Time
	// expireDirectOff has the expire loop ask streams' leaders alone (SetExpireDirect, for tests).
	expireDirectOff bool

	parkMu  sync.Mutex
	parked  map[string]*parkedBucket // idle composed-<node> buckets without a consumer (park.go)
	asked   map[string]time.Time     // when a request last waited on a composed-<node> bucket (Wake): it parks ParkAfter after
	pruneAt int                      // asked is pruned of requests older than ParkAfter once it holds this many

	started     time.Time     // when Start ran: a listing started after it shows each stream since start
	firstListed chan struct{} // closed once discover's first pass has its listing, or has none (parkAtStart)
	listedOnce  sync.Once

	afterForget    func(bucket string)                      // tests: called as a forgotten bucket's forgetting has committed
	afterParkRead  func(bucket string)                      // tests: called as a parking bucket has read its stream's info
	beforeParkRead func(bucket string)                      // tests: called as a parking bucket is registered, before it reads that info
	aged           func(bucket string) time.Duration        // tests: added to how long a bucket's stream has been quiet (quietSince)
	beforeRun      func(bucket string)                      // tests: called as a bucket's goroutine starts
	beforePending  func(bucket string, seq, pending uint64) // tests: called between handing a message over and its pending count
}

// New returns a Projector; Start runs it.
func New(js jetstream.JetStream, db *store.DB, opts Options) *Projector {
	if opts.Buckets == nil {
		for _, s := range provisioner.ProvisionerShapes {
			opts.Buckets = append(opts.Buckets, s.Bucket)
		}
	}
	if opts.BatchSize <= 0 {
		opts.BatchSize = 4096
	}
	if opts.PullMessages < 0 {
		opts.PullMessages = 0
	}
	if opts.Poll <= 0 {
		opts.Poll = time.Second
	}
	if opts.Verify <= 0 {
		opts.Verify = DefaultVerify
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if opts.AskPerSecond <= 0 {
		opts.AskPerSecond = DefaultAskPerSecond
	}
	if opts.DiscoverEvery <= 0 {
		opts.DiscoverEvery = 30 * time.Second
	}
	if opts.ParkAfter == 0 {
		opts.ParkAfter = DefaultParkAfter
	}
	p := &Projector{js: js, db: db, opts: opts, log: log, tailed: map[string]bool{}, asks: map[string]chan struct{}{}, askedAt: map[string]time.Time{}, ends: map[string]streamEnd{},
		setup: make(chan struct{}, maxSettingUp), retrySetup: make(chan struct{}, maxRetrySettingUp),
		streams: opts.Streams, waiting: map[string]chan struct{}{}, found: make(chan string, 256), parked: map[string]*parkedBucket{},
		firstListed: make(chan struct{})}
	if p.streams == nil {
		p.streams, p.ownStreams = streaminfo.New(js), true
	}
	p.discovered.Store(!opts.Composed)
	return p
}

// Applied is how many messages this Projector applied (skipped repeats not counted).
func (p *Projector) Applied() int64 { return p.applied.Load() }

// Start runs one consumer per bucket until Stop or ctx ends.
func (p *Projector) Start(ctx context.Context) {
	p.started = time.Now()
	ctx, p.cancel = context.WithCancel(ctx)
	if p.ownStreams {
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			p.streams.Run(ctx, p.opts.Verify, p.log.With("component", "verify"))
		}()
	}
	p.watchCreated(ctx)
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		p.expireLoop(ctx)
	}()
	for _, b := range p.opts.Buckets {
		p.Add(ctx, b)
	}
	if p.opts.Composed {
		// The composed-<node> buckets the projection holds, whether or not their streams still exist:
		// one deleted meanwhile is found missing, and its projection given up (runBucket).
		for _, b := range p.db.Buckets() {
			if provisioner.IsComposedBucket(b) && p.db.Checkpoint(b).Applied > 0 {
				p.Add(ctx, b)
			}
		}
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			p.discover(ctx)
		}()
		if p.opts.ParkAfter > 0 {
			p.wg.Add(1)
			go func() {
				defer p.wg.Done()
				p.watchParked(ctx)
			}()
		}
	}
}

// Add starts tailing one more bucket under the Projector's ownership (composed-<node> buckets found
// while running). ctx must be the one Start derived, or one below it. A bucket already tailed is not
// started twice.
func (p *Projector) Add(ctx context.Context, bucket string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.tailed[bucket] || ctx.Err() != nil {
		return
	}
	p.tailed[bucket] = true
	p.asks[bucket] = make(chan struct{}, 1)
	// Registered here, not on its goroutine: the verb answers once Start returns, and a Wake that
	// comes before the goroutine runs must be kept (parkstart.go).
	starting := p.startsParked(bucket)
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		p.runBucket(ctx, bucket, starting)
	}()
}

// Stop stops every consumer and waits until each has committed its last batch.
func (p *Projector) Stop() {
	if p.cancel != nil {
		p.cancel()
	}
	p.wg.Wait()
}

// runBucket waits for the bucket's stream, tails it, and starts over after a failure, with a backoff
// that doubles up to a cap. The first failure is logged, and "recovered" once it works again. starting
// is the bucket's registration as a bucket that may start parked (startsParked), or nil.
func (p *Projector) runBucket(ctx context.Context, bucket string, starting *parkedBucket) {
	if p.beforeRun != nil {
		p.beforeRun(bucket)
	}
	log := p.log.With("bucket", bucket)
	bo := backoff{min: 100 * time.Millisecond, max: 5 * time.Second}
	missing := p.missingBackoff()
	created, stopWaiting := p.waitCreated(bucket) // stream-created advisories of its stream (awaitStream)
	defer stopWaiting()
	failing := false
	defer p.failing.Delete(bucket)
	var parks parking // what one parking leaves the next (park.go)
	if !p.parkAtStart(ctx, bucket, log, created, starting) {
		return
	}
	parks.since = p.started
	if starting != nil {
		parks.since = p.wokenSince(starting)
	}
	for ctx.Err() == nil {
		err := p.tail(ctx, bucket, log, &parks, func() {
			if failing {
				log.Info("recovered")
				failing = false
			}
			p.tailWorks(bucket)
			bo.reset()
			missing.reset()
			// An advisory that came before its stream was read is of this stream: once it is
			// forgotten, leave must not take it for a creation after the deletion (forget.go).
			select {
			case <-created:
			default:
			}
		})
		if ctx.Err() != nil {
			return
		}
		if !errors.Is(err, errParked) {
			// Failed (its consumer lost with its stream deleted, say) or read again: the next tail
			// takes no info read before now (openStream).
			parks.since = time.Now()
		}
		if errors.Is(err, errParked) {
			if !p.park(ctx, bucket, log, &parks) {
				return
			}
			continue
		}
		if errors.Is(err, jetstream.ErrStreamNotFound) && p.db.Checkpoint(bucket).Applied > 0 {
			if cerr := p.streamMissing(bucket); cerr != nil { // else not yet confirmed (forget.go)
				err = cerr
			}
		}
		if errors.Is(err, errForget) {
			if err = p.forget(ctx, bucket, err, created, log); err == nil {
				return
			}
		}
		if errors.Is(err, ErrCannotResume) && provisioner.IsComposedBucket(bucket) {
			// Forgotten in place and read again from its stream's first message, by this goroutine: the
			// bucket stays tailed (forget.go). Backed off, so a stream that keeps changing under each
			// new read is not forgotten in a tight loop.
			if err = p.reread(ctx, bucket, err, log); err == nil {
				if !sleep(ctx, bo.next()) {
					return
				}
				continue
			}
		}
		if errors.Is(err, ErrCannotResume) {
			if p.opts.OnReset != nil {
				p.opts.OnReset(bucket, err)
				return
			}
			log.Error("bucket cannot be resumed; run `mesh-provisioner rebuild`", "err", err)
		} else if errors.Is(err, jetstream.ErrStreamNotFound) && p.db.Checkpoint(bucket).Applied > 0 {
			// Read before, missing now, not yet confirmed (forget.go): ask again once the confirmation
			// window has passed. Waiting on the listing instead (awaitStream) would never look again.
			if !sleep(ctx, p.opts.Verify) {
				return
			}
			continue
		} else if errors.Is(err, jetstream.ErrStreamNotFound) {
			// Not created yet: nothing to catch up with until it is (said once, like any bucket synced).
			seq, _ := p.db.Applied(bucket)
			p.markSynced(bucket, log.With("stream", "not created yet"), seq, time.Now())
			// Nor anything that cannot be read: failures before (a stream never read, then deleted)
			// would name it Unreadable while it waits, for good.
			p.failing.Delete(bucket)
			if !p.awaitStream(ctx, bucket, &missing, created) {
				return
			}
			continue
		} else {
			if p.opts.OnTailError != nil {
				p.opts.OnTailError(bucket, err)
			}
			if !failing {
				log.Warn("tailing failed; retrying with backoff", "err", err)
				failing = true
			}
			if de := (*denied.Error)(nil); errors.As(err, &de) {
				// Refused by NATS: no transient failure, and a tail whose pulls are refused sets its
				// consumer up each try (which ends a count of failures in a row) before it fails.
				p.tailRefused(bucket)
			} else {
				p.tailFailed(bucket)
			}
		}
		if !sleep(ctx, bo.next()) {
			return
		}
	}
}

// tail follows one bucket's stream from the checkpoint until ctx ends or the consumer fails. Unless
// st.again, it may park as soon as its stream is found quiet for ParkAfter (park.go), not ParkAfter
// after it last read; a tail that parks having read its stream to the end its info said (the end
// itself may be no message: removed) sets st.behind to it (park).
func (p *Projector) tail(ctx context.Context, bucket string, log *slog.Logger, st *parking, ok func()) error {
	early := !st.again
	if err := p.awaitRegistry(ctx, bucket); err != nil {
		return err
	}
	batchSize, pull, pullBytes := p.sizes(bucket)
	// Setting up is a few JetStream API requests; at most maxSettingUp buckets do it at once, and
	// maxRetrySettingUp more whose tail is failing (settingUp).
	slots := p.settingUp(bucket)
	select {
	case slots <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	}
	// A request NATS refuses this user is dropped, not answered: the setup's requests end as soon as
	// the connection reports a permissions violation of one of them (a consumer creation not granted
	// for this bucket's stream), naming it, rather than at the JetStream API's timeout each try.
	sctx, unwatch := denied.Context(ctx, p.js.Conn(), denied.OfStream(provisioner.StreamName(bucket)))
	settingUp := true
	release := func() {
		if settingUp {
			settingUp = false
			unwatch()
			<-slots
		}
	}
	defer release()
	stream, info, err := p.openStream(sctx, bucket, st.since)
	if err != nil {
		return denied.Cause(sctx, err)
	}
	p.streamFound(bucket)
	var quiet time.Time // when the stream last took a message, for parking as soon as it is read (park.go)
	if early {
		quiet = p.quietSince(bucket, info)
	}
	cp := p.db.Checkpoint(bucket)
	created := info.Created.UnixNano()
	p.mu.Lock()
	p.ends[bucket] = streamEnd{last: info.State.LastSeq, created: created}
	p.mu.Unlock()
	ver := &verifier{last: time.Now()}
	if err := p.check(sctx, info, bucket, ver); err != nil {
		return denied.Cause(sctx, err)
	}
	verify := func() error {
		if err := p.takeExpired(bucket); err != nil {
			return err
		}
		return p.verify(ctx, bucket, ver)
	}
	// The consumer is created here, under ctx, and created again by runBucket from the checkpoint when
	// it is lost or delivers out of order: internal/streamread says why this is not nats.go's ordered
	// consumer.
	// Named here, so that a creation whose answer does not come (a stop, a JetStream API slow to
	// answer) can be deleted all the same: the server may have created it.
	name := nuid.Next()
	cons, err := streamread.Create(sctx, stream, name, cp.Applied)
	if err != nil {
		if !streamread.Answered(err) {
			p.dropConsumer(ctx, stream, name)
		}
		return denied.Cause(sctx, err)
	}
	nc := p.js.Conn()
	mark := denied.Mark(nc) // the pulls' refusals come after it
	// A pull of this stream's consumers refused since the consumer was made, whichever came last:
	// with other buckets' pulls refused too, the connection's last error was theirs at each miss.
	next := ".CONSUMER.MSG.NEXT." + provisioner.StreamName(bucket) + "."
	pulls := reading{pull: pull, bytes: pullBytes, heartbeat: p.heartbeat(bucket), refused: func() error {
		if v := denied.Since(nc, mark, func(subject string) bool { return strings.Contains(subject, next) }); v != nil {
			return v
		}
		return nil
	}}
	release()
	ok()
	// Nothing past the checkpoint when the consumer was created, after the info was read: the tail is
	// at the info's end already, whatever the sequences between were (idleSince.reachedEnd).
	emptyAtStart := cons.CachedInfo().NumPending == 0

	start := time.Now()
	startSeq := cp.Applied
	if info.State.Msgs == 0 && info.State.LastSeq > cp.Applied {
		// Emptied before it was read (check refuses this past a checkpoint; here the store is new):
		// the messages it held are gone, which the log must know to refuse points among them.
		if err := p.db.TailRemoved(bucket, info.State.LastSeq, created); err != nil {
			return err
		}
	}
	if info.State.Msgs == 0 || info.State.LastSeq <= cp.Applied {
		p.markSynced(bucket, log, startSeq, start)
	}

	// The reader turns NATS messages into store messages; the applier batches and commits them. The
	// channel between them is the pipeline: while one batch commits, the next is read and parsed.
	in := make(chan provisioner.Message, batchSize*2)
	held := newBudget(p.pullBytes()) // the bytes in it and in the batch being applied
	pending := make(chan uint64, 1)  // NumPending after the newest message read
	var atEnd atomic.Uint64          // the newest sequence read with NumPending 0: it closes history gaps
	readErr := make(chan error, 1)
	rctx, rcancel := context.WithCancel(ctx)
	defer rcancel()
	var rwg sync.WaitGroup
	rwg.Add(1)
	go func() {
		defer rwg.Done()
		defer close(in)
		readErr <- p.read(rctx, cons, pulls, bucket, in, held, pending, &atEnd, log)
	}()

	idle := idleSince{read: start, quiet: quiet, end: info.State.LastSeq, start: startSeq, emptyAtStart: emptyAtStart}
	skip := func() bool { return p.skipRemoved(ctx, bucket, created, in, log) }
	applyErr := p.applyLoop(ctx, bucket, batchSize, created, in, held, pending, &atEnd, verify, skip, cons, log, startSeq, idle)
	rcancel()
	rwg.Wait()
	if errors.Is(applyErr, errParked) && idle.reachedEnd(p.db.Checkpoint(bucket).Applied, atEnd.Load()) {
		// What lies between the checkpoint and the info's end was gone before this tail's consumer
		// could deliver it: park need not tail again to find that out.
		st.behind = streamEnd{last: info.State.LastSeq, created: created}
	}
	// Given up on (the next is made afresh) or stopped: deleted either way (dropConsumer).
	p.dropConsumer(ctx, stream, name)
	if applyErr != nil {
		return applyErr
	}
	if err := <-readErr; err != nil && ctx.Err() == nil {
		return err
	}
	return nil
}

// dropConsumer deletes a consumer the bucket no longer reads, in the background (its server may be
// the one that is gone), owned by the Projector: for at most 5 s, or stopDropTimeout once ctx has
// ended (Stop waits that long at most, whatever the number of consumers). One it could not delete goes
// after its inactive threshold (5 minutes). A stop used to leave every consumer to that threshold: a
// seat stopped, or a rebuild abandoned or swapped, while thousands of composed-<node> buckets were
// still reading (a first read, before they park) left the server as many consumers for 5 minutes, and
// a rebuild started again set as many up beside them. A consumer whose creation got no answer is
// deleted too, by the name the tail gave it: a stop during a first read cut the creations under way
// short (up to maxSettingUp), and the server had created some of them.
func (p *Projector) dropConsumer(ctx context.Context, stream consumerHost, name string) {
	timeout := 5 * time.Second
	if ctx.Err() != nil {
		ctx, timeout = context.WithoutCancel(ctx), stopDropTimeout
	}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		dctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		_ = stream.DeleteConsumer(dctx, name)
	}()
}

// stopDropTimeout bounds the deletion of a consumer as its Projector stops (dropConsumer): a stop
// with the server gone waits no longer than this for it.
const stopDropTimeout = time.Second

// consumerHost is the stream a tail creates its consumer on and deletes it from.
type consumerHost interface {
	streamread.Stream
	DeleteConsumer(ctx context.Context, name string) error
}

// namedStream is a stream known by its name alone: its consumers are created and deleted through the
// JetStream context, with no STREAM.INFO asked for a handle.
type namedStream struct {
	js   jetstream.JetStream
	name string
}

func (s namedStream) CreateConsumer(ctx context.Context, cfg jetstream.ConsumerConfig) (jetstream.Consumer, error) {
	return s.js.CreateConsumer(ctx, s.name, cfg)
}

func (s namedStream) DeleteConsumer(ctx context.Context, name string) error {
	return s.js.DeleteConsumer(ctx, s.name, name)
}

// openStream returns the stream a bucket's tail reads, and its info. A composed-<node> bucket takes
// the info the stream listing (or a request of another reader) kept, when one was read since `since`
// and ends at or past the checkpoint (as verify takes it), and creates its consumer by the stream's name:
// a first read of thousands of composed-<node> buckets asked each stream for its info right after the
// listing that found it had read it, and so did every parked bucket a listing woke: one STREAM.INFO in
// five of a first read's requests. The listed info may be a listing interval old: a stream deleted
// since fails the consumer's creation as not found, as the request did; one purged or created again
// since is found by the bucket's next check, on the next listing (verify.go), as one changed just after
// the request was. The seat's fixed buckets, which a recreation sends to a rebuild, ask as before.
//
// since is when the tail's reason to read came (parking.since): Start for a first read, the parking
// for a bucket a listing woke (the listing that saw the change read after it), but the wake-up itself
// for one a request or a stopped listing woke, and the failure for a tail after one. An info read
// before that may be of a stream deleted and created again since (a node reinstalled, then written and
// asked with min_seq; a tail whose consumer went with its deleted stream): a consumer created by
// name on the new stream from the old checkpoint read on past it as if it were the old one, its first
// messages never read and the old stream's keys still answered, until a listing found the recreation
// (TestProjector_WokenBucketOfARecreatedStream). Such a tail asks STREAM.INFO, as before.
func (p *Projector) openStream(ctx context.Context, bucket string, since time.Time) (consumerHost, *jetstream.StreamInfo, error) {
	name := provisioner.StreamName(bucket)
	if provisioner.IsComposedBucket(bucket) {
		if info, read, ok := p.streams.Info(name); ok && !read.Before(since) && info.State.LastSeq >= p.db.Checkpoint(bucket).Applied {
			return namedStream{js: p.js, name: name}, info, nil
		}
	}
	stream, err := p.js.Stream(ctx, name)
	if err != nil {
		return nil, nil, err
	}
	return stream, stream.CachedInfo(), nil
}

func (p *Projector) markSynced(bucket string, log *slog.Logger, from uint64, start time.Time) {
	if _, synced := p.db.Applied(bucket); synced {
		return
	}
	p.db.SetSynced(bucket, true)
	seq, _ := p.db.Applied(bucket)
	log.Info("bucket synced", "applied_seq", seq, "messages", seq-min(seq, from), "took", time.Since(start).Round(time.Millisecond))
}

// reading is how a tail pulls its consumer (streamread.Consume).
type reading struct {
	pull, bytes int
	heartbeat   time.Duration
	refused     func() error
}

// read moves messages from the consumer into in until ctx ends (nil) or the consumer stops; a
// consumer lost (no heartbeat, deleted) or out of order ends it with an error. It reads with
// streamread.Consume, in nats.go's goroutine that delivers them, where a streamread.Reader's Next
// cost nats.go a timer armed and stopped a message (docs/performance.md, session 20; a tail whose
// pulls may hold more than nats.go's Consume keeps, a composed-<node> bucket's counted in messages,
// still reads with Next there); it pulls from here, and stops its pulls as it returns.
func (p *Projector) read(ctx context.Context, cons jetstream.Consumer, r reading, bucket string, in chan<- provisioner.Message, held *budget, pending chan uint64, atEnd *atomic.Uint64, log *slog.Logger) error {
	prefix := provisioner.SubjectPrefix(bucket)
	saidForeign := false // said once per tail
	err := streamread.Consume(ctx, cons, r.pull, r.bytes, r.heartbeat, r.refused, func(msg jetstream.Msg, md *jetstream.MsgMetadata) error {
		m, np, err := convert(msg, md, prefix)
		if err != nil {
			return err
		}
		switch {
		case m.Foreign && m.RemovesOthers():
			// Each one: it emptied the bucket, which an operator looks for in an incident.
			log.Warn("a rollup of the whole stream on a subject that is no key of the bucket removed every key of it",
				"subject", m.Key, "seq", m.Seq)
		case m.Foreign && !saidForeign:
			saidForeign = true
			log.Warn("the bucket's stream holds a subject that is no key of the bucket; such messages are passed over",
				"subject", m.Key, "seq", m.Seq)
		}
		if !held.take(ctx, size(m)) {
			return ctx.Err()
		}
		select {
		case in <- m:
		case <-ctx.Done():
			return ctx.Err()
		}
		if np == 0 {
			atEnd.Store(m.Seq)
		}
		if p.beforePending != nil {
			p.beforePending(bucket, m.Seq, np)
		}
		// Keep only the newest pending count.
		select {
		case <-pending:
		default:
		}
		pending <- np
		return nil
	})
	if ctx.Err() != nil {
		return nil
	}
	return err
}

// convert reads a stream message as the store applies it; it also returns how many messages were
// pending after it.
func convert(msg jetstream.Msg, md *jetstream.MsgMetadata, prefix string) (provisioner.Message, uint64, error) {
	// A subject added to the stream by hand is no key of the bucket (Message.Foreign): passed over,
	// unless it rolls up the whole stream.
	return messageOf(prefix, msg.Subject(), msg.Headers(), msg.Data(), md.Sequence.Stream, md.Timestamp.UnixNano()), md.NumPending, nil
}

// applyLoop takes what the reader has produced, as much as is there up to BatchSize, and commits it as
// one batch; it retries a failed commit of the same batch with backoff. It gives each batch's bytes
// back to held once committed: the reader hands over no more than held's bound (a batch is no larger).
func (p *Projector) applyLoop(ctx context.Context, bucket string, batchSize int, created int64, in <-chan provisioner.Message, held *budget, pending <-chan uint64,
	atEnd *atomic.Uint64, verify func() error, skip func() bool, cons jetstream.Consumer, log *slog.Logger, startSeq uint64, idle idleSince) error {
	start := idle.read
	batch := make([]provisioner.Message, 0, batchSize)
	var lastPending uint64 = 1
	// A bucket far behind its stream holds the store's compactions back until it catches up
	// (store/catchup.go); one that stops is no longer catching up.
	defer p.db.CatchingUp(bucket, 0)
	poll := time.NewTicker(p.opts.Poll)
	defer poll.Stop()
	bo := backoff{min: 50 * time.Millisecond, max: 5 * time.Second}
	endSynced := true // the last batch was committed as the stream's end (synced), or none was
	p.mu.Lock()
	asked := p.asks[bucket]
	p.mu.Unlock()
	// Caught up: the newest message read had nothing pending after it, or none was read and the
	// consumer had nothing to deliver from its creation, or nothing was read for a Poll. A skip does
	// not end that: before, the checkpoint compared with the one the tail started from, and a tail
	// that had skipped a removal but read nothing was never caught up again (a second removal unread,
	// never skipped). Nor does a message pending after the newest read that the stream removed before
	// it was delivered: no message with nothing pending after it comes then, and a tail that waited
	// for one never skipped for a request until the bucket's next write. The gate only keeps a tail
	// that reads from asking the stream; what is skipped is the stream's answer alone (skipRemoved).
	read := false
	caught := func() bool {
		return lastPending == 0 || idle.emptyAtStart && !read || time.Since(idle.read) >= p.opts.Poll
	}
	// A request waits on the bucket: skipRemoved is tried until askedFor after the request's Wake, or
	// until it is done (skippedAll: the stream ends at the checkpoint) and no request came since, at
	// most once a Poll (skipped: the last try), so that a flood of requests costs the stream no more.
	// The request's time is the Projector's, not this tail's: a tail that fails while a request waits
	// (its consumer deleted, NATS restarted) hands it over to the next one, which used to start with
	// no request, and the request waited its whole wait_ms for a 504 whatever the stream then held.
	var skippedAll, skipped time.Time
	trySkip := func() {
		at := p.askedAtTime(bucket)
		if time.Since(at) < askedFor && at.After(skippedAll) && time.Since(skipped) >= p.opts.Poll && len(in) == 0 && caught() {
			skipped = time.Now()
			if skip() {
				skippedAll = skipped
			}
		}
	}
	trySkip() // a request that waits since before this tail
	// A request waits on the bucket while its open history gap holds min_seq requests back with no
	// end asked since the newest jump (store.DB.Held): the stream is asked where it ends, at most once
	// a Poll (holdUntil).
	var holdAsked time.Time
	askHold := func() {
		// Held first: no lock while nothing is held, as on almost every batch.
		if held, until := p.db.Held(bucket); held != 0 && until == 0 && time.Since(holdAsked) >= p.opts.Poll &&
			time.Since(p.askedAtTime(bucket)) < askedFor {
			holdAsked = time.Now()
			p.holdUntil(ctx, bucket, created)
		}
	}
	askHold()
	// The stream's last messages up to the end its info said, removed before they were read (a
	// subject purged, a TTL without a marker, while the seat was down or before a rebuild): checked
	// once this tail has read up to that end (tailRemoved).
	endChecked := false
	checkEnd := func() {
		if endChecked || len(in) != 0 {
			return
		}
		applied := p.db.Checkpoint(bucket).Applied
		if applied >= idle.end {
			endChecked = true
			return
		}
		if idle.reachedEnd(applied, atEnd.Load()) {
			endChecked = p.tailRemoved(ctx, bucket, applied, idle.end, created, log)
		}
	}
	for {
		batch = batch[:0]
		select {
		case m, open := <-in:
			if !open {
				return nil
			}
			batch = append(batch, m)
			read = true
		case np := <-pending:
			// The reader hands a message's pending count over after the message: the count that says
			// the stream's end was read can come after its batch was applied, unsynced, as one of a
			// catch-up. That batch is synced now and the bucket said synced, not at the next poll
			// (a poll of a minute held a needs bucket unsynced that long on a loaded machine:
			// TestProjector_NeedsDoNotWaitAPollForAMissingRegistry).
			lastPending = np
			if np == 0 && len(in) == 0 && !endSynced {
				if err := p.db.Flush(); err == nil {
					endSynced = true
					p.caughtUp(ctx, bucket, atEnd, log)
					p.markSynced(bucket, log, startSeq, start)
				}
			}
			continue
		case <-asked:
			// Only once caught up (caught): while catching up, what is read answers the request, and
			// the applier does not wait on the stream's answers.
			trySkip()
			askHold()
			continue
		case <-poll.C:
			trySkip()
			checkEnd()
			p.caughtUp(ctx, bucket, atEnd, log) // the end may have been read after its batch was applied
			askHold()
			// So may the pending count that says the catch-up is over.
			select {
			case lastPending = <-pending:
			default:
			}
			p.db.CatchingUp(bucket, lastPending+uint64(len(in)))
			_, synced := p.db.Applied(bucket)
			if !synced {
				p.checkSynced(ctx, bucket, cons, log, startSeq, start)
			}
			if err := verify(); err != nil {
				return err
			}
			// Idle: park.go asks the stream whether anything is left to read before it parks.
			if synced && len(in) == 0 && p.idle(bucket, idle, atEnd.Load()) && p.mayPark(bucket) {
				return errParked
			}
			continue
		case <-ctx.Done():
			// The reader stops with ctx; what it already handed over is committed below.
		}
	drain:
		for len(batch) < batchSize {
			select {
			case m, open := <-in:
				if !open {
					break drain
				}
				batch = append(batch, m)
			default:
				break drain
			}
		}
		if len(batch) == 0 {
			return nil
		}
		idle.read = time.Now()
		select {
		case lastPending = <-pending:
		default:
		}
		failing, said := false, false
		// A batch that reaches the stream's end is synced: Pebble keeps unsynced commits in its own
		// WAL buffer, where neither a crash nor a reader of a copy of the state dir (replay --state)
		// would find them. While catching up, batches follow each other and are not synced one by one.
		atStreamEnd := lastPending == 0 && len(in) == 0
		endSynced = atStreamEnd
		p.db.CatchingUp(bucket, lastPending+uint64(len(in)))
		for {
			err := p.db.Apply(bucket, batch, created, atStreamEnd)
			if err == nil {
				break
			}
			if errors.Is(err, store.ErrClosed) {
				return err
			}
			if !failing {
				// A state dir out of room is said once by the store, not once per bucket (store/space.go).
				if said = !errors.Is(err, store.ErrNoSpace); said {
					log.Error("applying a batch failed; retrying with backoff", "err", err, "messages", len(batch))
				}
				failing = true
				// Answers say they are behind until the batch is in (it is marked again once caught up).
				p.db.SetSynced(bucket, false)
			}
			if !sleep(ctx, bo.next()) {
				return err
			}
		}
		if failing {
			if said {
				log.Info("recovered")
			}
			bo.reset()
		}
		held.give(sizeOf(batch))
		p.applied.Add(int64(len(batch)))
		p.caughtUp(ctx, bucket, atEnd, log)
		askHold()
		if lastPending == 0 && len(in) == 0 {
			p.markSynced(bucket, log, startSeq, start)
		}
		if ctx.Err() != nil && len(in) == 0 {
			return nil
		}
	}
}

// askedFor is how long a request waiting on a bucket (Wake) has the tail look for messages removed
// before they were read (skipRemoved): the longest wait_ms a request may ask for.
const askedFor = 10 * time.Second

// skipRemoved moves the bucket's checkpoint over the messages its stream removed before they were read
// (a subject purged, a TTL without a marker, while the seat was down or the bucket parked), when a
// request waits on it (Wake): without it, a request for the sequence of such a message, which no
// message will ever bring, waited its whole wait_ms for a projection as current as the stream and
// was answered 504. The stream says when, in two answers in this order: its info, the last sequence
// L it took; then whether it still holds any message past the checkpoint (a get of the next message
// at or after the checkpoint + 1, on any subject). No message is ever added below a stream's last
// sequence, so when it holds none, every sequence past the checkpoint up to L is gone: the projection
// has applied the stream up to there, and store.DB.SkipRemoved records so, with the log's gap. It is
// called by the applier between batches with nothing handed over left to apply (in is empty). It
// reports whether it is done: the checkpoint reached L, or the stream ends at it already (a request
// waits then for a message still to come, which the tail reads as any other).
//
// When the stream still holds a message past the checkpoint, nothing is skipped: the tail reads that
// message, the gap before it with it. A first version moved the checkpoint up to the message less one,
// but the messages removed before it may be removed by it (a key's purge, a put with Nats-Rollup, a
// put past the bucket's history, each removing the key's earlier messages): a write at A removed by
// its key's purge at B, both unread, was answered for min_seq A at as_of B - 1 without the write,
// which the stream held as the key's value up to B - 1
// (TestSeat_MinSeqOfAWriteALaterMessageRemovedWaitsForThatMessage): a lost write, where waiting for B
// costs the time the tail takes to read it.
//
// A first version asked the consumer instead, taking nothing pending past what it had delivered for
// nothing left: the server counts a message just stored as pending a moment later, so a client's own
// write was skipped as removed and its read-your-writes request answered without it (1 in 15 runs of
// TestSeat_MinSeqSeesOwnWrite).
func (p *Projector) skipRemoved(ctx context.Context, bucket string, created int64, in chan provisioner.Message, log *slog.Logger) bool {
	// A second for each answer: the applier waits for them (a caught-up one: nothing is left to apply).
	// The stream is asked by its name (the tail may know it by its name alone: openStream).
	ictx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	stream, err := p.js.Stream(ictx, provisioner.StreamName(bucket))
	if err != nil {
		return false
	}
	info := stream.CachedInfo()
	if info.Created.UnixNano() != created {
		return false
	}
	applied := p.db.Checkpoint(bucket).Applied
	last := info.State.LastSeq
	if last <= applied {
		// Whatever removed a message unread is at or below the checkpoint, read: a request inside
		// the store's open gap is held back no longer (store.DB.Reach).
		p.db.StreamEndsAt(bucket, last)
		return true
	}
	gctx, gcancel := context.WithTimeout(ctx, time.Second)
	defer gcancel()
	// Any message held past the checkpoint, at or past L too (a rollup stored after the info that
	// removed the messages up to L): the tail reads it.
	if _, found, err := p.firstHeld(gctx, bucket, applied+1); err != nil || found || len(in) != 0 {
		return false
	}
	moved, err := p.db.SkipRemoved(bucket, last, created)
	if err != nil {
		// A state dir out of room is said once by the store (store/space.go), not at each try.
		if !errors.Is(err, store.ErrClosed) && !errors.Is(err, store.ErrNoSpace) {
			log.Warn("recording the messages removed before they were read failed", "err", err, "last_seq", last)
		}
		return false
	}
	if moved {
		log.Debug("the stream's messages past the checkpoint were removed before they were read: applied up to its last", "applied_seq", last)
	}
	return moved
}

// tailRemoved records, once a tail has read its stream up to the last sequence its info said (last)
// and applied up to applied below it, that the messages between were removed before they were read
// (store.DB.TailRemoved: an open gap from applied + 1), when the stream's leader holds no message past
// applied (firstHeld: the count of messages pending after a message can be short, see caughtUp).
// Without it the log answered a point among them (the verb's at, replay --state) as of applied, as if
// they had never been written, while the streams' own read and their archive refuse it: seq:3 of a
// stream whose third message, a put, was purged before the seat read it answered without that put.
// The checkpoint does not move (skipRemoved moves it for a request that waits on it). It reports
// whether it is done: recorded, or a message is held past applied (the tail reads it, and its jump
// records the gap); false when the stream could not be asked, to ask again at the next poll. A request
// NATS refuses this user (STREAM.MSG.GET not granted, which only min_seq answers need: docs/accounts.md)
// is done too, as soon as the connection reports it: asked again at each poll, each try waited out
// its second with the applier stalled and a permissions violation said, for as long as the tail ran
// (TestProjector_RemovedEndCheckRefusedIsNotAskedEachPoll). The end is left unrecorded then.
func (p *Projector) tailRemoved(ctx context.Context, bucket string, applied, last uint64, created int64, log *slog.Logger) bool {
	dctx, unwatch := denied.Context(ctx, p.js.Conn(), func(subject string) bool {
		return strings.HasSuffix(subject, ".STREAM.MSG.GET."+provisioner.StreamName(bucket))
	})
	defer unwatch()
	gctx, cancel := context.WithTimeout(dctx, time.Second)
	defer cancel()
	if _, found, err := p.firstHeld(gctx, bucket, applied+1); err != nil || found {
		if err != nil && ctx.Err() == nil && dctx.Err() != nil {
			log.Debug("the stream's end was not checked for messages removed before they were read", "err", denied.Cause(dctx, err))
			return true
		}
		return err == nil
	}
	if err := p.db.TailRemoved(bucket, last, created); err != nil {
		// A state dir out of room is said once by the store (store/space.go), not at each poll.
		if !errors.Is(err, store.ErrClosed) && !errors.Is(err, store.ErrNoSpace) {
			log.Warn("recording the messages removed before they were read failed", "err", err, "last_seq", last)
		}
		return false
	}
	log.Debug("the stream's last messages were removed before they were read", "applied_seq", applied, "last_seq", last)
	return true
}

// RemovedEnds records, for each bucket keep keeps, the last messages of its stream removed before they
// were read, as tailRemoved does, once the Projector has stopped: up to the end its newest tail's
// stream info said as it started, past the applied sequence, when the stream's leader holds no message
// past that sequence (firstHeld). A fill (replay.Fill, replay.FromNATS) stops as soon as each bucket
// has read what its stream holds, before a tail's own check of its end had a poll to run, and the
// composed-<node> buckets it found by listing are named nowhere else: their removed end went
// unrecorded, and a rebuilt state dir or a --nats read answered a point among the removed messages as
// if they had never been written. Each bucket with such an end costs one STREAM.MSG.GET; the others
// cost nothing. A stream that cannot be asked leaves its bucket as it is, said (a seat reading the
// state dir records it once its tail has read that end); a refusal of the request by NATS ends the
// asking at once, said once. Only the store's errors are returned.
func (p *Projector) RemovedEnds(ctx context.Context, keep func(bucket string) bool) error {
	p.mu.Lock()
	ends := maps.Clone(p.ends)
	p.mu.Unlock()
	dctx, unwatch := denied.Context(ctx, p.js.Conn(), func(subject string) bool { return strings.Contains(subject, ".STREAM.MSG.GET.") })
	defer unwatch()
	for _, bucket := range slices.Sorted(maps.Keys(ends)) {
		end := ends[bucket]
		if !keep(bucket) {
			continue
		}
		cp := p.db.Checkpoint(bucket)
		if end.last <= cp.Applied || cp.StreamCreated != 0 && cp.StreamCreated != end.created {
			continue
		}
		gctx, cancel := context.WithTimeout(dctx, 5*time.Second)
		_, found, err := p.firstHeld(gctx, bucket, cp.Applied+1)
		cancel()
		if err != nil {
			err = denied.Cause(dctx, err)
			if ctx.Err() != nil {
				return nil
			}
			refused := dctx.Err() != nil // the buckets after it are not asked
			p.log.Warn("the stream's removed end was not recorded: a point among its removed messages is answered as if they had never been written",
				"bucket", bucket, "applied_seq", cp.Applied, "last_seq", end.last, "err", err, "asking_stopped", refused)
			if refused {
				return nil
			}
			continue
		}
		if found {
			continue
		}
		if err := p.db.TailRemoved(bucket, end.last, end.created); err != nil {
			return fmt.Errorf("%s: record the removed end: %w", bucket, err)
		}
	}
	return nil
}

// firstHeld asks a bucket's stream for the sequence of the first message it holds at or after from,
// any subject; found is false when it holds none. It asks the stream's leader (STREAM.MSG.GET), never a
// direct get: a KV stream allows direct gets, which any replica answers from what it holds, and a
// follower that has not yet stored a message the leader took (and its info counted) would say there is
// none, and skipRemoved would skip a live write.
func (p *Projector) firstHeld(ctx context.Context, bucket string, from uint64) (seq uint64, found bool, err error) {
	m, found, err := msgget.Get(ctx, p.js.Conn(), APIPrefix(p.js), provisioner.StreamName(bucket), msgget.Request{Seq: from, Next: ">"})
	var ae *msgget.APIError
	switch {
	case errors.As(err, &ae) && ae.Code == 404: // no stream either
		return 0, false, nil
	case err != nil || !found:
		return 0, false, err
	case m.Seq < from:
		return 0, false, fmt.Errorf("message get: message %d in the answer, asked from %d", m.Seq, from)
	}
	return m.Seq, true, nil
}

// APIPrefix is the prefix of js's JetStream API subjects, as nats.go builds it.
func APIPrefix(js jetstream.JetStream) string {
	switch o := js.Options(); {
	case o.Domain != "":
		return "$JS." + o.Domain + ".API."
	case o.APIPrefix != "":
		return strings.TrimSuffix(o.APIPrefix, ".") + "."
	}
	return jetstream.DefaultAPIPrefix
}

// idleSince is how long a tail has been idle (park.go): read is when it last applied a batch (or
// started); quiet, when its stream last took a message as its info said when the tail started (zero:
// not known, or not to be used), and end that info's last sequence; start is the checkpoint the tail
// started from, and emptyAtStart says its consumer had nothing to deliver past it when created.
type idleSince struct {
	read         time.Time
	quiet        time.Time
	end          uint64
	start        uint64
	emptyAtStart bool
}

// reachedEnd reports whether a tail that has applied up to applied has read its stream up to the end
// its info said, and nothing past it. The end itself need not be a message (its last message deleted,
// purged, expired by its TTL or removed by a rollup): the tail is at it once it has applied a message
// the consumer said had nothing pending after it (atEnd, the newest such), or applied nothing while its
// consumer had nothing to deliver from its creation, as long as that is not past the end. Before, only
// a checkpoint at the end's sequence itself counted, which such a stream never gives.
func (idle idleSince) reachedEnd(applied, atEnd uint64) bool {
	if applied == idle.end {
		return true
	}
	caught, ok := atEnd, atEnd != 0
	if !ok && idle.emptyAtStart {
		caught, ok = idle.start, true
	}
	return ok && applied == caught && caught <= idle.end
}

// idle reports whether a tail has been idle for ParkAfter: it has read nothing for that long, or its
// stream had taken nothing for that long when the tail started and the tail has read nothing past it
// (a message after the info, read, makes the bucket one written just now); and no request has waited
// on the bucket for that long either (Wake).
func (p *Projector) idle(bucket string, idle idleSince, atEnd uint64) bool {
	if time.Since(idle.read) < p.opts.ParkAfter &&
		(idle.quiet.IsZero() || time.Since(idle.quiet) < p.opts.ParkAfter || !idle.reachedEnd(p.db.Checkpoint(bucket).Applied, atEnd)) {
		return false
	}
	return !p.askedRecently(bucket) // a request waits on it, maybe for a write still to come (Wake)
}

// caughtUp tells the store the newest message read as the stream's last: it closes any history gap
// opened before it (store/doc.go).
//
// While the gap holds min_seq requests back (store.DB.Reach: what removed its messages may not be
// read), the stream is asked first: the server's count of messages pending after a message can be
// short (after the history limit removed a message while the consumer was paused, a message with one
// more held after it now and then says none), and a request for a write that message removed was
// answered without it. A stream past the message sets where the requests wait until instead
// (store.DB.HoldUntil); one STREAM.INFO a jump, only then.
func (p *Projector) caughtUp(ctx context.Context, bucket string, atEnd *atomic.Uint64, log *slog.Logger) {
	end := atEnd.Load()
	if end == 0 {
		return
	}
	if held, until := p.db.Held(bucket); held != 0 {
		if until != 0 || end > p.db.Checkpoint(bucket).Applied {
			return // the checkpoint reaching until clears it; a message not applied yet closes nothing
		}
		ictx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		info, err := p.js.Stream(ictx, provisioner.StreamName(bucket))
		if err != nil {
			return // asked again at the next batch or poll
		}
		if last := info.CachedInfo().State.LastSeq; last > end {
			p.db.HoldUntil(bucket, held, last)
			return
		}
	}
	if err := p.db.CaughtUp(bucket, end); err != nil && !errors.Is(err, store.ErrClosed) {
		log.Warn("recording the end of a history gap failed", "err", err)
	}
}

// holdUntil asks the stream where it ends for a bucket whose open history gap holds min_seq requests
// back (store.DB.Held) and tells the store (store.DB.HoldUntil): the messages the gap lacks were
// removed before the newest jump was delivered, so whatever removed them is at or below the stream's
// last sequence now, and the hold ends once the checkpoint reaches it with no jump since. Only
// caughtUp asked before, after a message the consumer said was the last had been read by this tail:
// a bucket written on and on, on a tail that started behind it (a restart, a rebuild, a tail after
// a failure), never gives one, and every min_seq from the gap on waited its whole wait_ms for a 504,
// the request's own write applied (TestProjector_HoldOfAGapIsReleasedWithoutAnEndRead). Asked while
// a request waits on the bucket (Wake), at most once a Poll: an unasked bucket costs the stream
// nothing.
func (p *Projector) holdUntil(ctx context.Context, bucket string, created int64) {
	held, until := p.db.Held(bucket)
	if held == 0 || until != 0 {
		return
	}
	ictx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	stream, err := p.js.Stream(ictx, provisioner.StreamName(bucket))
	if err != nil {
		return // asked again at the next poll while the request waits
	}
	info := stream.CachedInfo()
	if info.Created.UnixNano() != created {
		return // created again: the tail's checks send it to a rebuild
	}
	p.db.HoldUntil(bucket, held, info.State.LastSeq)
}

// checkSynced asks the consumer whether anything is left for it: messages at the stream's end may have
// been removed, so no message with NumPending 0 ever comes.
func (p *Projector) checkSynced(ctx context.Context, bucket string, cons jetstream.Consumer, log *slog.Logger, startSeq uint64, start time.Time) {
	ictx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	ci, err := cons.Info(ictx)
	if err != nil {
		return
	}
	seq, _ := p.db.Applied(bucket)
	if ci.NumPending == 0 && seq >= ci.Delivered.Stream {
		// Its last batch was applied as one of a catch-up, not synced: it is made durable before the
		// bucket says synced (a first fill's store without a log flushes its memtables).
		if err := p.db.Flush(); err != nil {
			return // asked again at the next poll
		}
		p.markSynced(bucket, log, startSeq, start)
	}
}

type backoff struct {
	min, max, cur time.Duration
}

func (b *backoff) next() time.Duration {
	if b.cur == 0 {
		b.cur = b.min
	} else if b.cur *= 2; b.cur > b.max {
		b.cur = b.max
	}
	return b.cur
}

func (b *backoff) reset() { b.cur = 0 }

// sleep waits d or until ctx ends, and reports whether ctx is still live.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// FailingAfter is how many failures in a row make a bucket's tail Failing: one failure is often
// transient (a first consumer creation that timed out on a loaded server), and a seat that said ready
// on it answered that node's plans unsynced, then went unready again once the retry worked. A
// permission NATS refused is not: it makes the tail Failing at once (tailRefused).
const FailingAfter = 3

// failures are a bucket's tail's failures in a row.
type failures struct {
	n     atomic.Int64
	works atomic.Bool // the tail works again since the last of them (tailWorks), the bucket not caught up yet
}

// Failing reports whether a bucket's tail failed FailingAfter times in a row ("tailing failed;
// retrying with backoff": NATS unreachable, a permission missing, a stream that does not answer) and
// the bucket has not caught up with its stream since: a tail that works again stays Failing while it
// catches up, so readiness, which does not wait for a Failing composed bucket, does not flip back.
func (p *Projector) Failing(bucket string) bool {
	v, ok := p.failing.Load(bucket)
	if !ok || v.(*failures).n.Load() < FailingAfter {
		return false
	}
	if _, synced := p.db.Applied(bucket); synced {
		if v.(*failures).works.Load() {
			p.failing.CompareAndDelete(bucket, v)
		}
		return false
	}
	return true
}

// Unreadable lists, in byte order, the buckets whose tail failed FailingAfter times in a row and has
// not worked since, synced or not (one read before and idle for days, whose stream then changed and
// can no longer be read, is synced and behind), and those Failing. The metrics name the composed ones
// in /readyz: nothing else says which node's bucket cannot be read but the log line of its first
// failure.
func (p *Projector) Unreadable() []string {
	var out []string
	p.failing.Range(func(k, v any) bool {
		f := v.(*failures)
		if f.n.Load() < FailingAfter {
			return true
		}
		if _, synced := p.db.Applied(k.(string)); !f.works.Load() || !synced {
			out = append(out, k.(string))
		} else {
			p.failing.CompareAndDelete(k, v) // read again and caught up since
		}
		return true
	})
	sort.Strings(out)
	return out
}

// settingUp returns the slots a bucket's tail takes one of to set its consumer up: those of the
// buckets whose tail is Failing and has not worked since, or the others'. A set-up that gets no answer
// holds its slot until the JetStream API's timeout (5 s): the streams of some nodes that the seat may
// not read (a permission missing) or that have no leader (a cluster's server down) set up again and
// again, and took every one of the 16 slots in turn, so that every other node's bucket woken by a
// change, read again, or new waited behind them (TestProjector_FailingBucketsLeaveSetUpToTheOthers).
// They take their own few slots once Failing; their first failures take the others', as any bucket's.
func (p *Projector) settingUp(bucket string) chan struct{} {
	if v, ok := p.failing.Load(bucket); ok {
		if f := v.(*failures); f.n.Load() >= FailingAfter && !f.works.Load() {
			return p.retrySetup
		}
	}
	return p.setup
}

// tailFailed counts one more failure in a row of a bucket's tail. A tail that worked again since the
// last failure and whose bucket has caught up since is Failing no more (whether or not Failing or
// Unreadable was asked meanwhile, which forget it then): this failure is the first of a new row.
func (p *Projector) tailFailed(bucket string) {
	for {
		v, _ := p.failing.LoadOrStore(bucket, new(failures))
		f := v.(*failures)
		if f.works.Swap(false) {
			if _, synced := p.db.Applied(bucket); synced {
				f.n.Store(0)
			}
		}
		f.n.Add(1)
		// Failing or Unreadable may have forgotten it in between (worked again and caught up): count
		// this failure in a new row, not in the one forgotten.
		if cur, ok := p.failing.Load(bucket); ok && cur == v {
			return
		}
	}
}

// tailRefused makes a bucket's tail Failing at once: NATS refused it a permission, which no retry
// mends until someone grants it.
func (p *Projector) tailRefused(bucket string) {
	for {
		v, _ := p.failing.LoadOrStore(bucket, new(failures))
		f := v.(*failures)
		f.works.Store(false)
		if f.n.Load() < FailingAfter {
			f.n.Store(FailingAfter)
		}
		// As in tailFailed: Failing or Unreadable may have forgotten it in between.
		if cur, ok := p.failing.Load(bucket); ok && cur == v {
			return
		}
	}
}

// tailWorks ends a bucket's failures in a row, unless they made it Failing: that lasts until the
// bucket is synced (Failing).
func (p *Projector) tailWorks(bucket string) {
	v, ok := p.failing.Load(bucket)
	if !ok {
		return
	}
	f := v.(*failures)
	if _, synced := p.db.Applied(bucket); synced || f.n.Load() < FailingAfter {
		p.failing.CompareAndDelete(bucket, v)
		return
	}
	f.works.Store(true)
}

// Buckets lists the buckets the Projector tails: those it was started with and those added since, in
// byte order.
func (p *Projector) Buckets() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]string, 0, len(p.tailed))
	for b := range p.tailed {
		out = append(out, b)
	}
	sort.Strings(out)
	return out
}

// BucketEntries is how many entries the Projector's per-bucket maps hold, by map: each bucket it
// tails has at most one in each, and a bucket it no longer tails (forgotten) none. A soak test watches
// them stay bounded while buckets come and go.
func (p *Projector) BucketEntries() map[string]int {
	out := map[string]int{}
	p.mu.Lock()
	out["tailed"], out["asks"], out["askedAt"], out["ends"], out["waiting"] = len(p.tailed), len(p.asks), len(p.askedAt), len(p.ends), len(p.waiting)
	p.mu.Unlock()
	p.parkMu.Lock()
	out["parked"], out["asked"] = len(p.parked), len(p.asked)
	p.parkMu.Unlock()
	count := func(m *sync.Map) (n int) {
		m.Range(func(any, any) bool { n++; return true })
		return n
	}
	out["missing"], out["failing"] = count(&p.missing), count(&p.failing)
	return out
}

// EachBucket calls fn for every bucket the Projector tails, as Buckets lists them but in no order and
// without a copy, until fn returns false; it reports whether fn returned true for all. fn must not
// call the Projector. A plans answer across every node asks it on every page: with thousands of
// composed-<node> buckets, Buckets' sorted copy cost more than the page (1.9 ms at 4,000).
func (p *Projector) EachBucket(fn func(bucket string) bool) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for b := range p.tailed {
		if !fn(b) {
			return false
		}
	}
	return true
}

// Listed returns the number of messages the stream listing found in a bucket's stream; ok is false
// when no listing or request has returned it (yet).
func (p *Projector) Listed(bucket string) (msgs uint64, ok bool) {
	info, _, ok := p.streams.Info(provisioner.StreamName(bucket))
	if !ok {
		return 0, false
	}
	return info.State.Msgs, true
}

// Tails reports whether the Projector has a consumer for a bucket.
func (p *Projector) Tails(bucket string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.tailed[bucket]
}

// awaitRegistry holds the needs back until the registry has caught up, when this Projector tails both:
// a need's unanswered-kind is judged against the registry, and needs applied before it would all be
// raised and then cleared again, a burst of writes and of tombstones in the anomaly rows that later
// scans would have to step over.
func (p *Projector) awaitRegistry(ctx context.Context, bucket string) error {
	if bucket != provisioner.BucketNeeds || !slices.Contains(p.opts.Buckets, provisioner.BucketRegistry) {
		return nil
	}
	for {
		changed := p.db.Changed(provisioner.BucketRegistry)
		if _, synced := p.db.Applied(provisioner.BucketRegistry); synced {
			return nil
		}
		select {
		case <-changed:
		case <-time.After(p.opts.Poll):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}
