package main

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/query"
)

// TestQuery_LaterPageFails: a page after the first is answered an error (its cursor's row removed
// meanwhile: 404). Every row of the pages before is printed, and the error says the table stops
// there. The table was printed 1,024 lines at a time, and an error dropped the lines received since
// the last of those: 1,500 rows received, 1,024 printed, the error, and nothing to say the rest of
// the first page was missing.
func TestQuery_LaterPageFails(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	nc, _ := natstest.Connect(t, ns.ClientURL())
	const page = 1500
	// A seat that answers the first page, then 404 for the next.
	sub, err := nc.Subscribe(query.Subject, func(m *nats.Msg) {
		var req map[string]any
		if err := json.Unmarshal(m.Data, &req); err != nil || req["after"] != nil {
			reply := nats.NewMsg(m.Reply)
			reply.Header.Set(micro.ErrorCodeHeader, "404")
			reply.Header.Set(micro.ErrorHeader, `after "x": no such row in this answer any more; start again without after`)
			reply.Data = []byte(`{"error":"gone"}`)
			_ = m.RespondMsg(reply)
			return
		}
		rows := make([]map[string]any, page)
		for i := range rows {
			rows[i] = map[string]any{"node": fmt.Sprintf("n%04d", i), "module": "m", "kind": "config", "name": "a", "revision": i + 1, "value": map[string]any{}}
		}
		body, _ := json.Marshal(map[string]any{"what": "needs", "rows": rows, "anomalies": []any{}, "anomalies_total": 0, "as_of": 7, "synced": true, "next": "x"})
		_ = m.Respond(body)
	})
	require.NoError(t, err)
	defer sub.Unsubscribe()
	require.NoError(t, nc.Flush())

	code, out, stderr := run(t, "query", "needs", "--nats", ns.ClientURL())
	require.Equal(t, exitAnswer, code, stderr)
	table, _ := tableLines(out)
	require.Equal(t, page, len(table)-1, "every row received is printed")
	require.Equal(t, fmt.Sprintf("n%04d", page-1), strings.Fields(table[page])[0])
	require.Contains(t, stderr, "404")
	require.Contains(t, stderr, fmt.Sprintf("the table above is the %d rows of the pages before", page))
}
