package replay

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/store"
)

// Point is a moment to answer as of: a stream sequence of the asked bucket, or a time.
type Point struct {
	Seq  uint64
	Time time.Time // set for a time point
}

// IsTime reports whether the point is a time.
func (p Point) IsTime() bool { return !p.Time.IsZero() }

func (p Point) String() string {
	if p.IsTime() {
		return p.Time.UTC().Format(time.RFC3339Nano)
	}
	return "seq:" + strconv.FormatUint(p.Seq, 10)
}

// ParsePoint reads a point as the verb's at and the replay command take it: seq:<n>, or an RFC 3339
// time (fractions of a second allowed).
func ParsePoint(s string) (Point, error) {
	if rest, ok := strings.CutPrefix(s, "seq:"); ok {
		n, err := strconv.ParseUint(rest, 10, 64)
		if err != nil || n == math.MaxUint64 {
			return Point{}, fmt.Errorf("point %q: want seq:<n> with n a stream sequence", s)
		}
		return Point{Seq: n}, nil
	}
	t, err := parseRFC3339(s)
	if err != nil {
		return Point{}, fmt.Errorf("point %q: want an RFC 3339 time (2026-11-02T03:12:00Z) or seq:<n>", s)
	}
	if t.IsZero() {
		t = t.Add(time.Nanosecond) // the zero time is no point; one nanosecond later answers the same
	}
	return Point{Time: t}, nil
}

// parseRFC3339 reads s as RFC 3339 section 5.6 writes a date-time, and nothing else. Go's
// time.Parse alone is both wider and narrower than the grammar: it takes a comma before the fraction
// and an offset of +24:00, which are no RFC 3339 times, and refuses the lower-case t and z and the
// leap second 60, which are. A leap second (23:59:60, with or without a fraction) reads as the last
// instant of the second before it: the clocks that stamp messages (Unix time) repeat or smear that
// second, so every message stamped during it is at or before it. Section 5.7 allows the second 60
// only where a leap second can fall, the last second of a month in UTC (shifted by the offset:
// 15:59:60-08:00 on December 31); anywhere else it is no time (03:12:60Z would read as a moment
// the writer did not mean, most likely 03:13:00).
func parseRFC3339(s string) (time.Time, error) {
	bad := errors.New("not an RFC 3339 date-time")
	digits := func(s string) bool {
		for i := 0; i < len(s); i++ {
			if s[i] < '0' || s[i] > '9' {
				return false
			}
		}
		return s != ""
	}
	// full-date "T" partial-time: YYYY-MM-DDTHH:MM:SS, then an optional fraction, then the offset.
	if len(s) < 20 || !digits(s[0:4]) || s[4] != '-' || !digits(s[5:7]) || s[7] != '-' || !digits(s[8:10]) ||
		(s[10] != 'T' && s[10] != 't') || !digits(s[11:13]) || s[13] != ':' || !digits(s[14:16]) || s[16] != ':' ||
		!digits(s[17:19]) {
		return time.Time{}, bad
	}
	rest := s[19:]
	frac := ""
	if rest[0] == '.' {
		i := 1
		for i < len(rest) && rest[i] >= '0' && rest[i] <= '9' {
			i++
		}
		if i == 1 {
			return time.Time{}, bad
		}
		frac, rest = rest[:i], rest[i:]
	}
	switch {
	case rest == "Z" || rest == "z":
		rest = "Z"
	case len(rest) == 6 && (rest[0] == '+' || rest[0] == '-') && digits(rest[1:3]) && rest[3] == ':' && digits(rest[4:6]):
		if rest[1:3] > "23" || rest[4:6] > "59" {
			return time.Time{}, bad
		}
	default:
		return time.Time{}, bad
	}
	leap := s[17:19] == "60"
	sec := s[17:19]
	if leap {
		sec, frac = "59", ""
	}
	t, err := time.Parse(time.RFC3339Nano, s[:10]+"T"+s[11:17]+sec+frac+rest)
	if err != nil {
		return time.Time{}, err
	}
	if leap {
		if end := t.Add(time.Second).UTC(); end.Day() != 1 || end.Hour() != 0 || end.Minute() != 0 || end.Second() != 0 {
			return time.Time{}, bad // not the last second of a month in UTC: no leap second falls there
		}
		t = t.Add(time.Second - time.Nanosecond)
	}
	return t, nil
}

// Resolved is a point resolved against a bucket's log: the sequence to answer as of, and the moment
// the registry is read at for unanswered-kind.
type Resolved struct {
	Bucket string
	Seq    uint64
	// RegistryAt is the time (Unix ns) the registry is read as of; math.MaxInt64 means its newest.
	RegistryAt int64
}

// Resolve turns a point into the sequence of bucket to answer as of, and checks that the log rebuilds
// it exactly; a point it cannot is an error wrapping store.ErrTrimmed or store.ErrGap.
func Resolve(v *store.View, bucket string, p Point) (Resolved, error) {
	return resolve(viewPoints{v}, bucket, p)
}

// pointIndex is what resolving a point reads of a bucket's log: its checkpoint and marks, and the
// sequences and times of its messages. A store's view answers it (viewPoints); a log holding one
// node's keys alone answers it from the stream for that node's bucket (nodePoints, node.go).
type pointIndex interface {
	Checkpoint(bucket string) (store.Checkpoint, error)
	HistoryMarks(bucket string) (store.HistoryMarks, error)
	// SeqAtTime is store.View.SeqAtTime.
	SeqAtTime(bucket string, t int64) (uint64, error)
	// TimeAfter is the time of the first message the log keeps after seq, or 0.
	TimeAfter(bucket string, seq uint64) (int64, error)
}

// viewPoints is a store view's pointIndex.
type viewPoints struct{ *store.View }

func (v viewPoints) TimeAfter(bucket string, seq uint64) (int64, error) {
	return firstEventAfter(v.View, bucket, seq)
}

// resolve is Resolve reading the log through ix.
func resolve(v pointIndex, bucket string, p Point) (Resolved, error) {
	applied, err := v.Checkpoint(bucket)
	if err != nil {
		return Resolved{}, err
	}
	marks, err := v.HistoryMarks(bucket)
	if err != nil {
		return Resolved{}, err
	}
	r := Resolved{Bucket: bucket}
	if p.IsTime() {
		t := unixNano(p.Time)
		if r.Seq, err = v.SeqAtTime(bucket, t); err != nil {
			return r, err
		}
		r.Seq = min(r.Seq, applied.Applied)
		r.RegistryAt = t
		if r.Seq == 0 && marks.Floor == 0 && applied.StreamCreated > 0 && t < applied.StreamCreated {
			// Before the stream was created, so before the bucket's first message, and nothing trimmed:
			// the empty state, whatever the stream removed later before the seat read it.
			return r, nil
		}
		if r.Seq < marks.Floor {
			return r, fmt.Errorf("%w: the log rebuilds %s (seq:%d) and later, not %s", store.ErrTrimmed,
				time.Unix(0, marks.FloorTime).UTC().Format(time.RFC3339Nano), marks.Floor, p)
		}
		if err := marks.Check(r.Seq); err != nil {
			return r, err
		}
		// Messages the log never saw right after the point may be stamped before the time: also
		// past the applied sequence, when the stream's end was removed before it was read
		// (store.DB.TailRemoved).
		if err := marks.Check(r.Seq + 1); errors.Is(err, store.ErrGap) {
			return r, fmt.Errorf("%w: the messages right after sequence %d were removed before they were read, so which of them came before %s is not known", store.ErrGap, r.Seq, p)
		}
		return r, nil
	}
	r.Seq = min(p.Seq, applied.Applied)
	if err := marks.Check(r.Seq); err != nil {
		return r, err
	}
	if p.Seq > applied.Applied {
		// Past what was applied: as of the applied sequence, unless the messages after it were
		// removed before they were read, and the point is among them.
		if err := marks.Check(applied.Applied + 1); err != nil {
			return r, err
		}
	}
	// The registry is read as of the last moment the bucket was in this state.
	r.RegistryAt = math.MaxInt64
	if r.Seq < applied.Applied {
		if first, err := v.TimeAfter(bucket, r.Seq); err != nil {
			return r, err
		} else if first != 0 {
			r.RegistryAt = first - 1
		}
	}
	return r, nil
}

// unixNano is a time in Unix nanoseconds, clamped to the int64 range: time.Time.UnixNano wraps
// around outside the years 1678-2262, so the year 1000 would read as 2169 and the year 9999 as 1816.
// Every message's time is inside the range, so a clamped time is before, or after, all of them.
func unixNano(t time.Time) int64 {
	switch {
	case t.Before(minUnixNano):
		return math.MinInt64
	case t.After(maxUnixNano):
		return math.MaxInt64
	}
	return t.UnixNano()
}

var (
	minUnixNano = time.Unix(0, math.MinInt64)
	maxUnixNano = time.Unix(0, math.MaxInt64)
)

// firstEventAfter is the time of the first message the log keeps after seq, or 0.
func firstEventAfter(v *store.View, bucket string, seq uint64) (int64, error) {
	var t int64
	err := v.Events(bucket, seq+1, func(_ []byte, ev *store.Event) bool {
		t = ev.Time
		return false
	})
	return t, err
}

// registryKinds reads the registry's kinds as of a time: the keys of the registry bucket that hold a
// put, and the registry's sequence they are as of. It checks that the registry's log rebuilds that
// moment.
func registryKinds(v *store.View, at int64) (map[string]struct{}, uint64, error) {
	bucket := provisioner.BucketRegistry
	cp, err := v.Checkpoint(bucket)
	if err != nil {
		return nil, 0, err
	}
	n := cp.Applied
	if at != math.MaxInt64 {
		if n, err = v.SeqAtTime(bucket, at); err != nil {
			return nil, 0, err
		}
		n = min(n, cp.Applied)
	}
	marks, err := v.HistoryMarks(bucket)
	if err != nil {
		return nil, 0, err
	}
	if err := marks.Check(n); err != nil {
		return nil, 0, fmt.Errorf("unanswered-kind needs the registry as of the same moment: %w", err)
	}
	kinds := map[string]struct{}{}
	err = v.StateAt(bucket, "", "", n, func(key []byte, _ *store.Event) bool {
		if _, err := provisioner.ParseKey(provisioner.ShapeRegistry, string(key)); err == nil {
			kinds[string(key)] = struct{}{}
		}
		return true
	})
	return kinds, n, err
}

// goneOr maps the log's "cannot rebuild" errors to the verb's 410.
func goneOr(err error) error {
	if errors.Is(err, store.ErrTrimmed) || errors.Is(err, store.ErrGap) {
		return query.Gone("%w", err)
	}
	return err
}
