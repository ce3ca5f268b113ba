// Package seat wires the mechanisms into the running seat: the registry writer, the projector and the
// verb over one store. The command's serve and the end-to-end tests start it the same way. Stop takes
// it down in the order that loses nothing: the verb drains, the projector commits its last batch, the
// store syncs.
package seat

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/registry"
	"github.com/novox/mesh-provisioner/store"
)

// Config of a seat.
type Config struct {
	Version string
	Logger  *slog.Logger
	// WriteRegistry runs the registry writer every RegistryInterval (0 means one hour).
	WriteRegistry    bool
	RegistryInterval time.Duration
	// Projector tunes the consumers; its Logger defaults to the seat's.
	Projector projector.Options
	// Plans tails the plans' inputs (mesh-host_modules, mesh-indexer_builds and every composed-<node>
	// bucket, those created later too) and answers what: plans.
	Plans bool
	// Observe, when set, is told of every answered request (query.Options.Observe): the metrics.
	Observe func(what string, code int, d time.Duration)
}

// Seat is a running seat.
type Seat struct {
	DB        *store.DB
	Projector *projector.Projector
	Server    *query.Server
	Registry  *registry.Writer // nil when the seat does not write the registry

	log     *slog.Logger
	stopped bool
	cancel  context.CancelFunc
	wg      sync.WaitGroup
}

// CompactAfter is how many messages a catch-up must have applied for the seat to compact the store
// once it is synced.
var CompactAfter int64 = 50_000

// Start starts a seat on a store, and answers the verb on nc.
func Start(ctx context.Context, nc *nats.Conn, js jetstream.JetStream, db *store.DB, cfg Config) (*Seat, error) {
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Seat{DB: db, log: log}
	ctx, s.cancel = context.WithCancel(ctx)
	if cfg.WriteRegistry {
		s.Registry = registry.New(js, provisioner.Registry, cfg.RegistryInterval, log)
		s.Registry.Start(ctx)
	}
	po := cfg.Projector
	if po.Logger == nil {
		po.Logger = log
	}
	if cfg.Plans {
		var buckets []string
		if po.Buckets == nil {
			for _, sh := range provisioner.ProvisionerShapes {
				buckets = append(buckets, sh.Bucket)
			}
		} else {
			buckets = append(buckets, po.Buckets...)
		}
		po.Buckets = append(buckets, provisioner.BucketHostModules, provisioner.BucketIndexerBuilds)
		po.Composed = true
	}
	s.Projector = projector.New(js, db, po)
	s.Projector.Start(ctx)

	qo := query.Options{Version: cfg.Version, Logger: log, Metadata: s.metadata(), Observe: cfg.Observe}
	if cfg.Plans {
		qo.Plans = query.Plans(query.StorePlans(db), s.PlansSynced)
	}
	s.Server = query.NewServer(query.StoreReader(db), qo)
	// $SRV.STATS carries where each bucket stands (see ops.go).
	if err := s.Server.Start(nc, func() any { return s.Stats() }); err != nil {
		s.Stop()
		return nil, err
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.compactAfterCatchUp(ctx)
	}()
	return s, nil
}

// compactAfterCatchUp waits until the seat is synced and, when the catch-up applied many messages,
// compacts the store once: a fresh catch-up leaves its rows spread over the memtable and many L0 files,
// and every answer would merge them until background compactions caught up.
func (s *Seat) compactAfterCatchUp(ctx context.Context) {
	t := time.NewTicker(200 * time.Millisecond)
	defer t.Stop()
	for !s.Synced() {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
	n := s.Projector.Applied()
	if n < CompactAfter {
		return
	}
	start := time.Now()
	if err := s.DB.CompactAll(ctx); err != nil {
		if ctx.Err() == nil {
			s.log.Warn("compaction after catch-up failed; background compactions go on", "err", err)
		}
		return
	}
	s.log.Info("compacted after catch-up", "messages", n, "took", time.Since(start).Round(time.Millisecond))
}

// Stop drains the verb, stops the registry writer and the projector (its last batch committed), and
// syncs the store. It does not close the store.
func (s *Seat) Stop() error {
	if s.stopped {
		return nil
	}
	s.stopped = true
	if s.cancel != nil {
		s.cancel()
	}
	s.wg.Wait()
	if s.Server != nil {
		s.Server.Stop()
	}
	if s.Registry != nil {
		s.Registry.Stop()
	}
	if s.Projector != nil {
		s.Projector.Stop()
	}
	if err := s.DB.Flush(); err != nil {
		return fmt.Errorf("sync state: %w", err)
	}
	return nil
}

// Synced reports whether every bucket the projector tails has caught up with its stream since start.
func (s *Seat) Synced() bool {
	if !s.Projector.Discovered() {
		return false
	}
	for _, b := range s.Projector.Buckets() {
		if _, ok := s.DB.Applied(b); !ok {
			return false
		}
	}
	return true
}

// PlansSynced reports whether the inputs of a plans answer have caught up with their streams since
// start: the streams were listed once for composed-<node> buckets, mesh-host_modules and
// mesh-indexer_builds are synced, and so is composed-<node> of the node (of every node when node is
// empty). A node with no composed-<node> bucket has nothing to catch up with.
func (s *Seat) PlansSynced(node string) bool {
	p := s.Projector
	synced := func(b string) bool {
		_, ok := s.DB.Applied(b)
		return ok
	}
	if !p.Discovered() || !synced(provisioner.BucketHostModules) || !synced(provisioner.BucketIndexerBuilds) {
		return false
	}
	if node != "" {
		b := provisioner.ComposedPrefix + node
		return !p.Tails(b) || synced(b)
	}
	for _, b := range p.Buckets() {
		if strings.HasPrefix(b, provisioner.ComposedPrefix) && !synced(b) {
			return false
		}
	}
	return true
}
