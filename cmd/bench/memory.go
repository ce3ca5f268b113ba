package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
)

// restartWrites is how many needs puts the restarted seat takes after its walk: enough for its
// memtables to grow to their full size (64 MiB) and take back their share of Pebble's cache.
const restartWrites = 400_000

// walked is what walkEverything saw.
type walked struct {
	peak  int64 // the seat's highest VmRSS sampled during the walk
	rows  int
	split split // after the walk
}

// walkEverything walks every index a client can walk once, every page of each, in MessagePack: needs by
// each module of the pool and by each kind, applied by each module, collect by each collection and
// each contributor. The lookups before it walk 5 modules and 3 collections, a small part of the
// covering indexes; this reads them all into the seat's block cache, as clients who walk everything
// would. It samples the seat's RSS meanwhile.
func (b *bench) walkEverything(ctx context.Context) (walked, error) {
	var reqs []map[string]any
	for j := 0; j < b.mesh.Modules*2; j++ { // the pool the fixtures draw modules from
		mod := fixtures.ModuleName(j)
		reqs = append(reqs, map[string]any{"what": "needs", "module": mod}, map[string]any{"what": "applied", "module": mod},
			map[string]any{"what": "collect", "contributor": mod})
	}
	for _, e := range provisioner.Registry.Entries {
		reqs = append(reqs, map[string]any{"what": "needs", "kind": e.Kind})
	}
	for _, c := range fixtures.CollectionPool {
		reqs = append(reqs, map[string]any{"what": "collect", "collection": c})
	}
	stop := b.sampleRSS()
	start := time.Now()
	var w walked
	for _, req := range reqs {
		n, _, err := b.allPages(req, false)
		if err != nil {
			stop()
			return walked{}, fmt.Errorf("walk %v: %w", req, err)
		}
		w.rows += n
	}
	w.peak = stop()
	w.split = b.seatSplit(ctx)
	fmt.Fprintf(os.Stderr, "bench: walked every index once: %d rows in %s, peak RSS %s, then %s\n", w.rows, time.Since(start).Round(time.Millisecond), mib(w.peak), w.split)
	return w, nil
}

// restarted starts the seat again on its state dir: its memtables start small, so its blocks may take
// their share of Pebble's cache. It walks every index once, then takes restartWrites needs puts (the
// first of ops, put again), which make the memtables take their share back, and reports the peak RSS
// of each part.
func (b *bench) restarted(ctx context.Context, state string, ops []fixtures.Op) error {
	if err := b.startSeat(state); err != nil {
		return err
	}
	defer b.stopSeat()
	if err := b.waitCaughtUp(ctx, 5*time.Minute); err != nil {
		return err
	}
	walk, err := b.walkEverything(ctx)
	if err != nil {
		return err
	}
	var needs []fixtures.Op
	for _, op := range ops {
		if op.Bucket == provisioner.BucketNeeds && len(needs) < restartWrites {
			needs = append(needs, op)
		}
	}
	stop := b.sampleRSS()
	if err := b.load(ctx, needs); err != nil {
		stop()
		return err
	}
	err = b.waitCaughtUp(ctx, 5*time.Minute)
	peak := stop()
	if err != nil {
		return err
	}
	after := b.seatSplit(ctx)
	b.add("memory after a restart", fmt.Sprintf("seat peak RSS %s walking every index once (then %s), %s taking %d writes after (then %s)",
		mib(walk.peak), walk.split, mib(peak), len(needs), after),
		fmt.Sprintf("the seat started again on its state dir, caught up, walked as above, then took %d needs puts until caught up; highest VmRSS sampled every 50 ms; %s", len(needs), splitHow))
	return nil
}

// split is what holds the seat's memory, from its /metrics: Pebble's block cache and memtables
// (allocated outside the Go heap in a cgo build) and the Go heap in use.
type split struct {
	cache, memtables, heap int64
	ok                     bool
}

const splitHow = "then: Pebble's block cache and memtables (outside the Go heap) and the Go heap in use, from the seat's /metrics"

func (s split) String() string {
	if !s.ok {
		return "no /metrics"
	}
	return fmt.Sprintf("block cache %s, memtables %s, Go heap %s", mib(s.cache), mib(s.memtables), mib(s.heap))
}

// seatSplit reads the seat's split from its /metrics.
func (b *bench) seatSplit(ctx context.Context) split {
	addr := b.metricsAddr()
	if addr == "" {
		return split{}
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return split{}
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return split{}
	}
	defer resp.Body.Close()
	var s split
	want := map[string]*int64{
		"mesh_provisioner_pebble_block_cache_size_bytes": &s.cache,
		"mesh_provisioner_pebble_memtable_size_bytes":    &s.memtables,
		"go_memstats_heap_inuse_bytes":                   &s.heap,
	}
	found := 0
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		name, value, _ := strings.Cut(sc.Text(), " ")
		if p := want[name]; p != nil {
			if v, err := strconv.ParseFloat(value, 64); err == nil {
				*p = int64(v)
				found++
			}
		}
	}
	s.ok = found == len(want)
	return s
}

// metricsAddr is the address the seat's /metrics listens on, from its log: the last one logged, the
// seat's now.
func (b *bench) metricsAddr() string {
	sc := bufio.NewScanner(strings.NewReader(b.seatErr.String()))
	sc.Buffer(make([]byte, 1<<16), 1<<20)
	addr := ""
	for sc.Scan() {
		var l struct {
			Msg  string `json:"msg"`
			Addr string `json:"addr"`
		}
		if json.Unmarshal(sc.Bytes(), &l) == nil && l.Msg == "metrics listening" {
			addr = l.Addr
		}
	}
	return addr
}
