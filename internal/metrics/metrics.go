// Package metrics shows a running seat to Prometheus, and its liveness and readiness to systemd or
// Kubernetes, on one HTTP listener: /metrics, /healthz and /readyz.
//
// What is read when:
//   - per-bucket positions (applied sequence, synced), anomaly rows by reason and Pebble's figures are
//     read from the seat at scrape time, so nothing is counted twice and nothing drifts;
//   - each bucket's stream last sequence comes from a listing of every stream's info, about 256
//     streams a request rather than one request per bucket (a seat with plans tails thousands of
//     composed-<node> buckets): the seat's own listing, shared (Options.Streams), or one the metrics
//     run every Options.Poll (Options.JetStream). The lag is their difference, so a stuck projector
//     shows as a growing lag even when no message reaches it;
//   - while the listing fails or is late, each poll asks streams for their info itself, a bounded
//     number of them (poll.go), and every bucket's stream_info_age_seconds says how old its stream
//     last sequence and lag are;
//   - verb requests and rebuilds are counted as they happen (ObserveRequest, StartRebuild).
//
// The fixed buckets have a series each; the composed-<node> buckets, one per node of the mesh, are
// taken together under bucket="composed-*" (ComposedLabel) with gauges of their own for what a sum
// hides (how many are behind, the largest lag, how long one has stood behind), so the series of a
// scrape do not grow with the mesh.
//
// The seat may change under the metrics (a rebuild swaps the store): SetSource says which one is
// current, and nil says there is none, which /readyz answers 503.
package metrics

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/streaminfo"
	"github.com/novox/mesh-provisioner/store"
)

// Source is the running seat as the metrics read it; *seat.Seat implements it.
type Source interface {
	// Store is the projection the seat answers from.
	Store() *store.DB
	// MessagesApplied is how many stream messages the seat's projector applied since it started.
	MessagesApplied() int64
	// Unsynced lists the buckets that have not caught up with their stream since start.
	Unsynced() []string
}

// Parker is a Source that parks idle composed-<node> buckets (a seat with plans): the gauge
// mesh_provisioner_buckets_parked counts them.
type Parker interface {
	BucketsParked() int
}

// FDSource is a Source that counts the answers that failed for want of a file descriptor (a seat,
// seat.Seat.AnswersOutOfFDs): mesh_provisioner_answers_out_of_fds_total.
type FDSource interface {
	AnswersOutOfFDs() int64
}

// RoomSource is a Source that says when its state dir is out of room (a seat, seat.Seat.OutOfRoom):
// /readyz is 503 with that in its body, and mesh_provisioner_state_out_of_room is 1.
type RoomSource interface {
	OutOfRoom() error
}

// FailingSource is a Source that says which buckets' tails fail and are retried (a seat,
// seat.Seat.Failing): a composed-<node> bucket among them does not hold /readyz (Ready).
type FailingSource interface {
	Failing(bucket string) bool
}

// UnreadableSource is a Source that lists the buckets whose tail fails and is retried, synced or not
// (a seat, seat.Seat.Unreadable): a composed-<node> bucket read before, whose stream can no longer be
// read, is synced and falls behind, and /readyz names it too.
type UnreadableSource interface {
	Unreadable() []string
}

// DiscoverSource is a Source that finds its composed-<node> buckets in a listing of the streams (a
// seat with plans, seat.Seat.Discovered): until that listing has come it tails none of them, and
// /readyz waits for it (Ready).
type DiscoverSource interface {
	Discovered() bool
}

// Options configure Metrics. The zero value is usable (no stream polling).
type Options struct {
	Version string
	// JetStream, when set and Streams is not, is asked for every stream's info every Poll: a listing
	// of the metrics' own, which each poll waits for (one that gets no answer fails at once when the
	// server reports the user denied $JS.API.STREAM.LIST, and else once its first page is 5 s late,
	// before the streams are asked).
	JetStream jetstream.JetStream
	// Streams, when set, is a listing of every stream's info that another owner runs and shares (a
	// seat's: seat.Config.Streams, listing at least every Poll); the metrics read it and list nothing
	// themselves. JetStream is then not needed.
	Streams *streaminfo.Poller
	// Poll is how often the streams' last sequences are read; 0 means five seconds.
	Poll time.Duration
	// ReadsPerPoll bounds the streams a poll asks for their info, beyond the seat's fixed buckets,
	// while the listing fails or is late (poll.go); 0 means DefaultReadsPerPoll.
	ReadsPerPoll int
	// AnomalyScanLimit bounds the anomaly rows read per bucket and scrape to count them by reason; rows
	// past it are counted under reason "uncounted". 0 means 100000.
	AnomalyScanLimit int
	Logger           *slog.Logger
}

// Metrics holds the seat's Prometheus registry and the metrics kept between scrapes.
type Metrics struct {
	opts Options
	log  *slog.Logger
	reg  *prometheus.Registry
	src  atomic.Pointer[sourceBox]

	requests       *prometheus.HistogramVec
	observers      sync.Map // requestLabels -> prometheus.Observer: requests' children, looked up once each
	rebuilds       *prometheus.CounterVec
	rebuildTook    prometheus.Histogram
	rebuildRunning prometheus.Gauge

	infos      *streaminfo.Poller // nil without Options.JetStream or Options.Streams
	ownList    bool               // infos is the metrics' own: each poll lists
	readErrors atomic.Int64       // STREAM.INFO requests of the polls that failed
	streamsMu  sync.Mutex
	streams    map[string]streamRead // bucket -> its stream's last sequence, as last read

	stuckMu sync.Mutex
	stuck   map[string]stuckSince // composed-<node> buckets behind their stream, as of the last poll

	anomMu    sync.Mutex
	anomKey   string                      // the applied sequences the counts were made at
	anomCount map[string]map[string]int64 // bucket -> reason -> rows

	cancel context.CancelFunc
	wg     sync.WaitGroup
}

type sourceBox struct {
	s Source
	// ready is set once Ready has found the seat ready: from then on a composed-<node> bucket that is
	// not synced (read again, or new) is one node catching up, which Ready does not wait for.
	ready atomic.Bool
}

// The whats a request is counted under; anything else is "invalid", so a bad request cannot make a
// new series.
var knownWhats = map[string]bool{"registry": true, "needs": true, "applied": true, "collect": true, "plans": true}

// New returns Metrics with every metric registered; Start runs the stream poller.
func New(opts Options) *Metrics {
	if opts.Poll <= 0 {
		opts.Poll = 5 * time.Second
	}
	if opts.AnomalyScanLimit <= 0 {
		opts.AnomalyScanLimit = 100000
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if opts.ReadsPerPoll <= 0 {
		opts.ReadsPerPoll = DefaultReadsPerPoll
	}
	m := &Metrics{opts: opts, log: log, reg: prometheus.NewRegistry(), streams: map[string]streamRead{}}
	switch {
	case opts.Streams != nil:
		m.infos = opts.Streams
	case opts.JetStream != nil:
		m.infos, m.ownList = streaminfo.New(opts.JetStream), true
	}
	m.requests = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "mesh_provisioner_request_duration_seconds",
		Help:    "Verb requests answered, by what and code (200 or the error code), and how long each took (a min_seq wait included).",
		Buckets: []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10},
	}, []string{"what", "code"})
	m.rebuilds = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "mesh_provisioner_rebuilds_total",
		Help: "Rebuilds of the state dir from the streams done by this process, by result (ok or error).",
	}, []string{"result"})
	m.rebuildTook = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "mesh_provisioner_rebuild_duration_seconds",
		Help:    "How long each rebuild of the state dir took.",
		Buckets: []float64{1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200},
	})
	m.rebuildRunning = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "mesh_provisioner_rebuild_running",
		Help: "1 while a rebuild of the state dir runs.",
	})
	infoErrors := prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name: "mesh_provisioner_stream_info_errors_total",
		Help: "Stream info reads that failed: listings of every stream, and the STREAM.INFO requests the lag falls back to meanwhile (see mesh_provisioner_bucket_stream_info_age_seconds for how old each lag is).",
	}, func() float64 {
		n := m.readErrors.Load()
		if m.infos != nil {
			n += m.infos.Failures()
		}
		return float64(n)
	})
	m.reg.MustRegister(m.requests, m.rebuilds, m.rebuildTook, m.rebuildRunning, infoErrors,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		seatCollector{m})
	for _, r := range []string{"ok", "error"} {
		m.rebuilds.WithLabelValues(r) // present at 0, so increase() sees the first one
	}
	return m
}

// Poll is how often the streams' last sequences are read (Options.Poll, or its default): a listing
// shared through Options.Streams should list at least this often.
func (m *Metrics) Poll() time.Duration { return m.opts.Poll }

// Registry is the registry /metrics serves.
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// SetSource says which seat is current; nil says none is (before start, during a rebuild, at stop).
// Clear it before the seat's store is closed.
func (m *Metrics) SetSource(s Source) {
	if s == nil {
		m.src.Store(nil)
		return
	}
	m.src.Store(&sourceBox{s: s})
}

func (m *Metrics) source() Source {
	if b := m.src.Load(); b != nil {
		return b.s
	}
	return nil
}

// ObserveRequest counts one answered request; it has the signature of query.Options.Observe.
func (m *Metrics) ObserveRequest(what string, code int, d time.Duration) {
	if m == nil {
		return
	}
	if !knownWhats[what] {
		what = "invalid"
	}
	// A child looked up by its labels costs a hash of them and three allocations a request (250-380 ns
	// here); the few pairs of what and code a seat answers are kept instead.
	key := requestLabels{what, code}
	o, ok := m.observers.Load(key)
	if !ok {
		o, _ = m.observers.LoadOrStore(key, m.requests.WithLabelValues(what, strconv.Itoa(code)))
	}
	o.(prometheus.Observer).Observe(d.Seconds())
}

// requestLabels are a request's labels: a known what (or "invalid") and a code, so there are few.
type requestLabels struct {
	what string
	code int
}

// StartRebuild marks a rebuild of the state dir as running; call the returned func once it ends, with
// its error. It is safe on a nil *Metrics, so rebuild code can call it whether or not metrics are
// served:
//
//	done := m.StartRebuild()
//	err := rebuild(...)
//	done(err)
func (m *Metrics) StartRebuild() (done func(err error)) {
	if m == nil {
		return func(error) {}
	}
	start := time.Now()
	m.rebuildRunning.Inc()
	var once sync.Once
	return func(err error) {
		once.Do(func() {
			m.rebuildRunning.Dec()
			m.rebuildTook.Observe(time.Since(start).Seconds())
			result := "ok"
			if err != nil {
				result = "error"
			}
			m.rebuilds.WithLabelValues(result).Inc()
		})
	}
}

// Start runs the stream poller until Stop, when Options.JetStream or Options.Streams is set.
func (m *Metrics) Start() {
	if m.infos == nil || m.cancel != nil {
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	m.cancel = cancel
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		m.pollLoop(ctx)
	}()
}

// Stop stops the poller and waits for it.
func (m *Metrics) Stop() {
	if m.cancel != nil {
		m.cancel()
	}
	m.wg.Wait()
}

// Ready says whether the seat answers from projections that have caught up: nil when every bucket is
// synced and the state dir has room to apply what comes, else why not (out of room first: the buckets
// behind follow from it). A seat with plans is not ready before it has listed the streams for its
// composed-<node> buckets. A composed-<node> bucket is one node's: one whose tail fails and is
// retried is not waited for, and once the seat has been ready none is (a node's bucket recreated,
// purged under the projection, or created, is read again while the seat answers every other node);
// Degraded names them.
func (m *Metrics) Ready() error {
	box := m.src.Load()
	if box == nil {
		return errors.New("the seat is not running")
	}
	src := box.s
	var why []string
	if r, ok := src.(RoomSource); ok {
		if err := r.OutOfRoom(); err != nil {
			why = append(why, err.Error())
		}
	}
	if db := src.Store(); db != nil {
		// Flushes or compactions that keep failing (for want of a descriptor, most often): the seat
		// answers, but its writes stall once the memtables are full.
		if err := db.BackgroundErr(); err != nil {
			why = append(why, err.Error())
		}
	}
	if d, ok := src.(DiscoverSource); ok && !d.Discovered() {
		why = append(why, "not synced yet: the composed-<node> buckets (the streams have not been listed yet)")
	}
	u := unsynced(src, box.ready.Load())
	if len(u.behind) > 0 {
		why = append(why, "not synced yet: "+listSome(u.behind))
	}
	if len(why) > 0 {
		return errors.New(strings.Join(append(why, u.notWaited()...), "\n"))
	}
	box.ready.Store(true)
	return nil
}

// Degraded names the composed-<node> buckets that are not synced and that Ready does not wait for:
// one node's bucket that cannot be read, or that is catching up once the seat has been ready, does
// not make the whole seat unready. "" when there is none.
func (m *Metrics) Degraded() string {
	box := m.src.Load()
	if box == nil {
		return ""
	}
	return strings.Join(unsynced(box.s, box.ready.Load()).notWaited(), "\n")
}

// unsyncedBuckets are the buckets a seat has not synced: those Ready waits for (behind), and the
// composed-<node> buckets it does not: those whose tail fails and is retried (failing, with those
// synced before whose tail fails now), and, once the seat has been ready, those catching up
// (catching).
type unsyncedBuckets struct {
	behind, failing, catching []string
}

func unsynced(src Source, wasReady bool) unsyncedBuckets {
	var u unsyncedBuckets
	f, _ := src.(FailingSource)
	names := src.Unsynced()
	for _, b := range names {
		switch {
		case !provisioner.IsComposedBucket(b):
			u.behind = append(u.behind, b)
		case f != nil && f.Failing(b):
			u.failing = append(u.failing, b)
		case wasReady:
			u.catching = append(u.catching, b)
		default:
			u.behind = append(u.behind, b)
		}
	}
	// And those synced whose tail fails now: the buckets above are not synced.
	if r, ok := src.(UnreadableSource); ok {
		var listed map[string]bool
		named := len(u.failing)
		for _, b := range r.Unreadable() {
			if !provisioner.IsComposedBucket(b) {
				continue
			}
			if listed == nil {
				listed = make(map[string]bool, len(names))
				for _, x := range names {
					listed[x] = true
				}
			}
			if !listed[b] {
				u.failing = append(u.failing, b)
			}
		}
		if len(u.failing) > named {
			slices.Sort(u.failing)
		}
	}
	return u
}

// notWaited is a line for each kind of bucket Ready does not wait for.
func (u unsyncedBuckets) notWaited() []string {
	var lines []string
	if len(u.failing) > 0 {
		lines = append(lines, "cannot be read (retried; not waited for): "+listSome(u.failing))
	}
	if len(u.catching) > 0 {
		lines = append(lines, "catching up since the seat was ready (not waited for): "+listSome(u.catching))
	}
	return lines
}

// maxListed bounds the buckets /readyz names on a line: a seat catching up with thousands of
// composed-<node> buckets would name every one.
const maxListed = 20

// listSome joins at most maxListed buckets, and says how many more there are.
func listSome(buckets []string) string {
	if len(buckets) <= maxListed {
		return strings.Join(buckets, ", ")
	}
	return fmt.Sprintf("%s and %d more", strings.Join(buckets[:maxListed], ", "), len(buckets)-maxListed)
}

// Handler serves /metrics, /healthz (the process is up) and /readyz (200 once every bucket is synced,
// 503 before and while the state dir is out of room, with why in the body).
func (m *Metrics) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{ErrorLog: slogErrorLog{m.log}}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		if err := m.Ready(); err != nil {
			w.WriteHeader(http.StatusServiceUnavailable)
			fmt.Fprintln(w, err)
			return
		}
		fmt.Fprintln(w, "ready")
		if d := m.Degraded(); d != "" {
			fmt.Fprintln(w, d)
		}
	})
	return mux
}

type slogErrorLog struct{ l *slog.Logger }

func (s slogErrorLog) Println(v ...any) { s.l.Warn("metrics: " + fmt.Sprint(v...)) }

// anomalyCounts counts the anomaly rows by bucket and reason code, those of the composed-<node>
// buckets together under ComposedLabel. A bucket the store says holds no anomaly row is not read, so
// a mesh of thousands of nodes with a few bad keys scans a few buckets, not a view per node. The
// counts are kept until any bucket's applied sequence moves (a registry change re-evaluates the needs'
// unanswered kinds, so one bucket's rows can change with another's sequence).
func (m *Metrics) anomalyCounts(db *store.DB, buckets []string) map[string]map[string]int64 {
	key := fmt.Appendf(nil, "%p", db)
	for _, b := range buckets {
		seq, _ := db.Applied(b)
		key = append(key, ' ')
		key = append(key, b...)
		key = append(key, '=')
		key = strconv.AppendUint(key, seq, 10)
	}
	m.anomMu.Lock()
	defer m.anomMu.Unlock()
	if m.anomCount != nil && m.anomKey == string(key) {
		return m.anomCount
	}
	counts := map[string]map[string]int64{}
	for _, b := range buckets {
		if db.AnomalyRows(b) == 0 {
			continue
		}
		by, err := countAnomalies(db, b, m.opts.AnomalyScanLimit)
		if err != nil {
			m.log.Debug("counting anomalies", "bucket", b, "err", err)
			return nil // a scrape during close: do not keep a partial count
		}
		label := b
		if provisioner.IsComposedBucket(b) {
			label = ComposedLabel
		}
		if counts[label] == nil {
			counts[label] = map[string]int64{}
		}
		for reason, n := range by {
			counts[label][reason] += n
		}
	}
	m.anomKey, m.anomCount = string(key), counts
	return counts
}

func countAnomalies(db *store.DB, bucket string, limit int) (map[string]int64, error) {
	v, err := db.View()
	if err != nil {
		return nil, err
	}
	defer v.Close()
	by := map[string]int64{}
	var counted int64
	total, err := v.Anomalies(bucket, "", limit, func(a provisioner.Anomaly) {
		by[string(a.Reason)]++
		counted++
	})
	if err != nil {
		return nil, err
	}
	if total > counted {
		by["uncounted"] += total - counted
	}
	return by, nil
}

// seatCollector reads the current seat at scrape time.
type seatCollector struct{ m *Metrics }

var (
	descBuildInfo = prometheus.NewDesc("mesh_provisioner_build_info",
		"Always 1: the version of the binary and the newest state dir schema it reads and writes (mesh_provisioner_state_schema is the state dir's).", []string{"version", "schema"}, nil)
	descStateSchema = prometheus.NewDesc("mesh_provisioner_state_schema",
		"The schema version the state dir is written in now: 1, which older binaries read too, until its event log holds a wildcard or whole-stream rollup.", nil, nil)
	descReady = prometheus.NewDesc("mesh_provisioner_ready",
		"1 when every bucket is synced and /readyz answers 200.", nil, nil)
	descSynced = prometheus.NewDesc("mesh_provisioner_bucket_synced",
		"1 once the bucket's projection has caught up with its stream since start; for bucket=\"composed-*\", once every composed-<node> bucket has.", []string{"bucket"}, nil)
	descApplied = prometheus.NewDesc("mesh_provisioner_bucket_applied_sequence",
		"The last stream sequence the bucket's projection applied: the as_of of its answers; for bucket=\"composed-*\", the sum over the composed-<node> buckets.", []string{"bucket"}, nil)
	descStreamLast = prometheus.NewDesc("mesh_provisioner_bucket_stream_last_sequence",
		"The bucket's stream last sequence, as last read (0 when the stream does not exist); mesh_provisioner_bucket_stream_info_age_seconds says how long ago; for bucket=\"composed-*\", the sum over the composed-<node> buckets.", []string{"bucket"}, nil)
	descStreamAge = prometheus.NewDesc("mesh_provisioner_bucket_stream_info_age_seconds",
		"Seconds since the bucket's stream last sequence was read: how old its stream_last_sequence and lag are; for bucket=\"composed-*\", the oldest reading of a composed-<node> bucket.", []string{"bucket"}, nil)
	descLag = prometheus.NewDesc("mesh_provisioner_bucket_lag",
		"Messages of the bucket's stream its projection has not read yet: stream last sequence (as last read) minus applied sequence, less those removed from the stream before they were read (a purge); at least 0; for bucket=\"composed-*\", the sum over the composed-<node> buckets (mesh_provisioner_composed_lag_max is the largest).", []string{"bucket"}, nil)
	descAnomalies = prometheus.NewDesc("mesh_provisioner_anomaly_rows",
		"Anomaly rows the projection holds (keys out of shape, values not MessagePack, ...), by bucket and reason code; the composed-<node> buckets' summed under bucket=\"composed-*\".", []string{"bucket", "reason"}, nil)
	descApplyCount = prometheus.NewDesc("mesh_provisioner_messages_applied_total",
		"Stream messages the projector applied since it started (repeats skipped).", nil, nil)
	descOutOfRoom = prometheus.NewDesc("mesh_provisioner_state_out_of_room",
		"1 while applying is paused for want of room in the state dir (a write held until there is room, or batches refused below the reserve): /readyz says why.", nil, nil)
	descStateFree = prometheus.NewDesc("mesh_provisioner_state_free_bytes",
		"Bytes free for the seat on the state dir's file system (statfs).", nil, nil)
	descStateReserve = prometheus.NewDesc("mesh_provisioner_state_reserve_bytes",
		"Bytes the store keeps free on the state dir's file system: below it, applying pauses until there is room.", nil, nil)
	descComposed = prometheus.NewDesc("mesh_provisioner_composed_buckets",
		"composed-<node> buckets the per-bucket series take together under bucket=\"composed-*\" (those the store holds, and those tailed not caught up yet).", nil, nil)
	descComposedUnsynced = prometheus.NewDesc("mesh_provisioner_composed_buckets_unsynced",
		"composed-<node> buckets that have not caught up with their stream since start (/readyz names them).", nil, nil)
	descComposedFailing = prometheus.NewDesc("mesh_provisioner_composed_buckets_failing",
		"composed-<node> buckets whose tail failed 3 times in a row and is retried, synced or not (/readyz names them): a permission missing, a stream without a leader or that refuses the seat's consumer.", nil, nil)
	descComposedBehind = prometheus.NewDesc("mesh_provisioner_composed_buckets_behind",
		"composed-<node> buckets whose lag is above 0.", nil, nil)
	descComposedLagMax = prometheus.NewDesc("mesh_provisioner_composed_lag_max",
		"The largest lag of one composed-<node> bucket (mesh_provisioner_bucket_lag{bucket=\"composed-*\"} is their sum).", nil, nil)
	descComposedStuck = prometheus.NewDesc("mesh_provisioner_composed_stuck_seconds",
		"How long the composed-<node> bucket behind its stream the longest has applied nothing (as of the last poll of the streams); 0 when none is behind.", nil, nil)
	descParked = prometheus.NewDesc("mesh_provisioner_buckets_parked",
		"composed-<node> buckets idle without a consumer, waiting for the stream listing to report a change.", nil, nil)

	descPebbleDisk = prometheus.NewDesc("mesh_provisioner_pebble_disk_usage_bytes",
		"Bytes the Pebble store uses on disk (tables, WAL, manifests).", nil, nil)
	descPebbleCompactions = prometheus.NewDesc("mesh_provisioner_pebble_compactions_total",
		"Compactions Pebble ran since the store opened.", nil, nil)
	descPebbleCompactDebt = prometheus.NewDesc("mesh_provisioner_pebble_compaction_debt_bytes",
		"Pebble's estimate of the bytes compactions must still rewrite to reach a stable shape.", nil, nil)
	descPebbleCompacting = prometheus.NewDesc("mesh_provisioner_pebble_compactions_in_progress",
		"Compactions running now.", nil, nil)
	descPebbleHeld = prometheus.NewDesc("mesh_provisioner_pebble_compactions_held",
		"1 while compactions wait for a catch-up to reach its stream's end (store/catchup.go), else 0.", nil, nil)
	descPebbleFlushes = prometheus.NewDesc("mesh_provisioner_pebble_flushes_total",
		"Memtable flushes since the store opened.", nil, nil)
	descPebbleBackgroundErrors = prometheus.NewDesc("mesh_provisioner_pebble_background_errors_total",
		"Flushes and compactions that failed since the store opened; Pebble tries each again (store.DB.BackgroundErrors).", nil, nil)
	descPebbleOutOfFDs = prometheus.NewDesc("mesh_provisioner_pebble_out_of_fds_total",
		"Files Pebble could not open since the store opened for want of a file descriptor (EMFILE, ENFILE): tables read, flush and compaction outputs.", nil, nil)
	descAnswersOutOfFDs = prometheus.NewDesc("mesh_provisioner_answers_out_of_fds_total",
		"Verb answers 500 since the seat started because a read could not open a file of the state dir for want of a file descriptor (their text starts \"the seat is out of file descriptors\"; asked again they may be answered).", nil, nil)
	descPebbleCacheHits = prometheus.NewDesc("mesh_provisioner_pebble_block_cache_hits_total",
		"Block cache hits since the store opened.", nil, nil)
	descPebbleCacheMisses = prometheus.NewDesc("mesh_provisioner_pebble_block_cache_misses_total",
		"Block cache misses since the store opened.", nil, nil)
	descPebbleCacheSize = prometheus.NewDesc("mesh_provisioner_pebble_block_cache_size_bytes",
		"Bytes in the block cache.", nil, nil)
	descPebbleReadAmp = prometheus.NewDesc("mesh_provisioner_pebble_read_amplification",
		"Pebble's read amplification: sublevels of L0 plus non-empty levels below.", nil, nil)
	descPebbleL0Files = prometheus.NewDesc("mesh_provisioner_pebble_l0_files",
		"Tables in L0; Pebble stalls writes when this reaches L0StopWritesThreshold (store.Open).", nil, nil)
	descPebbleMemtable = prometheus.NewDesc("mesh_provisioner_pebble_memtable_size_bytes",
		"Bytes in memtables.", nil, nil)
)

func (c seatCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descBuildInfo, descStateSchema, descReady, descSynced, descApplied, descStreamLast, descStreamAge, descLag,
		descAnomalies, descApplyCount, descComposed, descComposedUnsynced, descComposedFailing, descComposedBehind, descComposedLagMax, descComposedStuck, descParked, descOutOfRoom, descStateFree, descStateReserve, descPebbleDisk, descPebbleCompactions, descPebbleCompactDebt, descPebbleCompacting,
		descPebbleHeld, descPebbleFlushes, descPebbleBackgroundErrors, descPebbleOutOfFDs, descAnswersOutOfFDs, descPebbleCacheHits, descPebbleCacheMisses, descPebbleCacheSize, descPebbleReadAmp,
		descPebbleL0Files, descPebbleMemtable} {
		ch <- d
	}
}

func (c seatCollector) Collect(ch chan<- prometheus.Metric) {
	m := c.m
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	counter := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, labels...)
	}
	gauge(descBuildInfo, 1, m.opts.Version, strconv.Itoa(store.SchemaVersion))
	ready := 0.0
	if m.Ready() == nil {
		ready = 1
	}
	gauge(descReady, ready)
	src := m.source()
	if src == nil {
		return
	}
	db := src.Store()
	gauge(descStateSchema, float64(db.Schema()))
	buckets := shownBuckets(src)
	now := time.Now()
	// The fixed buckets have a series each; the composed-<node> buckets, one per node, are taken
	// together under ComposedLabel (see the descs), so a mesh's size makes no series.
	var comp composedSum
	for _, b := range buckets {
		seq, synced := db.Applied(b)
		r, read := m.lastRead(b)
		if provisioner.IsComposedBucket(b) {
			comp.add(seq, synced, r, read, now)
			continue
		}
		gauge(descApplied, float64(seq), b)
		gauge(descSynced, b2f(synced), b)
		if read {
			gauge(descStreamLast, float64(r.last), b)
			gauge(descStreamAge, max(0, now.Sub(r.at).Seconds()), b)
			gauge(descLag, float64(r.lag(seq)), b)
		}
	}
	if comp.buckets > 0 {
		gauge(descApplied, float64(comp.applied), ComposedLabel)
		listed := true
		if d, ok := src.(DiscoverSource); ok {
			listed = d.Discovered()
		}
		gauge(descSynced, b2f(comp.unsynced == 0 && listed), ComposedLabel)
		if comp.read > 0 {
			gauge(descStreamLast, float64(comp.last), ComposedLabel)
			gauge(descStreamAge, comp.age, ComposedLabel)
			gauge(descLag, float64(comp.lag), ComposedLabel)
		}
	}
	gauge(descComposed, float64(comp.buckets))
	gauge(descComposedUnsynced, float64(comp.unsynced))
	gauge(descComposedFailing, float64(len(unsynced(src, false).failing)))
	gauge(descComposedBehind, float64(comp.behind))
	gauge(descComposedLagMax, float64(comp.lagMax))
	gauge(descComposedStuck, m.stuckFor(now).Seconds())
	for b, by := range m.anomalyCounts(db, buckets) {
		for reason, n := range by {
			gauge(descAnomalies, float64(n), b, reason)
		}
	}
	counter(descApplyCount, float64(src.MessagesApplied()))
	if p, ok := src.(Parker); ok {
		gauge(descParked, float64(p.BucketsParked()))
	}
	if f, ok := src.(FDSource); ok {
		counter(descAnswersOutOfFDs, float64(f.AnswersOutOfFDs()))
	}
	if r, ok := src.(RoomSource); ok {
		gauge(descOutOfRoom, b2f(r.OutOfRoom() != nil))
	}
	if free, reserve, ok := db.Room(); ok {
		gauge(descStateFree, float64(free))
		if reserve >= 0 {
			gauge(descStateReserve, float64(reserve))
		}
	}

	pm, err := db.PebbleMetrics()
	if err != nil {
		return
	}
	counter(descPebbleCompactions, float64(pm.Compact.Count))
	gauge(descPebbleDisk, float64(pm.DiskSpaceUsage()))
	gauge(descPebbleCompactDebt, float64(pm.Compact.EstimatedDebt))
	gauge(descPebbleCompacting, float64(pm.Compact.NumInProgress))
	gauge(descPebbleHeld, b2f(db.CompactionsHeld()))
	counter(descPebbleFlushes, float64(pm.Flush.Count))
	counter(descPebbleBackgroundErrors, float64(db.BackgroundErrors()))
	counter(descPebbleOutOfFDs, float64(db.OutOfFDs()))
	counter(descPebbleCacheHits, float64(pm.BlockCache.Hits))
	counter(descPebbleCacheMisses, float64(pm.BlockCache.Misses))
	gauge(descPebbleCacheSize, float64(pm.BlockCache.Size))
	gauge(descPebbleReadAmp, float64(pm.ReadAmp()))
	gauge(descPebbleL0Files, float64(pm.Levels[0].TablesCount))
	gauge(descPebbleMemtable, float64(pm.MemTable.Size))
}

// ComposedLabel is the bucket label of the series that take every composed-<node> bucket together:
// applied and stream last sequences and lag summed, synced only when all are, the age of the oldest
// reading, anomaly rows summed by reason.
const ComposedLabel = provisioner.ComposedPrefix + "*"

// composedSum takes the composed-<node> buckets of a scrape together.
type composedSum struct {
	buckets, unsynced, behind, read int
	applied, last, lag, lagMax      uint64
	age                             float64
}

func (c *composedSum) add(seq uint64, synced bool, r streamRead, read bool, now time.Time) {
	c.buckets++
	c.applied += seq
	if !synced {
		c.unsynced++
	}
	if !read {
		return
	}
	c.read++
	lag := r.lag(seq)
	c.last += r.last
	c.lag += lag
	c.lagMax = max(c.lagMax, lag)
	if lag > 0 {
		c.behind++
	}
	c.age = max(c.age, now.Sub(r.at).Seconds())
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
