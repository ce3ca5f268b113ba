package query

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
)

// TestAnswerPlans_BoundedBySize: plans answers keep within one NATS message as the other answers do
// (docs/decisions.md, "An answer always fits one NATS message"): with plans of kilobytes on hundreds
// of nodes, a page ends early with next, as_of's member per node of the page still fits, the walk
// sees every row once and in order, and the anomalies are cut while anomalies_total counts them all.
func TestAnswerPlans_BoundedBySize(t *testing.T) {
	db := smallStore(t)
	const max = 64 << 10
	mp := func(v any) []byte {
		b, err := msgpack.Marshal(v)
		require.NoError(t, err)
		return b
	}
	plan := strings.Repeat("p", 1500)
	var hosts []provisioner.Message
	var want []string
	for i := 0; i < 200; i++ {
		node := fmt.Sprintf("node-with-a-long-name-%03d", i)
		var comps []provisioner.Message
		for j, module := range []string{"api", "web"} {
			comps = append(comps, provisioner.Message{Seq: uint64(j + 1), Time: 1, Key: module + ".7", Op: provisioner.OpPut,
				Value: mp(map[string]any{"status": "published", "plan": plan})})
			hosts = append(hosts, provisioner.Message{Seq: uint64(len(hosts) + 1), Time: 1, Key: node + "." + module, Op: provisioner.OpPut,
				Value: mp(map[string]any{"want": 7})})
			want = append(want, node+"."+module)
		}
		require.NoError(t, db.Apply(provisioner.ComposedPrefix+node, comps, 0, false))
	}
	for i := 0; i < 300; i++ { // out of shape: three tokens of two
		hosts = append(hosts, provisioner.Message{Seq: uint64(len(hosts) + 1), Time: 1, Key: fmt.Sprintf("zz%03d.%s.x", i, strings.Repeat("b", 1000)), Op: provisioner.OpPut, Value: mp(1)})
	}
	require.NoError(t, db.Apply(provisioner.BucketHostModules, hosts, 0, false))

	for _, format := range []Format{FormatJSON, FormatMsgpack} {
		t.Run(fmt.Sprint("format ", format), func(t *testing.T) {
			var got []string
			after := ""
			for page := 0; ; page++ {
				require.Less(t, page, 500)
				req := Request{What: "plans", After: after, Limit: ptr(int64(MaxLimit))}
				var e Encoder
				e.SetMaxBytes(max)
				e.Reset(format)
				v, err := db.View()
				require.NoError(t, err)
				require.NoError(t, AnswerPlans(v, &req, &e, true))
				require.NoError(t, v.Close())
				require.LessOrEqual(t, len(e.Bytes()), max, "page %d", page)
				var a struct {
					Rows      []map[string]any  `json:"rows" msgpack:"rows"`
					Anomalies []map[string]any  `json:"anomalies" msgpack:"anomalies"`
					Total     int64             `json:"anomalies_total" msgpack:"anomalies_total"`
					AsOf      map[string]uint64 `json:"as_of" msgpack:"as_of"`
					Next      string            `json:"next" msgpack:"next"`
				}
				if format == FormatJSON {
					require.NoError(t, json.Unmarshal(e.Bytes(), &a))
				} else {
					require.NoError(t, msgpack.Unmarshal(e.Bytes(), &a))
				}
				require.NotEmpty(t, a.Rows, "page %d", page)
				require.EqualValues(t, 300, a.Total, "anomalies_total counts every anomaly")
				require.Less(t, len(a.Anomalies), 300, "the anomalies are cut to the bound")
				for _, row := range a.Rows {
					k := row["key"].(string)
					got = append(got, k)
					require.Contains(t, a.AsOf, provisioner.ComposedPrefix+row["node"].(string), "as_of has the bucket of every row")
				}
				if a.Next == "" {
					break
				}
				require.Equal(t, got[len(got)-1], a.Next)
				after = a.Next
			}
			require.Equal(t, want, got, "every row once, in byte order")
		})
	}
}
