package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"

	"github.com/novox/mesh-provisioner/internal/metrics/metricstest"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/query"
)

func repoFile(tb testing.TB, rel string) []byte {
	tb.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", rel))
	require.NoError(tb, err)
	return b
}

var metricNameRe = regexp.MustCompile(`\bmesh_provisioner_[a-z0-9_]+`)

// Every metric the docs, the alert rules and the dashboard name is one a running seat serves: a renamed
// metric cannot leave a dead panel or an alert that never fires.
func TestDeploy_MetricNamesExist(t *testing.T) {
	s := demoSeat(t)
	s.waitReady(t)
	// The request histogram has a series once a request was answered.
	nc, _ := natstest.Connect(t, s.natsURL)
	_, _, err := natstest.Ask(nc, query.Subject, nil, false)
	require.NoError(t, err)
	var fams metricstest.Families
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		fams, err = metricstest.Scrape(s.metricsAddr)
		if err != nil {
			return err
		}
		if _, ok := fams.Value("mesh_provisioner_request_duration_seconds"); !ok {
			return fmt.Errorf("no request counted yet")
		}
		return nil
	})
	served := map[string]bool{}
	for name, f := range fams {
		served[name] = true
		if f.GetType().String() == "HISTOGRAM" {
			for _, suffix := range []string{"_bucket", "_sum", "_count"} {
				served[name+suffix] = true
			}
		}
	}
	files, err := filepath.Glob(filepath.Join("..", "..", "docs", "*.md"))
	require.NoError(t, err)
	files = append(files, filepath.Join("..", "..", "deploy", "grafana", "mesh-provisioner.json"),
		filepath.Join("..", "..", "deploy", "prometheus", "mesh-provisioner-rules.yml"))
	named := map[string]bool{}
	for _, f := range files {
		b, err := os.ReadFile(f)
		require.NoError(t, err)
		for _, name := range metricNameRe.FindAllString(string(b), -1) {
			named[name] = true
			require.True(t, served[name], "%s names %s, which no seat serves", f, name)
		}
	}
	// And the other way: every seat metric is documented.
	var undocumented []string
	for name := range fams {
		if strings.HasPrefix(name, "mesh_provisioner_") && !named[name] {
			undocumented = append(undocumented, name)
		}
	}
	sort.Strings(undocumented)
	require.Empty(t, undocumented, "metrics served but named in no doc")
}

func TestDeploy_GrafanaDashboard(t *testing.T) {
	t.Parallel()
	var dash struct {
		UID        string `json:"uid"`
		Templating struct {
			List []struct{ Name string } `json:"list"`
		} `json:"templating"`
		Panels []struct {
			ID      int    `json:"id"`
			Type    string `json:"type"`
			Title   string `json:"title"`
			GridPos struct{ H, W, X, Y int }
			Targets []struct {
				RefID string `json:"refId"`
				Expr  string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	require.NoError(t, json.Unmarshal(repoFile(t, "deploy/grafana/mesh-provisioner.json"), &dash))
	require.NotEmpty(t, dash.UID)
	vars := map[string]bool{}
	for _, v := range dash.Templating.List {
		vars[v.Name] = true
	}
	require.True(t, vars["datasource"] && vars["instance"], "the data source and the seat are picked")
	ids := map[int]bool{}
	for _, p := range dash.Panels {
		require.False(t, ids[p.ID], "panel id %d twice", p.ID)
		ids[p.ID] = true
		require.LessOrEqual(t, p.GridPos.X+p.GridPos.W, 24, p.Title)
		if p.Type == "row" {
			continue
		}
		require.NotEmpty(t, p.Targets, p.Title)
		for _, tg := range p.Targets {
			require.NotEmpty(t, tg.RefID, p.Title)
			require.Contains(t, tg.Expr, `instance=~"$instance"`, "%s: every query follows the seat picker", p.Title)
		}
	}
}

func TestDeploy_PrometheusRules(t *testing.T) {
	t.Parallel()
	var rules struct {
		Groups []struct {
			Name  string
			Rules []struct {
				Alert       string
				Expr        string
				For         string
				Labels      map[string]string
				Annotations map[string]string
			}
		}
	}
	require.NoError(t, yaml.Unmarshal(repoFile(t, "deploy/prometheus/mesh-provisioner-rules.yml"), &rules))
	require.Len(t, rules.Groups, 1)
	alerts := map[string]bool{}
	for _, r := range rules.Groups[0].Rules {
		require.NotEmpty(t, r.Alert)
		require.NotEmpty(t, r.Expr, r.Alert)
		require.Contains(t, []string{"page", "ticket"}, r.Labels["severity"], r.Alert)
		require.NotEmpty(t, r.Annotations["summary"], r.Alert)
		alerts[r.Alert] = true
	}
	// The alerts docs/operations.md lists are the rules'.
	ops := string(repoFile(t, "docs/operations.md"))
	for a := range alerts {
		require.Contains(t, ops, "`"+a+"`", "docs/operations.md explains %s", a)
	}
}

// The systemd unit: systemd itself accepts it (when systemd-analyze is here), it keeps the seat's
// promises (own user, state dir, restart, a signal that drains), and its command line is one serve
// takes.
func TestDeploy_SystemdUnit(t *testing.T) {
	t.Parallel()
	unit := string(repoFile(t, "deploy/systemd/mesh-provisioner.service"))
	for _, d := range []string{"User=mesh-provisioner", "StateDirectory=mesh-provisioner", "Restart=on-failure",
		"KillSignal=SIGTERM", "TimeoutStopSec=", "RestartPreventExitStatus=2", "NoNewPrivileges=yes", "ProtectSystem=strict"} {
		require.Contains(t, unit, "\n"+d, d)
	}
	var argv []string
	lines := strings.Split(unit, "\n")
	for i := 0; i < len(lines); i++ {
		if strings.HasPrefix(lines[i], "ExecStart=") {
			l := strings.TrimPrefix(lines[i], "ExecStart=")
			for strings.HasSuffix(l, "\\") && i+1 < len(lines) {
				i++
				l = strings.TrimSuffix(l, "\\") + " " + strings.TrimSpace(lines[i])
			}
			argv = strings.Fields(strings.ReplaceAll(l, "%S", "/var/lib"))
		}
	}
	require.GreaterOrEqual(t, len(argv), 2)
	require.Equal(t, "serve", argv[1])
	var stderr bytes.Buffer
	fs := (&ServeCommand{Stdout: io.Discard, Stderr: &stderr}).flags()
	require.NoError(t, fs.Parse(argv[2:]), stderr.String())

	analyze, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Log("systemd-analyze is not installed: the unit's syntax is not checked")
		return
	}
	self, err := os.Executable()
	require.NoError(t, err)
	path := filepath.Join(t.TempDir(), "mesh-provisioner.service")
	require.NoError(t, os.WriteFile(path, []byte(strings.ReplaceAll(unit, "/usr/local/bin/mesh-provisioner", self)), 0o644))
	out, err := exec.Command(analyze, "verify", path).CombinedOutput()
	require.NoError(t, err, string(out))
	require.Empty(t, strings.TrimSpace(string(out)), "systemd-analyze verify has something to say")
}

// The Kubernetes manifest: probes on the paths serve answers, and arguments serve takes.
func TestDeploy_KubernetesManifest(t *testing.T) {
	t.Parallel()
	dec := yaml.NewDecoder(bytes.NewReader(repoFile(t, "deploy/kubernetes/mesh-provisioner.yaml")))
	kinds := map[string]bool{}
	for {
		var doc map[string]any
		err := dec.Decode(&doc)
		if err == io.EOF {
			break
		}
		require.NoError(t, err)
		kind, _ := doc["kind"].(string)
		kinds[kind] = true
		if kind != "StatefulSet" {
			continue
		}
		b, err := json.Marshal(doc)
		require.NoError(t, err)
		var sts struct {
			Spec struct {
				Template struct {
					Spec struct {
						Containers []struct {
							Args           []string
							LivenessProbe  struct{ HTTPGet struct{ Path string } } `json:"livenessProbe"`
							ReadinessProbe struct{ HTTPGet struct{ Path string } } `json:"readinessProbe"`
						}
					}
				}
			}
		}
		require.NoError(t, json.Unmarshal(b, &sts))
		c := sts.Spec.Template.Spec.Containers[0]
		require.Equal(t, "/healthz", c.LivenessProbe.HTTPGet.Path)
		require.Equal(t, "/readyz", c.ReadinessProbe.HTTPGet.Path)
		require.Equal(t, "serve", c.Args[0])
		var stderr bytes.Buffer
		fs := (&ServeCommand{Stdout: io.Discard, Stderr: &stderr}).flags()
		require.NoError(t, fs.Parse(c.Args[1:]), stderr.String())
	}
	require.True(t, kinds["StatefulSet"] && kinds["Service"])
}

// One node's composed-<node> bucket that cannot be read is a ticket (MeshProvisionerComposedStuck),
// not a page: MeshProvisionerProjectorStuck read the bucket="composed-*" row, every node's summed, and
// on a quiet mesh one node's stuck bucket made its lag above 0 and its applied sequence still, and
// paged. It reads that row only while more than one composed bucket is behind.
func TestDeploy_OneComposedBucketDoesNotPage(t *testing.T) {
	t.Parallel()
	var rules struct {
		Groups []struct {
			Rules []struct {
				Alert string
				Expr  string
			}
		}
	}
	require.NoError(t, yaml.Unmarshal(repoFile(t, "deploy/prometheus/mesh-provisioner-rules.yml"), &rules))
	var expr string
	for _, r := range rules.Groups[0].Rules {
		if r.Alert == "MeshProvisionerProjectorStuck" {
			expr = r.Expr
		}
	}
	require.NotEmpty(t, expr)
	// Every read of a per-bucket series names which buckets it reads: the fixed ones, or the
	// composed row next to the count of composed buckets behind.
	for _, series := range []string{"mesh_provisioner_bucket_lag", "mesh_provisioner_bucket_applied_sequence"} {
		n := strings.Count(expr, series)
		require.Equal(t, n, strings.Count(expr, series+`{bucket!="composed-*"}`)+strings.Count(expr, series+`{bucket="composed-*"}`),
			"%s read for every bucket: %s", series, expr)
	}
	if strings.Contains(expr, `{bucket="composed-*"}`) {
		require.Contains(t, expr, "mesh_provisioner_composed_buckets_behind > 1")
	}
}

// The summed composed row (bucket="composed-*", every node's lag added up) is never compared with a
// lag threshold: MeshProvisionerLagHigh compared it with 10000, so a mesh of 4,000 nodes each three
// messages behind (a burst of compositions) opened a ticket though no bucket was behind by much. A
// rule reads the lag of the fixed buckets by name, and the composed buckets' largest lag
// (mesh_provisioner_composed_lag_max); only MeshProvisionerProjectorStuck reads the row, for a lag
// above 0 with more than one composed bucket behind (TestDeploy_OneComposedBucketDoesNotPage).
func TestDeploy_LagAlertsReadNoSummedComposedLag(t *testing.T) {
	t.Parallel()
	var rules struct {
		Groups []struct {
			Rules []struct {
				Alert string
				Expr  string
			}
		}
	}
	require.NoError(t, yaml.Unmarshal(repoFile(t, "deploy/prometheus/mesh-provisioner-rules.yml"), &rules))
	const lag = "mesh_provisioner_bucket_lag"
	found := false
	for _, r := range rules.Groups[0].Rules {
		n := strings.Count(r.Expr, lag)
		fixed := strings.Count(r.Expr, lag+`{bucket!="composed-*"}`)
		composed := strings.Count(r.Expr, lag+`{bucket="composed-*"}`)
		require.Equal(t, n, fixed+composed, "%s reads the lag of every bucket, the composed ones summed: %s", r.Alert, r.Expr)
		if composed > 0 {
			require.Equal(t, "MeshProvisionerProjectorStuck", r.Alert, "%s reads the summed composed lag: %s", r.Alert, r.Expr)
		}
		if r.Alert == "MeshProvisionerLagHigh" {
			found = true
			require.Positive(t, fixed, r.Expr)
			require.Contains(t, r.Expr, "mesh_provisioner_composed_lag_max", "the composed buckets by their largest lag")
		}
	}
	require.True(t, found)
}

// The alert rules' unit tests (deploy/prometheus/mesh-provisioner-rules_test.yml: what fires, and what
// does not, on series a seat serves) pass under promtool, when it is installed (Debian's prometheus
// package has it), as does promtool's check of the rules.
func TestDeploy_PrometheusRulesUnitTests(t *testing.T) {
	t.Parallel()
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Skip("promtool is not installed: the rules' unit tests are not run")
	}
	dir := filepath.Join("..", "..", "deploy", "prometheus")
	for _, args := range [][]string{{"check", "rules", "mesh-provisioner-rules.yml"}, {"test", "rules", "mesh-provisioner-rules_test.yml"}} {
		cmd := exec.Command(promtool, args...)
		cmd.Dir = dir
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "promtool %s:\n%s", strings.Join(args, " "), out)
	}
}
