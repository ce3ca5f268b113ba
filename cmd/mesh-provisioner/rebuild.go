package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/progress"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/replay"
	"github.com/novox/mesh-provisioner/store"
)

func init() {
	extraCommands["rebuild"] = func(ctx context.Context, m *Main, args []string) error {
		return (&RebuildCommand{Stdout: m.Stdout, Stderr: m.Stderr}).Run(ctx, args)
	}
}

// RebuildCommand rebuilds the state dir from scratch from the buckets' streams.
type RebuildCommand struct {
	Stdout, Stderr io.Writer

	nats  natsFlags
	logs  logFlags
	state string
	plans bool

	opts store.Options // the new generation's store (tests: a disk without room); its Logger is set
}

func (c *RebuildCommand) flags() *flag.FlagSet {
	fs := flag.NewFlagSet("rebuild", flag.ContinueOnError)
	fs.SetOutput(c.Stderr)
	c.nats.register(fs, nats.DefaultURL)
	c.logs.register(fs)
	fs.StringVar(&c.state, "state", "./data/state", "state dir to rebuild")
	fs.BoolVar(&c.plans, "plans", true, "rebuild the plans' inputs too, as serve --plans tails them (--plans=false: do not)")
	fs.Usage = func() {
		fmt.Fprint(c.Stderr, `Usage: mesh-provisioner rebuild [flags]

Builds a fresh projection from the buckets' streams into a new generation beside the current one, and
swaps it in only once every bucket has caught up: killed at any point, the state dir still opens, and
the next rebuild resumes where this one stopped. A running serve holds the state dir; it rebuilds by
itself when a stream can no longer be resumed, so stop it first to rebuild by hand.

The local event log of the replaced generation is not carried over: what the streams no longer hold
is gone with it. Keep it first with: mesh-provisioner export --state DIR --out FILE
A NATS holding none of the provisioner's buckets (the wrong server, or a user of another account)
leaves a state dir that has a projection as it was.

A composed-<node> bucket that cannot be read (a permission missing for its stream, no leader, its
consumer slot taken) does not stop the rebuild: it is swapped in without that bucket, which serve reads
once it can, and the rebuild names it and exits 4. Any other bucket that cannot be read fails it (exit
1, the generation kept to resume).

Example:
  mesh-provisioner rebuild --nats nats://nats.mesh:4222 --state /var/lib/mesh-provisioner/state

Flags:
`)
		fs.PrintDefaults()
	}
	return fs
}

// Run rebuilds.
func (c *RebuildCommand) Run(ctx context.Context, args []string) error {
	fs := c.flags()
	if err := parseNoArgs(fs, args); err != nil {
		return err
	}
	// What the fill writes goes through these: a fill left running past Run (below) writes no more.
	stdout, stderr := newCutWriter(c.Stdout), newCutWriter(c.Stderr)
	log, err := c.logs.logger(stderr)
	if err != nil {
		return err
	}
	if err := store.CheckStateDir(c.state); err != nil {
		return &usageError{msg: err.Error()}
	}
	// A permission the user lacks ends the rebuild at once, naming it; the generation is kept, and
	// nothing is swapped in. But for one composed-<node> bucket's stream: the rebuild goes on without
	// that node's bucket (replay.Fill), names it, and exits incomplete.
	c.nats.spareComposed = c.plans
	ctx, stop := c.nats.stopOnDenied(ctx)
	defer stop()
	// NATS is reached before the state dir is touched: a mistyped --nats leaves it exactly as it was
	// (locking it made the directory and its LOCK).
	nc, err := c.nats.connect(c.nats.url, "mesh-provisioner rebuild", log)
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return fmt.Errorf("jetstream: %w", err)
	}
	sd, err := store.LockState(c.state)
	if errors.Is(err, store.ErrLocked) {
		return fmt.Errorf("%w\na running serve rebuilds by itself when a stream cannot be resumed; stop it to rebuild by hand", err)
	}
	if err != nil {
		return err
	}
	sd.SetLogger(log)
	keep := false // a write held for room: the lock is the fill's, left to the exit (below)
	defer func() {
		if !keep {
			sd.Close()
		}
	}()

	if err := checkRebuildSource(ctx, js, sd, c.nats.url); err != nil {
		return refused(ctx, err)
	}

	// The generation is opened and filled by a goroutine of its own: a write of its store that finds
	// the disk full waits for room (store/space.go), and no stop reaches it there, so a first signal
	// did nothing until the disk had room again, and only a second one stopped the rebuild. A signal
	// that finds such a write held (now, or while the stop goes on) stops at once instead, as a kill
	// would: the goroutine, the generation's store and the state dir's lock are left to the process's
	// exit, and the generation keeps every batch committed, which the next rebuild resumes.
	var filling atomic.Pointer[string] // the generation being opened or filled
	done := make(chan error, 1)
	go func() { done <- c.fill(ctx, js, sd, log, &filling, stdout, stderr) }()
	gen, err := awaitUnlessHeld(ctx, done, func() (string, bool) {
		g := filling.Load()
		return deref(g), g != nil && store.WritesHeldIn(*g)
	})
	if gen == "" {
		return err
	}
	keep = true
	go func() { <-done; sd.Close() }() // the lock goes with the fill; the process's exit comes first
	log.Error("stopping without waiting: the state dir is out of room and a write of the rebuild waits for it", "generation", gen,
		"fix", "free space on that disk (or give --state a larger one), then run rebuild again: it resumes this generation")
	// The fill is left to the process's exit: once there is room it ends, stopped, and says nothing
	// more here (its lines came after Run had returned: "room again", "bucket synced", its bar).
	stdout.cut()
	stderr.cut()
	// A permission NATS refused ends ctx too (stopOnDenied): said as such, not as a stop.
	return fmt.Errorf("rebuild stopped while %s was out of room (the generation is kept; free space, then run rebuild again to resume): %w", gen, refused(ctx, ctx.Err()))
}

// awaitUnlessHeld returns what done says, or, once ctx has ended, the directory held names as soon as
// it reports a write held for room there (polled every heldPoll): the work sending on done waits for
// that room, however long, and is left to the process's exit.
func awaitUnlessHeld(ctx context.Context, done <-chan error, held func() (string, bool)) (string, error) {
	select {
	case err := <-done:
		return "", err
	case <-ctx.Done():
	}
	tick := time.NewTicker(heldPoll)
	defer tick.Stop()
	for {
		if dir, ok := held(); ok {
			return dir, nil
		}
		select {
		case err := <-done:
			return "", err
		case <-tick.C:
		}
	}
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// fill opens the generation to rebuild into (rebuildGeneration), fills it from the streams and swaps
// it in, saying which one it works on in filling.
func (c *RebuildCommand) fill(ctx context.Context, js jetstream.JetStream, sd *store.StateDir, log *slog.Logger, filling *atomic.Pointer[string], stdout, stderr io.Writer) error {
	start := time.Now()
	for attempt := 0; ; attempt++ {
		gen, resumed, err := rebuildGeneration(sd, log)
		if err != nil {
			return err
		}
		filling.Store(&gen)
		opts := c.opts
		if opts.MaxOpenFiles == 0 {
			// Chosen here rather than by the open, to be said with the descriptors it is a share of.
			opts.MaxOpenFiles = store.MaxOpenFiles()
		}
		fds := []any{"nofile", store.FileLimit(), "pebble_max_open_files", opts.MaxOpenFiles}
		if resumed {
			log.Info("resuming a rebuild that did not finish", append([]any{"generation", gen}, fds...)...)
		} else {
			log.Info("rebuilding", append([]any{"generation", gen}, fds...)...)
		}
		opts.Logger = log
		opts.OnFatal = onFatal(log, stderr)
		// Nothing answers from the generation until it is swapped in, after its Close has flushed
		// every memtable: no log, whose bytes were a second, uncompressed copy of all the fill
		// writes. Killed before, it keeps the batches its flushed memtables hold, each with its
		// checkpoint, and the next rebuild resumes from there (docs/decisions.md, h131).
		opts.NoWAL = true
		db, err := store.OpenContext(ctx, gen, opts)
		if err != nil && resumed && store.NeedsRebuild(err) {
			log.Warn("the unfinished rebuild does not open; starting over", "err", err)
			_ = sd.RemoveGeneration(gen, "the unfinished rebuild does not open: "+err.Error())
			continue
		}
		if err != nil && resumed {
			// No room (or no write access) is no fault of the generation: removing it would throw its
			// fill away, and the new one would fail alike.
			return fmt.Errorf("resume the unfinished rebuild in %s (it is kept: run rebuild again to resume it): %w", gen, err)
		}
		if err != nil {
			return err
		}
		// A generation is written from scratch and closed: its compaction is the next serve's,
		// which answers meanwhile, rather than a wait at the end of the rebuild.
		db.BulkLoad()
		var bar *progress.Bar
		var applied int64
		po := projector.Options{Logger: log}
		if c.plans {
			// The plans' inputs too, as serve tails them: a rebuilt state dir answers plans at once.
			for _, sh := range provisioner.ProvisionerShapes {
				po.Buckets = append(po.Buckets, sh.Bucket)
			}
			po.Buckets = append(po.Buckets, provisioner.BucketHostModules, provisioner.BucketIndexerBuilds)
			po.Composed = true
		}
		unread, err := replay.Fill(ctx, js, db, po, func(done, total int64) {
			applied = done
			if bar == nil {
				bar = progress.New(stderr, log, "rebuild", "messages", total)
			}
			// The composed-<node> buckets' messages join the total once listed (replay.Fill): a bar
			// that kept its first total ended past it ("100% 12973/12948 messages").
			bar.SetTotal(total)
			bar.Set(done)
		})
		if bar != nil {
			bar.Done()
		}
		if errors.Is(err, projector.ErrCannotResume) && attempt == 0 {
			// A resumed generation read streams that were recreated since: start over, once.
			db.Close()
			log.Warn("the streams changed since the unfinished rebuild; starting over", "err", err)
			_ = sd.RemoveGeneration(gen, "the streams changed since the unfinished rebuild: "+err.Error())
			continue
		}
		if err != nil {
			db.Close()
			return fmt.Errorf("rebuild (the generation is kept; run rebuild again to resume): %w", refused(ctx, err))
		}
		if err := db.Close(); err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			// A signal came while the close waited for room: the command may have stopped without
			// waiting, saying the generation is kept to resume, and no longer owns the state dir's
			// CURRENT nor its output. Nothing is swapped in; the next rebuild resumes the generation.
			// A permission NATS refused ends ctx too (stopOnDenied: a consumer's deletion as the last
			// tail ended), said as such, not as "context canceled".
			return fmt.Errorf("rebuild (the generation is kept; run rebuild again to resume): %w", refused(ctx, err))
		}
		if err := sd.Swap(gen); err != nil {
			return err
		}
		took := time.Since(start)
		fmt.Fprintf(stdout, "rebuilt %s from the streams: %d messages in %s (%.0f messages/s)\n",
			c.state, applied, took.Round(time.Millisecond), float64(applied)/took.Seconds())
		if len(unread) > 0 {
			// Swapped in without them, as a seat's own rebuild is (docs/decisions.md): their checkpoints
			// are not synced, and serve reads them on, their nodes' plans synced: false meanwhile.
			return &incompleteError{did: "rebuilt " + c.state, buckets: unread,
				then: "serve reads them once it can (their nodes' plans answer synced: false until then); the log above says why each failed"}
		}
		return nil
	}
}

// rebuildGeneration is the generation to rebuild into: one a killed rebuild left, or a new one. A
// CURRENT that cannot be read is a broken state dir, which is what rebuild is for: no generation is
// known to be newer than the current one, so none is resumed, and the swap writes CURRENT anew (and
// removes every other generation, each removal logged).
func rebuildGeneration(sd *store.StateDir, log *slog.Logger) (string, bool, error) {
	pending, err := sd.Pending()
	if errors.Is(err, store.ErrCorrupt) {
		log.Warn("the state dir is broken; rebuilding it from scratch", "err", err)
		gen, err := sd.NewGeneration()
		return gen, false, err
	}
	if err != nil {
		return "", false, err
	}
	if pending != "" {
		return pending, true, nil
	}
	gen, err := sd.NewGeneration()
	return gen, false, err
}

// checkRebuildSource refuses to replace a state dir's projection from a NATS that holds none of the
// provisioner's buckets (hasProvisionerStreams): the rebuild swapped in an empty projection, the local
// event log with it.
func checkRebuildSource(ctx context.Context, js jetstream.JetStream, sd *store.StateDir, url string) error {
	if cur, err := sd.Current(); err != nil || cur == "" {
		return nil // nothing to lose: a first rebuild, or a broken CURRENT (what rebuild is for)
	}
	if err := hasProvisionerStreams(ctx, js, url); err != nil {
		return fmt.Errorf("%w; the state dir was not changed (to start it empty, remove it: serve fills it from the streams)", err)
	}
	return nil
}

// hasProvisionerStreams refuses a NATS that holds none of the provisioner's four streams: a --nats
// left out reaches nats://127.0.0.1:4222, often a node's own server, and a user of another account
// sees no stream either. A mesh with a seat always has the registry bucket, so none of the four means
// the wrong server or account, and an answer read from it would say the mesh is empty.
func hasProvisionerStreams(ctx context.Context, js jetstream.JetStream, url string) error {
	var streams []string
	for _, sh := range provisioner.ProvisionerShapes {
		name := provisioner.StreamName(sh.Bucket)
		_, err := js.Stream(ctx, name)
		if err == nil {
			return nil
		}
		if !errors.Is(err, jetstream.ErrStreamNotFound) {
			return fmt.Errorf("stream of %s: %w", sh.Bucket, err)
		}
		streams = append(streams, name)
	}
	return fmt.Errorf("%s has none of the provisioner's streams (%s): is --nats the mesh's NATS, and the user one of the seat's account?", redact(url), strings.Join(streams, ", "))
}
