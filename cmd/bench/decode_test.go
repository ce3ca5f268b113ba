package main

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

// countRows must read what the verb writes: a map whose rows may be any size and next a long cursor.
func TestCountRows(t *testing.T) {
	for _, n := range []int{0, 3, 15, 16, 70000} {
		rows := make([]any, n)
		for i := range rows {
			rows[i] = map[string]any{"key": "n.m.k.x", "value": map[string]any{"a": []int{1, 2}, "s": `q"{[,:\`}}
		}
		next := strings.Repeat("n", 300)
		page := map[string]any{"what": "needs", "anomalies": []any{}, "rows": rows, "as_of": 7, "next": next}
		data, err := msgpack.Marshal(page)
		if err != nil {
			t.Fatal(err)
		}
		js, err := json.Marshal(page)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range []struct {
			data   []byte
			asJSON bool
		}{{data, false}, {js, true}} {
			got, gotNext, err := countRows(c.data, c.asJSON)
			if err != nil || got != n || gotNext != next {
				t.Fatalf("%d rows, JSON %v: have %d rows, next of %d bytes, %v", n, c.asJSON, got, len(gotNext), err)
			}
			if _, _, err := countRows(c.data[:len(c.data)-1], c.asJSON); err == nil {
				t.Fatalf("%d rows, JSON %v: a cut answer read without error", n, c.asJSON)
			}
		}
		delete(page, "rows")
		data, _ = msgpack.Marshal(page)
		js, _ = json.Marshal(page)
		if _, _, err := countRows(data, false); err == nil {
			t.Fatalf("an answer without rows read without error")
		}
		if _, _, err := countRows(js, true); err == nil {
			t.Fatalf("a JSON answer without rows read without error")
		}
	}
}
