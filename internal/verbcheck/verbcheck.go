// Package verbcheck compares what the verb answers with what the buckets hold, read through the KV
// API: the independent truth a projection must equal. It is for tests that run a seat in-process or as
// a subprocess, against a real nats-server, and need to say "no row missing, extra or stale, and the
// anomalies are exactly the out-of-shape keys present" after a fault.
//
// The expectation is computed here without the projection's own code paths: a key's shape is read by
// splitting it (only the collection's =XX decoding is shared with the root package), a value is
// MessagePack when the msgpack library decodes it whole, and a need's kind is answered when the
// registry bucket holds it.
package verbcheck

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"reflect"
	"sort"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nats.go/micro"
	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/query"
)

// Entry is a key as the KV API reads it.
type Entry struct {
	Key      string
	Value    []byte
	Revision uint64
	Created  time.Time
}

// ReadBucket reads every live key of a bucket with its last value, through a KV watcher (one ordered
// consumer delivering the last message per subject). A missing bucket is empty.
func ReadBucket(ctx context.Context, js jetstream.JetStream, bucket string) (map[string]Entry, error) {
	out := map[string]Entry{}
	kv, err := js.KeyValue(ctx, bucket)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		return out, nil
	}
	if err != nil {
		return nil, fmt.Errorf("bucket %s: %w", bucket, err)
	}
	w, err := kv.WatchAll(ctx, jetstream.IgnoreDeletes())
	if err != nil {
		return nil, fmt.Errorf("watch %s: %w", bucket, err)
	}
	defer w.Stop()
	for {
		select {
		case e, ok := <-w.Updates():
			if !ok {
				return nil, fmt.Errorf("watch %s: stopped before the initial values were read", bucket)
			}
			if e == nil {
				return out, nil // every initial value has been delivered
			}
			out[e.Key()] = Entry{Key: e.Key(), Value: e.Value(), Revision: e.Revision(), Created: e.Created()}
		case <-ctx.Done():
			return nil, fmt.Errorf("watch %s: %w", bucket, ctx.Err())
		}
	}
}

// shapeNames are the parts of each bucket's tokens, as a row answers them.
var shapeNames = map[string][]string{
	provisioner.BucketRegistry: {"kind"},
	provisioner.BucketNeeds:    {"node", "module", "kind", "name"},
	provisioner.BucketApplied:  {"node", "module"},
	provisioner.BucketCollect:  {"node", "collection_key", "contributor"},
}

// Shape says, by splitting the key itself, whether it fits the bucket's shape: its parts, or the
// reason code of its anomaly.
func Shape(bucket, key string) (map[string]string, string) {
	toks := strings.Split(key, ".")
	names := shapeNames[bucket]
	if len(toks) != len(names) {
		return nil, "token-count"
	}
	parts := map[string]string{}
	for i, tok := range toks {
		if tok == "" || strings.Trim(tok, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_/=") != "" {
			return nil, "bad-token"
		}
		parts[names[i]] = tok
	}
	if bucket == provisioner.BucketCollect {
		name, err := provisioner.DecodeCollection(parts["collection_key"])
		if err != nil {
			return nil, "bad-escape"
		}
		parts["collection"] = name
	}
	return parts, ""
}

// MaxDepth is how deeply arrays and maps may nest in a value that counts as MessagePack: a deeper one
// is kept as raw bytes and is an anomaly (docs/decisions.md), the same bound as internal/mpk's.
const MaxDepth = 512

// IsMsgpack reports whether b is one complete MessagePack object nested at most MaxDepth deep.
func IsMsgpack(b []byte) bool {
	rd := bytes.NewReader(b)
	dec := msgpack.NewDecoder(rd)
	return len(b) > 0 && walk(dec, 0) == nil && rd.Len() == 0
}

var errTooDeep = errors.New("nested too deep")

func walk(dec *msgpack.Decoder, depth int) error {
	c, err := dec.PeekCode()
	if err != nil {
		return err
	}
	isArray := msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32
	isMap := msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32
	if !isArray && !isMap {
		return dec.Skip()
	}
	if depth+1 > MaxDepth {
		return errTooDeep
	}
	var n int
	if isArray {
		n, err = dec.DecodeArrayLen()
	} else {
		n, err = dec.DecodeMapLen()
		n *= 2
	}
	if err != nil {
		return err
	}
	for i := 0; i < n; i++ {
		if err := walk(dec, depth+1); err != nil {
			return err
		}
	}
	return nil
}

// Truth is the buckets as the KV API reads them.
type Truth map[string]map[string]Entry

// ReadTruth reads the four provisioner buckets.
func ReadTruth(ctx context.Context, js jetstream.JetStream) (Truth, error) {
	t := Truth{}
	for _, s := range provisioner.ProvisionerShapes {
		b, err := ReadBucket(ctx, js, s.Bucket)
		if err != nil {
			return nil, err
		}
		t[s.Bucket] = b
	}
	return t, nil
}

// ExpectRow is a row a request must answer.
type ExpectRow struct {
	Entry
	Parts map[string]string
}

// Expect computes, from the truth, the rows (in byte order of raw keys) and the anomalies ("<key>
// <reason code>") of a request narrowed by the fields the test harnesses use: what, node, module,
// contributor, kind, collection.
func (t Truth) Expect(req map[string]any) ([]ExpectRow, map[string]bool) {
	str := func(k string) string {
		s, _ := req[k].(string)
		if k == "module" && s == "" {
			s, _ = req["contributor"].(string)
		}
		return s
	}
	what := str("what")
	if what == "" {
		what = "registry"
	}
	shape, _ := provisioner.ShapeOfWhat(provisioner.What(what))
	registry := t[provisioner.BucketRegistry]
	var rows []ExpectRow
	anomalies := map[string]bool{}
	for _, e := range t[shape.Bucket] {
		parts, bad := Shape(shape.Bucket, e.Key)
		node := strings.SplitN(e.Key, ".", 2)[0]
		if str("node") == "" || str("node") == node {
			if bad != "" {
				anomalies[e.Key+" "+bad] = true
			} else {
				if !IsMsgpack(e.Value) {
					anomalies[e.Key+" value-not-msgpack"] = true
				}
				if shape.Bucket == provisioner.BucketNeeds {
					if _, ok := registry[parts["kind"]]; !ok {
						anomalies[e.Key+" unanswered-kind"] = true
					}
				}
			}
		}
		if bad != "" {
			continue
		}
		match := true
		for _, f := range []struct{ req, part string }{{"node", "node"}, {"kind", "kind"}, {"collection", "collection"}} {
			if v := str(f.req); v != "" && parts[f.part] != v {
				match = false
			}
		}
		if m := str("module"); m != "" {
			switch what {
			case "registry":
				var reg map[string]any
				_ = msgpack.Unmarshal(e.Value, &reg)
				if reg["module"] != m {
					match = false
				}
			case "collect":
				match = match && parts["contributor"] == m
			default:
				match = match && parts["module"] == m
			}
		}
		if match {
			rows = append(rows, ExpectRow{Entry: e, Parts: parts})
		}
	}
	sort.Slice(rows, func(i, j int) bool { return rows[i].Key < rows[j].Key })
	return rows, anomalies
}

// Diff is how an answer differs from the truth. Empty means equal.
type Diff struct {
	Request   string
	Missing   []string // keys the buckets hold and the answer lacks
	Extra     []string // keys the answer holds and the buckets do not
	Stale     []string // keys answered with another revision, value, time or parts
	Anomalies []string // "+<key> <reason>" answered but not expected, "-<key> <reason>" expected but not answered
	Other     []string // as_of, synced, anomalies_total, order
}

// Empty reports whether the answer equals the truth.
func (d *Diff) Empty() bool {
	return len(d.Missing)+len(d.Extra)+len(d.Stale)+len(d.Anomalies)+len(d.Other) == 0
}

func (d *Diff) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s: %d missing, %d extra, %d stale, %d anomalies differ", d.Request, len(d.Missing), len(d.Extra), len(d.Stale), len(d.Anomalies))
	for _, l := range []struct {
		name  string
		items []string
	}{{"missing", d.Missing}, {"extra", d.Extra}, {"stale", d.Stale}, {"anomalies", d.Anomalies}, {"other", d.Other}} {
		if len(l.items) == 0 {
			continue
		}
		items := l.items
		if len(items) > 5 {
			items = append(items[:5:5], fmt.Sprintf("... %d more", len(l.items)-5))
		}
		fmt.Fprintf(&b, "\n  %s: %s", l.name, strings.Join(items, "; "))
	}
	return b.String()
}

// page is one answer, with each MessagePack row's value kept as the bytes answered.
type page struct {
	Rows           []map[string]any
	Values         [][]byte // MessagePack answers: each row's value as answered
	Anomalies      []map[string]any
	AnomaliesTotal int64
	AsOf           uint64
	Synced         bool
	Next           string
}

// ask sends one request, in JSON or MessagePack, and reads its answer.
func ask(nc *nats.Conn, req map[string]any, asMsgpack bool) (page, error) {
	var body []byte
	var err error
	if asMsgpack {
		body, err = msgpack.Marshal(req)
	} else {
		body, err = json.Marshal(req)
	}
	if err != nil {
		return page{}, err
	}
	if !asMsgpack {
		a, _, err := natstest.Ask(nc, query.Subject, body, false)
		return page{Rows: a.Rows, Anomalies: a.Anomalies, AnomaliesTotal: a.AnomaliesTotal, AsOf: a.AsOf, Synced: a.Synced, Next: a.Next}, err
	}
	msg, err := nc.Request(query.Subject, body, 10*time.Second)
	if err != nil {
		return page{}, err
	}
	if code := msg.Header.Get(micro.ErrorCodeHeader); code != "" {
		return page{}, fmt.Errorf("verb error %s: %s", code, msg.Header.Get(micro.ErrorHeader))
	}
	var a struct {
		Rows           []map[string]msgpack.RawMessage `msgpack:"rows"`
		Anomalies      []map[string]any                `msgpack:"anomalies"`
		AnomaliesTotal int64                           `msgpack:"anomalies_total"`
		AsOf           uint64                          `msgpack:"as_of"`
		Synced         bool                            `msgpack:"synced"`
		Next           string                          `msgpack:"next"`
	}
	if err := msgpack.Unmarshal(msg.Data, &a); err != nil {
		return page{}, fmt.Errorf("decode answer: %w", err)
	}
	p := page{Anomalies: a.Anomalies, AnomaliesTotal: a.AnomaliesTotal, AsOf: a.AsOf, Synced: a.Synced, Next: a.Next}
	for _, raw := range a.Rows {
		row := map[string]any{}
		for k, v := range raw {
			if k == "value" {
				continue
			}
			var x any
			if err := msgpack.Unmarshal(v, &x); err != nil {
				return page{}, fmt.Errorf("decode row field %s: %w", k, err)
			}
			row[k] = x
		}
		p.Rows = append(p.Rows, row)
		p.Values = append(p.Values, raw["value"])
	}
	return p, nil
}

// Check asks req through every page, in JSON or MessagePack, and compares rows and anomalies with the
// truth. asOf, when non-zero, is the sequence every page's as_of must equal (the bucket's last stream
// sequence, with writers paused); each page asks with it as min_seq. It returns a *Diff when they differ, or the error that stopped it.
func (t Truth) Check(nc *nats.Conn, req map[string]any, asMsgpack bool, asOf uint64) error {
	want, wantAnoms := t.Expect(req)
	d := &Diff{Request: fmt.Sprintf("%v msgpack=%v", req, asMsgpack)}
	r := map[string]any{}
	for k, v := range req {
		r[k] = v
	}
	if asOf != 0 {
		// Whichever seat of the queue group answers, it answers once it has applied asOf.
		r["min_seq"], r["wait_ms"] = asOf, query.MaxWaitMS
	}
	var rows []map[string]any
	var values [][]byte
	var last page
	for n := 0; ; n++ {
		if n > 100000 {
			return fmt.Errorf("%s: more than 100000 pages", d.Request)
		}
		p, err := ask(nc, r, asMsgpack)
		if err != nil {
			return fmt.Errorf("%s: %w", d.Request, err)
		}
		if asOf != 0 && p.AsOf != asOf {
			d.Other = append(d.Other, fmt.Sprintf("page %d: as_of %d, want %d", n, p.AsOf, asOf))
		}
		rows = append(rows, p.Rows...)
		values = append(values, p.Values...)
		last = p
		if p.Next == "" {
			break
		}
		r["after"] = p.Next
	}
	got := map[string]int{}
	for i, row := range rows {
		k := fmt.Sprint(row["key"])
		got[k] = i
		if i > 0 && fmt.Sprint(rows[i-1]["key"]) >= k {
			d.Other = append(d.Other, fmt.Sprintf("row %q follows %q: not in byte order", k, rows[i-1]["key"]))
		}
	}
	wantKeys := map[string]bool{}
	for _, w := range want {
		wantKeys[w.Key] = true
		i, ok := got[w.Key]
		if !ok {
			d.Missing = append(d.Missing, w.Key)
			continue
		}
		var value []byte
		if asMsgpack {
			value = values[i]
		}
		if why := stale(w, rows[i], asMsgpack, value); why != "" {
			d.Stale = append(d.Stale, w.Key+": "+why)
		}
	}
	for k := range got {
		if !wantKeys[k] {
			d.Extra = append(d.Extra, k)
		}
	}
	// The anomalies listed are the first of the expected ones in the answer's order (raw key, then
	// class): all of them when they fit one message, at least minListed of them when the list was cut.
	order := sortedAnomalies(wantAnoms)
	listed := make([]string, 0, len(last.Anomalies))
	for _, a := range last.Anomalies {
		reason, _ := a["reason"].(string)
		code, _, _ := strings.Cut(reason, ":")
		listed = append(listed, fmt.Sprint(a["key"])+" "+code)
	}
	need := min(len(order), query.MaxAnomalies)
	if len(listed) < need && len(listed) >= minListed {
		need = len(listed) // cut to fit one message
	}
	for i, a := range listed {
		if !wantAnoms[a] {
			d.Anomalies = append(d.Anomalies, "+"+a)
		} else if i < len(order) && order[i] != a {
			d.Other = append(d.Other, fmt.Sprintf("anomaly %d is %q, want %q", i, a, order[i]))
		}
	}
	for _, a := range order[min(len(listed), need):need] {
		d.Anomalies = append(d.Anomalies, "-"+a)
	}
	if last.AnomaliesTotal != int64(len(wantAnoms)) {
		d.Other = append(d.Other, fmt.Sprintf("anomalies_total %d, want %d", last.AnomaliesTotal, len(wantAnoms)))
	}
	if !last.Synced {
		d.Other = append(d.Other, "synced is false")
	}
	sort.Strings(d.Missing)
	sort.Strings(d.Extra)
	sort.Strings(d.Stale)
	sort.Strings(d.Anomalies)
	if d.Empty() {
		return nil
	}
	return d
}

// minListed is how many anomalies an answer lists at least when there are that many: a list cut to fit
// one message still holds this many of the longest keys.
const minListed = 32

// anomalyClass orders the reasons of one key as the store does: key shape, then value, then kind.
var anomalyClass = map[string]int{"token-count": 1, "bad-token": 1, "bad-escape": 1, "value-not-msgpack": 2, "unanswered-kind": 4}

// sortedAnomalies orders "<key> <reason>" by raw key, then class.
func sortedAnomalies(set map[string]bool) []string {
	out := make([]string, 0, len(set))
	for a := range set {
		out = append(out, a)
	}
	sort.Slice(out, func(i, j int) bool {
		ki, ri := splitAnomaly(out[i])
		kj, rj := splitAnomaly(out[j])
		if ki != kj {
			return ki < kj
		}
		return anomalyClass[ri] < anomalyClass[rj]
	})
	return out
}

func splitAnomaly(a string) (key, reason string) {
	i := strings.LastIndexByte(a, ' ')
	return a[:i], a[i+1:]
}

// stale says how an answered row differs from the entry, or "". value is the row's value as answered
// in a MessagePack answer (nil for JSON).
func stale(w ExpectRow, row map[string]any, asMsgpack bool, value []byte) string {
	if fmt.Sprint(row["revision"]) != fmt.Sprint(w.Revision) {
		return fmt.Sprintf("revision %v, want %d", row["revision"], w.Revision)
	}
	for part, v := range w.Parts {
		if row[part] != v {
			return fmt.Sprintf("%s %v, want %q", part, row[part], v)
		}
	}
	var created time.Time
	switch c := row["created"].(type) {
	case string:
		ts, err := time.Parse(time.RFC3339Nano, c)
		if err != nil {
			return "created: " + err.Error()
		}
		created = ts
	case time.Time:
		created = c
	default:
		return fmt.Sprintf("created is %T", row["created"])
	}
	if !created.Equal(w.Created) {
		return fmt.Sprintf("created %v, want %v", created, w.Created)
	}
	isNil := row["value"] == nil && (!asMsgpack || len(value) == 0 || bytes.Equal(value, []byte{0xc0}))
	if n, ok := row["value_omitted"]; ok {
		// Too large for one answer (query/limits.go): the size is said instead.
		if fmt.Sprint(n) != fmt.Sprint(len(w.Value)) || !isNil || len(w.Value) < OmitAtLeast {
			return fmt.Sprintf("value_omitted %v for a value of %d bytes", n, len(w.Value))
		}
		return ""
	}
	rawOK := func() string {
		if !isNil {
			return "value is not null beside value_raw"
		}
		raw := row["value_raw"]
		if !asMsgpack {
			s, _ := raw.(string)
			b, err := base64.StdEncoding.DecodeString(s)
			if err != nil {
				return "value_raw: " + err.Error()
			}
			raw = b
		}
		if b, _ := raw.([]byte); !bytes.Equal(b, w.Value) {
			return fmt.Sprintf("value_raw %x, want %x", raw, w.Value)
		}
		return ""
	}
	if !IsMsgpack(w.Value) {
		return rawOK()
	}
	if _, has := row["value_raw"]; has {
		if !asMsgpack && !jsonCanCarry(w.Value) {
			return rawOK() // JSON has no form for it: the bytes as they are
		}
		return "value_raw on a MessagePack value"
	}
	if asMsgpack {
		if !bytes.Equal(value, w.Value) {
			return fmt.Sprintf("value %x, want %x", value, w.Value)
		}
		return ""
	}
	var v any
	if err := msgpack.Unmarshal(w.Value, &v); err != nil {
		return "" // a value this library cannot read (ext types): the MessagePack pass compares bytes
	}
	wantJSON, err := json.Marshal(v)
	if err != nil {
		// JSON has no such value (NaN): the MessagePack pass compares it exactly; here it is enough
		// that the answer parsed.
		return ""
	}
	gotJSON, err := json.Marshal(row["value"])
	if err != nil {
		return fmt.Sprintf("value: %v", err)
	}
	var a, b any
	_ = json.Unmarshal(wantJSON, &a)
	_ = json.Unmarshal(gotJSON, &b)
	if !reflect.DeepEqual(a, b) {
		return fmt.Sprintf("value %s, want %s", gotJSON, wantJSON)
	}
	return ""
}

// validTimestamp reports whether b starts with the timestamp extension (type -1) in one of its three
// forms, with nanoseconds below a second.
func validTimestamp(b []byte) bool {
	switch {
	case len(b) >= 6 && b[0] == 0xd6 && b[1] == 0xff:
		return true
	case len(b) >= 10 && b[0] == 0xd7 && b[1] == 0xff:
		return binary.BigEndian.Uint32(b[2:])>>2 < 1e9
	case len(b) >= 15 && b[0] == 0xc7 && b[1] == 12 && b[2] == 0xff:
		return binary.BigEndian.Uint32(b[3:]) < 1e9
	}
	return false
}

// OmitAtLeast is the smallest value a row may be answered without (value_omitted): anything smaller
// fits in an answer of the default 1 MiB max payload in either format.
const OmitAtLeast = 64 << 10

// jsonCanCarry reports whether a MessagePack value has a JSON form: no extension types (a timestamp
// that is not one, an application's own), no map keys that are not strings, no float that is NaN or
// infinite, and no string (a key's or a value's) that is not UTF-8.
func jsonCanCarry(b []byte) bool {
	rd := bytes.NewReader(b)
	dec := msgpack.NewDecoder(rd)
	var walk func() bool
	walk = func() bool {
		c, err := dec.PeekCode()
		if err != nil {
			return false
		}
		switch {
		case c == msgpcode.Float || c == msgpcode.Double:
			f, err := dec.DecodeFloat64()
			return err == nil && !math.IsNaN(f) && !math.IsInf(f, 0) // JSON has no NaN or infinity
		case msgpcode.IsFixedString(c) || c == msgpcode.Str8 || c == msgpcode.Str16 || c == msgpcode.Str32:
			s, err := dec.DecodeBytes()
			return err == nil && utf8.Valid(s) // JSON text holds no other string
		case msgpcode.IsExt(c):
			return validTimestamp(b[len(b)-rd.Len():]) && dec.Skip() == nil
		case msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32:
			n, err := dec.DecodeArrayLen()
			if err != nil {
				return false
			}
			for i := 0; i < n; i++ {
				if !walk() {
					return false
				}
			}
			return true
		case msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32:
			n, err := dec.DecodeMapLen()
			if err != nil {
				return false
			}
			for i := 0; i < n; i++ {
				k, err := dec.PeekCode()
				if err != nil || !(msgpcode.IsFixedString(k) || k == msgpcode.Str8 || k == msgpcode.Str16 || k == msgpcode.Str32) {
					return false
				}
				if !walk() || !walk() {
					return false
				}
			}
			return true
		}
		return dec.Skip() == nil
	}
	return walk()
}

// sameValue is reflect.DeepEqual, but for NaN, which equals NaN here: the same bytes were answered.
func sameValue(a, b any) bool {
	switch a := a.(type) {
	case float64:
		if bf, ok := b.(float64); ok && math.IsNaN(a) && math.IsNaN(bf) {
			return true
		}
	case float32:
		if bf, ok := b.(float32); ok && a != a && bf != bf {
			return true
		}
	case []any:
		bs, ok := b.([]any)
		if !ok || len(bs) != len(a) {
			return false
		}
		for i := range a {
			if !sameValue(a[i], bs[i]) {
				return false
			}
		}
		return true
	case map[string]any:
		bm, ok := b.(map[string]any)
		if !ok || len(bm) != len(a) {
			return false
		}
		for k, v := range a {
			if w, ok := bm[k]; !ok || !sameValue(v, w) {
				return false
			}
		}
		return true
	}
	return reflect.DeepEqual(a, b)
}

// CheckAll compares every provisioner bucket whole (one request per what, all pages) with the truth,
// in JSON and in MessagePack. lastSeq, when set, gives each bucket's stream last sequence that every
// as_of must equal. It returns the first difference found per what, joined.
func (t Truth) CheckAll(nc *nats.Conn, lastSeq map[string]uint64) error {
	var errs []error
	for _, s := range provisioner.ProvisionerShapes {
		for _, mp := range []bool{false, true} {
			req := map[string]any{"what": string(s.What), "limit": 997}
			if err := t.Check(nc, req, mp, lastSeq[s.Bucket]); err != nil {
				errs = append(errs, err)
				break
			}
		}
	}
	return errors.Join(errs...)
}

// LastSeqs reads each provisioner bucket's stream last sequence; a missing stream is 0.
func LastSeqs(ctx context.Context, js jetstream.JetStream) (map[string]uint64, error) {
	out := map[string]uint64{}
	for _, s := range provisioner.ProvisionerShapes {
		st, err := js.Stream(ctx, provisioner.StreamName(s.Bucket))
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			continue
		}
		if err != nil {
			return nil, err
		}
		info, err := st.Info(ctx)
		if err != nil {
			return nil, err
		}
		out[s.Bucket] = info.State.LastSeq
	}
	return out, nil
}

// CaughtUp asks the verb once per bucket whether it has applied the bucket's last sequence: it
// returns nil when every answer's as_of reached it and says synced.
func CaughtUp(nc *nats.Conn, lastSeq map[string]uint64) error {
	for _, s := range provisioner.ProvisionerShapes {
		body := fmt.Sprintf(`{"what":%q,"limit":1}`, s.What)
		a, _, err := natstest.Ask(nc, query.Subject, []byte(body), false)
		if err != nil {
			return fmt.Errorf("%s: %w", s.What, err)
		}
		if a.AsOf < lastSeq[s.Bucket] || !a.Synced {
			return fmt.Errorf("%s: as_of %d of %d, synced %v", s.What, a.AsOf, lastSeq[s.Bucket], a.Synced)
		}
	}
	return nil
}
