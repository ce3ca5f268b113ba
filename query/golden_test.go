package query

import (
	"bytes"
	"context"
	"encoding/hex"
	"flag"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/mpk"
	"github.com/novox/mesh-provisioner/store"
)

// Run using: go test ./query -run TestAnswer_Golden -update
var updateGolden = flag.Bool("update", false, "rewrite query/testdata/answers.golden from the answers written now")

const goldenFile = "testdata/answers.golden"

// TestAnswer_Golden writes the answers of every what, in JSON and in MessagePack, from a fixed store
// (values of every MessagePack type, values that are not MessagePack or that JSON cannot render,
// escaped collections, anomalies of every reason the four buckets and plans carry, pages cut by limit
// with their next), and compares them byte for byte with testdata/answers.golden: a change of the
// encoder that changes one byte of an answer fails here, and the diff of the golden file shows which.
func TestAnswer_Golden(t *testing.T) {
	db := goldenStore(t)
	s := NewServer(StoreReader(db), Options{Plans: Plans(StorePlans(db), func(string) bool { return true }, nil)})
	var out bytes.Buffer
	out.WriteString("# The verb's answers from TestAnswer_Golden's store, byte for byte: JSON as written, MessagePack in\n")
	out.WriteString("# hex. Regenerate with: go test ./query -run TestAnswer_Golden -update\n")
	for _, c := range goldenRequests {
		for _, f := range []Format{FormatJSON, FormatMsgpack} {
			req := c.req
			req.What = c.what
			var e Encoder
			e.SetMaxBytes(1 << 20)
			err := s.Answer(context.Background(), &req, f, &e)
			body := e.Bytes()
			status := "200"
			if err != nil {
				status = fmt.Sprint(Code(err))
				body = ErrorBody(f, err.Error())
			}
			name := "json"
			if f == FormatMsgpack {
				name = "msgpack"
			}
			fmt.Fprintf(&out, "\n== %s (%s) %s\n", c.name, name, status)
			if f == FormatJSON {
				out.Write(body)
				out.WriteByte('\n')
				continue
			}
			for len(body) > 0 {
				n := min(len(body), 48)
				out.WriteString(hex.EncodeToString(body[:n]))
				out.WriteByte('\n')
				body = body[n:]
			}
		}
	}
	path := filepath.FromSlash(goldenFile)
	if *updateGolden {
		require.NoError(t, os.WriteFile(path, out.Bytes(), 0o644))
	}
	want, err := os.ReadFile(path)
	require.NoError(t, err, "regenerate with: go test ./query -run TestAnswer_Golden -update")
	if !bytes.Equal(want, out.Bytes()) {
		got := strings.Split(out.String(), "\n")
		lines := strings.Split(string(want), "\n")
		for i := range max(len(got), len(lines)) {
			var g, w string
			if i < len(got) {
				g = got[i]
			}
			if i < len(lines) {
				w = lines[i]
			}
			if g != w {
				t.Fatalf("%s line %d differs:\nwant %s\nhave %s\n(regenerate with -update only when the change is meant)", goldenFile, i+1, w, g)
			}
		}
	}
}

// goldenRequests are the requests of the golden answers: each what, narrowed each way its range or
// filter can be, and pages cut by limit with the page after them.
var goldenRequests = []struct {
	name, what string
	req        Request
}{
	{"registry", "registry", Request{}},
	{"registry kind", "registry", Request{Kind: "config"}},
	{"registry module", "registry", Request{Module: "mesh-vault"}},
	{"needs", "needs", Request{}},
	{"needs node", "needs", Request{Node: "n1"}},
	{"needs node module", "needs", Request{Node: "n1", Module: "m1"}},
	{"needs module", "needs", Request{Module: "m1"}},
	{"needs kind", "needs", Request{Kind: "config"}},
	{"needs limit 2", "needs", Request{Limit: ptr(int64(2))}},
	{"needs limit 2 after", "needs", Request{Limit: ptr(int64(2)), After: "n1.m1.config.b"}},
	{"needs after gone", "needs", Request{After: "n9.m1.config.a"}},
	{"applied", "applied", Request{}},
	{"applied node", "applied", Request{Node: "n2"}},
	{"applied module limit 1", "applied", Request{Module: "m1", Limit: ptr(int64(1))}},
	{"collect", "collect", Request{}},
	{"collect collection", "collect", Request{Collection: "shell:zsh:normal"}},
	{"collect node collection", "collect", Request{Node: "n2", Collection: "shell:zsh:normal"}},
	{"collect contributor", "collect", Request{Module: "m1"}},
	{"plans", "plans", Request{}},
	{"plans node limit 1", "plans", Request{Node: "n1", Limit: ptr(int64(1))}},
}

// goldenStore is the store of the golden answers: fixed messages, times and sequences, every bucket
// synced.
func goldenStore(t *testing.T) *store.DB {
	t.Helper()
	db := smallStore(t)
	put := func(bucket string, kvs ...any) {
		var msgs []provisioner.Message
		for i := 0; i < len(kvs); i += 2 {
			msgs = append(msgs, provisioner.Message{Seq: uint64(len(msgs) + 1), Time: 1.7e18 + int64(len(msgs))*1_234_567_891,
				Key: kvs[i].(string), Op: provisioner.OpPut, Value: kvs[i+1].([]byte)})
		}
		require.NoError(t, db.Apply(bucket, msgs, 1, false))
		db.SetSynced(bucket, true)
	}
	var reg []any
	for _, e := range provisioner.Registry.Entries {
		reg = append(reg, e.Kind, e.Value())
	}
	reg = append(reg, "two.tokens", mapOf("kind", "x"), "zz-not-msgpack", []byte{0xc1, 'x'})
	put(provisioner.BucketRegistry, reg...)

	// Values of every type: strings that JSON escapes, long strings of each header width, numbers of
	// every width and sign, floats, bin, timestamps, an extension, nested arrays and maps with keys
	// that are not strings.
	var every []byte
	every = mpk.AppendMapHeader(every, 14)
	every = mpk.AppendString(mpk.AppendString(every, "quote"), "a \"quoted\" \\ back\nnew\tline \x01 <&> é \u2028 ok")
	every = mpk.AppendString(mpk.AppendString(every, "long"), strings.Repeat("0123456789", 30))
	every = mpk.AppendInt(mpk.AppendString(every, "neg"), -129)
	every = mpk.AppendInt(mpk.AppendString(every, "neg64"), math.MinInt64)
	every = mpk.AppendUint(mpk.AppendString(every, "u64"), math.MaxUint64)
	every = mpk.AppendFloat64(mpk.AppendString(every, "f64"), 1e-7)
	every = append(mpk.AppendString(every, "f32"), 0xca, 0x3f, 0xc0, 0x00, 0x00) // 1.5
	every = mpk.AppendBin(mpk.AppendString(every, "bin"), []byte{0, 1, 2, 0xff})
	every = mpk.AppendTime(mpk.AppendString(every, "t"), time.Unix(1700000000, 250000000))
	every = append(mpk.AppendString(every, "ext"), 0xd4, 0x05, 0x2a)
	every = mpk.AppendBool(mpk.AppendString(every, "yes"), true)
	every = mpk.AppendNil(mpk.AppendString(every, "nil"))
	every = mpk.AppendString(every, "arr")
	every = mpk.AppendArrayHeader(every, 3)
	every = mpk.AppendInt(every, 1)
	every = mpk.AppendArrayHeader(every, 0)
	every = mpk.AppendMapHeader(every, 0)
	every = mpk.AppendString(every, "intkeys")
	every = mpk.AppendMapHeader(every, 2)
	every = mpk.AppendString(mpk.AppendInt(every, 7), "seven")
	every = mpk.AppendString(mpk.AppendArrayHeader(every, 0), "empty array")
	nan := append(mpk.AppendMapHeader(nil, 1), mpk.AppendString(nil, "nan")...)
	nan = mpk.AppendFloat64(nan, math.NaN()) // MessagePack that JSON cannot render: value_raw in JSON
	badUTF8 := mpk.AppendString(nil, "not \xff utf-8")
	put(provisioner.BucketNeeds,
		"n1.m1.config.a", mapOf("path", "/etc/a", "mode", "0644"),
		"n1.m1.config.b", every,
		"n1.m2.secret.c", mpk.AppendNil(nil),
		"n1.m2.nokind.d", mapOf("x", "y"), // unanswered-kind: an anomaly, and still a row
		"n2.m1.config.e", []byte{0xc1}, // not MessagePack
		"n2.m1.config.f", nan,
		"n2.m1.config.g", badUTF8,
		"n2.m1.config.h", []byte{0x01, 0x02}, // two objects: not one complete object
		"n2.x.y", mapOf(), // token-count
		"n3.m3.config."+strings.Repeat("k", 40), []byte{0x7f},
	)
	put(provisioner.BucketApplied,
		"n1.m1", mapOf("build", "1042"),
		"n1.m2", []byte("plain text"),
		"n2.m1", mapOf(),
		"n3", mapOf(),
	)
	put(provisioner.BucketCollect,
		"n1.shell=3Azsh=3Anormal.m1", mapOf("line", "export A=1"),
		"n1.environment.m2", mapOf("A", "1"),
		"n2.=C3=A9t=C3=A9.m1", mapOf("season", "summer"),
		"n2.bad=ZZ.m1", mapOf(), // bad-escape
		"n2.shell=3azsh=3anormal.m3", mapOf("line", "lower-case escapes"),
		"n2.=FF.m1", mapOf(), // decodes to invalid UTF-8: bad-escape
	)
	put(provisioner.ComposedPrefix+"n1",
		"m1.7", mapOf("status", "published", "plan", "p7"),
		"m1.9", mapOf("status", "published", "plan", "p9"),
		"m2.8", mapOf("status", "refused", "plan", "p8"),
		"m2.x", mapOf("status", "published"), // bad-build
	)
	put(provisioner.BucketHostModules,
		"n1.m1", mapOf("want", uint64(7)),
		"n1.m2", mapOf("want", uint64(8), "have", uint64(7)),
		"n2.m1", mapOf("have", "x"), // bad-value
	)
	put(provisioner.BucketIndexerBuilds, "m1", mapOf("newest", uint64(9)))
	return db
}

// mapOf is a MessagePack map of string keys and string or unsigned values, in the order given.
func mapOf(kvs ...any) []byte {
	b := mpk.AppendMapHeader(nil, len(kvs)/2)
	for i := 0; i < len(kvs); i += 2 {
		b = mpk.AppendString(b, kvs[i].(string))
		switch v := kvs[i+1].(type) {
		case string:
			b = mpk.AppendString(b, v)
		case uint64:
			b = mpk.AppendUint(b, v)
		}
	}
	return b
}
