package seat

import (
	"sort"
	"strconv"
	"strings"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/store"
)

// What an operator reads of a running seat: the metrics (internal/metrics.Source) and the micro
// service's $SRV.INFO metadata and $SRV.STATS data, so `nats micro info mesh-provisioner` tells what a
// seat holds.

// MessagesApplied is how many stream messages the seat's projectors applied since it started: those a
// rebuild replaced included, so that it only grows (a Prometheus counter that falls reads as a restart).
func (s *Seat) MessagesApplied() int64 {
	s.mu.Lock()
	before, p := s.appliedBefore, s.proj
	s.mu.Unlock()
	return before + p.Applied()
}

// BucketsParked is how many composed-<node> buckets are idle without a consumer (projector/park.go).
func (s *Seat) BucketsParked() int { return s.Current().ParkedCount() }

// AnswersOutOfFDs is how many answers failed for want of a file descriptor to read the state dir
// (query.Server.OutOfFDs).
func (s *Seat) AnswersOutOfFDs() int64 { return s.Server.OutOfFDs() }

// Unsynced lists, in order, the buckets the projector tails that have not caught up with their stream
// since start. With plans, the composed-<node> buckets are tailed once the streams were listed
// (Discovered): an empty list before says nothing of them.
func (s *Seat) Unsynced() []string {
	var out []string
	db := s.Store()
	for _, b := range s.Current().Buckets() {
		if _, ok := db.Applied(b); !ok {
			out = append(out, b)
		}
	}
	return out
}

// Failing reports whether a bucket's tail is failing and retried (projector.Projector.Failing): the
// metrics' readiness does not wait on a composed-<node> bucket that cannot be read.
func (s *Seat) Failing(bucket string) bool { return s.Current().Failing(bucket) }

// Unreadable lists the buckets whose tail fails and is retried, synced or not
// (projector.Projector.Unreadable): /readyz names the composed-<node> ones.
func (s *Seat) Unreadable() []string { return s.Current().Unreadable() }

// Discovered reports whether the projector has listed the streams once for composed-<node> buckets, so
// that it tails every one there was (always true without plans): the metrics' readiness waits for it.
func (s *Seat) Discovered() bool { return s.Current().Discovered() }

// maxStatsBuckets bounds the buckets listed one by one in Stats: $SRV.STATS is one NATS message, and a
// mesh of thousands of nodes tails one composed-<node> bucket per node.
const maxStatsBuckets = 32

// Stats is the data of the verb endpoint in $SRV.STATS (and so in `nats micro info` and `nats micro
// stats`).
type Stats struct {
	// Schema is the state dir's schema version as written now (store.DB.Schema): 1 until its event log
	// holds a rollup, so an operator knows whether a downgrade keeps it.
	Schema int `json:"schema"`
	// Synced is true once every bucket the projector tails has caught up with its stream (as /readyz).
	Synced bool `json:"synced"`
	// OutOfRoom, present while applying is paused for want of room in the state dir, says why and
	// what to do (Seat.OutOfRoom, as /readyz).
	OutOfRoom string `json:"out_of_room,omitempty"`
	// MessagesApplied counts the stream messages applied since start.
	MessagesApplied int64 `json:"messages_applied"`
	// Buckets holds, per bucket, the as_of an answer would carry now: the provisioner's own buckets
	// first, at most 32 in all.
	Buckets map[string]BucketStats `json:"buckets"`
	// BucketsTotal is how many buckets the projection holds, listed in Buckets or not.
	BucketsTotal int `json:"buckets_total"`
	// BucketsParked is how many composed-<node> buckets are idle without a consumer, waiting for the
	// stream listing to report their stream changed (docs/decisions.md, plans).
	BucketsParked int `json:"buckets_parked"`
	// AnswersByCode counts the verb's answers since start by code: "200" for rows, and every error
	// code. micro's num_errors counts only the requests that could not be decoded (answered in its
	// handler); the 404, 410, 504 and 500 found while answering are counted here.
	AnswersByCode map[string]int64 `json:"answers_by_code"`
}

// BucketStats is one bucket's position.
type BucketStats struct {
	AsOf        uint64 `json:"as_of"`
	Synced      bool   `json:"synced"`
	AnomalyRows int64  `json:"anomaly_rows"`
}

// Stats reads where every bucket's projection stands.
func (s *Seat) Stats() Stats {
	db := s.Store()
	st := Stats{Schema: db.Schema(), MessagesApplied: s.MessagesApplied(), Buckets: map[string]BucketStats{},
		AnswersByCode: s.Server.Answered(), BucketsParked: s.BucketsParked()}
	st.Synced = s.Synced() // the composed-<node> buckets listed, and every bucket tailed synced
	if err := s.OutOfRoom(); err != nil {
		st.OutOfRoom = err.Error()
	}
	buckets := db.Buckets()
	own := map[string]bool{}
	for _, sh := range provisioner.ProvisionerShapes {
		own[sh.Bucket] = true
	}
	sort.Slice(buckets, func(i, j int) bool {
		if own[buckets[i]] != own[buckets[j]] {
			return own[buckets[i]]
		}
		return buckets[i] < buckets[j]
	})
	st.BucketsTotal = len(buckets)
	for _, b := range buckets {
		if len(st.Buckets) == maxStatsBuckets {
			break
		}
		seq, synced := db.Applied(b)
		st.Buckets[b] = BucketStats{AsOf: seq, Synced: synced, AnomalyRows: db.AnomalyRows(b)}
	}
	return st
}

// metadata is the micro service's fixed metadata: the schema version and the buckets tailed, the
// composed-<node> ones as "composed-*". Every $SRV.PING, INFO and STATS reply carries it: the names of
// the composed buckets a restarted seat held (thousands, one per node) made each about 15 bytes a node
// longer, and a seat started on an empty state dir listed none of them.
func (s *Seat) metadata() map[string]string {
	var buckets []string
	for _, b := range s.Projector.Buckets() {
		if !provisioner.IsComposedBucket(b) {
			buckets = append(buckets, b)
		}
	}
	if s.cfg.Plans {
		buckets = append(buckets, provisioner.ComposedPrefix+"*")
	}
	return map[string]string{
		"schema":  strconv.Itoa(store.SchemaVersion),
		"buckets": strings.Join(buckets, ","),
	}
}
