package query

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/store"
)

// Hostile input, fuzzed. Seeds are added here and kept under testdata/fuzz/<Target>/ (what `go test
// -fuzz` finds goes there too); plain `go test` replays both, `make fuzz` explores for a while.

func requestSeeds(f *testing.F) {
	mp := func(v any) []byte { b, _ := msgpack.Marshal(v); return b }
	for _, s := range []string{
		``, ` `, "\t\r\n", `{}`, `{"what":"needs"}`, `{"what":"needs","node":"n00001","module":"mod-001","kind":"config"}`,
		`{"what":"collect","collection":"shell:zsh:normal","contributor":"m"}`, `{"what":"collect","module":"a","contributor":"b"}`,
		`{"what":"applied","limit":1}`, `{"what":"applied","limit":10000}`, `{"what":"applied","limit":10001}`, `{"limit":0}`,
		`{"limit":-1}`, `{"limit":1e3}`, `{"limit":9223372036854775808}`, `{"limit":null}`, `{"what":null}`,
		`{"what":"needs","min_seq":1,"wait_ms":10000}`, `{"min_seq":-1}`, `{"wait_ms":10001}`, `{"at":"seq:5"}`,
		`{"after":"n1.m.k.n"}`, `{"what":"plans","node":"n1"}`, `{"nod":"n1"}`, `{"what":"needs"} {}`, `{"what":"needs"}x`,
		`["needs"]`, `"needs"`, `null`, `{"what":"wants"}`, `{"node":"n 1","what":"needs"}`, `{"node":"","what":"needs"}`,
		`{"what":"needs","WHAT":"applied"}`, `{"What":"needs"}`, `{"what":"needs","what":"applied"}`, `{"what":"\u0000"}`,
		`{"collection":"\ud800","what":"collect"}`, strings.Repeat(`[`, 20000), `{"what":` + strings.Repeat(`[`, 20000),
		"\xef\xbb\xbf", "\xef\xbb\xbf{\"what\":\"needs\"}", "\xef\xbb\xbf \xef\xbb\xbf{}", "\xff\xfe{\x00}\x00", "\xfe\xff\x00{\x00}",
	} {
		f.Add([]byte(s))
	}
	f.Add(mp(map[string]any{"what": "needs", "node": "n1", "limit": 5}))
	f.Add(mp(map[string]any{"what": "collect", "collection": "\xff\xfe"}))
	f.Add(mp(map[string]any{"what": "needs", "x": 1}))
	f.Add(mp(map[string]any{"what": "needs", "node": 12}))
	f.Add(mp(map[string]any{"limit": uint64(1 << 63)}))
	f.Add(mp(map[string]any{"limit": 1.5}))
	f.Add([]byte{0x82, 0xa4, 'w', 'h', 'a', 't'})                                // truncated
	f.Add([]byte{0xdf, 0xff, 0xff, 0xff, 0xff})                                  // a map that claims 4G members
	f.Add([]byte{0x81, 0xa4, 'w', 'h', 'a', 't', 0xc1})                          // never-used byte
	f.Add([]byte{0x81, 0x01, 0xa5, 'n', 'e', 'e', 'd', 's'})                     // an integer key
	f.Add([]byte{0x81, 0xa4, 'w', 'h', 'a', 't', 0xd4, 0x01, 0x02})              // an extension for a string
	f.Add([]byte{0x80, 0x80})                                                    // data after the map
	f.Add(append([]byte{0x81, 0xa4, 'w', 'h', 'a', 't'}, nested(0x91, 5000)...)) // deep array for a string
	f.Add(append([]byte{0x81, 0xa5, 'l', 'i', 'm', 'i', 't'}, nested(0x81, 5000)...))
}

// nested is depth levels of a one-member container, each holding the next, ending in nil.
func nested(header byte, depth int) []byte {
	b := bytes.Repeat([]byte{header}, depth)
	if header&0xf0 == 0x80 { // a map: each level is key nil, value the next level
		b = nil
		for i := 0; i < depth; i++ {
			b = append(b, header, 0xc0)
		}
	}
	return append(b, 0xc0)
}

// checkRequest checks what DecodeRequest promises for a body: every rejection is a 400, and an
// accepted request satisfies every validation rule and survives a MessagePack round trip unchanged.
func checkRequest(t *testing.T, body []byte) (Request, Format, error) {
	// The one-pass reading of a plain MessagePack request reads what the decoder reads.
	if plain, ok := decodePlainMsgpack(body); ok {
		dec, err := decodeMsgpack(body)
		if err != nil || !equalRequest(plain, dec) {
			t.Fatalf("plain reading %+v, the decoder's %+v (%v)", plain, dec, err)
		}
	}
	req, format, err := DecodeRequest(body)
	trimmed := bytes.TrimLeft(bytes.TrimPrefix(body, utf8BOM), " \t\r\n")
	if len(trimmed) > 0 && formatOf(body) != format {
		t.Fatalf("format %v for a body starting %#x", format, trimmed[0])
	}
	if format == FormatMsgpack && byteOrderMark(bytes.TrimLeft(body, " \t\r\n")) {
		t.Fatal("a body starting with a byte order mark is answered in MessagePack")
	}
	if err != nil {
		var br *badRequest
		if !errors.As(err, &br) || Code(err) != 400 {
			t.Fatalf("rejection %T %q is not a 400 bad request", err, err)
		}
		if err.Error() == "" {
			t.Fatal("a rejection without a message")
		}
		return req, format, err
	}
	if len(trimmed) == 0 && format != FormatJSON {
		t.Fatal("an empty body answers JSON")
	}
	if len(body) > maxRequestBytes {
		t.Fatalf("a body of %d bytes was accepted", len(body))
	}
	w := provisioner.What(req.What)
	switch w {
	case provisioner.WhatRegistry, provisioner.WhatNeeds, provisioner.WhatApplied, provisioner.WhatCollect, provisioner.WhatPlans:
	default:
		t.Fatalf("accepted what %q", req.What)
	}
	module := req.Module
	if w == provisioner.WhatRegistry {
		module = "" // the entry's module, as its value says: any string (<provider-module>, docs/decisions.md)
	}
	for _, f := range []struct{ name, v string }{{"node", req.Node}, {"module", module}, {"kind", req.Kind}} {
		if f.v != "" && !provisioner.ValidToken(f.v) {
			t.Fatalf("accepted %s %q, not a token", f.name, f.v)
		}
	}
	if req.Node != "" && w == provisioner.WhatRegistry {
		t.Fatal("accepted node with registry")
	}
	if req.Collection != "" && w != provisioner.WhatCollect {
		t.Fatal("accepted collection outside collect")
	}
	if req.Contributor != "" && (w != provisioner.WhatCollect || req.Module != req.Contributor) {
		t.Fatalf("accepted contributor %q with what %q, module %q", req.Contributor, w, req.Module)
	}
	if req.Kind != "" && w != provisioner.WhatRegistry && w != provisioner.WhatNeeds {
		t.Fatal("accepted kind outside registry and needs")
	}
	if req.Limit != nil && (*req.Limit < 1 || *req.Limit > MaxLimit) {
		t.Fatalf("accepted limit %d", *req.Limit)
	}
	if l := req.limit(); l < 1 || l > MaxLimit {
		t.Fatalf("limit() %d", l)
	}
	for _, v := range []string{req.What, req.Node, req.Module, req.Contributor, req.Collection, req.Kind, req.After, req.At} {
		if !utf8.ValidString(v) {
			t.Fatalf("accepted a string field that is not UTF-8: %q", v)
		}
	}
	if req.MinSeq < 0 || req.WaitMS < 0 || req.WaitMS > MaxWaitMS {
		t.Fatalf("accepted min_seq %d, wait_ms %d", req.MinSeq, req.WaitMS)
	}
	// The request, written again as MessagePack, reads back as itself: nothing was half-read.
	again, err := msgpack.Marshal(&req)
	if err != nil {
		t.Fatalf("re-encode: %v", err)
	}
	back, f2, err := DecodeRequest(again)
	if err != nil || f2 != FormatMsgpack {
		t.Fatalf("re-encoded request rejected: %v (format %v)", err, f2)
	}
	if !equalRequest(req, back) {
		t.Fatalf("round trip changed the request: %+v -> %+v", req, back)
	}
	return req, format, nil
}

func equalRequest(a, b Request) bool {
	la, lb := a.Limit, b.Limit
	a.Limit, b.Limit = nil, nil
	if a != b {
		return false
	}
	return (la == nil) == (lb == nil) && (la == nil || *la == *lb)
}

func FuzzDecodeRequest(f *testing.F) {
	requestSeeds(f)
	f.Fuzz(func(t *testing.T, body []byte) {
		checkRequest(t, body)
	})
}

// FuzzAnswer sends what the decoder accepts on to a real store: planning the range, the cursor, the
// filters and both encoders. An answer is a 200 whose body parses, or a 404 (a cursor with no row),
// or a 501 (at and plans are not served by a bare Server); never a 500 or a panic.
func FuzzAnswer(f *testing.F) {
	requestSeeds(f)
	for _, s := range []string{
		`{"what":"needs","after":"n1.m1.config.a"}`, `{"what":"needs","after":"n1.m1.config.a","limit":1}`,
		`{"what":"collect","collection":"shell:zsh"}`, `{"what":"collect","collection":"\u0000x","node":"n1"}`,
		`{"what":"collect","after":"n1.=00x.c1","collection":"\u0000x"}`, `{"what":"needs","kind":"config","limit":1}`,
		`{"what":"registry","module":"mesh-vault"}`, `{"what":"applied","module":"m1","node":"n1"}`,
	} {
		f.Add([]byte(s))
	}
	db, err := store.Open(f.TempDir(), store.Options{CacheSize: 1 << 20, MemTableSize: 1 << 20})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { db.Close() })
	put := func(seq uint64, key string, value []byte) provisioner.Message {
		return provisioner.Message{Seq: seq, Time: int64(seq) * 1e9, Key: key, Op: provisioner.OpPut, Value: value}
	}
	for _, b := range []struct {
		bucket string
		msgs   []provisioner.Message
	}{
		{provisioner.BucketRegistry, []provisioner.Message{put(1, "config", provisioner.Registry.Entries[0].Value())}},
		{provisioner.BucketNeeds, []provisioner.Message{
			put(1, "n1.m1.config.a", []byte{0x01}), put(2, "n1.m1.secret.b", []byte{0xc1}), put(3, "n1.m2.config", []byte{0x01}),
			put(4, "n2.m1.wish.c", []byte{0x81, 0xa1, 'a', 0x92, 0x01, 0xc0}), put(5, "n\x00.m.k.n", []byte{0x01}),
		}},
		{provisioner.BucketApplied, []provisioner.Message{put(1, "n1.m1", []byte{0x01}), put(2, "n1", []byte{0x01})}},
		{provisioner.BucketCollect, []provisioner.Message{
			put(1, "n1.shell=3Azsh.c1", []byte{0x01}), put(2, "n1.=00x.c1", []byte{0x01}), put(3, "n1.bad=Z.c1", []byte{0x01}),
			put(4, "n2.=C3=A9.c2", []byte{0xa1, 'x'}),
		}},
	} {
		if err := db.Apply(b.bucket, b.msgs, 0, false); err != nil {
			f.Fatal(err)
		}
		db.SetSynced(b.bucket, true)
	}
	s := NewServer(StoreReader(db), Options{})
	f.Cleanup(s.Stop)
	f.Fuzz(func(t *testing.T, body []byte) {
		req, format, err := checkRequest(t, body)
		if err != nil {
			return
		}
		req.WaitMS = 0 // a min_seq ahead is a 504 at once, not a wait per input
		var e Encoder
		max := 0
		if len(body)%2 == 1 {
			max = 1500 // a small bound, so pages end early and rows lose their values
		}
		e.SetMaxBytes(max)
		err = s.Answer(context.Background(), &req, format, &e)
		if err != nil {
			switch code := Code(err); code {
			case 400, 404, 501, 504:
			default:
				t.Fatalf("%s: code %d: %v", body, code, err)
			}
			return
		}
		out := e.Bytes()
		var a struct {
			What  string           `json:"what" msgpack:"what"`
			Rows  []map[string]any `json:"rows" msgpack:"rows"`
			AsOf  uint64           `json:"as_of" msgpack:"as_of"`
			Next  string           `json:"next" msgpack:"next"`
			Total int64            `json:"anomalies_total" msgpack:"anomalies_total"`
		}
		if format == FormatJSON {
			if !utf8.Valid(out) || !json.Valid(out) {
				t.Fatalf("%s: answer is not valid JSON: %q", body, out)
			}
			err = json.Unmarshal(out, &a)
		} else {
			err = msgpack.Unmarshal(out, &a)
		}
		if err != nil {
			t.Fatalf("%s: answer does not decode: %v", body, err)
		}
		if a.What != req.What || len(a.Rows) > req.limit() || (a.Next != "" && len(a.Rows) != req.limit() && max == 0) {
			t.Fatalf("%s: what %q, %d rows for limit %d, next %q", body, a.What, len(a.Rows), req.limit(), a.Next)
		}
		if max > 0 && len(out) > max {
			t.Fatalf("%s: answer of %d bytes past the bound of %d", body, len(out), max)
		}
		if a.Next != "" && len(a.Rows) == 0 {
			t.Fatalf("%s: next without a row: a walk would never end", body)
		}
		for i, row := range a.Rows {
			k, _ := row["key"].(string)
			if i > 0 && k <= a.Rows[i-1]["key"].(string) {
				t.Fatalf("%s: rows out of order", body)
			}
			if req.After != "" && k <= req.After {
				t.Fatalf("%s: row %q is not after %q", body, k, req.After)
			}
		}
	})
}
