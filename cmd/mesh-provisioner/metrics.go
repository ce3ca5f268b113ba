package main

import (
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/pprof"
	"syscall"
	"time"

	"github.com/novox/mesh-provisioner/internal/metrics"
	"github.com/novox/mesh-provisioner/internal/streaminfo"
	"github.com/novox/mesh-provisioner/seat"
)

// opsFlags are serve's flags for what operators read beside the verb.
type opsFlags struct {
	metricsAddr string
	metricsPoll time.Duration
	pprof       bool
}

func (f *opsFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.metricsAddr, "metrics-addr", "", "serve /metrics (Prometheus), /healthz and /readyz on this host:port, e.g. 127.0.0.1:9464 (empty: off)")
	fs.BoolVar(&f.pprof, "pprof", false, "also serve Go's profiles under /debug/pprof/ on --metrics-addr (keep that address private)")
	fs.DurationVar(&f.metricsPoll, "metrics-poll", 5*time.Second, "how often the streams' last sequences are read for the lag metric (the seat lists every stream's info this often, or every 10s if sooner)")
}

// opsServer serves the metrics, /healthz and /readyz of serve. A nil *opsServer (no --metrics-addr)
// does nothing.
type opsServer struct {
	metrics *metrics.Metrics
	http    *metrics.Server
}

// startOps binds the listener at once (a taken port fails serve at start) and starts the metrics'
// stream poller, which reads the seat's listing of every stream's info (streams, run by the seat every
// poll()) and asks streams themselves while that fails; stop undoes both. /readyz answers 503 until
// setSeat names a seat whose buckets are synced.
func startOps(f opsFlags, streams *streaminfo.Poller, log *slog.Logger) (*opsServer, error) {
	if f.metricsAddr == "" {
		return nil, nil
	}
	m := metrics.New(metrics.Options{Version: Version, Streams: streams, Poll: f.metricsPoll, Logger: log})
	h, paths := m.Handler(), "/metrics /healthz /readyz"
	if f.pprof {
		h, paths = withPprof(h), paths+" /debug/pprof/"
	}
	srv, err := metrics.Listen(f.metricsAddr, h, log)
	if errors.Is(err, syscall.EADDRINUSE) {
		// Said alone, "address already in use" did not say which flag moves it (a second make run, or
		// a second seat on one host).
		return nil, fmt.Errorf("%w: another process listens there (another seat's metrics?): give --metrics-addr another address", err)
	}
	if err != nil {
		return nil, err
	}
	m.Start()
	log.Info("metrics listening", "addr", srv.Addr(), "paths", paths)
	return &opsServer{metrics: m, http: srv}, nil
}

// withPprof serves Go's profiles (CPU, heap, goroutines, traces) under /debug/pprof/ beside h: how an
// operator, or a benchmark, finds where a running seat spends its time without restarting it.
func withPprof(h http.Handler) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/", h)
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	return mux
}

// poll is how often the metrics read the streams' last sequences, so the seat lists them at least as
// often; 0 without metrics.
func (o *opsServer) poll() time.Duration {
	if o == nil {
		return 0
	}
	return o.metrics.Poll()
}

// addr is where the listener is bound, or "".
func (o *opsServer) addr() string {
	if o == nil {
		return ""
	}
	return o.http.Addr()
}

// observe is the seat's request hook, nil without metrics.
func (o *opsServer) observe() func(what string, code int, d time.Duration) {
	if o == nil {
		return nil
	}
	return o.metrics.ObserveRequest
}

// setSeat says which seat the metrics and /readyz read; nil (while stopping, or rebuilding) makes
// /readyz answer 503. Clear it before the seat's store closes.
func (o *opsServer) setSeat(st *seat.Seat) {
	if o == nil {
		return
	}
	if st == nil {
		o.metrics.SetSource(nil)
		return
	}
	o.metrics.SetSource(st)
}

// rebuilds is the hook rebuild code inside serve calls: done := o.rebuilds().StartRebuild(); ...;
// done(err). It is safe without metrics.
func (o *opsServer) rebuilds() *metrics.Metrics {
	if o == nil {
		return nil
	}
	return o.metrics
}

// stop closes the listener and stops the poller.
func (o *opsServer) stop(log *slog.Logger) {
	if o == nil {
		return
	}
	o.metrics.SetSource(nil)
	if err := o.http.Close(); err != nil {
		log.Warn("closing the metrics listener", "err", err)
	}
	o.metrics.Stop()
}
