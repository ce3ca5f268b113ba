package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/embedded"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/seat"
	"github.com/novox/mesh-provisioner/store"
)

// ServeCommand tails the buckets into the projection and answers the verb.
type ServeCommand struct {
	Stdout, Stderr io.Writer

	nats             natsFlags
	logs             logFlags
	state            string
	embeddedListen   string
	embeddedStore    string
	embeddedConfig   string
	demo             bool
	registryInterval time.Duration
	noRegistry       bool
}

func (c *ServeCommand) flags() *flag.FlagSet {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(c.Stderr)
	c.nats.register(fs, "")
	c.logs.register(fs)
	fs.StringVar(&c.state, "state", "./data/state", "state dir: the projection, the program's alone")
	fs.StringVar(&c.embeddedListen, "embedded-listen", "127.0.0.1:4222", "with no --nats: where the embedded NATS server listens")
	fs.StringVar(&c.embeddedStore, "embedded-store", "./data/nats", "with no --nats: the embedded server's JetStream store (never inside --state)")
	fs.StringVar(&c.embeddedConfig, "embedded-config", "", "with no --nats: a nats-server config file for the embedded server (accounts)")
	fs.BoolVar(&c.demo, "demo", false, "load a synthetic mesh into an empty embedded server")
	fs.DurationVar(&c.registryInterval, "registry-interval", time.Hour, "how often the registry is compared with the table and written where it differs")
	fs.BoolVar(&c.noRegistry, "no-registry", false, "do not write the registry (another seat writes it)")
	fs.Usage = func() {
		fmt.Fprint(c.Stderr, `Usage: mesh-provisioner serve [flags]

Tails mesh-provisioner_registry, _needs, _applied and _collect into the projection under --state and
answers mesh-provisioner.provisioning from it. With no --nats it starts an embedded NATS server.

Example:
  mesh-provisioner serve --demo
  mesh-provisioner serve --nats nats://nats.mesh:4222 --creds /etc/mesh/provisioner.creds --state /var/lib/mesh-provisioner

Flags:
`)
		fs.PrintDefaults()
	}
	return fs
}

// Run serves until ctx ends.
func (c *ServeCommand) Run(ctx context.Context, args []string) error {
	fs := c.flags()
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return &usageError{msg: fmt.Sprintf("serve takes no arguments, got %q", fs.Args())}
	}
	log, err := c.logs.logger(c.Stderr)
	if err != nil {
		return err
	}
	if c.demo && c.nats.url != "" {
		return &usageError{msg: "--demo loads the embedded server: leave out --nats"}
	}

	url := c.nats.url
	if url == "" {
		if inside(c.embeddedStore, c.state) {
			return &usageError{msg: fmt.Sprintf("--embedded-store %s is inside --state %s: the state dir is the projection's alone", c.embeddedStore, c.state)}
		}
		ns, err := embedded.Start(embedded.Config{Listen: c.embeddedListen, StoreDir: c.embeddedStore, ConfigFile: c.embeddedConfig, Logger: log})
		if err != nil {
			return err
		}
		defer func() {
			ns.Shutdown()
			ns.WaitForShutdown()
		}()
		url = ns.ClientURL()
		log.Info("embedded NATS server started", "url", url, "store", c.embeddedStore)
	}

	nc, err := c.nats.connect(url, "mesh-provisioner", log)
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return fmt.Errorf("jetstream: %w", err)
	}

	db, err := store.OpenState(c.state, store.Options{Logger: log})
	if err != nil {
		if store.NeedsRebuild(err) {
			return fmt.Errorf("%w\nrun: mesh-provisioner rebuild --state %s", err, c.state)
		}
		return err
	}
	defer func() {
		if err := db.Close(); err != nil {
			log.Error("close state", "err", err)
		}
	}()
	log.Info("mesh-provisioner starting", "version", Version, "nats", redact(url), "state", c.state,
		"registry_interval", c.registryInterval, "demo", c.demo, "schema", store.SchemaVersion)

	if c.demo {
		if err := loadDemo(ctx, js, log); err != nil {
			return err
		}
	}
	return runSeat(ctx, nc, js, db, seatConfig{log: log, registryInterval: c.registryInterval, writeRegistry: !c.noRegistry, stdout: c.Stdout, demo: c.demo})
}

// runSeat runs the seat until ctx ends, then stops it in the order that loses nothing.
func runSeat(ctx context.Context, nc *nats.Conn, js jetstream.JetStream, db *store.DB, cfg seatConfig) error {
	log := cfg.log
	st, err := seat.Start(ctx, nc, js, db, seat.Config{Version: Version, Logger: log, WriteRegistry: cfg.writeRegistry, RegistryInterval: cfg.registryInterval})
	if err != nil {
		return err
	}
	defer st.Stop()
	log.Info("answering", "subject", query.Subject, "service", query.ServiceName)
	if cfg.demo {
		fmt.Fprintf(cfg.stdout, "\nmesh-provisioner is serving the demo mesh on %s. Try, in another terminal:\n"+
			"  go run ./cmd/mesh-provisioner query needs --node %s\n"+
			"  go run ./cmd/mesh-provisioner query collect --collection shell:zsh:normal\n"+
			"  nats req mesh-provisioner.provisioning '{\"what\":\"applied\",\"node\":\"%s\"}'\n\n",
			nc.ConnectedUrl(), fixtures.NodeName(7), fixtures.NodeName(7))
	}
	select {
	case <-ctx.Done():
	case <-db.Broken():
		// Part of the projection no longer reads back: stop answering around the hole, and say what to do.
		log.Error("stopping: the state dir is broken", "err", db.BrokenErr())
		st.Stop()
		return db.BrokenErr()
	}
	log.Info("stopping: draining the verb, committing the last batch")
	if err := st.Stop(); err != nil {
		return err
	}
	log.Info("stopped cleanly")
	return nil
}

type seatConfig struct {
	log              *slog.Logger
	registryInterval time.Duration
	writeRegistry    bool
	stdout           io.Writer
	demo             bool
}

// loadDemo loads the demo mesh when the provisioner's buckets are empty or missing.
func loadDemo(ctx context.Context, js jetstream.JetStream, log *slog.Logger) error {
	for _, b := range []string{provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect} {
		s, err := js.Stream(ctx, provisioner.StreamName(b))
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			continue
		}
		if err != nil {
			return fmt.Errorf("demo: %w", err)
		}
		if s.CachedInfo().State.Msgs > 0 {
			log.Info("demo: buckets already hold data; not loading again")
			return nil
		}
	}
	start := time.Now()
	ops := fixtures.Demo().Ops()
	if err := fixtures.Load(ctx, js, ops, 0, nil); err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	log.Info("demo mesh loaded", "ops", len(ops), "took", time.Since(start).Round(time.Millisecond))
	return nil
}

// inside reports whether path is dir or below it.
func inside(path, dir string) bool {
	p, err1 := filepath.Abs(path)
	d, err2 := filepath.Abs(dir)
	if err1 != nil || err2 != nil {
		return false
	}
	return p == d || strings.HasPrefix(p, d+string(os.PathSeparator))
}
