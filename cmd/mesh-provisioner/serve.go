package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/embedded"
	"github.com/novox/mesh-provisioner/internal/progress"
	"github.com/novox/mesh-provisioner/internal/streaminfo"
	"github.com/novox/mesh-provisioner/internal/streamread"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/replay"
	"github.com/novox/mesh-provisioner/seat"
	"github.com/novox/mesh-provisioner/store"
)

// ServeCommand tails the buckets into the projection and answers the verb.
type ServeCommand struct {
	Stdout, Stderr io.Writer

	nats             natsFlags
	logs             logFlags
	ops              opsFlags
	state            string
	embeddedListen   string
	embeddedStore    string
	embeddedConfig   string
	embeddedMaxConn  int
	demo             bool
	registryInterval time.Duration
	registryReplicas int
	noRegistry       bool
	plans            bool

	// started, when set (tests), is called once the seat answers, with the NATS URL and the metrics
	// address.
	started          func(natsURL, metricsAddr string)
	historyRetention time.Duration
	historyMaxBytes  byteSize
}

func (c *ServeCommand) flags() *flag.FlagSet {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(c.Stderr)
	c.nats.register(fs, "")
	c.logs.register(fs)
	c.ops.register(fs)
	fs.StringVar(&c.state, "state", "./data/state", "state dir: the projection, the program's alone")
	fs.StringVar(&c.embeddedListen, "embedded-listen", "127.0.0.1:4222", "with no --nats: where the embedded NATS server listens (port 0: a free one, which the log says)")
	fs.StringVar(&c.embeddedStore, "embedded-store", "./data/nats", "with no --nats: the embedded server's JetStream store (apart from --state: neither inside the other)")
	fs.StringVar(&c.embeddedConfig, "embedded-config", "", "with no --nats: a nats-server config file for the embedded server (accounts)")
	fs.IntVar(&c.embeddedMaxConn, "embedded-max-conn", 0, "with no --nats: the most clients the embedded NATS server holds at once, this seat's connection among them (0: half the descriptors it is left, at least 64, unless --embedded-config sets max_connections)")
	fs.BoolVar(&c.demo, "demo", false, "load a synthetic mesh into an empty embedded server")
	fs.DurationVar(&c.registryInterval, "registry-interval", time.Hour, "how often the registry is compared with the table and written where it differs")
	fs.IntVar(&c.registryReplicas, "registry-replicas", 1, "replicas of the registry bucket when the seat creates it (3 in a cluster; a bucket that exists is used as it is)")
	fs.BoolVar(&c.noRegistry, "no-registry", false, "do not write the registry (another seat writes it)")
	fs.BoolVar(&c.plans, "plans", true, "tail mesh-host_modules, mesh-indexer_builds and every composed-<node> bucket, and answer what: plans (--plans=false: do not)")
	fs.DurationVar(&c.historyRetention, "history-retention", 30*24*time.Hour, "keep the event log's history this long, by the messages' time (0 keeps it all)")
	fs.Var(&c.historyMaxBytes, "history-max-bytes", "trim the oldest event log history beyond this size, e.g. 20GiB (0: no limit)")
	fs.Usage = func() {
		fmt.Fprint(c.Stderr, `Usage: mesh-provisioner serve [flags]

Tails mesh-provisioner_registry, _needs, _applied and _collect into the projection under --state and
answers mesh-provisioner.provisioning from it. With --plans (the default) it also tails the plans'
inputs: mesh-host_modules, mesh-indexer_builds and every composed-<node> bucket, those created later
too. With no --nats it starts an embedded NATS server.

Example:
  mesh-provisioner serve --demo --metrics-addr 127.0.0.1:9464
  mesh-provisioner serve --nats nats://nats.mesh:4222 --creds /etc/mesh/provisioner.creds \
      --state /var/lib/mesh-provisioner/state --metrics-addr :9464 --log-format json

Flags:
`)
		fs.PrintDefaults()
	}
	return fs
}

// Run serves until ctx ends.
func (c *ServeCommand) Run(ctx context.Context, args []string) error {
	fs := c.flags()
	if err := parseNoArgs(fs, args); err != nil {
		return err
	}
	// What the seat writes goes through these: a seat left stopping past Run (errNotDrained) writes no
	// more.
	stdout, stderr := newCutWriter(c.Stdout), newCutWriter(c.Stderr)
	log, err := c.logs.logger(stderr)
	if err != nil {
		return err
	}
	if c.demo && c.nats.url != "" {
		return &usageError{msg: "--demo loads the embedded server: leave out --nats, and unset NATS_URL"}
	}
	if c.ops.pprof && c.ops.metricsAddr == "" {
		return &usageError{msg: "--pprof serves the profiles on --metrics-addr: give it too"}
	}
	if c.embeddedMaxConn < 0 {
		return &usageError{msg: fmt.Sprintf("--embedded-max-conn %d: want a number of clients, or 0 for half the descriptors the embedded server is left", c.embeddedMaxConn)}
	}
	if c.registryInterval <= 0 {
		// The writer would take it for its default, an hour, without a word.
		return &usageError{msg: fmt.Sprintf("--registry-interval %v: want a positive duration such as 1h (--no-registry writes no registry)", c.registryInterval)}
	}

	url := c.nats.url
	if url != "" {
		var ignored []string
		fs.Visit(func(f *flag.Flag) {
			if strings.HasPrefix(f.Name, "embedded-") {
				ignored = append(ignored, "--"+f.Name)
			}
		})
		if len(ignored) > 0 {
			// NATS_URL in the environment (a runbook's env file) makes the flags moot without a word.
			log.Warn("no embedded server with --nats or NATS_URL: its flags are ignored", "flags", strings.Join(ignored, " "), "nats", redact(url))
		}
	}
	if url == "" {
		// The two are separate directories: deleting the state dir must never take the streams with
		// it, nor a reset of the embedded server the state dir.
		if inside(c.embeddedStore, c.state) {
			return &usageError{msg: fmt.Sprintf("--embedded-store %s is inside --state %s: the state dir is the projection's alone", c.embeddedStore, c.state)}
		}
		if inside(c.state, c.embeddedStore) {
			return &usageError{msg: fmt.Sprintf("--state %s is inside --embedded-store %s: the embedded server's store is the server's alone (its streams would be deleted with the state dir); give them separate directories, as the defaults ./data/state and ./data/nats are", c.state, c.embeddedStore)}
		}
	}
	if err := store.CheckStateDir(c.state); err != nil {
		return &usageError{msg: err.Error()}
	}

	// With --nats, NATS is reached before the state dir is touched: a mistyped --nats leaves it exactly
	// as it was (a new one was made whole, Pebble's files and all, and left behind). With the embedded
	// server the state dir is opened before anything else starts: a second serve on it stops here,
	// before it starts an embedded server on the first one's store (docs/decisions.md). One this binary
	// cannot read is started over only once NATS is reached (below): a serve that cannot reach it
	// leaves it as it was.
	var nc *nats.Conn
	if url != "" {
		if nc, err = c.nats.connect(url, "mesh-provisioner", log); err != nil {
			return err
		}
		defer nc.Close()
	}
	var db *store.DB
	defer func() {
		// A store whose write waits for room would hold Close until there is (runSeat): left to the
		// process's exit instead, as a kill would, which loses nothing.
		if db != nil && !db.WritesHeld() {
			if err := db.Close(); err != nil {
				log.Error("close state", "err", err)
			}
		}
	}()
	// A signal during the start stops it between its steps (store.OpenContext says which part of the
	// open cannot be stopped): it returns ctx's error, which main says as "stopped by SIGTERM".
	fatal := onFatal(log, stderr)
	replay.SetOnFatal(fatal) // the temporary stores of plans answered at a point
	if url == "" {
		store.KeepForEmbeddedServer() // its streams' files, one per stream written lately
	}
	// A state dir with no generation yet is filled from the streams without a log, which the seat turns
	// on once caught up (seat/relog.go); so is one started over (below).
	db, err = store.OpenStateContext(ctx, c.state, store.Options{Logger: log, OnFatal: fatal, FirstFillNoWAL: true})
	broken := err
	if err != nil && !store.NeedsRebuild(err) {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}

	if err := c.nats.validate(); err != nil {
		return err // before an embedded server starts
	}
	maxConn := c.embeddedMaxConn // the embedded server's, once it runs
	if url == "" {
		unlock, err := lockEmbeddedStore(c.embeddedStore)
		if err != nil {
			return err
		}
		defer unlock()
		// Its clients are bounded (store.EmbeddedMaxConn): past the bound nats-server refuses one rather
		// than take a descriptor the state dir keeps for its log and tables.
		ns, err := embedded.Start(embedded.Config{Listen: c.embeddedListen, StoreDir: c.embeddedStore, ConfigFile: c.embeddedConfig, Logger: log,
			MaxConn: c.embeddedMaxConn, DefaultMaxConn: store.EmbeddedMaxConn()})
		if errors.Is(err, embedded.ErrListen) {
			return fmt.Errorf("%w: another process listens there; if it is a NATS server, use it with --nats nats://%s, else give --embedded-listen another address", err, c.embeddedListen)
		}
		if err != nil {
			return err
		}
		defer func() {
			ns.Shutdown()
			ns.WaitForShutdown()
		}()
		url = ns.ClientURL()
		if vz, err := ns.Varz(nil); err == nil {
			maxConn = vz.MaxConn
		}
		log.Info("embedded NATS server started", "url", url, "store", c.embeddedStore)
		if _, err := os.Stat(filepath.Join(c.embeddedStore, demoMarker)); err == nil && !c.demo {
			log.Warn("the embedded server holds part of a demo load that did not finish; serve --demo removes it and loads the demo mesh whole (or remove --embedded-store)", "store", c.embeddedStore)
		}
	}

	if nc == nil {
		if nc, err = c.nats.connect(url, "mesh-provisioner", log); err != nil {
			return err
		}
		defer nc.Close()
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return fmt.Errorf("jetstream: %w", err)
	}
	if broken != nil {
		// Nothing this binary can answer from: start over, and answer (synced false) while the
		// projection refills from the streams, as on a first start.
		log.Warn("the state dir cannot be used; rebuilding it from the streams", "state", c.state, "reason", broken)
		if db, err = store.ResetState(c.state, store.Options{Logger: log, OnFatal: fatal, FirstFillNoWAL: true}); err != nil {
			return err
		}
	}
	// Every setting, one field per flag (docs/operations.md, Logs): what a seat ran with is read from its
	// log, not guessed from a unit file and an environment. So are the descriptors it may hold and the
	// share of them its store gave Pebble's table cache (store/fds.go).
	log.Info("mesh-provisioner starting", "version", Version, "nats", redact(url), "embedded", c.nats.url == "",
		"embedded_listen", c.embeddedListen, "embedded_store", c.embeddedStore, "embedded_config", c.embeddedConfig,
		"embedded_max_conn", maxConn, "creds", c.nats.creds, "user", c.nats.user, "inbox_prefix", c.nats.inbox, "state", c.state, "schema", store.SchemaVersion,
		"write_registry", !c.noRegistry, "registry_interval", c.registryInterval, "registry_replicas", c.registryReplicas,
		"plans", c.plans, "history_retention", c.historyRetention, "history_max_bytes", int64(c.historyMaxBytes), "demo", c.demo,
		"metrics_addr", c.ops.metricsAddr, "metrics_poll", c.ops.metricsPoll, "pprof", c.ops.pprof,
		"log_format", c.logs.format, "log_level", c.logs.level,
		"nofile", store.FileLimit(), "pebble_max_open_files", db.MaxOpenFiles())

	// One listing of every stream's info for the whole seat: its projectors' stream checks and the lag
	// metric read it. The seat runs it, as often as the shorter of their intervals.
	streams := streaminfo.New(js)
	// The listener comes up before the demo load and the seat, so /healthz answers at once and
	// /readyz says 503 until every bucket is synced.
	ops, err := startOps(c.ops, streams, log)
	if err != nil {
		return err
	}
	defer ops.stop(log) // before the store closes

	if c.demo {
		if err := loadDemo(ctx, js, log, stderr, c.plans, c.embeddedStore); err != nil {
			return err
		}
	}
	retention := &store.RetentionOptions{MaxAge: c.historyRetention, MaxBytes: int64(c.historyMaxBytes)}
	err = runSeat(ctx, nc, js, db, seatConfig{log: log, fatal: fatal, registryInterval: c.registryInterval, registryReplicas: c.registryReplicas, writeRegistry: !c.noRegistry, stdout: stdout, demo: c.demo, plans: c.plans,
		cut:       func() { stdout.cut(); stderr.cut() },
		retention: retention, ops: ops, streams: streams, started: func() {
			if c.started != nil {
				c.started(nc.ConnectedUrl(), ops.addr())
			}
		}})
	if errors.Is(err, errNotDrained) {
		// The seat was left running, a write held for room (runSeat): so is its store, to the exit.
		db = nil
	}
	return err
}

// natsDefaultURL is where query and the other commands ask without --nats or NATS_URL.
const natsDefaultURL = nats.DefaultURL

// errNotDrained is what runSeat returns when a signal came while a write of the seat's was held for
// room: the seat is left running, and its stores open, to the process's exit.
var errNotDrained = errors.New("stopped without committing the last batch")

// runSeat runs the seat until ctx ends, then stops it in the order that loses nothing.
func runSeat(ctx context.Context, nc *nats.Conn, js jetstream.JetStream, db *store.DB, cfg seatConfig) error {
	log := cfg.log
	rebuildStore := cfg.store // tests: a file system that fills
	rebuildStore.Logger = log
	rebuildStore.OnFatal = cfg.fatal
	st, err := seat.Start(ctx, nc, js, db, seat.Config{Version: Version, Logger: log, WriteRegistry: cfg.writeRegistry, RegistryInterval: cfg.registryInterval, RegistryReplicas: cfg.registryReplicas,
		Plans: cfg.plans, Observe: cfg.ops.observe(), OnRebuild: cfg.ops.rebuilds().StartRebuild, Retention: cfg.retention, Store: rebuildStore,
		Streams: cfg.streams, ListEvery: cfg.ops.poll()})
	if err != nil {
		return err
	}
	held := false // the stop found the store's writes held for room: the seat is left to the exit
	defer func() {
		if !held {
			st.Stop()
		}
	}()
	cfg.ops.setSeat(st)
	defer cfg.ops.setSeat(nil)
	// seat.Start returned once the server has the verb's subscription (query.Server.Start flushes): a
	// request sent on any connection now reaches the seat, as "answering" says.
	log.Info("answering", "subject", query.Subject, "service", query.ServiceName)
	if cfg.demo {
		// The commands to try name the server when it is not the one they ask by default: on another
		// --embedded-listen they asked nats://127.0.0.1:4222, where nothing, or another seat, answers.
		natsFlag, natsCLI := "", "nats"
		if url := nc.ConnectedUrl(); url != natsDefaultURL {
			natsFlag, natsCLI = " --nats "+url, "nats --server "+url
		}
		fmt.Fprintf(cfg.stdout, "\nmesh-provisioner is serving the demo mesh on %s. Try, in another terminal:\n"+
			"  go run ./cmd/mesh-provisioner query needs --node %s%s\n"+
			"  go run ./cmd/mesh-provisioner query collect --collection shell:zsh:normal%s\n"+
			"  go run ./cmd/mesh-provisioner query plans --node edge-1%s\n"+
			"  %s req mesh-provisioner.provisioning '{\"what\":\"applied\",\"node\":\"%s\"}'\n\n",
			nc.ConnectedUrl(), fixtures.NodeName(7), natsFlag, natsFlag, natsFlag, natsCLI, fixtures.NodeName(7))
		if addr := cfg.ops.addr(); addr != "" {
			fmt.Fprintf(cfg.stdout, "Metrics: curl -s http://%s/metrics | grep mesh_provisioner_bucket_lag\n\n", addr)
		}
	}
	if cfg.started != nil {
		cfg.started()
	}
	select {
	case <-ctx.Done():
		cfg.ops.setSeat(nil) // /readyz says 503 while the seat drains
		if dir, ok := st.WritesHeld(); ok {
			// The batch being committed waits for room in the state dir (store/space.go), and a
			// clean stop would wait with it: stop as a kill would instead. Its checkpoint was not
			// written with it, so the next start reads it again from the stream. The store may be a
			// rebuild's new generation (dir names it): the next start removes it and rebuilds.
			held = true
			log.Error("stopping without draining: the state dir is out of room and the last batch waits for it", "state", dir,
				"fix", "free space on that disk (or give --state a larger one); the next start reads the batches not written again from the streams")
			// The stop is begun, not waited for: the seat's goroutines end once there is room (its stop
			// owns them), where they ran on, tailing and answering, for as long as the process lived.
			given, giveUp := context.WithCancel(context.Background())
			giveUp()
			_ = st.StopContext(given)
			return notDrained(ctx, cfg, dir)
		}
	case <-db.Failed():
		// A write failed for another reason than a full disk: Pebble takes no other (store/failed.go).
		log.Error("stopping: the state dir cannot be written", "err", db.FailedErr())
		cfg.ops.setSeat(nil)
		st.Stop()
		return db.FailedErr()
	case <-db.Broken():
		// Part of the projection no longer reads back: stop answering around the hole, and say what to do.
		log.Error("stopping: the state dir is broken", "err", db.BrokenErr())
		cfg.ops.setSeat(nil)
		st.Stop()
		return db.BrokenErr()
	}
	log.Info("stopping: draining the verb, committing the last batch")
	dir, err := stopUnlessHeld(st)
	if dir != "" {
		// The disk filled after the signal: the last batch, or the final sync, waits for room, and the
		// stop with it. Left to the exit as above.
		held = true
		log.Error("stopping without draining: the state dir is out of room and the last batch waits for it", "state", dir,
			"fix", "free space on that disk (or give --state a larger one); the next start reads the batches not written again from the streams")
		return notDrained(ctx, cfg, dir)
	}
	if err != nil {
		return err
	}
	log.Info("stopped cleanly")
	return nil
}

// notDrained is runSeat's errNotDrained, the seat's stop left going on by itself: what it says from
// then on (the store's "room again", the tails' and the rebuild's last lines) is cut from the
// caller's streams, which it wrote to after Run had returned.
func notDrained(ctx context.Context, cfg seatConfig, dir string) error {
	if cfg.cut != nil {
		cfg.cut()
	}
	return fmt.Errorf("state dir %s out of room: %w: %w", dir, errNotDrained, ctx.Err())
}

// heldPoll is how often a clean stop looks whether a write of the seat's waits for room.
const heldPoll = 50 * time.Millisecond

// stopUnlessHeld stops the seat, and gives up when a write of the seat's waits for room in the state
// dir meanwhile (a disk that filled after the signal), returning that store's directory; the stop
// goes on by itself (seat.StopContext) and ends once there is room.
func stopUnlessHeld(st *seat.Seat) (dir string, err error) {
	for {
		ctx, cancel := context.WithCancel(context.Background())
		watched := make(chan string, 1)
		go func() { // watches for a write held; ends with ctx
			defer close(watched)
			tick := time.NewTicker(heldPoll)
			defer tick.Stop()
			for {
				select {
				case <-ctx.Done():
					return
				case <-tick.C:
				}
				if d, held := st.WritesHeld(); held {
					watched <- d
					cancel()
					return
				}
			}
		}()
		err := st.StopContext(ctx)
		cancel()
		d := <-watched
		switch {
		case d == "":
			return "", err // the stop ended
		case errors.Is(err, seat.ErrNotDrained):
			return d, err
		}
		// Room came back between the look and the give-up: the stop goes on; wait for it again.
	}
}

type seatConfig struct {
	log              *slog.Logger
	fatal            func(error) // the stores' OnFatal (onFatal)
	registryInterval time.Duration
	registryReplicas int
	writeRegistry    bool
	stdout           io.Writer
	demo             bool
	plans            bool
	ops              *opsServer // nil without --metrics-addr
	started          func()     // called once the seat answers
	retention        *store.RetentionOptions
	streams          *streaminfo.Poller // the stream info listing the seat runs and the metrics read
	store            store.Options      // tests: the options of a rebuild's new generation (its Logger is log)
	// cut, when set, ends the writes of log and stdout to the caller's streams: runSeat calls it as it
	// returns errNotDrained, the seat left to the process's exit (serve's Run: cutWriter).
	cut func()
}

// loadDemo loads the demo mesh into an empty embedded server, with a progress bar when stderr is a
// terminal; with plans, the plans' scenario of the golden tests too (fixtures.Plans). A server whose
// streams hold messages (the registry's aside, which the seat writes) is served as it is: the demo
// loaded by an earlier start, or data of its own, which synthetic keys must not be mixed into.
func loadDemo(ctx context.Context, js jetstream.JetStream, log *slog.Logger, stderr io.Writer, plans bool, storeDir string) error {
	ops := fixtures.Demo().Ops()
	if plans {
		sc := fixtures.Plans()
		ops = append(append(ops, sc.Before...), sc.After...)
	}
	marker := filepath.Join(storeDir, demoMarker)
	if before, ok, err := readDemoMarker(marker); err != nil {
		return err
	} else if ok {
		// A load a second signal or a kill ended part way: what it wrote is removed, and the demo
		// loaded whole below, as after a first signal. Only while the streams it loaded hold nothing
		// but the demo's messages: a plain serve may have run on the store since, and its clients
		// written data of their own there, which is served as it is (below), never removed.
		foreign, err := othersData(ctx, js, demoOps(ops, plans))
		if err != nil {
			return fmt.Errorf("demo: %w", err)
		}
		if foreign != nil {
			log.Warn("demo: an earlier load did not finish, but the embedded server holds data the demo does not write since; removing nothing", "stream", foreign.stream, "seq", foreign.seq, "subject", foreign.subject)
		} else {
			log.Warn("demo: an earlier load did not finish (a second signal or a kill stopped it); removing what it wrote to load the demo mesh whole")
			if !removeDemo(js, demoOps(ops, plans), before, log) {
				return fmt.Errorf("demo: the part of the demo an earlier load left could not be removed: remove --embedded-store %s and start again", storeDir)
			}
		}
		if err := os.Remove(marker); err != nil {
			return fmt.Errorf("demo: %w", err)
		}
	}
	streams := js.ListStreams(ctx)
	before := map[string]bool{} // the streams there before the load, all empty but the registry's
	for info := range streams.Info() {
		before[info.Config.Name] = true
		if info.Config.Name != provisioner.StreamName(provisioner.BucketRegistry) && info.State.Msgs > 0 {
			log.Info("demo: the embedded server already holds data; serving it as it is, not loading the demo mesh",
				"stream", info.Config.Name, "messages", info.State.Msgs)
			return nil
		}
	}
	if err := streams.Err(); err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	// The marker says a load is under way until it has finished, or what it wrote is removed: a second
	// signal (which exits at once) or a kill leaves it, and the next start finds it above.
	if err := writeDemoMarker(marker, before); err != nil {
		return err
	}
	start := time.Now()
	bar := progress.New(stderr, nil, "demo: loading", "ops", int64(len(ops)))
	if err := fixtures.Load(ctx, js, ops, 0, func(done int) {
		bar.Set(int64(done))
		if demoLoaded != nil {
			demoLoaded(done)
		}
	}); err != nil {
		if removeDemo(js, ops, before, log) {
			_ = os.Remove(marker)
		}
		return fmt.Errorf("demo: %w", err)
	}
	bar.Done()
	if err := os.Remove(marker); err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	log.Info("demo mesh loaded", "ops", len(ops), "took", time.Since(start).Round(time.Millisecond))
	return nil
}

// foreignMsg is a message of a stream the demo loads that none of the demo's ops publishes.
type foreignMsg struct {
	stream, subject string
	seq             uint64
}

// othersData returns the first message of the streams ops load (the registry's aside, which the seat
// writes) that is not one of theirs, or nil when there is none: what an unfinished load left is
// removed only when it is provably the demo's alone. A stream holds the demo's alone when its messages,
// in order, are its ops in order (subject, operation and value), some left out: the load publishes them
// in order on one connection, and a purge's rollup removes the messages of its key before it. Any
// message of the demo's text was taken for the demo's before (h88): a client that put a demo key's
// value again, or deleted a key the demo deletes too, after a load a kill left marked, lost its write
// when the next serve --demo removed the streams and loaded the demo again.
func othersData(ctx context.Context, js jetstream.JetStream, ops []fixtures.Op) (*foreignMsg, error) {
	ours := map[string][]string{} // each stream's ops, in order
	var streams []string
	for _, op := range ops {
		name := provisioner.StreamName(op.Bucket)
		if name == provisioner.StreamName(provisioner.BucketRegistry) {
			continue
		}
		if !slices.Contains(streams, name) {
			streams = append(streams, name)
		}
		ours[name] = append(ours[name], demoMsgKey(fixtures.OpMsg(op)))
	}
	pullBytes := streamread.PullBytes(js.Conn(), 0)
	for _, name := range streams {
		st, err := js.Stream(ctx, name)
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("stream %s: %w", name, err)
		}
		state := st.CachedInfo().State
		if state.Msgs == 0 {
			continue
		}
		cons, err := st.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", name, err)
		}
		next := ours[name] // the ops not yet matched: each message is the first of them it equals
		for seq := uint64(0); seq < state.LastSeq; {
			// At most streamread.PullBytes a pull: a stream of the demo's may hold others' values too.
			batch, err := cons.Fetch(1000, jetstream.FetchMaxBytes(pullBytes), jetstream.FetchMaxWait(5*time.Second))
			if err != nil {
				return nil, fmt.Errorf("read %s: %w", name, err)
			}
			n := 0
			for msg := range batch.Messages() {
				n++
				md, err := msg.Metadata()
				if err != nil {
					return nil, fmt.Errorf("read %s: %w", name, err)
				}
				seq = md.Sequence.Stream
				i := slices.Index(next, demoMsgKey(&nats.Msg{Subject: msg.Subject(), Header: msg.Headers(), Data: msg.Data()}))
				if i < 0 {
					return &foreignMsg{stream: name, subject: msg.Subject(), seq: seq}, nil
				}
				next = next[i+1:]
				if seq >= state.LastSeq {
					// The stream's end: the batch's wait for messages that will not come is not
					// waited out, 5 s a stream (a start after a killed load spent 40 s here).
					break
				}
			}
			if seq >= state.LastSeq {
				break
			}
			if err := batch.Error(); err != nil {
				return nil, fmt.Errorf("read %s: %w", name, err)
			}
			if n == 0 {
				break // the last ones were removed since the listing
			}
		}
	}
	return nil, nil
}

// demoMsgKey is what tells a message of the demo's from another's: its subject, KV operation and value.
func demoMsgKey(m *nats.Msg) string {
	return m.Subject + "\x00" + m.Header.Get("KV-Operation") + "\x00" + string(m.Data)
}

// demoOps is ops: the buckets a demo load writes are the same whichever --plans the earlier start had,
// but for the plans' inputs, which are added for removal alike.
func demoOps(ops []fixtures.Op, plans bool) []fixtures.Op {
	if plans {
		return ops
	}
	sc := fixtures.Plans()
	return append(append(ops[:len(ops):len(ops)], sc.Before...), sc.After...)
}

// demoMarker is the file, at the top of --embedded-store (beside nats-server's jetstream/), that says a
// demo load is under way, with the streams that were there before it (JSON, a list of names).
const demoMarker = "mesh-provisioner-demo-loading"

func writeDemoMarker(path string, before map[string]bool) error {
	names := make([]string, 0, len(before))
	for n := range before {
		names = append(names, n)
	}
	b, err := json.Marshal(names)
	if err == nil {
		err = writeFileSync(path, b)
	}
	if err != nil {
		return fmt.Errorf("demo: mark the load under way: %w", err)
	}
	return nil
}

// writeFileSync writes path whole and syncs it and its directory: a kill right after finds it.
func writeFileSync(path string, b []byte) error {
	tmp := path + ".tmp"
	f, err := os.Create(tmp)
	if err != nil {
		return err
	}
	_, err = f.Write(b)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		return err
	}
	d, err := os.Open(filepath.Dir(path))
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// readDemoMarker reads the marker of a demo load under way: ok is false when there is none.
func readDemoMarker(path string) (before map[string]bool, ok bool, err error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, false, nil
	}
	var names []string
	if err == nil {
		err = json.Unmarshal(b, &names)
	}
	if err != nil {
		return nil, false, fmt.Errorf("demo: read %s, which marks a demo load that did not finish: %w: remove --embedded-store and start again", path, err)
	}
	before = map[string]bool{}
	for _, n := range names {
		before[n] = true
	}
	return before, true, nil
}

// demoLoaded, when set (tests), is told how many of the demo's ops are loaded, as the progress bar is.
var demoLoaded func(done int)

// removeDemo removes what a demo load that stopped part way (a Ctrl-C during the start) wrote: left,
// the next start found a server that holds data and served that part of the demo for good, with
// neither the plans' examples nor most of the mesh. The streams it loaded held no message before it
// (loadDemo's check): those it created are deleted, the others purged. A second signal or a kill
// during the load leaves a part, and the load's marker: the next start removes it then. It reports
// whether it removed everything.
func removeDemo(js jetstream.JetStream, ops []fixtures.Op, before map[string]bool, log *slog.Logger) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second) // the command's has ended
	defer cancel()
	select { // the publishes still out land first, so none comes after the purge
	case <-js.PublishAsyncComplete():
	case <-ctx.Done():
	}
	done := map[string]bool{}
	for _, op := range ops {
		name := provisioner.StreamName(op.Bucket)
		if done[name] || name == provisioner.StreamName(provisioner.BucketRegistry) {
			continue
		}
		done[name] = true
		var err error
		if before[name] {
			var st jetstream.Stream
			if st, err = js.Stream(ctx, name); err == nil {
				err = st.Purge(ctx)
			}
		} else {
			err = js.DeleteStream(ctx, name)
		}
		if err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
			log.Warn("demo: the load stopped part way, and what it wrote could not be removed; the next start with --demo tries again (else remove --embedded-store)", "stream", name, "err", err)
			return false
		}
	}
	log.Info("demo: the load stopped part way; what it wrote is removed, so the next start loads the demo mesh whole")
	return true
}

// lockEmbeddedStore takes the embedded server's store dir for this process until unlock, waiting no
// longer than store.Flock's grace: nats-server locks nothing there, and a second serve given the same
// --embedded-store (with another --state) would run a second server on the first one's streams.
func lockEmbeddedStore(dir string) (unlock func(), err error) {
	if err := os.MkdirAll(dir, 0o750); err != nil { // as nats-server makes it
		return nil, fmt.Errorf("create --embedded-store: %w", err)
	}
	f, err := os.Open(dir)
	if err != nil {
		return nil, fmt.Errorf("open --embedded-store: %w", err)
	}
	if err := store.Flock(f); err != nil {
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, fmt.Errorf("--embedded-store %s is in use by another embedded server (another mesh-provisioner serve): stop it, or give this one another --embedded-store", dir)
		}
		return nil, fmt.Errorf("lock --embedded-store: %w", err)
	}
	return func() { f.Close() }, nil // closing the descriptor releases the flock
}

// inside reports whether path is dir or below it, as written or once symbolic links are followed (a
// --state that is a link to the directory holding --embedded-store is the same directory).
func inside(path, dir string) bool {
	below := func(p, d string) bool { return p == d || strings.HasPrefix(p, d+string(os.PathSeparator)) }
	p, err1 := filepath.Abs(path)
	d, err2 := filepath.Abs(dir)
	if err1 != nil || err2 != nil {
		return false
	}
	return below(p, d) || below(realPath(p), realPath(d))
}

// realPath is an absolute path with the symbolic links of its longest existing part followed; the
// part that does not exist yet is kept as written.
func realPath(abs string) string {
	rest := ""
	for cur := abs; ; {
		if r, err := filepath.EvalSymlinks(cur); err == nil {
			return filepath.Join(r, rest)
		}
		parent := filepath.Dir(cur)
		if parent == cur {
			return abs
		}
		rest = filepath.Join(filepath.Base(cur), rest)
		cur = parent
	}
}
