package query

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/micro"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
)

// TestReadAhead_WalksUnderWritesAnswerAsWithout walks modules through the verb, several askers at once
// (two of the same module in the same format, one in the other format, one of another module, one of a
// node), while commits land between their pages at random: needs put and deleted behind and ahead of
// the cursors, and registry entries that raise and clear the needs' unanswered-kind anomalies. Each
// page the verb answers, with read-ahead on, is compared byte for byte with the answer a server
// without read-ahead gives at that moment (no commit lands between the two): pages written ahead are
// answered only while they are what the request would get, and the walks' next cursors are those of
// a walk without read-ahead. The commits touch the walked modules, a module no asker walks, only
// out-of-shape keys (the anomalies every page without node carries), or the registry; some are
// bursts, some come after a quiet spell, so that walks go cold (no page written ahead) and warm again.
// READAHEAD_SEED=<n> runs one seed again; -count=N runs N seeds.
func TestReadAhead_WalksUnderWritesAnswerAsWithout(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	if v := os.Getenv("READAHEAD_SEED"); v != "" {
		n, err := strconv.ParseUint(v, 10, 64)
		require.NoError(t, err)
		seed = n
	}
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 1))
	db := smallStore(t)
	kinds := []string{provisioner.Registry.Entries[0].Kind, provisioner.Registry.Entries[1].Kind}
	var needSeq, regSeq uint64
	need := func(node, module int, kind string, del bool) provisioner.Message {
		needSeq++
		m := provisioner.Message{Seq: needSeq, Time: int64(needSeq) * 1e9, Key: fmt.Sprintf("n%02d.m%d.%s.a", node, module, kind), Op: provisioner.OpPut, Value: []byte{byte(needSeq % 100)}}
		if del {
			m.Op, m.Value = provisioner.OpDelete, nil
		}
		return m
	}
	var msgs []provisioner.Message
	for node := 0; node < 40; node++ {
		for module := 1; module <= 3; module++ {
			msgs = append(msgs, need(node, module, kinds[node%2], false))
		}
	}
	require.NoError(t, db.Apply(provisioner.BucketNeeds, msgs, 0, false))
	db.SetSynced(provisioner.BucketNeeds, true)

	ns := natstest.RunServer(t)
	snc, _ := natstest.Connect(t, ns.ClientURL())
	s := NewServer(StoreReader(db), Options{Workers: 2})
	require.NoError(t, s.Start(snc, nil))
	t.Cleanup(s.Stop)
	fresh := NewServer(StoreReader(db), Options{NoReadAhead: true})
	nc, _ := natstest.Connect(t, ns.ClientURL())

	// Commits take frozen for writing; an asker holds it for reading from its request to the answer
	// it compares with, so that no commit lands between the two.
	var frozen sync.RWMutex
	var commits atomic.Int64
	commit := func() {
		frozen.Lock()
		defer frozen.Unlock()
		var err error
		switch rng.IntN(7) {
		case 1: // a module no asker walks
			var ms []provisioner.Message
			for range 1 + rng.IntN(3) {
				ms = append(ms, need(rng.IntN(45), 3, kinds[rng.IntN(2)], rng.IntN(4) == 0))
			}
			err = db.Apply(provisioner.BucketNeeds, ms, 0, false)
		case 2: // out-of-shape keys only: an anomaly comes, or goes with its key's delete
			needSeq++
			m := provisioner.Message{Seq: needSeq, Time: int64(needSeq) * 1e9, Key: fmt.Sprintf("n%02d.m%d.bad", rng.IntN(45), 1+rng.IntN(3)), Op: provisioner.OpPut, Value: []byte{0x01}}
			if rng.IntN(2) == 0 {
				m.Op, m.Value = provisioner.OpDelete, nil
			}
			err = db.Apply(provisioner.BucketNeeds, []provisioner.Message{m}, 0, false)
		case 0: // a registry entry goes or comes back: the needs of its kind are unanswered, or no more
			k := provisioner.Registry.Entries[rng.IntN(2)]
			regSeq++
			m := provisioner.Message{Seq: regSeq, Time: int64(regSeq) * 1e9, Key: k.Kind, Op: provisioner.OpPut, Value: k.Value()}
			if rng.IntN(2) == 0 {
				m.Op, m.Value = provisioner.OpDelete, nil
			}
			err = db.Apply(provisioner.BucketRegistry, []provisioner.Message{m}, 0, false)
		default:
			var ms []provisioner.Message
			for range 1 + rng.IntN(3) {
				ms = append(ms, need(rng.IntN(45), 1+rng.IntN(2), kinds[rng.IntN(2)], rng.IntN(4) == 0))
			}
			err = db.Apply(provisioner.BucketNeeds, ms, 0, false)
		}
		require.NoError(t, err)
		commits.Add(1)
	}

	type asker struct {
		req     map[string]any
		msgpack bool
	}
	askers := []asker{
		{map[string]any{"what": "needs", "module": "m1", "limit": 3}, true},
		{map[string]any{"what": "needs", "module": "m1", "limit": 3}, true},
		{map[string]any{"what": "needs", "module": "m1", "limit": 3}, false},
		{map[string]any{"what": "needs", "module": "m2", "limit": 4}, true},
		{map[string]any{"what": "needs", "node": "n07", "limit": 1}, false},
	}
	walks := 40
	if raceEnabled || testing.Short() {
		walks = 6 // a walk is several times slower under the race detector
	}
	var pages, restarts atomic.Int64
	var wg sync.WaitGroup
	ask := func(a asker, after string) (string, error) {
		frozen.RLock()
		defer frozen.RUnlock()
		r := map[string]any{}
		for k, v := range a.req {
			r[k] = v
		}
		if after != "" {
			r["after"] = after
		}
		body, err := natstest.Body(r, a.msgpack)
		if err != nil {
			return "", err
		}
		msg, err := nc.Request(Subject, body, 30*time.Second)
		if err != nil {
			return "", err
		}
		req, format, err := DecodeRequest(body)
		if err != nil {
			return "", err
		}
		want := &Encoder{}
		werr := fresh.Answer(context.Background(), &req, format, want)
		if code := msg.Header.Get(micro.ErrorCodeHeader); code != "" || werr != nil {
			if code != strconv.Itoa(Code(werr)) {
				return "", fmt.Errorf("after %q: the verb answered code %q (%s), without read-ahead %v", after, code, msg.Header.Get(micro.ErrorHeader), werr)
			}
			restarts.Add(1)
			return "", nil // the cursor's row went: start again
		}
		if got := msg.Data; !bytes.Equal(want.Bytes(), got) {
			i := 0
			for i < min(len(got), len(want.Bytes())) && got[i] == want.Bytes()[i] {
				i++
			}
			from := max(0, i-40)
			return "", fmt.Errorf("after %q: the verb answered %d bytes, without read-ahead %d; from byte %d:\n%q\nwithout read-ahead:\n%q",
				after, len(got), len(want.Bytes()), from, got[from:min(len(got), i+80)], want.Bytes()[from:min(len(want.Bytes()), i+80)])
		}
		pages.Add(1)
		return want.next, nil
	}
	for _, a := range askers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range walks {
				after := ""
				for {
					next, err := ask(a, after)
					if err != nil {
						t.Error(err)
						return
					}
					if next == "" {
						break
					}
					after = next
				}
			}
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	for running := true; running; {
		select {
		case <-done:
			running = false
		default:
			commit()
			// Let some pages be taken between commits, and some be written ahead across one; now and
			// then a quiet spell of several pages, in which cold walks are read ahead again.
			pause := time.Duration(rng.IntN(500)) * time.Microsecond
			if rng.IntN(2) == 0 {
				pause = 0
			} else if rng.IntN(20) == 0 {
				pause = time.Duration(5+rng.IntN(20)) * time.Millisecond
			}
			select {
			case <-done:
			case <-time.After(pause):
			}
		}
	}
	taken := s.ahead.taken.Load()
	t.Logf("%d pages, %d walks started again, %d commits; %d pages written ahead, %d answered from them", pages.Load(), restarts.Load(), commits.Load(), s.ahead.written.Load(), taken)
	require.NotZero(t, taken, "no page was answered from read-ahead: the test proves nothing")
}

// TestReadAhead_QuietWalksAfterACommitAreReadAhead: a module walked through the verb, a commit landing
// while a page written ahead waits for its asker (the walk goes cold), then walked again and again on a
// quiet bucket: the walk warms again, and its pages are answered from read-ahead, as on a mesh that
// never saw the commit (the bench's module walks). Each page is checked against the answer without
// read-ahead.
func TestReadAhead_QuietWalksAfterACommitAreReadAhead(t *testing.T) {
	db := smallStore(t)
	kind := provisioner.Registry.Entries[0].Kind
	var msgs []provisioner.Message
	for i := 0; i < 20; i++ {
		msgs = append(msgs, provisioner.Message{Seq: uint64(i + 1), Time: int64(i+1) * 1e9, Key: fmt.Sprintf("n%02d.m1.%s.a", i, kind), Op: provisioner.OpPut, Value: []byte{0x01}})
	}
	require.NoError(t, db.Apply(provisioner.BucketNeeds, msgs, 0, false))
	db.SetSynced(provisioner.BucketNeeds, true)
	ns := natstest.RunServer(t)
	snc, _ := natstest.Connect(t, ns.ClientURL())
	s := NewServer(StoreReader(db), Options{Workers: 2})
	require.NoError(t, s.Start(snc, nil))
	t.Cleanup(s.Stop)
	fresh := NewServer(StoreReader(db), Options{NoReadAhead: true})
	nc, _ := natstest.Connect(t, ns.ClientURL())

	// walk walks module m1, 5 pages of 4, and runs between after the page it is given.
	walk := func(between func(page int)) {
		t.Helper()
		after := ""
		for page := 0; ; page++ {
			r := map[string]any{"what": "needs", "module": "m1", "limit": 4}
			if after != "" {
				r["after"] = after
			}
			body, err := natstest.Body(r, true)
			require.NoError(t, err)
			msg, err := nc.Request(Subject, body, 30*time.Second)
			require.NoError(t, err)
			req, format, err := DecodeRequest(body)
			require.NoError(t, err)
			want := &Encoder{}
			require.NoError(t, fresh.Answer(context.Background(), &req, format, want))
			require.Equal(t, string(want.Bytes()), string(msg.Data), "page %d", page)
			if want.next == "" {
				return
			}
			after = want.next
			if between != nil {
				between(page)
			}
		}
	}
	walk(func(page int) {
		if page != 1 {
			return
		}
		// The page after this one is written ahead (or being written); a commit to another module
		// makes it stale.
		natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
			if s.Ahead() == 0 {
				return errors.New("no page written ahead")
			}
			return nil
		})
		require.NoError(t, db.Apply(provisioner.BucketNeeds, []provisioner.Message{{Seq: 21, Time: 21e9, Key: "n00.m2." + kind + ".a", Op: provisioner.OpPut, Value: []byte{0x01}}}, 0, false))
	})
	taken := s.ahead.taken.Load()
	for range 10 {
		walk(nil)
	}
	t.Logf("%d of the quiet walks' 40 later pages answered from read-ahead, %d written ahead in all", s.ahead.taken.Load()-taken, s.ahead.written.Load())
	// 40 later pages: a walk that stayed cold would have none of them written ahead.
	require.Greater(t, s.ahead.taken.Load()-taken, int64(10), "pages of the quiet walks answered from read-ahead")
}
