package metrics_test

import (
	"fmt"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/metrics"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/internal/streaminfo"
	"github.com/novox/mesh-provisioner/store"
)

// BenchmarkMetrics_ScrapeComposed scrapes /metrics of a store holding 2,000 composed-<node> buckets,
// one in ten with an anomaly row, while one bucket applies a message between scrapes (a live mesh),
// and reports the body's size and series beside the allocations (docs/decisions.md, Operations).
//
//	go test -run '^$' -bench ScrapeComposed -benchmem ./internal/metrics/
func BenchmarkMetrics_ScrapeComposed(b *testing.B) {
	const composed = 2000
	ns := natstest.RunServer(b)
	_, js := natstest.Connect(b, ns.ClientURL())
	db, err := store.Open(b.TempDir(), store.Options{})
	require.NoError(b, err)
	defer db.Close()
	published := []byte{0x81, 0xa6, 's', 't', 'a', 't', 'u', 's', 0xa9, 'p', 'u', 'b', 'l', 'i', 's', 'h', 'e', 'd'}
	for i := range composed {
		msgs := []provisioner.Message{{Seq: 1, Time: 1, Key: "web.1", Op: provisioner.OpPut, Value: published}}
		if i%10 == 0 {
			msgs = append(msgs, provisioner.Message{Seq: 2, Time: 1, Key: "web", Op: provisioner.OpPut, Value: published})
		}
		bucket := fmt.Sprintf("composed-n%05d", i)
		require.NoError(b, db.Apply(bucket, msgs, 1, false))
		db.SetSynced(bucket, true)
	}
	streams := streaminfo.New(js)
	natstest.RunPoller(b, streams, time.Second)
	m := metrics.New(metrics.Options{Streams: streams, Poll: time.Second})
	m.SetSource(storeSource{db})
	m.Start()
	defer m.Stop()
	natstest.CheckFor(b, 20*time.Second, 50*time.Millisecond, func() error {
		if _, ok := m.BucketGauge("mesh_provisioner_bucket_stream_last_sequence", "composed-n01999"); !ok {
			return fmt.Errorf("no stream read yet")
		}
		return nil
	})
	h := m.Handler()
	scrape := func() string {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, httptest.NewRequest("GET", "/metrics", nil))
		return w.Body.String()
	}
	body := scrape()
	series := 0
	for _, l := range strings.Split(body, "\n") {
		if l != "" && !strings.HasPrefix(l, "#") {
			series++
		}
	}
	for i := 0; b.Loop(); i++ {
		require.NoError(b, db.Apply("composed-n00001", []provisioner.Message{{Seq: uint64(10 + i), Time: 1, Key: "web.1", Op: provisioner.OpPut, Value: published}}, 1, false))
		scrape()
	}
	b.ReportMetric(float64(len(body)), "body-bytes")
	b.ReportMetric(float64(series), "series")
}
