package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/metrics/metricstest"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/store"
)

// waitReady polls until /readyz answers 200 and every bucket's lag is 0: a bucket whose stream did not
// exist at start is synced (nothing to catch up with) but is picked up only once the registry writer
// has created it, so readiness alone does not say the demo data is all in.
func (s *servedSeat) waitReady(tb testing.TB) {
	tb.Helper()
	natstest.CheckFor(tb, 60*time.Second, 20*time.Millisecond, func() error {
		code, body, err := metricstest.Get("http://" + s.metricsAddr + "/readyz")
		if err != nil {
			return err
		}
		if code != http.StatusOK {
			return fmt.Errorf("/readyz %d: %s", code, body)
		}
		fams, err := metricstest.Scrape(s.metricsAddr)
		if err != nil {
			return err
		}
		for _, sh := range provisioner.ProvisionerShapes {
			last, ok := fams.Value("mesh_provisioner_bucket_stream_last_sequence", "bucket", sh.Bucket)
			lag, _ := fams.Value("mesh_provisioner_bucket_lag", "bucket", sh.Bucket)
			if !ok || last == 0 || lag != 0 {
				return fmt.Errorf("%s: stream last %v (%v), lag %v", sh.Bucket, last, ok, lag)
			}
		}
		return nil
	})
}

var serveMesh = fixtures.Mesh{Seed: 5, Nodes: 30, Modules: 3, NeedsPerModule: 3, Collections: 3, BadKeys: 2, BadValues: 1}

// serve as an operator runs it: on a NATS it does not own, with metrics, JSON logs. After ingest the
// metrics say lag 0 at the streams' last sequences; the logs say the config once, each bucket synced
// once, and nothing per message or per request.
func TestServe_MetricsAndLogs(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	nc, js := natstest.Connect(t, ns.ClientURL())
	require.NoError(t, fixtures.Load(context.Background(), js, serveMesh.Ops(), 256, nil))

	s, err := startServe(t.TempDir(), "--nats", ns.ClientURL(), "--metrics-addr", "127.0.0.1:0", "--metrics-poll", "20ms",
		"--log-format", "json", "--log-level", "info")
	require.NoError(t, err)
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			s.stop()
		}
	})
	code, _, err := metricstest.Get("http://" + s.metricsAddr + "/healthz")
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, code)
	s.waitReady(t)

	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		fams, err := metricstest.Scrape(s.metricsAddr)
		if err != nil {
			return err
		}
		for _, sh := range provisioner.ProvisionerShapes {
			stream, err := js.Stream(context.Background(), provisioner.StreamName(sh.Bucket))
			if err != nil {
				return err
			}
			last := float64(stream.CachedInfo().State.LastSeq)
			applied, _ := fams.Value("mesh_provisioner_bucket_applied_sequence", "bucket", sh.Bucket)
			lag, ok := fams.Value("mesh_provisioner_bucket_lag", "bucket", sh.Bucket)
			if last == 0 || applied != last || !ok || lag != 0 {
				return fmt.Errorf("%s: stream last %v, applied %v, lag %v (%v)", sh.Bucket, last, applied, lag, ok)
			}
		}
		return nil
	})

	// Many requests, good and bad: none of them is a log line at info.
	for i := 0; i < 50; i++ {
		_, _, _ = natstest.Ask(nc, query.Subject, []byte(fmt.Sprintf(`{"what":"needs","node":"%s"}`, fixtures.NodeName(i%30))), false)
		_, _, _ = natstest.Ask(nc, query.Subject, []byte(`{"what":"wants"}`), false)
	}
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		fams, err := metricstest.Scrape(s.metricsAddr)
		if err != nil {
			return err
		}
		if v, _ := fams.Value("mesh_provisioner_request_duration_seconds", "what", "invalid", "code", "400"); v != 50 {
			return fmt.Errorf("%v bad requests counted", v)
		}
		return nil
	})
	stopped = true
	require.NoError(t, s.stop())

	type line struct {
		Level, Msg, Bucket string
		Messages           *int64
		Took               *string
	}
	var lines []line
	counts := map[string]int{}
	for _, raw := range strings.Split(strings.TrimSpace(s.stderr.String()), "\n") {
		var l line
		require.NoError(t, json.Unmarshal([]byte(raw), &l), "every log line is JSON: %s", raw)
		lines = append(lines, l)
		counts[l.Msg]++
	}
	require.Equal(t, 1, counts["mesh-provisioner starting"], "one line with the config")
	synced := map[string]int{}
	for _, l := range lines {
		if l.Msg == "bucket synced" {
			require.NotEmpty(t, l.Bucket)
			require.NotNil(t, l.Messages, "how many messages")
			require.NotNil(t, l.Took, "how long")
			synced[l.Bucket]++
		}
	}
	// One line per bucket tailed: the four of the provisioner, and the plans' inputs serve tails too;
	// once the first fill, which has no log, is checkpointed into a store with one (seat/relog.go), a
	// second from that store's projector.
	most := 1
	if counts["the first catch-up is done: checkpointed its store into a generation with a log, which reads on from there"] > 0 {
		most = 2
	}
	for _, sh := range provisioner.ProvisionerShapes {
		require.GreaterOrEqual(t, synced[sh.Bucket], 1, "a line for %s:\n%s", sh.Bucket, s.stderr.String())
	}
	for b, n := range synced {
		require.LessOrEqual(t, n, most, "lines for %s:\n%s", b, s.stderr.String())
	}
	// Every info line is one of the few that happen once per start, stop, bucket or hour.
	once := map[string]bool{"mesh-provisioner starting": true, "metrics listening": true, "answering": true, "bucket synced": true,
		"registry written": true, "registry kinds lost by someone else written again": true, "registry bucket created": true, "composed buckets found": true, "compacted after catch-up": true, "stopping: draining the verb, committing the last batch": true, "stopped cleanly": true,
		"the first catch-up is done: checkpointed its store into a generation with a log, which reads on from there": true,
		"answering from the store with a log": true, "removed a generation of the state dir": true}
	for _, l := range lines {
		require.True(t, once[l.Msg] || l.Level != "INFO", "unexpected info line %q", l.Msg)
	}
	require.Less(t, len(lines), 30, "no line per message or per request:\n%s", s.stderr.String())

	// The config line says everything that shapes this seat.
	for _, raw := range strings.Split(s.stderr.String(), "\n") {
		if strings.Contains(raw, `"mesh-provisioner starting"`) {
			var cfg map[string]any
			require.NoError(t, json.Unmarshal([]byte(raw), &cfg))
			for _, k := range []string{"version", "nats", "state", "schema", "write_registry", "registry_interval", "metrics_addr", "log_format", "log_level"} {
				require.Contains(t, cfg, k)
			}
			// And the descriptors it may hold, of which its store gave Pebble's table cache its share
			// (the test's process is the seat's).
			require.EqualValues(t, store.FileLimit(), cfg["nofile"])
			require.EqualValues(t, store.MaxOpenFiles(), cfg["pebble_max_open_files"])
		}
	}
}

// serve on a NATS user that may not list the streams' infos ($JS.API.STREAM.LIST denied, as for a user
// set up before the listing existed): the lag metric asks the streams themselves, and follows new
// messages instead of showing nothing, or the last value listed.
func TestServe_LagWithoutStreamListPermission(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServerDeniedStreamList(t)
	ctx := context.Background()
	_, js := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("admin", "admin"))
	require.NoError(t, fixtures.Load(ctx, js, serveMesh.Ops(), 256, nil))

	s, err := startServe(t.TempDir(), "--nats", ns.ClientURL(), "--user", "seat", "--password", "seat",
		"--metrics-addr", "127.0.0.1:0", "--metrics-poll", "100ms", "--log-format", "json")
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, s.stop()) })
	s.waitReady(t)

	// follows waits until the metrics say the needs stream ends at its last sequence, and that the
	// seat applied it.
	follows := func() {
		t.Helper()
		stream, err := js.Stream(ctx, provisioner.StreamName(provisioner.BucketNeeds))
		require.NoError(t, err)
		want := float64(stream.CachedInfo().State.LastSeq)
		natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
			fams, err := metricstest.Scrape(s.metricsAddr)
			if err != nil {
				return err
			}
			last, _ := fams.Value("mesh_provisioner_bucket_stream_last_sequence", "bucket", provisioner.BucketNeeds)
			applied, _ := fams.Value("mesh_provisioner_bucket_applied_sequence", "bucket", provisioner.BucketNeeds)
			age, ok := fams.Value("mesh_provisioner_bucket_stream_info_age_seconds", "bucket", provisioner.BucketNeeds)
			if last != want || applied != want || !ok || age > 5 {
				return fmt.Errorf("needs: stream last %v (the stream's is %v), applied %v, read %vs ago (%v)", last, want, applied, age, ok)
			}
			return nil
		})
	}
	follows()
	kv, err := js.KeyValue(ctx, provisioner.BucketNeeds)
	require.NoError(t, err)
	for i := range 5 {
		_, err := kv.Put(ctx, fmt.Sprintf("%s.mod-late.config.k%d", fixtures.NodeName(1), i), []byte{0x80})
		require.NoError(t, err)
	}
	follows()
}

// --pprof serves Go's profiles beside the metrics, and only there: without --metrics-addr it is a usage
// error, and without --pprof the path is not served.
func TestServe_Pprof(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	s, err := startServe(t.TempDir(), "--nats", ns.ClientURL(), "--metrics-addr", "127.0.0.1:0", "--pprof")
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.stop() })
	code, body, err := metricstest.Get("http://" + s.metricsAddr + "/debug/pprof/")
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, "Types of profiles available")
	code, body, err = metricstest.Get("http://" + s.metricsAddr + "/debug/pprof/goroutine?debug=1")
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, "goroutine profile")
	code, _, err = metricstest.Get("http://" + s.metricsAddr + "/healthz")
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, code, "the ops paths are still served")

	plain, err := startServe(t.TempDir(), "--nats", ns.ClientURL(), "--metrics-addr", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = plain.stop() })
	code, _, err = metricstest.Get("http://" + plain.metricsAddr + "/debug/pprof/")
	require.NoError(t, err)
	require.Equal(t, http.StatusNotFound, code)

	rc, _, stderr := run(t, "serve", "--nats", ns.ClientURL(), "--pprof", "--state", filepath.Join(t.TempDir(), "state"))
	require.Equal(t, 2, rc, stderr)
	require.Contains(t, stderr, "--pprof serves the profiles on --metrics-addr")
}

// --registry-interval 0 or below is a usage error: the writer took it for an hour without a word.
func TestServe_RegistryIntervalMustBePositive(t *testing.T) {
	t.Parallel()
	for _, v := range []string{"0", "-1m"} {
		rc, _, stderr := run(t, "serve", "--nats", "nats://127.0.0.1:1", "--registry-interval", v, "--state", filepath.Join(t.TempDir(), "state"))
		require.Equal(t, 2, rc, stderr)
		require.Contains(t, stderr, "--registry-interval")
		require.Contains(t, stderr, "--no-registry")
	}
}

// serve without --nats runs an embedded server in its process, whose streams' files (one per stream
// written lately: thousands with as many composed-<node> buckets) take a store's share of the
// descriptors: the store gives Pebble a third of what the limit leaves, not half.
func TestServe_EmbeddedServerTakesAStoresShare(t *testing.T) {
	t.Setenv("NATS_URL", "")
	s, err := startServe(t.TempDir(), "--plans=false", "--log-format", "json")
	require.NoError(t, err)
	defer func() { require.NoError(t, s.stop()) }()
	started := logLines(s, "mesh-provisioner starting")
	require.Len(t, started, 1)
	soft := int(store.FileLimit())
	left := soft - min(256, soft/2)
	require.EqualValues(t, soft, started[0]["nofile"])
	require.EqualValues(t, max(left/3, 74), started[0]["pebble_max_open_files"], "limit %d", soft)
	// Its clients get half that share (TestServe_EmbeddedServerRefusesClientsPastItsBound floods them).
	require.EqualValues(t, max(left/3/2, 64), started[0]["embedded_max_conn"], "limit %d", soft)
}

// --embedded-max-conn sets the embedded server's bound on its clients; below 0 it is a usage error
// (nats-server would refuse every client).
func TestServe_EmbeddedMaxConnFlag(t *testing.T) {
	t.Setenv("NATS_URL", "")
	s, err := startServe(t.TempDir(), "--plans=false", "--log-format", "json", "--embedded-max-conn", "5")
	require.NoError(t, err)
	started := logLines(s, "mesh-provisioner starting")
	require.NoError(t, s.stop())
	require.Len(t, started, 1)
	require.EqualValues(t, 5, started[0]["embedded_max_conn"])

	rc, _, stderr := run(t, "serve", "--embedded-max-conn", "-1", "--state", filepath.Join(t.TempDir(), "state"))
	require.Equal(t, 2, rc, stderr)
	require.Contains(t, stderr, "--embedded-max-conn -1")
}
