package seat_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/internal/verbcheck"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/seat"
	"github.com/novox/mesh-provisioner/store"
)

// prefixMesh holds names that are prefixes of others at every place a filter reads: nodes n1, n10 and
// n1-x; modules a and ab; kinds config and configx; collections a, a:b (written a=3Ab and a=3ab), a=,
// a== and the name a=3Ab itself (written a=3D3Ab), whose raw tokens are prefixes of one another's and
// of the decoded names.
func prefixMesh(t *testing.T) []fixtures.Op {
	var ops []fixtures.Op
	put := func(bucket, key string) {
		ops = append(ops, fixtures.Op{Bucket: bucket, Key: key, Op: provisioner.OpPut, Value: mp(t, key)})
	}
	for _, node := range []string{"n1", "n10", "n1-x"} {
		for _, mod := range []string{"a", "ab"} {
			for _, kind := range []string{"config", "configx", "secret"} {
				put(provisioner.BucketNeeds, node+"."+mod+"."+kind+".x")
			}
			put(provisioner.BucketApplied, node+"."+mod)
			for _, col := range []string{"a", "a=3Ab", "a=3ab", "a=3D", "a=3D=3D", "ab", "a=3D3Ab"} {
				put(provisioner.BucketCollect, node+"."+col+"."+mod)
			}
		}
		put(provisioner.BucketNeeds, node+".a.config") // out of shape, on each node
		put(provisioner.BucketApplied, node)
		put(provisioner.BucketCollect, node+".a=.a")
	}
	return ops
}

// TestSeat_FiltersOnPrefixNames: CONTRACT section 3, each filter matches its value exactly on every
// what, alone and combined, and paging with limit 1, 2, 10000 and the default loses and repeats no row.
func TestSeat_FiltersOnPrefixNames(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.load(prefixMesh(t))
	st, _ := h.startSeat(t.TempDir())
	h.waitCaughtUp(st)
	var reqs []map[string]any
	for _, kind := range []string{"", "config", "configx", "conf", "secret"} {
		reqs = append(reqs, map[string]any{"what": "registry", "kind": kind})
	}
	reqs = append(reqs, map[string]any{"what": "registry", "module": "mesh-"}, map[string]any{"what": "registry", "module": "mesh-vault", "kind": "secret"})
	for _, node := range []string{"", "n1", "n10", "n", "n1-x"} {
		for _, mod := range []string{"", "a", "ab", "b"} {
			for _, kind := range []string{"", "config", "configx", "conf"} {
				reqs = append(reqs, map[string]any{"what": "needs", "node": node, "module": mod, "kind": kind})
			}
			reqs = append(reqs, map[string]any{"what": "applied", "node": node, "module": mod})
			for _, col := range []string{"", "a", "a:b", "a=", "a==", "ab", "a:", "A:B", "a=3Ab", "a=3D"} {
				reqs = append(reqs, map[string]any{"what": "collect", "node": node, "contributor": mod, "collection": col})
			}
		}
	}
	truth, err := verbcheck.ReadTruth(context.Background(), h.js)
	require.NoError(t, err)
	for _, req := range reqs {
		for _, limit := range []any{nil, 1, 2, 10000} {
			r := map[string]any{"limit": limit}
			for k, v := range req {
				r[k] = v
			}
			for _, asMsgpack := range []bool{false, true} {
				require.NoError(t, truth.Check(h.nc, r, asMsgpack, 0))
			}
		}
	}
}

func (h *harness) askErr(req map[string]any, asMsgpack bool) (natstest.Answer, error) {
	h.t.Helper()
	body, err := natstest.Body(req, asMsgpack)
	require.NoError(h.t, err)
	a, _, err := natstest.Ask(h.nc, query.Subject, body, asMsgpack)
	return a, err
}

func verbCode(err error) int {
	var ve *natstest.VerbError
	if errors.As(err, &ve) {
		return ve.Code
	}
	if err == nil {
		return 200
	}
	return -1
}

// TestSeat_CursorOfAnotherAnswer: a cursor names a row of the answer it came from; as the cursor of
// another answer (another what, another narrowing, a key no row has) it is 404, in both formats.
func TestSeat_CursorOfAnotherAnswer(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.load(prefixMesh(t))
	st, _ := h.startSeat(t.TempDir())
	h.waitCaughtUp(st)
	for _, asMsgpack := range []bool{false, true} {
		for _, tc := range []struct {
			req  map[string]any
			code int
		}{
			{map[string]any{"what": "needs", "node": "n1", "kind": "config", "after": "n1.a.config.x"}, 200},
			{map[string]any{"what": "needs", "node": "n1", "kind": "config", "after": "n1.a.configx.x"}, 404},
			{map[string]any{"what": "needs", "node": "n1", "kind": "config", "after": "n10.a.config.x"}, 404},
			{map[string]any{"what": "needs", "module": "a", "kind": "secret", "after": "n1.a.config.x"}, 404},
			{map[string]any{"what": "needs", "node": "n1", "module": "a", "after": "n1.ab.config.x"}, 404},
			{map[string]any{"what": "needs", "after": "n1.a"}, 404},
			{map[string]any{"what": "needs", "after": "n1.a.config"}, 404}, // an anomaly's key has no row
			{map[string]any{"what": "applied", "node": "n1", "module": "a", "after": "n1.a"}, 200},
			{map[string]any{"what": "applied", "node": "n1", "module": "a", "after": "n1.ab"}, 404},
			{map[string]any{"what": "applied", "after": "n1.a.config.x"}, 404},
			{map[string]any{"what": "collect", "node": "n1", "contributor": "a", "after": "n1.a.a"}, 200},
			{map[string]any{"what": "collect", "node": "n1", "contributor": "a", "after": "n1.a.ab"}, 404},
			{map[string]any{"what": "collect", "collection": "a:b", "contributor": "ab", "after": "n1.a=3Ab.a"}, 404},
			{map[string]any{"what": "collect", "collection": "a:b", "after": "n1.a=3Ab.a"}, 200},
			{map[string]any{"what": "collect", "collection": "a:b", "after": "n1.a.a"}, 404},
			{map[string]any{"what": "registry", "kind": "secret", "after": "secret"}, 200},
			{map[string]any{"what": "registry", "module": "mesh-vault", "after": "config"}, 404},
			{map[string]any{"what": "registry", "after": "no-such-kind"}, 404},
		} {
			a, err := h.askErr(tc.req, asMsgpack)
			require.Equal(t, tc.code, verbCode(err), "%v msgpack=%v: %v %v", tc.req, asMsgpack, err, a.Rows)
			// As of the newest state, from the event log, the same.
			at := map[string]any{"at": "9999-12-31T23:59:59Z"}
			for k, v := range tc.req {
				at[k] = v
			}
			a, err = h.askErr(at, asMsgpack)
			require.Equal(t, tc.code, verbCode(err), "%v msgpack=%v: %v %v", at, asMsgpack, err, a.Rows)
		}
	}
}

// TestSeat_PagingWhileKeysChange: the cursor's promise (docs/decisions.md, The verb): a walk in byte
// order sees every key that lives through it exactly once, with its value as of the page that holds
// it; a key added ahead of the cursor is seen, one added behind it is not; a key deleted or purged
// ahead of the cursor is not; and a cursor whose row was deleted is 404.
func TestSeat_PagingWhileKeysChange(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	var ops []fixtures.Op
	for i := 0; i < 40; i += 2 {
		key := fmt.Sprintf("n2.m.config.k%02d", i)
		ops = append(ops, fixtures.Op{Bucket: provisioner.BucketNeeds, Key: key, Op: provisioner.OpPut, Value: mp(t, key)})
	}
	ops = append(ops, fixtures.Op{Bucket: provisioner.BucketNeeds, Key: "n20.m.config.k00", Op: provisioner.OpPut, Value: mp(t, "n20")})
	h.load(ops)
	require.NoError(t, fixtures.CreateBuckets(context.Background(), h.js, provisioner.BucketApplied, provisioner.BucketCollect))
	st, _ := h.startSeat(t.TempDir())
	h.waitCaughtUp(st)
	kv, err := h.js.KeyValue(context.Background(), provisioner.BucketNeeds)
	require.NoError(t, err)
	ctx := context.Background()

	for _, asMsgpack := range []bool{false, true} {
		req := map[string]any{"what": "needs", "node": "n2", "limit": 3}
		seen := map[string]int{}
		var order []string
		lived := map[string]bool{} // keys that live through the whole walk
		for i := 0; i < 40; i += 2 {
			lived[fmt.Sprintf("n2.m.config.k%02d", i)] = true
		}
		removed := map[string]bool{}
		added := map[string]bool{}
		var last uint64
		for page := 0; ; page++ {
			a, err := h.askErr(req, asMsgpack)
			require.NoError(t, err, "page %d", page)
			for _, row := range a.Rows {
				k := row["key"].(string)
				seen[k]++
				order = append(order, k)
			}
			if a.Next == "" {
				break
			}
			// Between pages: a key added ahead of the cursor and one behind it, a key ahead deleted and
			// one purged, a key behind written again.
			cur, err := strconv.Atoi(strings.TrimPrefix(a.Next, "n2.m.config.k"))
			require.NoError(t, err)
			write := func(key string, del, purge bool) {
				var err error
				switch {
				case del:
					err = kv.Delete(ctx, key)
				case purge:
					err = kv.Purge(ctx, key)
				default:
					last, err = kv.Put(ctx, key, mp(t, key+" again"))
				}
				require.NoError(t, err)
			}
			if ahead := fmt.Sprintf("n2.m.config.k%02d", cur+3); cur+3 < 40 {
				write(ahead, false, false)
				added[ahead] = true
			}
			behind := fmt.Sprintf("n2.m.config.k%02dz", cur-1)
			write(behind, false, false)
			for j, gone := range []int{cur + 4, cur + 6} {
				if key := fmt.Sprintf("n2.m.config.k%02d", gone); gone < 40 && lived[key] {
					write(key, j == 0, j == 1)
					delete(lived, key)
					removed[key] = true
				}
			}
			write(fmt.Sprintf("n2.m.config.k%02d", cur-2), false, false)
			req["after"] = a.Next
			req["min_seq"], req["wait_ms"] = last, 5000 // the next page sees every write above
		}
		for i := 1; i < len(order); i++ {
			require.Less(t, order[i-1], order[i], "msgpack=%v: rows in byte order, none twice", asMsgpack)
		}
		for k := range lived {
			require.Equal(t, 1, seen[k], "msgpack=%v: %s lived through the walk", asMsgpack, k)
		}
		for k := range removed {
			require.Zero(t, seen[k], "msgpack=%v: %s was removed ahead of the cursor", asMsgpack, k)
		}
		for k := range added {
			require.Equal(t, 1, seen[k], "msgpack=%v: %s was added ahead of the cursor", asMsgpack, k)
		}
		for k := range seen {
			require.NotContains(t, k, "z", "msgpack=%v: %s was added behind the cursor", asMsgpack, k)
			require.True(t, strings.HasPrefix(k, "n2."), "msgpack=%v: %s is not node n2's", asMsgpack, k)
		}
		// Start over for the other format: every key back as it was.
		for i := 0; i < 40; i++ {
			key := fmt.Sprintf("n2.m.config.k%02d", i)
			_ = kv.Purge(ctx, key)
			_ = kv.Purge(ctx, key+"z")
			if i%2 == 0 {
				last, err = kv.Put(ctx, key, mp(t, key))
				require.NoError(t, err)
			}
		}
		_, err = h.askErr(map[string]any{"what": "needs", "min_seq": last, "wait_ms": 5000}, false)
		require.NoError(t, err)
	}

	// The cursor's own row deleted between pages: 404, in both formats.
	a, err := h.askErr(map[string]any{"what": "needs", "node": "n2", "limit": 2}, false)
	require.NoError(t, err)
	require.NotEmpty(t, a.Next)
	seq, err := kv.Put(ctx, "n2.m.config.k99", mp(t, "later"))
	require.NoError(t, err)
	require.NoError(t, kv.Delete(ctx, a.Next))
	for _, asMsgpack := range []bool{false, true} {
		_, err = h.askErr(map[string]any{"what": "needs", "node": "n2", "limit": 2, "after": a.Next, "min_seq": seq + 1, "wait_ms": 5000}, asMsgpack)
		require.Equal(t, 404, verbCode(err), "%v", err)
	}
}

// TestSeat_SyncedSinceStart: CONTRACT section 3, synced is true once the projection has caught up with
// the bucket's stream since start: a seat restarted on its state dir answers from its checkpoint with
// synced false while it cannot read what came since, and as_of never goes back across its answers.
func TestSeat_SyncedSinceStart(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServerSeatDenied(t)
	url := ns.ClientURL()
	_, admin := natstest.Connect(t, url, nats.UserInfo("admin", "admin"))
	ctx := context.Background()
	require.NoError(t, fixtures.CreateBuckets(ctx, admin, provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect))
	applied, err := admin.KeyValue(ctx, provisioner.BucketApplied)
	require.NoError(t, err)
	var last uint64
	for i := 0; i < 3; i++ {
		last, err = applied.Put(ctx, fmt.Sprintf("n1.m%d", i), mp(t, i))
		require.NoError(t, err)
	}
	dir := t.TempDir()
	start := func() (*nats.Conn, func()) {
		nc, js := natstest.Connect(t, url, nats.UserInfo("seat", "seat"))
		db, err := store.OpenState(dir, store.Options{})
		require.NoError(t, err)
		st, err := seat.Start(ctx, nc, js, db, seat.Config{WriteRegistry: true, Projector: projector.Options{Poll: 20 * time.Millisecond, Verify: 100 * time.Millisecond}})
		require.NoError(t, err)
		var once sync.Once
		stop := func() {
			once.Do(func() { require.NoError(t, st.Stop()); require.NoError(t, db.Close()); nc.Close() })
		}
		t.Cleanup(stop)
		return nc, stop
	}
	nc, stop := start()
	var asOf uint64
	ask := func(nc *nats.Conn) natstest.Answer {
		t.Helper()
		a, _, err := natstest.Ask(nc, query.Subject, []byte(`{"what":"applied"}`), false)
		require.NoError(t, err)
		require.GreaterOrEqual(t, a.AsOf, asOf, "as_of never goes back")
		asOf = a.AsOf
		return a
	}
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		if a := ask(nc); !a.Synced || a.AsOf != last {
			return fmt.Errorf("as_of %d synced %v", a.AsOf, a.Synced)
		}
		return nil
	})
	stop()

	// While the seat is down, two more puts; once it is up again it may not read them yet.
	for i := 3; i < 5; i++ {
		last, err = applied.Put(ctx, fmt.Sprintf("n1.m%d", i), mp(t, i))
		require.NoError(t, err)
	}
	stream := provisioner.StreamName(provisioner.BucketApplied)
	natstest.DenySeat(t, ns, "$JS.API.CONSUMER.CREATE."+stream, "$JS.API.CONSUMER.CREATE."+stream+".>")
	nc, stop = start()
	for i := 0; i < 3; i++ {
		a := ask(nc)
		require.False(t, a.Synced, "not caught up since start")
		require.EqualValues(t, 3, a.AsOf, "as of the checkpoint")
		require.Len(t, a.Rows, 3)
	}
	stop()
	natstest.DenySeat(t, ns)
	nc, _ = start()
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		if a := ask(nc); !a.Synced || a.AsOf != last || len(a.Rows) != 5 {
			return fmt.Errorf("as_of %d synced %v rows %d", a.AsOf, a.Synced, len(a.Rows))
		}
		return nil
	})
}

// TestSeat_AtPages: CONTRACT section 3, at answers from the event log with the live answer's paging:
// seq:0 and a time before the first message are empty (not 410), a sequence past the end is the newest
// state, and a point in the middle holds exactly the keys put by then, walked page by page.
func TestSeat_AtPages(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	before := time.Now().Add(-time.Hour).UTC().Format(time.RFC3339Nano)
	h.load(prefixMesh(t))
	st, _ := h.startSeat(t.TempDir())
	h.waitCaughtUp(st)
	for _, what := range []string{"needs", "applied", "collect", "registry"} {
		for _, asMsgpack := range []bool{false, true} {
			live, last, err := natstest.AskAll(h.nc, query.Subject, map[string]any{"what": what}, asMsgpack)
			require.NoError(t, err)
			require.NotEmpty(t, live)
			end := last.AsOf
			walk := func(at string, limit any) ([]string, []uint64) {
				t.Helper()
				req := map[string]any{"what": what, "at": at, "limit": limit}
				var keys []string
				var asOfs []uint64
				for {
					a, err := h.askErr(req, asMsgpack)
					require.NoError(t, err, "%v", req)
					for _, row := range a.Rows {
						keys = append(keys, row["key"].(string))
					}
					asOfs = append(asOfs, a.AsOf)
					if a.Next == "" {
						return keys, asOfs
					}
					req["after"] = a.Next
				}
			}
			mid := end / 2
			var liveKeys, midKeys []string
			for _, row := range live {
				liveKeys = append(liveKeys, row["key"].(string))
				rev, err := strconv.ParseUint(fmt.Sprint(row["revision"]), 10, 64)
				require.NoError(t, err)
				if rev <= mid {
					midKeys = append(midKeys, row["key"].(string))
				}
			}
			for _, limit := range []any{nil, 1, 2} {
				name := fmt.Sprintf("%s limit=%v msgpack=%v", what, limit, asMsgpack)
				keys, asOfs := walk("seq:0", limit)
				require.Empty(t, keys, name)
				require.Equal(t, []uint64{0}, asOfs, name)
				keys, _ = walk(before, limit)
				require.Empty(t, keys, name)
				keys, asOfs = walk(fmt.Sprintf("seq:%d", end+1000), limit)
				require.Equal(t, liveKeys, keys, name)
				for _, a := range asOfs {
					require.Equal(t, end, a, name)
				}
				keys, asOfs = walk(fmt.Sprintf("seq:%d", mid), limit)
				require.Equal(t, midKeys, keys, name)
				for _, a := range asOfs {
					require.Equal(t, mid, a, name)
				}
			}
		}
	}

	// Trimmed to the end: a point before it is 410, in both formats, with the micro headers and the
	// error in the body, as for every error.
	end, _ := st.Store().Applied(provisioner.BucketApplied)
	last := h.lastMsg(provisioner.BucketApplied)
	_, err := st.Store().TrimHistory(context.Background(), provisioner.BucketApplied, end, last.Time.UnixNano())
	require.NoError(t, err)
	for _, asMsgpack := range []bool{false, true} {
		for _, at := range []string{"seq:1", before} {
			_, err := h.askErr(map[string]any{"what": "applied", "at": at}, asMsgpack)
			var ve *natstest.VerbError
			require.ErrorAs(t, err, &ve)
			require.Equal(t, 410, ve.Code)
			require.NotEmpty(t, ve.Description)
			require.Equal(t, ve.Description, ve.Body, "the body says the error too")
		}
	}
}

// TestSeat_SeatsAnswerAlike: CONTRACT section 3, several seats share the verb in the default queue
// group, and whichever answers, the answer is the same bytes: rows, anomalies, as_of, cursors and
// errors alike, so a walk may page on from one seat to the other.
func TestSeat_SeatsAnswerAlike(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.load(prefixMesh(t))
	st1, _ := h.startSeat(t.TempDir())
	st2, _ := h.startSeat(t.TempDir())
	h.waitCaughtUp(st1)
	h.waitCaughtUp(st2)
	answered := func() int64 {
		n := int64(0)
		for _, st := range []*seat.Seat{st1, st2} {
			if st.Server.Answered()["200"] > 0 {
				n++
			}
		}
		return n
	}
	reqs := []map[string]any{
		{}, {"what": "needs", "node": "n1", "limit": 2}, {"what": "needs", "node": "n1", "limit": 2, "after": "n1.a.configx.x"},
		{"what": "collect", "collection": "a:b"}, {"what": "applied", "module": "ab", "at": "seq:4"},
		{"what": "needs", "after": "n1.nope.config.x"}, {"what": "needs", "kind": "a.b"},
	}
	for _, req := range reqs {
		for _, asMsgpack := range []bool{false, true} {
			body, err := natstest.Body(req, asMsgpack)
			require.NoError(t, err)
			var first *nats.Msg
			for i := 0; i < 24; i++ {
				msg, err := h.nc.Request(query.Subject, body, 5*time.Second)
				require.NoError(t, err)
				if first == nil {
					first = msg
					continue
				}
				require.Equal(t, first.Header, msg.Header, "%v msgpack=%v", req, asMsgpack)
				require.Equal(t, first.Data, msg.Data, "%v msgpack=%v", req, asMsgpack)
			}
		}
	}
	require.EqualValues(t, 2, answered(), "both seats answered")
}

// TestSeat_MinSeqBounds: CONTRACT section 3, min_seq answers once applied and 504 exactly when it is
// not reached within wait_ms; wait_ms 0 and 10000 are its bounds, 10001 is a bad request.
func TestSeat_MinSeqBounds(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.load(prefixMesh(t))
	st, _ := h.startSeat(t.TempDir())
	h.waitCaughtUp(st)
	applied, _ := st.Store().Applied(provisioner.BucketApplied)
	require.Positive(t, applied)
	kv, err := h.js.KeyValue(context.Background(), provisioner.BucketApplied)
	require.NoError(t, err)
	for _, asMsgpack := range []bool{false, true} {
		for _, tc := range []struct {
			minSeq, waitMS any
			code           int
		}{
			{applied, nil, 200}, {applied, 0, 200}, {applied, 10000, 200}, {1, 10000, 200},
			{applied + 1, nil, 504}, {applied + 1, 0, 504}, {applied + 1, 30, 504},
			{applied, 10001, 400}, {applied, -1, 400}, {-1, 0, 400},
		} {
			req := map[string]any{"what": "applied", "min_seq": tc.minSeq, "wait_ms": tc.waitMS}
			a, err := h.askErr(req, asMsgpack)
			require.Equal(t, tc.code, verbCode(err), "%v msgpack=%v: %v", req, asMsgpack, err)
			if tc.code == 200 {
				require.GreaterOrEqual(t, a.AsOf, applied)
			}
		}
	}
	// A wait that a write ends (or that finds it written already): answered with the write in it.
	done := natstest.AskLater(h.nc, query.Subject, []byte(fmt.Sprintf(`{"what":"applied","node":"n9","min_seq":%d,"wait_ms":10000}`, applied+1)))
	seq, err := kv.Put(context.Background(), "n9.m", mp(t, "late"))
	require.NoError(t, err)
	require.Equal(t, applied+1, seq)
	got := <-done
	require.NoError(t, got.Err)
	require.Len(t, got.A.Rows, 1)
	require.Equal(t, "n9.m", got.A.Rows[0]["key"])
	require.GreaterOrEqual(t, got.A.AsOf, seq)
}

// TestSeat_RegistryRowsReadTheValue: CONTRACT section 3, a registry row carries module, bucket,
// key_shape and verb from the value (docs/decisions.md: each when present), and module narrows by the
// value's: also for a value that holds a field more, as a newer seat's table may (a rolling upgrade),
// or one field of another type, which the row leaves out alone.
func TestSeat_RegistryRowsReadTheValue(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	require.NoError(t, fixtures.CreateBuckets(ctx, h.js, provisioner.BucketRegistry, provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect))
	reg, err := h.js.KeyValue(ctx, provisioner.BucketRegistry)
	require.NoError(t, err)
	values := map[string]map[string]any{
		"config":    {"kind": "config", "module": "mesh-config", "bucket": "mesh-config_values", "key_shape": "<node>.<module>.<name>"},
		"secret":    {"kind": "secret", "module": "mesh-vault", "verb": "mesh-vault.secret", "since": "v2"},
		"consumers": {"kind": "consumers", "module": "mesh-vault", "verb": "mesh-vault.consumers", "replicas": 3},
		"port":      {"kind": "port", "module": "mesh-controller", "bucket": 7, "key_shape": "<node>.<module>"},
	}
	for k, v := range values {
		_, err := reg.Put(ctx, k, mp(t, v))
		require.NoError(t, err)
	}
	st, _ := h.startReadOnlySeat(t.TempDir())
	h.waitCaughtUp(st)
	for _, asMsgpack := range []bool{false, true} {
		rows, _, err := natstest.AskAll(h.nc, query.Subject, map[string]any{"what": "registry"}, asMsgpack)
		require.NoError(t, err)
		require.Len(t, rows, len(values))
		for _, row := range rows {
			kind := row["kind"].(string)
			want := map[string]any{"kind": kind}
			for _, f := range []string{"module", "bucket", "key_shape", "verb"} {
				if s, ok := values[kind][f].(string); ok {
					want[f] = s
				}
			}
			got := map[string]any{}
			for _, f := range []string{"kind", "module", "bucket", "key_shape", "verb"} {
				if v, ok := row[f]; ok {
					got[f] = v
				}
			}
			require.Equal(t, want, got, "msgpack=%v", asMsgpack)
		}
		rows, _, err = natstest.AskAll(h.nc, query.Subject, map[string]any{"what": "registry", "module": "mesh-vault"}, asMsgpack)
		require.NoError(t, err)
		var kinds []string
		for _, row := range rows {
			kinds = append(kinds, row["key"].(string))
		}
		require.Equal(t, []string{"consumers", "secret"}, kinds, "msgpack=%v", asMsgpack)
	}
}

// TestSeat_PageSizes: CONTRACT section 3, limit is rows per answer, 1000 by default and at most 10000:
// a walk of 2,500 rows is pages of 1000, 1000 and 500 by default, and one page at 10000.
func TestSeat_PageSizes(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	var ops []fixtures.Op
	for i := 0; i < 2500; i++ {
		key := fmt.Sprintf("n%04d.m", i)
		ops = append(ops, fixtures.Op{Bucket: provisioner.BucketApplied, Key: key, Op: provisioner.OpPut, Value: mp(t, i)})
	}
	h.load(ops)
	require.NoError(t, fixtures.CreateBuckets(context.Background(), h.js, provisioner.BucketNeeds, provisioner.BucketCollect))
	st, _ := h.startSeat(t.TempDir())
	h.waitCaughtUp(st)
	for _, asMsgpack := range []bool{false, true} {
		for _, tc := range []struct {
			limit any
			pages []int
		}{{nil, []int{1000, 1000, 500}}, {10000, []int{2500}}, {1000, []int{1000, 1000, 500}}, {2499, []int{2499, 1}}, {2500, []int{2500}}} {
			req := map[string]any{"what": "applied", "module": "m", "limit": tc.limit}
			var pages []int
			var keys []string
			for {
				a, err := h.askErr(req, asMsgpack)
				require.NoError(t, err)
				pages = append(pages, len(a.Rows))
				for _, row := range a.Rows {
					keys = append(keys, row["key"].(string))
				}
				if a.Next == "" {
					break
				}
				req["after"] = a.Next
			}
			require.Equal(t, tc.pages, pages, "limit %v msgpack=%v", tc.limit, asMsgpack)
			require.Len(t, keys, 2500)
			for i, k := range keys {
				require.Equal(t, fmt.Sprintf("n%04d.m", i), k)
			}
		}
	}
}

// TestSeat_RegistryLossIsWrittenAgainAtOnce: CONTRACT section 4, a kind of the table deleted by someone
// else is written again; the seat does it as soon as its projection sees the loss, not at the next
// --registry-interval (an hour here), so the needs of that kind are unanswered for moments only. An
// edit or a stray waits for the pass.
func TestSeat_RegistryLossIsWrittenAgainAtOnce(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	require.NoError(t, fixtures.CreateBuckets(ctx, h.js, provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect))
	needs, err := h.js.KeyValue(ctx, provisioner.BucketNeeds)
	require.NoError(t, err)
	for _, kind := range []string{"secret", "port", "dir", "config"} {
		_, err := needs.Put(ctx, "n1.m."+kind+".x", mp(t, kind))
		require.NoError(t, err)
	}
	st, _ := h.startSeat(t.TempDir()) // the writer's interval: an hour
	h.waitCaughtUp(st)
	require.Empty(t, h.unanswered())
	reg, err := h.js.KeyValue(ctx, provisioner.BucketRegistry)
	require.NoError(t, err)
	_, writes := st.Registry.Stats()

	require.NoError(t, reg.Delete(ctx, "secret"))
	require.NoError(t, reg.Purge(ctx, "port"))
	h.rawMsg(provisioner.BucketRegistry, "dir", nats.Header{jetstream.MarkerReasonHeader: {"MaxAge"}}, nil)
	edited, err := reg.Put(ctx, "config", mp(t, "edited by hand"))
	require.NoError(t, err)
	_, err = reg.Put(ctx, "gadget", mp(t, "a stray"))
	require.NoError(t, err)
	natstest.CheckFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		for _, kind := range []string{"secret", "port", "dir"} {
			e, err := reg.Get(ctx, kind)
			if err != nil {
				return fmt.Errorf("%s: %w", kind, err)
			}
			want, _ := provisioner.Registry.Lookup(kind)
			if !want.Matches(e.Value()) {
				return fmt.Errorf("%s: %x", kind, e.Value())
			}
		}
		return nil
	})
	h.waitCaughtUp(st)
	require.Empty(t, h.unanswered(), "every need answered again")
	_, after := st.Registry.Stats()
	require.Equal(t, writes+3, after, "one write per lost kind")
	e, err := reg.Get(ctx, "config")
	require.NoError(t, err)
	require.Equal(t, edited, e.Revision(), "an edit waits for the pass")
	_, err = reg.Get(ctx, "gadget")
	require.NoError(t, err, "a stray waits for the pass")
}

// TestSeat_TwoSeatsStartingAtOnce: CONTRACT section 4, seats starting together on a mesh without a
// registry write each kind once between them, keep it at one revision, and put back a lost kind with
// one write between them.
func TestSeat_TwoSeatsStartingAtOnce(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	require.NoError(t, fixtures.CreateBuckets(ctx, h.js, provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect))
	seats := make([]*seat.Seat, 2)
	var wg sync.WaitGroup
	gate := make(chan struct{})
	for i := range seats {
		nc, js := natstest.Connect(t, h.url)
		db, err := store.OpenState(t.TempDir(), store.Options{})
		require.NoError(t, err)
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-gate
			st, err := seat.Start(ctx, nc, js, db, seat.Config{WriteRegistry: true, Projector: projector.Options{Poll: 20 * time.Millisecond}})
			if err != nil {
				t.Error(err)
				return
			}
			seats[i] = st
		}()
		t.Cleanup(func() {
			if seats[i] != nil {
				require.NoError(t, seats[i].Stop())
			}
			require.NoError(t, db.Close())
		})
	}
	close(gate)
	wg.Wait()
	require.NotContains(t, seats, (*seat.Seat)(nil))
	revisions := func() map[string]uint64 {
		stream, err := h.js.Stream(ctx, provisioner.StreamName(provisioner.BucketRegistry))
		require.NoError(t, err)
		prefix := provisioner.SubjectPrefix(provisioner.BucketRegistry)
		info, err := stream.Info(ctx, jetstream.WithSubjectFilter(prefix+">"))
		require.NoError(t, err)
		out := map[string]uint64{}
		for subj, n := range info.State.Subjects {
			out[strings.TrimPrefix(subj, prefix)] = n
		}
		return out
	}
	for _, st := range seats {
		h.waitCaughtUp(st)
		natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
			if p, _ := st.Registry.Stats(); p == 0 {
				return fmt.Errorf("no pass yet")
			}
			return nil
		})
	}
	want := map[string]uint64{}
	for _, e := range provisioner.Registry.Entries {
		want[e.Kind] = 1
	}
	require.Equal(t, want, revisions(), "each kind written once between them")
	writes := func() int {
		n := 0
		for _, st := range seats {
			_, w := st.Registry.Stats()
			n += w
		}
		return n
	}
	require.Equal(t, len(want), writes())

	reg, err := h.js.KeyValue(ctx, provisioner.BucketRegistry)
	require.NoError(t, err)
	require.NoError(t, reg.Delete(ctx, "machine"))
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		if _, err := reg.Get(ctx, "machine"); err != nil {
			return err
		}
		return nil
	})
	for _, st := range seats {
		h.waitCaughtUp(st)
	}
	want["machine"] = 3 // written, deleted, written again once
	require.Equal(t, want, revisions())
	require.Equal(t, len(want)+1, writes())

	// A seat restarted, on a state dir of its own or a fresh one, writes nothing: no kind gets a
	// new revision.
	require.NoError(t, seats[0].Stop())
	st, _ := h.startSeat(t.TempDir()) // waits for its first pass
	h.waitCaughtUp(st)
	_, n := st.Registry.Stats()
	require.Zero(t, n)
	require.Equal(t, want, revisions())
}
