package metrics

import (
	"log/slog"
	"net"
	"net/http"
	"time"
)

// BucketGauge is the value a per-bucket gauge (mesh_provisioner_bucket_applied_sequence, _synced,
// _stream_last_sequence, _stream_info_age_seconds, _lag) has for one bucket, composed-<node> buckets
// included, which /metrics takes together under ComposedLabel: the tests of the poll read each
// composed bucket's reading through it. A fixed bucket's is what /metrics shows.
func (m *Metrics) BucketGauge(name, bucket string) (float64, bool) {
	src := m.source()
	if src == nil {
		return 0, false
	}
	seq, synced := src.Store().Applied(bucket)
	switch name {
	case "mesh_provisioner_bucket_applied_sequence":
		return float64(seq), true
	case "mesh_provisioner_bucket_synced":
		return b2f(synced), true
	}
	r, ok := m.lastRead(bucket)
	if !ok {
		return 0, false
	}
	switch name {
	case "mesh_provisioner_bucket_stream_last_sequence":
		return float64(r.last), true
	case "mesh_provisioner_bucket_stream_info_age_seconds":
		return max(0, time.Since(r.at).Seconds()), true
	case "mesh_provisioner_bucket_lag":
		return float64(r.lag(seq)), true
	}
	return 0, false
}

// Shown lists the buckets the per-bucket figures are made of, composed-<node> ones included.
func (m *Metrics) Shown() []string {
	src := m.source()
	if src == nil {
		return nil
	}
	return shownBuckets(src)
}

// ListenCapped is Listen holding at most maxConns connections, with timeouts of 10 minutes, so that
// a test's connections are held for as long as it needs them.
func ListenCapped(addr string, h http.Handler, maxConns int) (*Server, error) {
	return ListenHooked(addr, h, maxConns, nil, Hooks{})
}

// Hooks are points of a Server's shedding where a test runs something of its own; any may be nil.
type Hooks struct {
	Swapped   func()         // in full, after it swapped the shed state and before the shed is applied
	Freed     func(open int) // after freed returned, with the count it was given
	ConnState func(net.Conn, http.ConnState)
}

// ListenHooked is ListenCapped logging to log (nil: nowhere) and calling hk's hooks.
func ListenHooked(addr string, h http.Handler, maxConns int, log *slog.Logger, hk Hooks) (*Server, error) {
	const long = 10 * time.Minute
	return listen(addr, h, log, limits{maxConns: maxConns, readHeaderTimeout: long, readTimeout: long, writeTimeout: long, idleTimeout: long},
		hooks{swapped: hk.Swapped, freed: hk.Freed, connState: hk.ConnState})
}

// Shedding is whether the Server has keep-alives off, or is turning them off, because its cap was
// reached.
func (s *Server) Shedding() bool { return s.state.Load() != keepAlivesOn }

// Settle returns once the Server's keep-alive setting is its shed state as of the call.
func (s *Server) Settle() { s.settle() }
