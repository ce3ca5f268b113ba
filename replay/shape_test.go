package replay_test

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/replay"
	"github.com/novox/mesh-provisioner/store"
)

// TestAsk_AnOutOfShapeKeyHasNoRowAsOfAPoint: CONTRACT section 2, an out-of-shape key is an anomaly
// row (docs/decisions.md: it has no row). A key with the shape's token count whose token is empty or
// holds a byte a token cannot (bad-token), or whose collection has a bad escape, answered as a row as
// of a point (the verb's at, replay): the log keeps every key, and the rows read from it were split
// by token count alone. The live answer had no such row.
func TestAsk_AnOutOfShapeKeyHasNoRowAsOfAPoint(t *testing.T) {
	t.Parallel()
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	l := &replay.Log{DB: db}
	defer l.Close()
	put := func(bucket string, seq uint64, key string) provisioner.Message {
		return provisioner.Message{Seq: seq, Time: int64(seq) * 1e9, Key: key, Op: provisioner.OpPut, Value: mp("v")}
	}
	require.NoError(t, db.Apply(provisioner.BucketRegistry, []provisioner.Message{put(provisioner.BucketRegistry, 1, "config")}, 0, false))
	require.NoError(t, db.Apply(provisioner.BucketNeeds, []provisioner.Message{
		put(provisioner.BucketNeeds, 1, "n1.m1.config.a"),
		put(provisioner.BucketNeeds, 2, "n1.m1.con:fig.b"), // bad-token
		put(provisioner.BucketNeeds, 3, "n1.m1.config.c\xff"),
		put(provisioner.BucketNeeds, 4, "n1..config.d"), // an empty token
		put(provisioner.BucketNeeds, 5, "n1.m1.config.e"),
	}, 0, false))
	require.NoError(t, db.Apply(provisioner.BucketCollect, []provisioner.Message{
		put(provisioner.BucketCollect, 1, "n1.shell.m1"),
		put(provisioner.BucketCollect, 2, "n1.=G1.m1"), // bad-escape
		put(provisioner.BucketCollect, 3, "n1.shell.m*"),
	}, 0, false))

	ask := func(req map[string]any) (rows []string, anomalies []string, err error) {
		body, _ := json.Marshal(req)
		b, err := l.Ask(body)
		if err != nil {
			return nil, nil, err
		}
		var a struct {
			Rows      []struct{ Key string }
			Anomalies []struct{ Key, Reason string }
		}
		require.NoError(t, json.Unmarshal(b, &a))
		for _, r := range a.Rows {
			rows = append(rows, r.Key)
		}
		for _, an := range a.Anomalies {
			anomalies = append(anomalies, an.Key)
		}
		return rows, anomalies, nil
	}
	for _, tc := range []struct {
		req       map[string]any
		rows, bad []string
	}{
		{map[string]any{"what": "needs"}, []string{"n1.m1.config.a", "n1.m1.config.e"}, []string{"n1..config.d", "n1.m1.con:fig.b", "n1.m1.config.c\ufffd"}},
		{map[string]any{"what": "needs", "node": "n1"}, []string{"n1.m1.config.a", "n1.m1.config.e"}, []string{"n1..config.d", "n1.m1.con:fig.b", "n1.m1.config.c\ufffd"}},
		{map[string]any{"what": "needs", "limit": 1, "after": "n1.m1.config.a"}, []string{"n1.m1.config.e"}, []string{"n1..config.d", "n1.m1.con:fig.b", "n1.m1.config.c\ufffd"}},
		{map[string]any{"what": "collect"}, []string{"n1.shell.m1"}, []string{"n1.=G1.m1", "n1.shell.m*"}},
		{map[string]any{"what": "collect", "node": "n1"}, []string{"n1.shell.m1"}, []string{"n1.=G1.m1", "n1.shell.m*"}},
	} {
		for _, at := range []string{"seq:5", "1970-01-01T00:00:05Z"} {
			req := map[string]any{"at": at}
			for k, v := range tc.req {
				req[k] = v
			}
			rows, anomalies, err := ask(req)
			require.NoError(t, err, "%v", req)
			require.Equal(t, tc.rows, rows, "%v: rows", req)
			require.Equal(t, tc.bad, anomalies, "%v: each out-of-shape key is an anomaly", req)
		}
	}
	// A cursor naming an out-of-shape key names no row: 404, as in a live answer.
	_, _, err = ask(map[string]any{"what": "needs", "at": "seq:5", "after": "n1.m1.con:fig.b"})
	require.Equal(t, 404, query.Code(err), "%v", err)
}
