package metrics_test

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/metrics"
	"github.com/novox/mesh-provisioner/internal/metrics/metricstest"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/registry"
	"github.com/novox/mesh-provisioner/seat"
	"github.com/novox/mesh-provisioner/store"
)

var mesh = fixtures.Mesh{Seed: 11, Nodes: 20, Modules: 3, NeedsPerModule: 3, Collections: 3, BadKeys: 3, BadValues: 2}

// gate forwards the JetStream API requests a seat sends under its own prefix to $JS.API, once it is
// opened: until then the seat's projector cannot read a stream's info, so no bucket can be synced. It
// makes "before sync" a state the test holds, not a race it hopes to win.
type gate struct {
	nc     *nats.Conn
	mu     sync.Mutex
	open   bool
	queued []*nats.Msg
	hold   func(subject string) bool // once open, requests it holds wait for Release
	held   []*nats.Msg
}

const gatePrefix = "$GATE.API"

func newGate(t *testing.T, url string) *gate {
	nc, _ := natstest.Connect(t, url)
	g := &gate{nc: nc}
	_, err := nc.Subscribe(gatePrefix+".>", func(m *nats.Msg) {
		g.mu.Lock()
		defer g.mu.Unlock()
		if !g.open {
			g.queued = append(g.queued, m)
			return
		}
		if g.hold != nil && g.hold(m.Subject) {
			g.held = append(g.held, m)
			return
		}
		g.forward(m)
	})
	require.NoError(t, err)
	require.NoError(t, nc.Flush())
	return g
}

// forward republishes a request on $JS.API with the asker's reply subject: the server answers (and
// delivers consumer messages) straight to the asker.
func (g *gate) forward(m *nats.Msg) {
	out := &nats.Msg{Subject: "$JS.API" + strings.TrimPrefix(m.Subject, gatePrefix), Reply: m.Reply, Data: m.Data, Header: m.Header}
	_ = g.nc.PublishMsg(out)
}

func (g *gate) Open() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.open = true
	for _, m := range g.queued {
		g.forward(m)
	}
	g.queued = nil
}

// Hold keeps the requests whose subject (under gatePrefix) hold accepts until Release.
func (g *gate) Hold(hold func(subject string) bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.hold = hold
}

// Held lists the subjects of the requests held now.
func (g *gate) Held() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	var out []string
	for _, m := range g.held {
		out = append(out, m.Subject)
	}
	return out
}

// Release forwards the held requests and holds no more.
func (g *gate) Release() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.hold = nil
	for _, m := range g.held {
		g.forward(m)
	}
	g.held = nil
}

func TestMetrics_ReadyzAndLagAfterIngest(t *testing.T) {
	ns := natstest.RunServer(t)
	url := ns.ClientURL()
	nc, js := natstest.Connect(t, url)
	require.NoError(t, fixtures.Load(context.Background(), js, mesh.Ops(), 256, nil))
	// The registry is written beforehand: KV puts through an API prefix take another subject, which
	// the gate does not forward.
	_, err := registry.New(js, provisioner.Registry, time.Hour, nil).Pass(context.Background())
	require.NoError(t, err)

	m := metrics.New(metrics.Options{Version: "1.2.3-test", JetStream: js, Poll: 20 * time.Millisecond})
	m.Start()
	t.Cleanup(m.Stop)
	srv, err := metrics.Listen("127.0.0.1:0", m.Handler(), nil)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, srv.Close()) })
	get := func(path string) (int, string) {
		code, body, err := metricstest.Get("http://" + srv.Addr() + path)
		require.NoError(t, err)
		return code, body
	}

	code, _ := get("/healthz")
	require.Equal(t, http.StatusOK, code)
	code, body := get("/readyz")
	require.Equal(t, http.StatusServiceUnavailable, code, "no seat yet")
	require.Contains(t, body, "not running")

	// The seat's projector talks to JetStream through the gate, still closed.
	g := newGate(t, url)
	snc, _ := natstest.Connect(t, url)
	gated, err := jetstream.NewWithAPIPrefix(snc, gatePrefix)
	require.NoError(t, err)
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	st, err := seat.Start(context.Background(), snc, gated, db, seat.Config{Version: "1.2.3-test",
		Projector: projector.Options{Poll: 20 * time.Millisecond}, Observe: m.ObserveRequest})
	require.NoError(t, err)
	m.SetSource(st)
	t.Cleanup(func() {
		m.SetSource(nil) // before the store closes
		require.NoError(t, st.Stop())
		require.NoError(t, db.Close())
	})

	code, body = get("/readyz")
	require.Equal(t, http.StatusServiceUnavailable, code, "the projector cannot have synced through a closed gate")
	for _, s := range provisioner.ProvisionerShapes {
		require.Contains(t, body, s.Bucket)
	}
	fams, err := metricstest.Scrape(srv.Addr())
	require.NoError(t, err)
	ready, _ := fams.Value("mesh_provisioner_ready")
	require.Zero(t, ready)

	g.Open()
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if code, body := get("/readyz"); code != http.StatusOK {
			return fmt.Errorf("readyz %d: %s", code, body)
		}
		return nil
	})

	// After ingest: for every bucket the applied sequence is the stream's last sequence, as JetStream
	// itself says, and the lag is 0. The registry writer may still be writing: poll until it holds.
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		fams, err := metricstest.Scrape(srv.Addr())
		if err != nil {
			return err
		}
		var sum float64
		for _, s := range provisioner.ProvisionerShapes {
			stream, err := js.Stream(context.Background(), provisioner.StreamName(s.Bucket))
			if err != nil {
				return err
			}
			last := float64(stream.CachedInfo().State.LastSeq)
			applied, ok1 := fams.Value("mesh_provisioner_bucket_applied_sequence", "bucket", s.Bucket)
			streamLast, ok2 := fams.Value("mesh_provisioner_bucket_stream_last_sequence", "bucket", s.Bucket)
			lag, ok3 := fams.Value("mesh_provisioner_bucket_lag", "bucket", s.Bucket)
			synced, _ := fams.Value("mesh_provisioner_bucket_synced", "bucket", s.Bucket)
			if !ok1 || !ok2 || !ok3 || last == 0 || applied != last || streamLast != last || lag != 0 || synced != 1 {
				return fmt.Errorf("%s: stream last %v; metrics applied %v, stream last %v, lag %v, synced %v", s.Bucket, last, applied, streamLast, lag, synced)
			}
			sum += applied
		}
		// A fresh state dir applied every message of every stream, each once.
		if n, _ := fams.Value("mesh_provisioner_messages_applied_total"); n != sum {
			return fmt.Errorf("messages applied %v, streams hold %v", n, sum)
		}
		if v, _ := fams.Value("mesh_provisioner_ready"); v != 1 {
			return fmt.Errorf("not ready")
		}
		return nil
	})

	// Anomaly rows by reason are what the verb answers (the verb is checked against the buckets in
	// package seat).
	fams, err = metricstest.Scrape(srv.Addr())
	require.NoError(t, err)
	for _, what := range []string{"needs", "applied", "collect"} {
		a, _, err := natstest.Ask(nc, query.Subject, []byte(`{"what":"`+what+`","limit":1}`), false)
		require.NoError(t, err)
		require.Positive(t, a.AnomaliesTotal, what)
		want := map[string]float64{}
		for _, row := range a.Anomalies {
			code, _, _ := strings.Cut(row["reason"].(string), ":")
			want[code]++
		}
		shape, _ := provisioner.ShapeOfWhat(provisioner.What(what))
		got := map[string]float64{}
		for _, reason := range fams.LabelValues("mesh_provisioner_anomaly_rows", "reason") {
			if v, ok := fams.Value("mesh_provisioner_anomaly_rows", "bucket", shape.Bucket, "reason", reason); ok {
				got[reason] = v
			}
		}
		require.Equal(t, want, got, what)
	}

	// A scan bound counts the rest as "uncounted", so the reasons still add up to the total.
	small := metrics.New(metrics.Options{AnomalyScanLimit: 1})
	small.SetSource(st)
	mfs, err := small.Registry().Gather()
	require.NoError(t, err)
	totals := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "mesh_provisioner_anomaly_rows" {
			continue
		}
		for _, s := range mf.GetMetric() {
			for _, l := range s.GetLabel() {
				if l.GetName() == "bucket" {
					totals[l.GetValue()] += s.GetGauge().GetValue()
				}
			}
		}
	}
	for _, s := range []string{provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect} {
		require.EqualValues(t, db.Checkpoint(s).AnomalyRows, totals[s], s)
	}

	// Pebble's own figures are there.
	disk, ok := fams.Value("mesh_provisioner_pebble_disk_usage_bytes")
	require.True(t, ok)
	require.Positive(t, disk)
	for _, name := range []string{"mesh_provisioner_pebble_compactions_total", "mesh_provisioner_pebble_block_cache_hits_total",
		"mesh_provisioner_pebble_block_cache_misses_total", "mesh_provisioner_pebble_read_amplification"} {
		_, ok := fams.Value(name)
		require.True(t, ok, name)
	}
	held, ok := fams.Value("mesh_provisioner_pebble_compactions_held")
	require.True(t, ok)
	require.EqualValues(t, 0, held, "a synced seat holds no compactions back")
	v, ok := fams.Value("mesh_provisioner_build_info", "version", "1.2.3-test", "schema", fmt.Sprint(store.SchemaVersion))
	require.True(t, ok)
	require.EqualValues(t, 1, v)
}

func TestMetrics_RequestsByWhatAndCode(t *testing.T) {
	ns := natstest.RunServer(t)
	nc, js := natstest.Connect(t, ns.ClientURL())
	require.NoError(t, fixtures.Load(context.Background(), js, mesh.Ops(), 256, nil))
	m := metrics.New(metrics.Options{})
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	snc, sjs := natstest.Connect(t, ns.ClientURL())
	st, err := seat.Start(context.Background(), snc, sjs, db, seat.Config{Observe: m.ObserveRequest})
	require.NoError(t, err)
	require.NoError(t, snc.Flush()) // the verb's subscription is at the server
	srv := serveSeat(t, m, st, db)

	asks := []struct {
		body string
		code int
	}{
		{`{"what":"needs"}`, 200}, {`{"what":"needs","node":"n00001"}`, 200}, {`{}`, 200},
		{`{"what":"needs","limit":0}`, 400}, {`{"what":"wants"}`, 400}, {`{"what":"what-` + strings.Repeat("x", 40) + `"}`, 400},
		{`{"what":"needs","after":"n00000.nope.config.x"}`, 404},
		{`{"what":"applied","min_seq":99999999,"wait_ms":1}`, 504},
	}
	for _, a := range asks {
		_, _, err := natstest.Ask(nc, query.Subject, []byte(a.body), false)
		if a.code == 200 {
			require.NoError(t, err, a.body)
		} else {
			var ve *natstest.VerbError
			require.ErrorAs(t, err, &ve, a.body)
			require.Equal(t, a.code, ve.Code, a.body)
		}
	}
	// Observe runs after the answer is sent: poll until every request is counted.
	want := map[[2]string]float64{
		{"needs", "200"}: 2, {"registry", "200"}: 1, {"needs", "400"}: 1, {"invalid", "400"}: 2, {"needs", "404"}: 1, {"applied", "504"}: 1,
	}
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		fams, err := metricstest.Scrape(srv.Addr())
		if err != nil {
			return err
		}
		for k, n := range want {
			if v, _ := fams.Value("mesh_provisioner_request_duration_seconds", "what", k[0], "code", k[1]); v != n {
				return fmt.Errorf("what=%s code=%s: %v requests, want %v", k[0], k[1], v, n)
			}
		}
		// A bad what never becomes a label value of its own.
		if got := fams.LabelValues("mesh_provisioner_request_duration_seconds", "what"); len(got) != 4 {
			return fmt.Errorf("what labels %v", got)
		}
		return nil
	})
}

func TestMetrics_StartRebuild(t *testing.T) {
	m := metrics.New(metrics.Options{})
	srv, err := metrics.Listen("127.0.0.1:0", m.Handler(), nil)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, srv.Close()) })
	scrape := func(name string, labels ...string) float64 {
		fams, err := metricstest.Scrape(srv.Addr())
		require.NoError(t, err)
		v, ok := fams.Value(name, labels...)
		require.True(t, ok, name)
		return v
	}
	require.Zero(t, scrape("mesh_provisioner_rebuilds_total", "result", "ok"), "present before the first rebuild")
	done := m.StartRebuild()
	require.EqualValues(t, 1, scrape("mesh_provisioner_rebuild_running"))
	done(nil)
	done(nil) // a second call changes nothing
	failed := m.StartRebuild()
	failed(fmt.Errorf("stream gone"))
	require.Zero(t, scrape("mesh_provisioner_rebuild_running"))
	require.EqualValues(t, 1, scrape("mesh_provisioner_rebuilds_total", "result", "ok"))
	require.EqualValues(t, 1, scrape("mesh_provisioner_rebuilds_total", "result", "error"))
	require.EqualValues(t, 2, scrape("mesh_provisioner_rebuild_duration_seconds"))

	var none *metrics.Metrics // rebuild code may run without metrics
	none.StartRebuild()(nil)
	none.ObserveRequest("needs", 200, time.Millisecond)
}

// serveSeat makes st the metrics' source and serves the metrics on a free port until the test ends;
// then the source is cleared (before the store closes), before runs, st stops and db closes.
func serveSeat(t *testing.T, m *metrics.Metrics, st *seat.Seat, db *store.DB, before ...func()) *metrics.Server {
	t.Helper()
	m.SetSource(st)
	t.Cleanup(func() {
		m.SetSource(nil)
		for _, f := range before {
			f()
		}
		require.NoError(t, st.Stop())
		require.NoError(t, db.Close())
	})
	srv, err := metrics.Listen("127.0.0.1:0", m.Handler(), nil)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, srv.Close()) })
	return srv
}
