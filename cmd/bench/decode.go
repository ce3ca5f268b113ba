package main

import (
	"bytes"
	"encoding/json"

	"github.com/vmihailenco/msgpack/v5"
)

func jsonBody(r map[string]any) ([]byte, error) { return json.Marshal(r) }

// countRows decodes an answer page the way a client would and returns its rows and next.
func countRows(data []byte, asJSON bool) (int, string, error) {
	if asJSON {
		var a struct {
			Rows []json.RawMessage `json:"rows"`
			Next string            `json:"next"`
		}
		dec := json.NewDecoder(bytes.NewReader(data))
		if err := dec.Decode(&a); err != nil {
			return 0, "", err
		}
		return len(a.Rows), a.Next, nil
	}
	var a answer
	if err := msgpack.Unmarshal(data, &a); err != nil {
		return 0, "", err
	}
	return len(a.Rows), a.Next, nil
}
