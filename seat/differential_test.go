package seat_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/replay"
	"github.com/novox/mesh-provisioner/store"
)

// The differential test: one hostile mix of messages published to the node buckets through a real
// nats-server, and every path to the projection asked about it (the live seat, at on the verb, a
// rebuild, replay from the streams, from the state dir, from an export of each), compared row for row
// and anomaly for anomaly with each other and with a model computed here from the contract's text
// (sections 1 and 2) alone.

// dop is what a hand-published message does, as the test writes it.
type dop int

const (
	dPut        dop = iota
	dDel            // KV-Operation: DEL
	dPurge          // KV-Operation: PURGE, Nats-Rollup: sub
	dMarker         // Nats-Marker-Reason: MaxAge
	dMarkerNone     // Nats-Marker-Reason set, empty
	dOddOp          // KV-Operation: neither DEL nor PURGE, with a value: a put
)

type dmsg struct {
	bucket, key string
	op          dop
	value       []byte
	rollup      string // a Nats-Rollup header added by hand: "sub" or "all", in any case
	header      string // a header named in lower case, which NATS reads as no header of its: "name: value"
	foreign     string // a subject added to the bucket's stream by hand, published instead of the key's
	phase       int
	seq         uint64 // from the publish's ack
}

// rollsUp reports whether m's rollup removed an earlier message of key from the stream: NATS matches
// the message's subject as a filter ("*" one token, ">" the rest), or the whole stream for "all".
func (m dmsg) rollsUp(key string) bool {
	rollup := m.rollup
	if m.op == dPurge {
		rollup = "sub" // a KV purge's
	}
	switch strings.ToLower(rollup) {
	case "all":
		return true
	case "sub":
		p, k := strings.Split(m.key, "."), strings.Split(key, ".")
		for i := range p {
			switch {
			case p[i] == ">":
				return len(k) > i
			case i >= len(k) || p[i] != "*" && p[i] != k[i]:
				return false
			}
		}
		return len(p) == len(k)
	}
	return false
}

func (m dmsg) removes() bool { return m.op != dPut && m.op != dOddOp }

func (m dmsg) natsMsg() *nats.Msg {
	msg := nats.NewMsg("$KV." + m.bucket + "." + m.key)
	if m.foreign != "" {
		msg.Subject = m.foreign
	}
	switch m.op {
	case dDel:
		msg.Header.Set("KV-Operation", "DEL")
	case dPurge:
		msg.Header.Set("KV-Operation", "PURGE")
		msg.Header.Set("Nats-Rollup", "sub")
	case dMarker:
		msg.Header.Set("Nats-Marker-Reason", "MaxAge")
	case dMarkerNone:
		msg.Header.Set("Nats-Marker-Reason", "")
	case dOddOp:
		msg.Header.Set("KV-Operation", "del")
		msg.Data = m.value
	default:
		msg.Data = m.value
	}
	if m.rollup != "" {
		msg.Header.Set("Nats-Rollup", m.rollup)
	}
	if name, value, ok := strings.Cut(m.header, ": "); ok {
		msg.Header[name] = []string{value}
	}
	return msg
}

// The model: the contract's rules written out plainly.

// contractTokens is how many tokens each bucket's keys have (CONTRACT section 1).
var contractTokens = map[string]int{
	provisioner.BucketRegistry: 1, provisioner.BucketNeeds: 4, provisioner.BucketApplied: 2, provisioner.BucketCollect: 3,
}

// contractKinds are the kinds of the registry table (CONTRACT section 4).
var contractKinds = []string{"config", "secret", "bound", "consumers", "collected", "shell", "environment", "contribution",
	"dir", "access", "port", "seat", "machine"}

func modelToken(tok string) bool {
	if tok == "" {
		return false
	}
	for _, c := range []byte(tok) {
		if !(c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || strings.IndexByte("-_/=", c) >= 0) {
			return false
		}
	}
	return true
}

func modelHex(c byte) (byte, bool) {
	switch {
	case c >= '0' && c <= '9':
		return c - '0', true
	case c >= 'a' && c <= 'f':
		return c - 'a' + 10, true
	case c >= 'A' && c <= 'F':
		return c - 'A' + 10, true
	}
	return 0, false
}

// modelDecode decodes a collection token: every =XX, XX two hex digits of either case; the result
// must be valid UTF-8.
func modelDecode(tok string) (string, bool) {
	var out []byte
	for i := 0; i < len(tok); i++ {
		if tok[i] != '=' {
			out = append(out, tok[i])
			continue
		}
		if i+2 >= len(tok) {
			return "", false
		}
		hi, ok1 := modelHex(tok[i+1])
		lo, ok2 := modelHex(tok[i+2])
		if !ok1 || !ok2 {
			return "", false
		}
		out = append(out, hi<<4|lo)
		i += 2
	}
	return string(out), utf8.Valid(out)
}

// modelShape returns a key's parts, or the reason code it is out of shape.
func modelShape(bucket, key string) (map[string]string, string) {
	toks := strings.Split(key, ".")
	if len(toks) != contractTokens[bucket] {
		return nil, "token-count"
	}
	for _, tok := range toks {
		if !modelToken(tok) {
			return nil, "bad-token" // docs/decisions.md, Keys and anomalies
		}
	}
	switch bucket {
	case provisioner.BucketRegistry:
		return map[string]string{"kind": toks[0]}, ""
	case provisioner.BucketNeeds:
		return map[string]string{"node": toks[0], "module": toks[1], "kind": toks[2], "name": toks[3]}, ""
	case provisioner.BucketApplied:
		return map[string]string{"node": toks[0], "module": toks[1]}, ""
	}
	name, ok := modelDecode(toks[1])
	if !ok {
		return nil, "bad-escape"
	}
	return map[string]string{"node": toks[0], "collection": name, "collection_key": toks[1], "contributor": toks[2]}, ""
}

// modelValue says whether a value is one complete MessagePack object, and its JSON.
func modelValue(b []byte) (string, bool) {
	if len(b) == 0 {
		return "", false
	}
	rd := bytes.NewReader(b)
	v, err := msgpack.NewDecoder(rd).DecodeInterface()
	if err != nil || rd.Len() != 0 {
		return "", false
	}
	j, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return string(j), true
}

// drow and danom are rows and anomaly rows as every path is compared: value is JSON, or "raw:" and
// base64 when the value is not MessagePack.
type drow struct {
	Key     string
	Rev     uint64
	Created int64
	Value   string
	Parts   map[string]string
}

type danom struct {
	Bucket string
	Key    string
	Rev    uint64
	Reason string // the code; Text the whole reason
	Text   string
}

type danswer struct {
	Rows      []drow
	Anomalies []danom
	Total     int64
	AsOf      uint64
}

// modelState is what the contract says a bucket answers after every message up to seq n, with the
// registry's kinds as given; created is left 0 (the model does not know the server's times).
func modelState(msgs []dmsg, bucket string, n uint64, kinds map[string]bool, req map[string]string) danswer {
	a := modelUncapped(msgs, bucket, n, kinds, req)
	if len(a.Anomalies) > query.MaxAnomalies {
		a.Anomalies = a.Anomalies[:query.MaxAnomalies]
	}
	return a
}

// modelUncapped is modelState with every anomaly row.
func modelUncapped(msgs []dmsg, bucket string, n uint64, kinds map[string]bool, req map[string]string) danswer {
	node := req["node"]
	cur := map[string]dmsg{}
	for _, m := range msgs {
		if m.bucket != bucket || m.seq > n {
			continue
		}
		if m.foreign != "" {
			// A message on a subject that is no key of the bucket changes nothing, but a rollup of
			// the whole stream, which purged every key.
			if strings.EqualFold(m.rollup, "all") {
				clear(cur)
			}
			continue
		}
		for k := range cur {
			if m.rollsUp(k) {
				delete(cur, k)
			}
		}
		if m.removes() {
			delete(cur, m.key)
		} else {
			cur[m.key] = m
		}
	}
	keys := make([]string, 0, len(cur))
	for k := range cur {
		keys = append(keys, k)
	}
	sort.Strings(keys) // byte order of raw keys
	var a danswer
	for _, k := range keys {
		m := cur[k]
		parts, bad := modelShape(bucket, k)
		if node != "" && strings.SplitN(k, ".", 2)[0] != node {
			continue
		}
		if bad != "" {
			a.Anomalies = append(a.Anomalies, danom{Bucket: bucket, Key: k, Rev: m.seq, Reason: bad})
			continue
		}
		value, ok := modelValue(m.value)
		if !ok {
			value = "raw:" + base64.StdEncoding.EncodeToString(m.value)
			a.Anomalies = append(a.Anomalies, danom{Bucket: bucket, Key: k, Rev: m.seq, Reason: "value-not-msgpack"})
		}
		if bucket == provisioner.BucketNeeds && !kinds[parts["kind"]] {
			a.Anomalies = append(a.Anomalies, danom{Bucket: bucket, Key: k, Rev: m.seq, Reason: "unanswered-kind"})
		}
		if bucket == provisioner.BucketRegistry {
			var e map[string]any
			if msgpack.Unmarshal(m.value, &e) == nil {
				for _, f := range []string{"module", "bucket", "key_shape", "verb"} {
					if s, _ := e[f].(string); s != "" {
						parts[f] = s
					}
				}
			}
		}
		if modelMatches(bucket, parts, req) {
			a.Rows = append(a.Rows, drow{Key: k, Rev: m.seq, Value: value, Parts: parts})
		}
	}
	a.Total = int64(len(a.Anomalies))
	return a
}

// modelMatches narrows rows as CONTRACT section 3 says: node, module (the contributor for collect, the
// value's module for registry), contributor, kind, and the decoded collection.
func modelMatches(bucket string, parts map[string]string, req map[string]string) bool {
	for field, v := range req {
		part := field
		switch {
		case field == "module" && bucket == provisioner.BucketCollect:
			part = "contributor"
		case field == "what":
			continue
		}
		if parts[part] != v {
			return false
		}
	}
	return true
}

// The generator: a deterministic hostile mix.

type gen struct {
	r *rand.Rand
}

func (g *gen) pick(s []string) string { return s[g.r.IntN(len(s))] }

var (
	dNodes   = []string{"n1", "n2", "n3", "n10", "N1", "n-1", "n_1", "n/1", "n=1"}
	dModules = []string{"m1", "m2", "mod-x", "m/y"}
	dNames   = []string{"a", "b", "c=3D", "x_1"}
	// dKindsNeeds mixes the table's kinds with kinds no entry answers until the test writes them into
	// the registry by hand.
	dKindsNeeds = []string{"config", "secret", "shell", "dir", "zzkind", "zzother", "nope"}
	// Collection tokens in shape: plain, upper- and lower-case escapes, escapes decoding to '.', ' ',
	// '=', ':' and a two-byte UTF-8 letter.
	dCollectionsOK = []string{"shell", "shell=3Azsh=3Anormal", "shell=3azsh=3anormal", "a=2Eb", "path=20with=20space",
		"a=3Db", "=C3=A9", "=c3=a9", "x=2e", "=3D", "caf=C3=A9", "a=00b", "=7F"}
	// Collection tokens out of shape.
	dCollectionsBad = []string{"=", "a=", "=4", "a=4", "=G1", "=g1", "=C3", "=FF", "=C0=AE", "=ED=A0=80", "=E2=82", "ab=",
		"==41", "=4=41", "=F4=90=80=80"}
)

// key draws a key of a bucket: in shape mostly, and every kind out of shape now and then.
func (g *gen) key(bucket string) string {
	n := contractTokens[bucket]
	inShape := func() []string {
		switch bucket {
		case provisioner.BucketNeeds:
			return []string{g.pick(dNodes), g.pick(dModules), g.pick(dKindsNeeds), g.pick(dNames)}
		case provisioner.BucketApplied:
			return []string{g.pick(dNodes), g.pick(dModules)}
		}
		return []string{g.pick(dNodes), g.pick(dCollectionsOK), g.pick(dModules)}
	}
	toks := inShape()
	switch g.r.IntN(12) {
	case 0: // one token fewer
		toks = toks[:n-1]
	case 1: // one token more
		toks = append(toks, g.pick(dNames))
	case 2: // a token with a byte a token cannot hold
		toks[g.r.IntN(n)] = g.pick([]string{"é", "a\x00b", "a\xffb", "*", ">", "a*b", "a>b", "a:b", "a%b", "a,b"})
	case 3:
		if bucket == provisioner.BucketCollect {
			toks[1] = g.pick(dCollectionsBad)
		}
	case 4: // the node alone, or a node with nothing else of the shape
		return g.pick(dNodes)
	}
	return strings.Join(toks, ".")
}

// value draws a value: MessagePack, cut short, followed by more bytes, empty, nil, or a byte no
// MessagePack object starts with.
func (g *gen) value() []byte {
	objs := []any{1, -7, "s", "é", true, nil, []any{1, "two", nil}, map[string]any{"a": 1, "b": []any{"x"}}, uint64(1) << 40,
		map[string]any{"nested": map[string]any{"k": "v"}}, strings.Repeat("long", 20)}
	v, err := msgpack.Marshal(objs[g.r.IntN(len(objs))])
	if err != nil {
		panic(err)
	}
	switch g.r.IntN(10) {
	case 0:
		return v[:len(v)-1] // truncated (empty for a one-byte object)
	case 1:
		return append(v, 0x01) // trailing bytes
	case 2:
		return nil
	case 3:
		return []byte{0xc1}
	case 4:
		return append(v, v...) // two objects
	}
	return v
}

// phase draws the messages of one phase. A purge's rollup removes its key's earlier messages from the
// stream: only keys not written in this phase are purged, so the live seat has read what it removes.
func (g *gen) phase(phase, n int, pool map[string][]string, msgs []dmsg) []dmsg {
	touched := map[string]bool{}
	buckets := []string{provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect}
	for i := 0; i < n; i++ {
		b := buckets[g.r.IntN(len(buckets))]
		var key string
		if len(pool[b]) > 0 && g.r.IntN(3) > 0 {
			key = g.pick(pool[b]) // overwrite, delete or purge a key already written
		} else {
			key = g.key(b)
			pool[b] = append(pool[b], key)
		}
		m := dmsg{bucket: b, key: key, phase: phase}
		switch r := g.r.IntN(20); {
		case r == 0:
			m.op = dDel
		case r == 1 && phase > 1 && !touched[b+" "+key] && !strings.ContainsAny(key, "*>"):
			m.op = dPurge
		case r == 2:
			m.op = dMarker
		case r == 3:
			m.op = dMarkerNone
		case r == 4:
			m.op, m.value = dOddOp, g.value()
		default:
			m.value = g.value()
		}
		touched[b+" "+key] = true
		msgs = append(msgs, m)
	}
	return msgs
}

// publish sends messages and waits for every ack, keeping each message's stream sequence.
func publish(t *testing.T, js jetstream.JetStream, msgs []dmsg) {
	t.Helper()
	futures := make([]jetstream.PubAckFuture, len(msgs))
	for i := range msgs {
		f, err := js.PublishMsgAsync(msgs[i].natsMsg())
		require.NoError(t, err)
		futures[i] = f
	}
	for i, f := range futures {
		select {
		case ack := <-f.Ok():
			msgs[i].seq = ack.Sequence
		case err := <-f.Err():
			t.Fatalf("publish %q: %v", msgs[i].key, err)
		case <-time.After(30 * time.Second):
			t.Fatalf("publish %q: no ack", msgs[i].key)
		}
	}
}

// Asking the paths.

// pathAsker answers one request body, as the verb does: the answer's bytes, or an error carrying the
// verb's code.
type pathAsker func(body []byte) ([]byte, int, error)

func verbAsker(nc *nats.Conn) pathAsker {
	return func(body []byte) ([]byte, int, error) {
		msg, err := nc.Request(query.Subject, body, 10*time.Second)
		if err != nil {
			return nil, 0, err
		}
		if c := msg.Header.Get("Nats-Service-Error-Code"); c != "" {
			var code int
			fmt.Sscan(c, &code)
			return nil, code, fmt.Errorf("verb %s: %s", c, msg.Header.Get("Nats-Service-Error"))
		}
		return msg.Data, 200, nil
	}
}

func logAsker(l *replay.Log) pathAsker {
	return func(body []byte) ([]byte, int, error) {
		b, err := l.Ask(body)
		if err != nil {
			return nil, query.Code(err), err
		}
		return b, 200, nil
	}
}

// askAll asks a request through every page, in JSON or MessagePack, and reads it as a danswer.
func askAll(t *testing.T, ask pathAsker, req map[string]any, asMsgpack bool) (danswer, int) {
	t.Helper()
	r := map[string]any{}
	for k, v := range req {
		r[k] = v
	}
	var out danswer
	for page := 0; page < 10000; page++ {
		body, err := natstest.Body(r, asMsgpack)
		require.NoError(t, err)
		b, code, err := ask(body)
		if code != 200 {
			return danswer{}, code
		}
		require.NoError(t, err)
		a := decodeAnswer(t, b, asMsgpack)
		out.Rows = append(out.Rows, a.Rows...)
		out.Anomalies, out.Total, out.AsOf = a.Anomalies, a.Total, a.AsOf
		if a.next == "" {
			return out, 200
		}
		r["after"] = a.next
	}
	t.Fatalf("too many pages")
	return out, 0
}

type decoded struct {
	danswer
	next string
}

func decodeAnswer(t *testing.T, b []byte, asMsgpack bool) decoded {
	t.Helper()
	var a struct {
		Rows           []map[string]any `json:"rows" msgpack:"rows"`
		Anomalies      []map[string]any `json:"anomalies" msgpack:"anomalies"`
		AnomaliesTotal int64            `json:"anomalies_total" msgpack:"anomalies_total"`
		AsOf           uint64           `json:"as_of" msgpack:"as_of"`
		Next           string           `json:"next" msgpack:"next"`
	}
	if asMsgpack {
		require.NoError(t, msgpack.Unmarshal(b, &a))
	} else {
		dec := json.NewDecoder(bytes.NewReader(b))
		dec.UseNumber()
		require.NoError(t, dec.Decode(&a))
	}
	out := decoded{next: a.Next}
	out.Total, out.AsOf = a.AnomaliesTotal, a.AsOf
	num := func(v any) uint64 {
		var n uint64
		_, err := fmt.Sscan(fmt.Sprint(v), &n)
		require.NoError(t, err, "%v", v)
		return n
	}
	for _, row := range a.Rows {
		r := drow{Key: row["key"].(string), Rev: num(row["revision"]), Parts: map[string]string{}}
		switch c := row["created"].(type) {
		case string:
			ts, err := time.Parse(time.RFC3339Nano, c)
			require.NoError(t, err)
			r.Created = ts.UnixNano()
		case time.Time:
			r.Created = c.UnixNano()
		default:
			t.Fatalf("created is %T", c)
		}
		if raw, ok := row["value_raw"]; ok {
			require.Nil(t, row["value"], "a value not MessagePack answers null")
			switch raw := raw.(type) {
			case string:
				r.Value = "raw:" + raw
			case []byte:
				r.Value = "raw:" + base64.StdEncoding.EncodeToString(raw)
			default:
				t.Fatalf("value_raw is %T", raw)
			}
		} else {
			j, err := json.Marshal(row["value"])
			require.NoError(t, err)
			r.Value = string(j)
		}
		for k, v := range row {
			switch k {
			case "key", "revision", "created", "value", "value_raw":
				continue
			}
			r.Parts[k] = v.(string)
		}
		out.Rows = append(out.Rows, r)
	}
	for _, an := range a.Anomalies {
		text := an["reason"].(string)
		code, _, _ := strings.Cut(text, ":")
		out.Anomalies = append(out.Anomalies, danom{Bucket: an["bucket"].(string), Key: an["key"].(string), Rev: num(an["revision"]), Reason: code, Text: text})
	}
	return out
}

// jsonText is a string as a JSON answer carries it: each byte that is not UTF-8 reads as U+FFFD
// (docs/decisions.md); MessagePack answers carry the bytes as they are.
func jsonText(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && n == 1 {
			b.WriteRune(utf8.RuneError)
		} else {
			b.WriteString(s[i : i+n])
		}
		i += n
	}
	return b.String()
}

// asJSON is a model answer as a JSON answer reads.
func asJSON(a danswer) danswer {
	out := danswer{Total: a.Total, AsOf: a.AsOf}
	for _, r := range a.Rows {
		parts := map[string]string{}
		for k, v := range r.Parts {
			parts[k] = jsonText(v)
		}
		r.Key, r.Parts = jsonText(r.Key), parts
		out.Rows = append(out.Rows, r)
	}
	for _, an := range a.Anomalies {
		an.Key = jsonText(an.Key)
		out.Anomalies = append(out.Anomalies, an)
	}
	return out
}

// sameAnswers requires two answers to be equal, saying where they first differ; with model set,
// created and the reasons' texts are not compared (the model knows neither).
func sameAnswers(t *testing.T, want, got danswer, model bool, name string) {
	t.Helper()
	for i := 0; i < max(len(want.Rows), len(got.Rows)); i++ {
		var w, g drow
		if i < len(want.Rows) {
			w = want.Rows[i]
		}
		if i < len(got.Rows) {
			g = got.Rows[i]
		}
		if model {
			w.Created, g.Created = 0, 0
		}
		require.Equal(t, w, g, "%s: row %d of %d (want %d)", name, i, len(got.Rows), len(want.Rows))
	}
	for i := 0; i < max(len(want.Anomalies), len(got.Anomalies)); i++ {
		var w, g danom
		if i < len(want.Anomalies) {
			w = want.Anomalies[i]
		}
		if i < len(got.Anomalies) {
			g = got.Anomalies[i]
		}
		if model {
			w.Text, g.Text = "", ""
		}
		require.Equal(t, w, g, "%s: anomaly %d of %d (want %d)", name, i, len(got.Anomalies), len(want.Anomalies))
	}
	require.Equal(t, want.Total, got.Total, "%s: anomalies_total", name)
	require.Equal(t, want.AsOf, got.AsOf, "%s: as_of", name)
}

func sameAsModel(t *testing.T, want, got danswer, asMsgpack bool, name string) {
	t.Helper()
	if !asMsgpack {
		want = asJSON(want)
	}
	sameAnswers(t, want, got, true, name)
}

func TestDifferential_EveryPathAgreesWithTheContract(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	// History high enough that no limit removes a message: only purges do.
	for _, b := range []string{provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect} {
		_, err := h.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: b, History: 64})
		require.NoError(t, err)
	}
	// The needs' stream is given one more subject by hand (docs/decisions.md).
	s, err := h.js.Stream(ctx, provisioner.StreamName(provisioner.BucketNeeds))
	require.NoError(t, err)
	cfg := s.CachedInfo().Config
	cfg.Subjects = append(cfg.Subjects, "extra.>")
	_, err = h.js.UpdateStream(ctx, cfg)
	require.NoError(t, err)
	dir := t.TempDir()
	st, stop := h.startSeat(dir)
	h.waitCaughtUp(st)

	g := &gen{r: rand.New(rand.NewPCG(24, 1))}
	pool := map[string][]string{}
	var msgs []dmsg
	// The registry as the writer wrote it at start: the table, one revision each.
	regMsgs := func() []dmsg {
		var out []dmsg
		for _, m := range msgs {
			if m.bucket == provisioner.BucketRegistry {
				out = append(out, m)
			}
		}
		return out
	}
	{
		kv, err := h.js.KeyValue(ctx, provisioner.BucketRegistry)
		require.NoError(t, err)
		for _, k := range contractKinds {
			e, err := kv.Get(ctx, k)
			require.NoError(t, err, k)
			msgs = append(msgs, dmsg{bucket: provisioner.BucketRegistry, key: k, value: e.Value(), seq: e.Revision()})
		}
	}
	// The registry changes at each phase's end, after its needs: a kind the needs name comes and goes.
	regChanges := [][]dmsg{
		nil,
		{{key: "zzkind", value: mustMsgpack(t, map[string]any{"kind": "zzkind", "module": "mz", "verb": "mz.v"})}},
		{{key: "zzkind", op: dDel}, {key: "zzother", value: []byte{0xc1}}, {key: "zz.bad", value: mustMsgpack(t, 1)}},
		{{key: "zzother", op: dPurge}, {key: "zzkind", value: mustMsgpack(t, map[string]any{"kind": "zzkind"})}},
		nil,
	}
	type livePoint struct {
		bucket string
		seq    uint64
		answer danswer
	}
	var live []livePoint
	nodeBulk := 0
	const phases = 4
	// Rollups on subjects with wildcard tokens, which NATS stores as published and which purge every
	// subject they match, and one of a whole stream: each opens its phase, so the live seat has read
	// everything they remove.
	rollups := [][]dmsg{2: {
		{bucket: provisioner.BucketNeeds, key: "n1.m1.*.*", op: dPurge},
		{bucket: provisioner.BucketNeeds, foreign: "extra.n1.m1.config.a", value: []byte{0xc0}},
		{bucket: provisioner.BucketApplied, key: "n2.>", op: dDel, rollup: "sub"},
		{bucket: provisioner.BucketCollect, key: "n3.*.m2", value: []byte{0xc0}, rollup: "SUB"},
	}, 3: {
		// First: all it removes the live seat has read.
		{bucket: provisioner.BucketNeeds, foreign: "extra.n1.m1.config.a", value: []byte{0xc0}, rollup: "all"},
		{bucket: provisioner.BucketNeeds, key: "*.m/y.>", op: dPurge},
		{bucket: provisioner.BucketCollect, key: "n10.=C3=A9.m1", value: mustMsgpack(t, "alone"), rollup: "All"},
		{bucket: provisioner.BucketApplied, key: "n=1.*", op: dMarker, rollup: "sub"},
	}, 4: {
		{bucket: provisioner.BucketNeeds, key: ">", op: dPurge},
		// Header names are read as written: these are a put and a put with no rollup.
		{bucket: provisioner.BucketApplied, key: "n3.>", value: []byte{0xc0}, header: "nats-rollup: sub"},
		{bucket: provisioner.BucketApplied, key: "n10.m1", value: []byte{0xc0}, header: "kv-operation: DEL"},
		{bucket: provisioner.BucketApplied, key: "n10.m2", value: []byte{0xc0}, header: "nats-marker-reason: MaxAge"},
	}}
	for phase := 1; phase <= phases; phase++ {
		if phase < len(rollups) && len(rollups[phase]) > 0 {
			from := len(msgs)
			for _, m := range rollups[phase] {
				m.phase = phase
				msgs = append(msgs, m)
			}
			publish(t, h.js, msgs[from:])
		}
		from := len(msgs)
		msgs = g.phase(phase, 250, pool, msgs)
		if phase == 2 {
			// More anomalies than an answer carries, under one node: the cap and anomalies_total.
			for i := 0; i < 1010; i++ {
				msgs = append(msgs, dmsg{bucket: provisioner.BucketApplied, key: fmt.Sprintf("nb.%04d.x", i), value: []byte{0xc0}, phase: phase})
			}
			nodeBulk = 1010
		}
		if phase == 3 {
			// Keys at NATS's limits: a token of 3000 bytes in shape, and 400 tokens.
			long := strings.Repeat("L", 3000)
			msgs = append(msgs,
				dmsg{bucket: provisioner.BucketApplied, key: "n1." + long, value: mustMsgpack(t, "long"), phase: phase},
				dmsg{bucket: provisioner.BucketNeeds, key: "n1.m1.config." + long, value: mustMsgpack(t, "long"), phase: phase},
				dmsg{bucket: provisioner.BucketCollect, key: "n1." + strings.Repeat("=C3=A9", 400) + ".m1", value: mustMsgpack(t, "long"), phase: phase},
				dmsg{bucket: provisioner.BucketNeeds, key: strings.TrimSuffix(strings.Repeat("t.", 400), "."), value: mustMsgpack(t, "many"), phase: phase},
			)
		}
		publish(t, h.js, msgs[from:])
		regFrom := len(msgs)
		for _, c := range regChanges[phase] {
			c.bucket, c.phase = provisioner.BucketRegistry, phase
			msgs = append(msgs, c)
		}
		publish(t, h.js, msgs[regFrom:])
		h.waitCaughtUp(st)
		for _, b := range []string{provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect, provisioner.BucketRegistry} {
			a, code := askAll(t, verbAsker(h.nc), map[string]any{"what": string(shapeWhat(b)), "limit": 97}, false)
			require.Equal(t, 200, code)
			live = append(live, livePoint{bucket: b, seq: a.AsOf, answer: a})
		}
	}
	require.Positive(t, nodeBulk)

	// kindsAt is the registry's kinds for a needs point: those of the last moment the bucket was in
	// that state (docs/decisions.md: just before its next message, or now for its newest).
	kindsAfter := func(upToPhase int) map[string]bool {
		kinds := map[string]bool{}
		for _, m := range regMsgs() {
			if m.phase > upToPhase {
				continue
			}
			if _, bad := modelShape(provisioner.BucketRegistry, m.key); bad != "" {
				continue
			}
			kinds[m.key] = !m.removes()
		}
		return kinds
	}
	lastSeq := map[string]uint64{}
	for _, m := range msgs {
		lastSeq[m.bucket] = max(lastSeq[m.bucket], m.seq)
	}
	kindsAt := func(n uint64) map[string]bool {
		next := 0
		for _, m := range msgs {
			if m.bucket == provisioner.BucketNeeds && m.seq == n+1 {
				next = m.phase
			}
		}
		if n >= lastSeq[provisioner.BucketNeeds] || next == 0 {
			return kindsAfter(phases)
		}
		return kindsAfter(next - 1)
	}
	model := func(bucket string, n uint64, req map[string]string) danswer {
		a := modelState(msgs, bucket, n, kindsAt(n), req)
		a.AsOf = n
		return a
	}
	buckets := []string{provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect, provisioner.BucketRegistry}

	// (a) The live seat, now: every bucket, whole, narrowed by node (the anomalies too) and by every
	// other field, in both formats, paged.
	narrowings := map[string][]map[string]string{
		provisioner.BucketNeeds: {{"module": "m/y"}, {"kind": "zzkind"}, {"node": "n1", "module": "m1"}, {"node": "n2", "kind": "shell"},
			{"module": "m2", "kind": "nope"}},
		provisioner.BucketApplied: {{"module": "mod-x"}, {"node": "n=1", "module": "m2"}},
		provisioner.BucketCollect: {{"collection": "shell:zsh:normal"}, {"collection": "é"}, {"collection": "a.b"}, {"collection": "path with space"},
			{"collection": "="}, {"collection": "a=b"}, {"collection": "x."}, {"collection": "a\x00b"}, {"collection": "\x7f"}, {"contributor": "m1"}, {"module": "m/y"},
			{"node": "n3", "collection": "shell"}, {"node": "n1", "contributor": "m2"}},
		provisioner.BucketRegistry: {{"kind": "zzkind"}, {"module": "mesh-vault"}, {"kind": "config"}},
	}
	requests := func(b string) []map[string]string {
		out := append([]map[string]string(nil), narrowings[b]...)
		for _, node := range append([]string{"", "nb", "t"}, dNodes...) {
			switch {
			case node == "":
				out = append(out, map[string]string{})
			case b != provisioner.BucketRegistry:
				out = append(out, map[string]string{"node": node})
			}
		}
		return out
	}
	reqOf := func(b string, narrow map[string]string, more map[string]any) map[string]any {
		req := map[string]any{"what": string(shapeWhat(b))}
		for k, v := range narrow {
			if v != "" {
				req[k] = v
			}
		}
		for k, v := range more {
			req[k] = v
		}
		return req
	}
	checkLive := func(name string, ask pathAsker) {
		for _, b := range buckets {
			for _, narrow := range requests(b) {
				want := model(b, lastSeq[b], narrow)
				for _, mp := range []bool{false, true} {
					req := reqOf(b, narrow, map[string]any{"limit": 53})
					got, code := askAll(t, ask, req, mp)
					n := fmt.Sprintf("%s: %v msgpack=%v", name, req, mp)
					require.Equal(t, 200, code, n)
					sameAsModel(t, want, got, mp, n)
				}
			}
		}
	}
	checkLive("live", verbAsker(h.nc))
	liveFinal := map[string]danswer{}
	for _, b := range buckets {
		a, _ := askAll(t, verbAsker(h.nc), map[string]any{"what": string(shapeWhat(b)), "limit": 97}, false)
		liveFinal[b] = a
	}
	{
		a, _ := askAll(t, verbAsker(h.nc), map[string]any{"what": "applied", "node": "nb"}, true)
		require.Len(t, a.Anomalies, query.MaxAnomalies)
		require.GreaterOrEqual(t, a.Total, int64(nodeBulk))
	}

	// The points every log is asked at: each phase's end (what the live seat answered then), the
	// newest, past the newest, and points between.
	type point struct {
		bucket string
		seq    uint64
		live   *danswer
		time   time.Time // a time point (the time of message seq) rather than seq:<n>
	}
	var points []point
	for i := range live {
		points = append(points, point{bucket: live[i].bucket, seq: live[i].seq, live: &live[i].answer})
	}
	msgTime := func(b string, seq uint64) (time.Time, bool) {
		s, err := h.js.Stream(ctx, provisioner.StreamName(b))
		require.NoError(t, err)
		m, err := s.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			return time.Time{}, false // a purge removed it
		}
		require.NoError(t, err)
		return m.Time, true
	}
	for _, b := range buckets {
		f := liveFinal[b]
		points = append(points, point{bucket: b, seq: lastSeq[b], live: &f}, point{bucket: b, seq: lastSeq[b] + 50}, point{bucket: b, seq: 0})
		for i := 0; i < 4; i++ {
			points = append(points, point{bucket: b, seq: 1 + g.r.Uint64N(lastSeq[b])})
		}
		for _, seq := range []uint64{lastSeq[b], 1 + g.r.Uint64N(lastSeq[b]), 1 + g.r.Uint64N(lastSeq[b])} {
			ts, ok := msgTime(b, seq)
			next, nok := msgTime(b, seq+1)
			if ok && (!nok || next.After(ts)) {
				points = append(points, point{bucket: b, seq: seq, time: ts})
			}
		}
	}
	// A needs point at a time reads the registry as of that time: the changes of the message's own
	// phase come after it.
	kindsAtTime := func(n uint64) map[string]bool {
		for _, m := range msgs {
			if m.bucket == provisioner.BucketNeeds && m.seq == n {
				return kindsAfter(m.phase - 1)
			}
		}
		t.Fatalf("no needs message %d", n)
		return nil
	}
	// removedFrom is the first message of each bucket that a purge removed from the stream: a log
	// read from the streams has a gap from there up to its last message.
	removedFrom := map[string]uint64{}
	for _, m := range msgs {
		for _, e := range msgs {
			if e.bucket == m.bucket && m.rollsUp(e.key) && e.seq < m.seq && (removedFrom[m.bucket] == 0 || e.seq < removedFrom[m.bucket]) {
				removedFrom[m.bucket] = e.seq
			}
		}
	}
	// checkPoints asks a path at every point, in the given formats (the encoder is the live one's,
	// checked in both); with narrow, the newest point with every narrowing too.
	checkPoints := func(name string, ask pathAsker, fromStreams, narrow bool, formats ...bool) {
		for _, p := range points {
			narrowed := []map[string]string{nil}
			if narrow && p.seq == lastSeq[p.bucket] && p.time.IsZero() {
				narrowed = requests(p.bucket) // the newest point, narrowed as the live answer was
			}
			for _, narrow := range narrowed {
				for _, mp := range formats {
					at := fmt.Sprintf("seq:%d", p.seq)
					if !p.time.IsZero() {
						at = p.time.UTC().Format(time.RFC3339Nano)
					}
					req := reqOf(p.bucket, narrow, map[string]any{"at": at, "limit": 61})
					n := fmt.Sprintf("%s: %v msgpack=%v", name, req, mp)
					got, code := askAll(t, ask, req, mp)
					seq := min(p.seq, lastSeq[p.bucket])
					if fromStreams && removedFrom[p.bucket] != 0 && seq >= removedFrom[p.bucket] && seq < lastSeq[p.bucket] {
						require.Equal(t, 410, code, "%s: inside the gap the purges left", n)
						continue
					}
					require.Equal(t, 200, code, n)
					want := model(p.bucket, seq, narrow)
					if !p.time.IsZero() && p.bucket == provisioner.BucketNeeds {
						want = modelState(msgs, p.bucket, seq, kindsAtTime(seq), narrow)
						want.AsOf = seq
					}
					sameAsModel(t, want, got, mp, n)
					if p.live != nil && !mp && narrow == nil {
						sameAnswers(t, *p.live, got, false, n+": what the live seat answered at that point")
					}
				}
			}
		}
	}
	// (c) at on the verb.
	checkPoints("verb at", verbAsker(h.nc), false, true, false, true)

	// (d) replay from the state dir, beside the running seat.
	ls, err := replay.OpenState(dir)
	require.NoError(t, err)
	checkPoints("replay --state", logAsker(ls), false, false, true)
	// replay state (the command's table and --json) reads the whole state, anomalies uncapped.
	for _, p := range points {
		if !p.time.IsZero() || p.bucket == provisioner.BucketRegistry {
			continue
		}
		for _, node := range []string{"", "nb", "n1"} {
			seq := min(p.seq, lastSeq[p.bucket])
			name := fmt.Sprintf("replay state %s seq:%d node %q", p.bucket, p.seq, node)
			got, err := ls.State(query.Request{What: string(shapeWhat(p.bucket)), Node: node}, replay.Point{Seq: p.seq})
			require.NoError(t, err, name)
			require.Equal(t, seq, got.AsOf, name)
			kinds := kindsAt(seq)
			var want []string
			var narrow map[string]string
			if node != "" {
				narrow = map[string]string{"node": node}
			}
			all := modelUncapped(msgs, p.bucket, seq, kinds, narrow)
			for _, r := range all.Rows {
				want = append(want, fmt.Sprintf("row %q %d", r.Key, r.Rev))
			}
			var have []string
			for _, r := range got.Rows {
				have = append(have, fmt.Sprintf("row %q %d", r.Key, r.Revision))
			}
			require.Equal(t, want, have, name)
			want, have = nil, nil
			for _, a := range all.Anomalies {
				want = append(want, fmt.Sprintf("%q %d %s", a.Key, a.Rev, a.Reason))
			}
			for _, a := range got.Anomalies {
				have = append(have, fmt.Sprintf("%q %d %s", a.Key, a.Revision, a.Reason))
			}
			require.Equal(t, want, have, name)
		}
	}
	require.NoError(t, ls.Close())

	// (d) replay from the streams.
	ln, err := replay.FromNATS(ctx, h.js, nil, "nats", nil)
	require.NoError(t, err)
	checkPoints("replay --nats", logAsker(ln), true, false, false)
	require.NoError(t, ln.Close())

	// (d) replay from an export of the streams and of the state dir.
	archNATS := filepath.Join(t.TempDir(), "nats.mph")
	_, err = replay.ExportNATS(ctx, h.js, nil, archNATS, "test", nil)
	require.NoError(t, err)
	la, err := replay.FromArchive(ctx, archNATS, nil)
	require.NoError(t, err)
	checkPoints("replay --archive (export --nats)", logAsker(la), true, false, true)
	require.NoError(t, la.Close())

	ls, err = replay.OpenState(dir)
	require.NoError(t, err)
	archState := filepath.Join(t.TempDir(), "state.mph")
	_, err = replay.ExportLog(ctx, ls.DB, archState, "test", nil)
	require.NoError(t, err)
	require.NoError(t, ls.Close())
	la, err = replay.FromArchive(ctx, archState, nil)
	require.NoError(t, err)
	checkPoints("replay --archive (export --state)", logAsker(la), false, false, false)
	require.NoError(t, la.Close())

	// (b) rebuild, as the command does, then a seat serving the rebuilt state dir.
	stop()
	sd, err := store.LockState(dir)
	require.NoError(t, err)
	gdir, err := sd.NewGeneration()
	require.NoError(t, err)
	db, err := store.Open(gdir, store.Options{})
	require.NoError(t, err)
	_, err = replay.Fill(ctx, h.js, db, projector.Options{}, nil)
	require.NoError(t, err)
	require.NoError(t, db.Close())
	require.NoError(t, sd.Swap(gdir))
	require.NoError(t, sd.Close())
	st2, _ := h.startReadOnlySeat(dir)
	h.waitCaughtUp(st2)
	checkLive("rebuilt seat", verbAsker(h.nc))
	for _, b := range buckets {
		a, _ := askAll(t, verbAsker(h.nc), map[string]any{"what": string(shapeWhat(b)), "limit": 97}, false)
		sameAnswers(t, liveFinal[b], a, false, "the rebuilt seat answers "+b+" as the live one did")
	}
	checkPoints("rebuilt seat at", verbAsker(h.nc), true, false, true)
}

func shapeWhat(bucket string) provisioner.What {
	s, _ := provisioner.ShapeOf(bucket)
	return s.What
}

func mustMsgpack(t *testing.T, v any) []byte {
	t.Helper()
	b, err := msgpack.Marshal(v)
	require.NoError(t, err)
	return b
}
