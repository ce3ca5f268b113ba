package query

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/micro"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/store"
)

// anomalyStore holds 2000 needs of about 1 KB each (about twice what one NATS message of the default
// 1 MiB carries), of a kind the registry answers, and nBad out-of-shape keys of badLen bytes: the
// anomalies.
func anomalyStore(t *testing.T, nBad, badLen int) *store.DB {
	t.Helper()
	db := smallStore(t)
	kind := provisioner.Registry.Entries[0]
	require.NoError(t, db.Apply(provisioner.BucketRegistry, []provisioner.Message{{Seq: 1, Time: 1, Key: kind.Kind, Op: provisioner.OpPut, Value: kind.Value()}}, 0, false))
	db.SetSynced(provisioner.BucketRegistry, true)
	val, err := msgpack.Marshal(map[string]any{"pad": strings.Repeat("v", 1000)})
	require.NoError(t, err)
	var msgs []provisioner.Message
	put := func(key string, value []byte) {
		msgs = append(msgs, provisioner.Message{Seq: uint64(len(msgs) + 1), Time: int64(len(msgs) + 1), Key: key, Op: provisioner.OpPut, Value: value})
	}
	for i := 0; i < 2000; i++ {
		put(fmt.Sprintf("n1.m%04d.%s.a", i, kind.Kind), val)
	}
	for i := 0; i < nBad; i++ {
		k := fmt.Sprintf("n1.bad%04d.", i)
		put(k+strings.Repeat("b", badLen-len(k)), []byte{0x01}) // out of shape: three tokens
	}
	require.NoError(t, db.Apply(provisioner.BucketNeeds, msgs, 0, false))
	db.SetSynced(provisioner.BucketNeeds, true)
	return db
}

// pageOf is one page of needs as a client reads it, and where its rows end in the bytes: the offset
// of the anomalies' key.
type pageOf struct {
	Rows      []map[string]any `json:"rows" msgpack:"rows"`
	Anomalies []map[string]any `json:"anomalies" msgpack:"anomalies"`
	Total     int64            `json:"anomalies_total" msgpack:"anomalies_total"`
	Next      string           `json:"next" msgpack:"next"`
	size      int
	rowsEnd   int
}

// askPage asks the verb for a page of needs through NATS, in format, and decodes it.
func askPage(t *testing.T, ask func([]byte) []byte, after string, format Format) pageOf {
	t.Helper()
	req := map[string]any{"what": "needs", "limit": MaxLimit}
	if after != "" {
		req["after"] = after
	}
	var body []byte
	var err error
	if format == FormatMsgpack {
		body, err = msgpack.Marshal(req)
	} else {
		body, err = json.Marshal(req)
	}
	require.NoError(t, err)
	raw := ask(body)
	var p pageOf
	key := []byte(`,"anomalies":`)
	if format == FormatMsgpack {
		require.NoError(t, msgpack.Unmarshal(raw, &p))
		key = append([]byte{0xa0 | 9}, "anomalies"...)
	} else {
		require.NoError(t, json.Unmarshal(raw, &p), "%.200s", raw)
	}
	p.size, p.rowsEnd = len(raw), bytes.Index(raw, key)
	require.Positive(t, p.rowsEnd)
	return p
}

// walkPages walks every page of needs through the verb on a real NATS server (max_payload 1 MiB by
// default) and checks that each fits and that the walk sees every row once.
func walkPages(t *testing.T, db *store.DB, format Format) []pageOf {
	t.Helper()
	_, nc := serveStore(t, db)
	max := int(nc.MaxPayload())
	ask := func(body []byte) []byte {
		msg, err := nc.Request(Subject, body, 10*time.Second)
		require.NoError(t, err)
		require.Empty(t, msg.Header.Get(micro.ErrorCodeHeader), msg.Header.Get(micro.ErrorHeader))
		return msg.Data
	}
	var pages []pageOf
	seen := map[string]bool{}
	after := ""
	for {
		require.Less(t, len(pages), 10)
		p := askPage(t, ask, after, format)
		require.LessOrEqual(t, p.size, max, "page %d fits one NATS message", len(pages))
		for _, row := range p.Rows {
			k := row["key"].(string)
			require.False(t, seen[k], k)
			seen[k] = true
		}
		pages = append(pages, p)
		if p.Next == "" {
			break
		}
		after = p.Next
	}
	require.Len(t, seen, 2000, "every row once")
	return pages
}

// TestVerb_FewAnomaliesLeaveTheRowsTheWholeBound: a page whose bucket has few anomalies carries rows up
// to near the whole bound, not three quarters of it (docs/decisions.md, "An answer always fits one NATS
// message"), carries every anomaly, and fits.
func TestVerb_FewAnomaliesLeaveTheRowsTheWholeBound(t *testing.T) {
	db := anomalyStore(t, 3, 100)
	for _, format := range []Format{FormatJSON, FormatMsgpack} {
		t.Run(fmt.Sprint("format ", format), func(t *testing.T) {
			pages := walkPages(t, db, format)
			const max = 1 << 20
			p := pages[0]
			require.NotEmpty(t, p.Next)
			require.Greater(t, p.rowsEnd, max-max/16, "the rows take near the whole bound")
			require.EqualValues(t, 3, p.Total)
			require.Len(t, p.Anomalies, 3, "every anomaly is carried")
		})
	}
}

// TestVerb_LargeAnomaliesKeepTheRowsToThreeQuarters: with 1000 anomalies of 4 KB keys, more than the
// whole bound, the rows still stop at three quarters of it, the anomalies fill what is left and are
// cut there (anomalies_total counts them all), and the page fits.
func TestVerb_LargeAnomaliesKeepTheRowsToThreeQuarters(t *testing.T) {
	db := anomalyStore(t, MaxAnomalies, 4096)
	for _, format := range []Format{FormatJSON, FormatMsgpack} {
		t.Run(fmt.Sprint("format ", format), func(t *testing.T) {
			const max = 1 << 20
			for i, p := range walkPages(t, db, format) {
				require.LessOrEqual(t, p.rowsEnd, max-max/4, "page %d: the rows stop at three quarters", i)
				require.EqualValues(t, MaxAnomalies, p.Total, "page %d", i)
				require.NotEmpty(t, p.Anomalies, "page %d", i)
				require.Less(t, len(p.Anomalies), MaxAnomalies, "page %d: the anomalies are cut to the bound", i)
				require.Greater(t, p.size, max-max/16, "page %d: the anomalies fill what the rows left", i)
				if p.Next != "" {
					require.Greater(t, p.rowsEnd, max/2, "page %d: the rows take their three quarters", i)
				}
			}
		})
	}
}

// TestAnswer_AnomaliesWrittenAheadSameBytes: the anomalies written ahead of the rows and appended give
// the bytes that writing them in place gives, in both formats: a page answered under the bound is byte
// for byte the page of as many rows answered with no bound.
func TestAnswer_AnomaliesWrittenAheadSameBytes(t *testing.T) {
	db := anomalyStore(t, 5, 200)
	s := NewServer(StoreReader(db), Options{NoReadAhead: true})
	defer s.Stop()
	for _, format := range []Format{FormatJSON, FormatMsgpack} {
		var bounded, free Encoder
		bounded.SetMaxBytes(256 << 10)
		req := Request{What: "needs", Limit: ptr(int64(MaxLimit))}
		require.NoError(t, s.Answer(context.Background(), &req, format, &bounded))
		require.NotEmpty(t, bounded.next)
		require.Less(t, bounded.part, 256<<10/4, "the anomalies were written ahead")
		var page pageOf
		if format == FormatMsgpack {
			require.NoError(t, msgpack.Unmarshal(bounded.Bytes(), &page))
		} else {
			require.NoError(t, json.Unmarshal(bounded.Bytes(), &page))
		}
		require.Len(t, page.Anomalies, 5)
		req.Limit = ptr(int64(len(page.Rows)))
		require.NoError(t, s.Answer(context.Background(), &req, format, &free))
		require.Equal(t, bounded.Bytes(), free.Bytes(), "format %v", format)
	}
}
