package main

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/seat"
	"github.com/novox/mesh-provisioner/store"
)

// TestTables_ValuesJSONCannotShow: a value that is MessagePack but has no JSON form (a NaN, a string
// not UTF-8) is a value like any other (CONTRACT section 1: no anomaly), so the tables of query and
// replay do not call it "not MessagePack", which is what a value-not-msgpack anomaly says; the bytes
// that are not MessagePack still are. Their JSON (query --json, replay state, diff and history
// --json) gives the bytes as value_raw.
func TestTables_ValuesJSONCannotShow(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	url := ns.ClientURL()
	nc, js := natstest.Connect(t, url)
	ctx := context.Background()
	nan, err := msgpack.Marshal(map[string]any{"limit": math.NaN()})
	require.NoError(t, err)
	latin1, err := msgpack.Marshal("caf\xe9")
	require.NoError(t, err)
	raw := []byte{0xc1, 'r', 'a', 'w'}
	N := provisioner.BucketNeeds
	ops := []fixtures.Op{
		{Bucket: N, Key: "n1.m.config.nan", Op: provisioner.OpPut, Value: nan},
		{Bucket: N, Key: "n1.m.config.latin1", Op: provisioner.OpPut, Value: latin1},
		{Bucket: N, Key: "n1.m.config.raw", Op: provisioner.OpPut, Value: raw},
	}
	require.NoError(t, fixtures.Load(ctx, js, ops, 0, nil))
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	st, err := seat.Start(ctx, nc, js, db, seat.Config{WriteRegistry: true})
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, st.Stop())
		require.NoError(t, db.Close())
	})

	// lineOf finds the line of key in a table.
	lineOf := func(out, key string) string {
		for _, l := range strings.Split(out, "\n") {
			if strings.Contains(l, key) {
				return l
			}
		}
		t.Fatalf("no line of %s in\n%s", key, out)
		return ""
	}
	check := func(what, out string) {
		t.Helper()
		for _, k := range []string{"nan", "latin1"} {
			key := "n1.m.config." + k
			if what == "query" {
				key = " " + k + " " // the query table has the name, not the key
			}
			l := lineOf(out, key)
			require.NotContains(t, l, "not MessagePack", "%s: %s is MessagePack", what, k)
			require.Contains(t, l, "(MessagePack with no JSON form: ", "%s: %s", what, k)
		}
		key := "n1.m.config.raw"
		if what == "query" {
			key = " raw "
		}
		l := lineOf(out, key)
		require.Contains(t, l, "(not MessagePack: "+base64.StdEncoding.EncodeToString(raw)+")", what)
	}

	var out string
	natstest.CheckFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		o, errOut, code := runCmd(t, "query", "needs", "--node", "n1", "--nats", url)
		if code != 0 {
			return fmt.Errorf("query: %d %s", code, errOut)
		}
		if !strings.Contains(o, "3 rows") {
			return fmt.Errorf("not projected yet:\n%s", o)
		}
		out = o
		return nil
	})
	check("query", out)
	// The JSON answer itself: value null and the bytes as written.
	o, errOut, code := runCmd(t, "query", "needs", "--node", "n1", "--nats", url, "--json")
	require.Zero(t, code, errOut)
	var a struct{ Rows []map[string]any }
	require.NoError(t, json.Unmarshal([]byte(o), &a))
	require.Len(t, a.Rows, 3)
	for i, want := range [][]byte{latin1, nan, raw} {
		require.Nil(t, a.Rows[i]["value"], a.Rows[i]["key"])
		require.Equal(t, base64.StdEncoding.EncodeToString(want), a.Rows[i]["value_raw"], a.Rows[i]["key"])
	}

	// replay diff: a line per key added; replay history: the revision line of one key (PUT).
	o, errOut, code = runCmd(t, "replay", "diff", "needs", "--from", "seq:0", "--to", "seq:3", "--nats", url)
	require.Zero(t, code, errOut)
	check("replay diff", o)
	history := ""
	for _, k := range []string{"nan", "latin1", "raw"} {
		o, errOut, code := runCmd(t, "replay", "history", "needs", "n1.m.config."+k, "--nats", url)
		require.Zero(t, code, errOut)
		history += strings.Replace(lineOf(o, " PUT "), " PUT ", " PUT n1.m.config."+k+" ", 1) + "\n"
	}
	check("replay history", history)

	// And their JSON: value null (diff, state) or absent (history), and the bytes as value_raw.
	o, errOut, code = runCmd(t, "replay", "diff", "needs", "--from", "seq:0", "--to", "seq:3", "--nats", url, "--json")
	require.Zero(t, code, errOut)
	var d struct{ Added []map[string]any }
	require.NoError(t, json.Unmarshal([]byte(o), &d), o)
	o, errOut, code = runCmd(t, "replay", "state", "needs", "--at", "seq:3", "--nats", url, "--json")
	require.Zero(t, code, errOut)
	var s struct{ Rows []map[string]any }
	require.NoError(t, json.Unmarshal([]byte(o), &s), o)
	for what, rows := range map[string][]map[string]any{"diff": d.Added, "state": s.Rows} {
		require.Len(t, rows, 3, what)
		for i, want := range [][]byte{latin1, nan, raw} {
			require.Nil(t, rows[i]["value"], "%s %v", what, rows[i]["key"])
			require.Equal(t, base64.StdEncoding.EncodeToString(want), rows[i]["value_raw"], "%s %v", what, rows[i]["key"])
		}
	}
	for k, want := range map[string][]byte{"nan": nan, "latin1": latin1, "raw": raw} {
		o, errOut, code := runCmd(t, "replay", "history", "needs", "n1.m.config."+k, "--nats", url, "--json")
		require.Zero(t, code, errOut)
		var h struct{ Revisions []map[string]any }
		require.NoError(t, json.Unmarshal([]byte(o), &h), o)
		require.Len(t, h.Revisions, 1)
		require.NotContains(t, h.Revisions[0], "value", k)
		require.Equal(t, base64.StdEncoding.EncodeToString(want), h.Revisions[0]["value_raw"], k)
	}
}
