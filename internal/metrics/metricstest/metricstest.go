// Package metricstest scrapes a /metrics endpoint the way Prometheus does, for tests: over HTTP, in
// the text exposition format, parsed by Prometheus' own parser.
package metricstest

import (
	"fmt"
	"io"
	"net/http"
	"sort"
	"strings"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
)

// Families are the metric families of one scrape, by name.
type Families map[string]*dto.MetricFamily

// Get fetches url and returns the status code and body.
func Get(url string) (int, string, error) {
	c := &http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// Scrape fetches and parses http://addr/metrics.
func Scrape(addr string) (Families, error) {
	code, body, err := Get("http://" + addr + "/metrics")
	if err != nil {
		return nil, err
	}
	if code != http.StatusOK {
		return nil, fmt.Errorf("/metrics answered %d: %s", code, body)
	}
	var p expfmt.TextParser
	fams, err := p.TextToMetricFamilies(strings.NewReader(body))
	if err != nil {
		return nil, fmt.Errorf("parse /metrics: %w", err)
	}
	return fams, nil
}

// Value is the value of the sample of a family whose labels include the given ones (name, value
// pairs): a gauge's or counter's value, a histogram's sample count. ok is false when there is none.
func (f Families) Value(name string, labels ...string) (v float64, ok bool) {
	fam, found := f[name]
	if !found {
		return 0, false
	}
next:
	for _, m := range fam.GetMetric() {
		have := map[string]string{}
		for _, lp := range m.GetLabel() {
			have[lp.GetName()] = lp.GetValue()
		}
		for i := 0; i+1 < len(labels); i += 2 {
			if have[labels[i]] != labels[i+1] {
				continue next
			}
		}
		switch {
		case m.Gauge != nil:
			return m.Gauge.GetValue(), true
		case m.Counter != nil:
			return m.Counter.GetValue(), true
		case m.Histogram != nil:
			return float64(m.Histogram.GetSampleCount()), true
		case m.Untyped != nil:
			return m.Untyped.GetValue(), true
		}
	}
	return 0, false
}

// LabelValues lists the values a label takes in a family's samples, sorted, each once.
func (f Families) LabelValues(name, label string) []string {
	seen := map[string]bool{}
	for _, m := range f[name].GetMetric() {
		for _, lp := range m.GetLabel() {
			if lp.GetName() == label {
				seen[lp.GetValue()] = true
			}
		}
	}
	out := make([]string, 0, len(seen))
	for v := range seen {
		out = append(out, v)
	}
	sort.Strings(out)
	return out
}
