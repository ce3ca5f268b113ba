// Package seat wires the mechanisms into the running seat: the registry writer, the projector and the
// verb over one store. The command's serve and the end-to-end tests start it the same way. Stop takes
// it down in the order that loses nothing: the verb drains, the projector commits its last batch, the
// store syncs.
package seat

import (
	"context"
	"fmt"
	"log/slog"
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
}

// Seat is a running seat.
type Seat struct {
	DB        *store.DB
	Projector *projector.Projector
	Server    *query.Server
	Registry  *registry.Writer // nil when the seat does not write the registry

	log     *slog.Logger
	nc      *nats.Conn // the verb's connection: Stop drains it
	stopped bool
}

// Start starts a seat on a store, and answers the verb on nc.
func Start(ctx context.Context, nc *nats.Conn, js jetstream.JetStream, db *store.DB, cfg Config) (*Seat, error) {
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Seat{DB: db, log: log, nc: nc}
	if cfg.WriteRegistry {
		s.Registry = registry.New(js, provisioner.Registry, cfg.RegistryInterval, log)
		s.Registry.Start(ctx)
	}
	po := cfg.Projector
	if po.Logger == nil {
		po.Logger = log
	}
	s.Projector = projector.New(js, db, po)
	s.Projector.Start(ctx)

	s.Server = query.NewServer(query.StoreReader(db), query.Options{Version: cfg.Version, Logger: log,
		Metadata: map[string]string{"schema": fmt.Sprint(store.SchemaVersion)}})
	if err := s.Server.Start(nc, nil); err != nil {
		s.Stop()
		return nil, err
	}
	return s, nil
}

// Stop drains the verb, stops the registry writer and the projector (its last batch committed), and
// syncs the store. It does not close the store; it leaves the connection given to Start drained and
// closed (drain.go).
func (s *Seat) Stop() error {
	if s.stopped {
		return nil
	}
	s.stopped = true
	if s.Server != nil {
		s.Server.Stop()
	}
	if s.Registry != nil {
		s.Registry.Stop()
	}
	if s.Projector != nil {
		s.Projector.Stop()
	}
	s.drainVerb()
	if err := s.DB.Flush(); err != nil {
		return fmt.Errorf("sync state: %w", err)
	}
	return nil
}

// Synced reports whether every bucket the projector tails has caught up with its stream since start.
func (s *Seat) Synced() bool {
	for _, b := range s.Projector.Buckets() {
		if _, ok := s.DB.Applied(b); !ok {
			return false
		}
	}
	return true
}
