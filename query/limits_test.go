package query

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/store"
)

// TestAnswer_BoundedBySize walks a bucket whose rows and anomalies are far more than one bounded answer
// holds: every page stays within the bound, the walk sees every row once and in order, a row too large
// for any answer comes without its value, and the anomalies are cut while anomalies_total counts them
// all.
func TestAnswer_BoundedBySize(t *testing.T) {
	db := smallStore(t)
	const max = 64 << 10
	var msgs []provisioner.Message
	seq := uint64(0)
	put := func(key string, value []byte) {
		seq++
		msgs = append(msgs, provisioner.Message{Seq: seq, Time: int64(seq), Key: key, Op: provisioner.OpPut, Value: value})
	}
	val, _ := msgpack.Marshal(map[string]any{"pad": strings.Repeat("v", 2000)})
	var keys []string
	for i := 0; i < 200; i++ {
		k := fmt.Sprintf("n1.m%03d.config.%s", i, strings.Repeat("k", 500))
		keys = append(keys, k)
		put(k, val)
	}
	huge, _ := msgpack.Marshal(strings.Repeat("h", max))
	put("n1.m100.config.huge", huge) // sorts among the others
	keys = append(keys, "n1.m100.config.huge")
	notMsgpack := append([]byte{0xc1}, strings.Repeat("r", max)...)
	put("n1.m150.config.raw", notMsgpack)
	keys = append(keys, "n1.m150.config.raw")
	// Values JSON has no form for answer in JSON as value_raw, base64 a third larger than the bytes:
	// what the bound counts is what is written. One of 40 KB fits a MessagePack answer's rows' share
	// (48 KB) and not a JSON one's.
	nanVal, _ := msgpack.Marshal(map[string]any{"pad": strings.Repeat("n", 2000), "x": math.NaN()})
	for i := 0; i < 50; i++ {
		k := fmt.Sprintf("n1.m%03d.config.nan", i*4)
		keys = append(keys, k)
		put(k, nanVal)
	}
	nanBig, _ := msgpack.Marshal(map[string]any{"pad": strings.Repeat("n", 40<<10), "x": math.Inf(1)})
	put("n1.m050.config.nanbig", nanBig)
	keys = append(keys, "n1.m050.config.nanbig")
	for i := 0; i < 300; i++ {
		put(fmt.Sprintf("n1.bad%03d.%s", i, strings.Repeat("b", 1000)), []byte{0x01}) // out of shape
	}
	require.NoError(t, db.Apply(provisioner.BucketNeeds, msgs, 0, false))
	db.SetSynced(provisioner.BucketNeeds, true)
	s := NewServer(StoreReader(db), Options{})
	defer s.Stop()

	for _, format := range []Format{FormatJSON, FormatMsgpack} {
		t.Run(fmt.Sprint("format ", format), func(t *testing.T) {
			var got []string
			omitted := map[string]uint64{}
			after := ""
			for page := 0; ; page++ {
				require.Less(t, page, 500)
				req := Request{What: "needs", After: after, Limit: ptr(int64(MaxLimit))}
				var e Encoder
				e.SetMaxBytes(max)
				require.NoError(t, s.Answer(context.Background(), &req, format, &e))
				require.LessOrEqual(t, len(e.Bytes()), max, "page %d", page)
				var a struct {
					Rows      []map[string]any `json:"rows" msgpack:"rows"`
					Anomalies []map[string]any `json:"anomalies" msgpack:"anomalies"`
					Total     int64            `json:"anomalies_total" msgpack:"anomalies_total"`
					Next      string           `json:"next" msgpack:"next"`
				}
				if format == FormatJSON {
					require.NoError(t, json.Unmarshal(e.Bytes(), &a))
				} else {
					require.NoError(t, msgpack.Unmarshal(e.Bytes(), &a))
				}
				require.NotEmpty(t, a.Rows, "page %d", page)
				// 300 out of shape, 253 needs of a kind no registry answers (it is empty), 1 value not MessagePack.
				require.EqualValues(t, 554, a.Total, "anomalies_total counts every anomaly")
				require.NotEmpty(t, a.Anomalies)
				require.Less(t, len(a.Anomalies), 554, "the anomalies are cut to the bound")
				for _, row := range a.Rows {
					k := row["key"].(string)
					got = append(got, k)
					if n, ok := row["value_omitted"]; ok {
						require.Nil(t, row["value"], k)
						require.NotContains(t, row, "value_raw", k)
						omitted[k] = toUint(n)
					} else if strings.HasSuffix(k, ".nan") && format == FormatJSON {
						require.Nil(t, row["value"], k)
						require.Equal(t, base64.StdEncoding.EncodeToString(nanVal), row["value_raw"], k)
					}
				}
				if a.Next == "" {
					break
				}
				require.Equal(t, got[len(got)-1], a.Next)
				after = a.Next
			}
			want := append([]string(nil), keys...)
			sort.Strings(want)
			require.Equal(t, want, got, "every row once, in byte order")
			wantOmitted := map[string]uint64{"n1.m100.config.huge": uint64(len(huge)), "n1.m150.config.raw": uint64(len(notMsgpack))}
			if format == FormatJSON {
				wantOmitted["n1.m050.config.nanbig"] = uint64(len(nanBig))
			}
			require.Equal(t, wantOmitted, omitted)
		})
	}
}

func ptr[T any](v T) *T { return &v }

func toUint(v any) uint64 {
	n, err := strconv.ParseUint(fmt.Sprint(v), 10, 64)
	if err != nil {
		panic(err)
	}
	return n
}

// smallStore opens a store with a small cache and memtables in a temporary directory, closed when the
// test ends: what the tests of answers need.
func smallStore(t *testing.T) *store.DB {
	t.Helper()
	db, err := store.Open(t.TempDir(), store.Options{CacheSize: 1 << 20, MemTableSize: 4 << 20})
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	return db
}
