package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/replay"
	"github.com/novox/mesh-provisioner/seat"
	"github.com/novox/mesh-provisioner/store"
)

// The differential test of a node's state and diff read from the streams (replay.NodeFromNATS, the
// node's own subjects): seeded histories of puts, deletes, purges, TTL markers, out-of-shape keys of
// the node and of others, values that are not MessagePack, registry changes between needs, rollups of
// one of the node's keys and of the whole stream, and keys written past the buckets' history; every
// point (each sequence, each message's time and a nanosecond either side, before the stream) asked of
// the node's log, of a log of the whole bucket (FromNATS) and of an archive of the streams, and with
// nothing removed of the seat's own log too, whose answers (rows, anomalies, as_of, or the refusal)
// must be the same bytes.

// nodeMsg is a message of the drawn history: a fmsg, with a rollup header when set.
type nodeMsg struct {
	fmsg
	rollup string // "sub" or "all"
}

func (m nodeMsg) natsMsg() *nats.Msg {
	msg := m.fmsg.natsMsg()
	if m.rollup != "" {
		msg.Header.Set("Nats-Rollup", m.rollup)
	}
	return msg
}

// nodeKeys are each bucket's keys: of n1 (in shape, and out of it: n1 alone, too few or too many
// tokens), of n10 (a prefix of n1's name, not n1's), of n2.
var nodeKeys = map[string][]string{
	provisioner.BucketNeeds: {"n1.m1.config.a", "n1.m1.zzkind.b", "n1.m2.port.x", "n1", "n1.m1", "n1.a.b.c.d",
		"n10.m1.config.a", "n2.m1.config.a", "n2.m1.zzkind.a", "n2"},
	provisioner.BucketApplied: {"n1.m1", "n1.m2", "n1", "n1.m1.x", "n10.m1", "n2.m1", "n2"},
	provisioner.BucketCollect: {"n1.shell=3Azsh.m1", "n1.plain.m2", "n1.c", "n1", "n10.plain.m1", "n2.a=2Eb.m1", "n2.x.y.z"},
}

// drawNodeHistory draws n messages over the three buckets and the registry. With removals, keys are
// purged and rolled up (one of n1's keys, and the whole stream once per bucket halfway); without,
// nothing is removed from the streams (no purge, no rollup; the history limit is not reached).
func drawNodeHistory(r *rand.Rand, n int, removals bool) []nodeMsg {
	buckets := []string{provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect}
	var out []nodeMsg
	rolledAll := map[string]bool{}
	for len(out) < n {
		if r.IntN(12) == 0 {
			// The registry: a kind answered, or no longer, between needs.
			kind := []string{"config", "port", "zzkind"}[r.IntN(3)]
			m := nodeMsg{fmsg: fmsg{bucket: provisioner.BucketRegistry, key: kind, op: provisioner.OpPut}}
			if r.IntN(3) == 0 {
				m.op = provisioner.OpDelete
			} else {
				v, err := msgpack.Marshal(map[string]any{"kind": kind, "module": "m"})
				if err != nil {
					panic(err)
				}
				m.value = v
			}
			out = append(out, m)
			continue
		}
		b := buckets[r.IntN(len(buckets))]
		keys := nodeKeys[b]
		m := nodeMsg{fmsg: fmsg{bucket: b, key: keys[r.IntN(len(keys))], op: provisioner.OpPut}}
		switch x := r.IntN(20); {
		case x < 2:
			m.op = provisioner.OpDelete
		case x < 3 && removals:
			m.op = provisioner.OpPurge
		case x < 4:
			m.op = provisioner.OpExpire
		case x < 6:
			m.value = fmNotMsgpack[r.IntN(len(fmNotMsgpack))]
		}
		if m.op == provisioner.OpPut && m.value == nil {
			v, err := msgpack.Marshal(map[string]any{"n": r.IntN(1000)})
			if err != nil {
				panic(err)
			}
			m.value = v
		}
		if removals && m.op == provisioner.OpPut {
			switch {
			case !rolledAll[b] && len(out) > n/2:
				m.rollup, rolledAll[b] = "all", true
			case r.IntN(15) == 0:
				m.rollup = "sub"
			case r.IntN(40) == 0:
				// A rollup of n1's keys, written on a wildcard subject: a key of n1 to the store
				// (an anomaly), and every key it matches removed.
				m.key, m.rollup = []string{"n1.>", "n1.*"}[r.IntN(2)], "sub"
			}
		}
		out = append(out, m)
	}
	if removals {
		// Last, what the streams' last points answer: a key of n1 written on a wildcard subject, and
		// n1's keys rolled up by one (the wildcard key too), then written again.
		put := func(b, key, rollup string) {
			v, err := msgpack.Marshal(map[string]any{"n": len(out)})
			if err != nil {
				panic(err)
			}
			out = append(out, nodeMsg{fmsg: fmsg{bucket: b, key: key, op: provisioner.OpPut, value: v}, rollup: rollup})
		}
		put(provisioner.BucketApplied, "n1.*", "")
		put(provisioner.BucketNeeds, "n1.*", "")
		put(provisioner.BucketNeeds, "n1.>", "sub")
		put(provisioner.BucketCollect, "n1.>", "sub")
		put(provisioner.BucketCollect, "n1.plain.m2", "")
	}
	return out
}

func TestReplayNode_SameAsTheWholeStream(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name       string
		removals   bool
		history    uint8
		endRemoved bool
	}{
		{"nothing removed", false, 64, false},
		{"removed", true, 4, false},
		// Each stream's last message, of n1, removed before it was read (its subject purged).
		{"end removed", false, 64, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			checkNodeReads(t, tc.removals, tc.history, tc.endRemoved)
		})
	}
}

func checkNodeReads(t *testing.T, removals bool, history uint8, endRemoved bool) {
	ns := natstest.RunServer(t)
	url := ns.ClientURL()
	_, js := natstest.Connect(t, url)
	ctx := context.Background()
	streams := map[string]jetstream.Stream{}
	created := map[string]time.Time{}
	for _, b := range []string{provisioner.BucketRegistry, provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect} {
		_, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: b, History: history})
		require.NoError(t, err)
		s, err := js.Stream(ctx, provisioner.StreamName(b))
		require.NoError(t, err)
		// A subject added to the stream by hand: its messages are no key of the bucket (foreign), the
		// store logs none of them, and a time among them resolves to the bucket's message before.
		cfg := s.CachedInfo().Config
		cfg.Subjects = append(cfg.Subjects, "extra."+b+".>")
		_, err = js.UpdateStream(ctx, cfg)
		require.NoError(t, err)
		streams[b] = s
		created[b] = s.CachedInfo().Created
	}
	r := rand.New(rand.NewPCG(93, 2026))
	msgs := drawNodeHistory(r, 240, removals)
	for i := range msgs {
		ack, err := js.PublishMsg(ctx, msgs[i].natsMsg())
		require.NoError(t, err)
		msgs[i].seq, msgs[i].time = ack.Sequence, time.Now()
		raw, err := streams[msgs[i].bucket].GetMsg(ctx, ack.Sequence)
		if errors.Is(err, jetstream.ErrMsgNotFound) && msgs[i].rollup != "" {
			continue // a rollup on a wildcard subject may remove itself with what it matches
		}
		require.NoError(t, err)
		msgs[i].time = raw.Time
		if i%7 == 3 {
			// A foreign message after it: the times between the two resolve to it, not the foreign.
			_, err := js.Publish(ctx, "extra."+msgs[i].bucket+".x", []byte{0x01})
			require.NoError(t, err)
		}
	}

	for b := range streams {
		// Each stream's last message foreign: the log's last is the bucket's message before it.
		_, err := js.Publish(ctx, "extra."+b+".last", []byte{0x01})
		require.NoError(t, err)
	}

	if endRemoved {
		for b, key := range map[string]string{provisioner.BucketNeeds: "n1.m9.config.tail", provisioner.BucketApplied: "n1.m9",
			provisioner.BucketCollect: "n1.tail.m9"} {
			subject := provisioner.SubjectPrefix(b) + key
			_, err := js.Publish(ctx, subject, []byte{0x01})
			require.NoError(t, err)
			require.NoError(t, streams[b].Purge(ctx, jetstream.WithPurgeSubject(subject)))
		}
	}

	// With nothing removed after the seat read it (it starts after the ends' purges), the seat's own
	// log (--state) holds what the streams hold: it answers the same bytes too, and refuses alike the
	// points among a stream's last messages removed before it read them (projector.tailRemoved).
	var stateLog *replay.Log
	if !removals {
		dir := filepath.Join(t.TempDir(), "state")
		db, err := store.OpenState(dir, store.Options{})
		require.NoError(t, err)
		snc, sjs := natstest.Connect(t, url)
		st, err := seat.Start(ctx, snc, sjs, db, seat.Config{Projector: projector.Options{Poll: 20 * time.Millisecond}})
		require.NoError(t, err)
		natstest.CheckFor(t, 30*time.Second, 20*time.Millisecond, func() error {
			for b, s := range streams {
				info, err := s.Info(ctx)
				if err != nil {
					return err
				}
				if seq, _ := db.Applied(b); seq < info.State.LastSeq {
					if end, ok := db.RemovedEnd(b); !ok || end != info.State.LastSeq {
						return fmt.Errorf("%s applied %d of %d, removed end %d", b, seq, info.State.LastSeq, end)
					}
				}
			}
			return nil
		})
		require.NoError(t, st.Stop())
		require.NoError(t, db.Close())
		stateLog, err = replay.OpenState(dir)
		require.NoError(t, err)
		defer stateLog.Close()
	}

	archive := filepath.Join(t.TempDir(), "nats.mph")
	_, err := replay.ExportNATS(ctx, js, nil, archive, "test", nil)
	require.NoError(t, err)
	fromArchive, err := replay.FromArchive(ctx, archive, nil)
	require.NoError(t, err)
	defer fromArchive.Close()

	seen := map[string]int{}
	for _, b := range []string{provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect} {
		shape, _ := provisioner.ShapeOf(b)
		what := string(shape.What)
		buckets := []string{b}
		if b == provisioner.BucketNeeds {
			buckets = append(buckets, provisioner.BucketRegistry)
		}
		whole, err := replay.FromNATS(ctx, js, buckets, "nats", nil)
		require.NoError(t, err)
		defer whole.Close()
		info, err := streams[b].Info(ctx)
		require.NoError(t, err)
		if removals || endRemoved {
			require.Less(t, info.State.Msgs, info.State.LastSeq, "%s: the stream removed messages", b)
		} else {
			require.Equal(t, info.State.Msgs, info.State.LastSeq, "%s: the stream removed nothing", b)
		}

		// Every point of the bucket.
		var points []string
		for n := uint64(0); n <= info.State.LastSeq+2; n++ {
			points = append(points, fmt.Sprintf("seq:%d", n))
		}
		points = append(points, created[b].Add(-time.Second).Format(time.RFC3339Nano))
		for _, m := range msgs {
			// Every message's time, of every bucket: a time between two messages of other nodes, or
			// of other buckets.
			for _, d := range []time.Duration{-time.Nanosecond, 0, time.Nanosecond} {
				points = append(points, m.time.Add(d).UTC().Format(time.RFC3339Nano))
			}
		}
		// Under the race detector, n1 asks every other point and each other node every eighth (each its
		// own share; n1's keys are the only wildcard ones the draw puts) and a tenth of the diffs: the
		// whole sweep, tens of thousands of reads on one goroutine, each several times slower in a race
		// build (which turns Pebble's invariant checks on), ran past 11 minutes and took make race's
		// package over its 15 minute timeout on a loaded machine; the race detector finds nothing more
		// in a read's thousandth repetition than in its first.
		diffs := 150
		if raceEnabled {
			diffs = 15
		}
		for ni, node := range []string{"n1", "n10", "n2", "n3"} {
			stride := 1
			if raceEnabled {
				stride = 8
				if node == "n1" {
					stride = 2
				}
			}
			nodeLog, err := replay.NodeFromNATS(ctx, js, b, node, "nats", nil)
			require.NoError(t, err)
			defer nodeLog.Close()
			req := query.Request{What: what, Node: node}
			state := func(l *replay.Log, at string, archive bool) string {
				var out bytes.Buffer
				c := &ReplayCommand{Stdout: &out, Stderr: io.Discard, jsonOut: true, at: at}
				if archive {
					c.archive = "x"
				}
				if err := c.runState(ctx, l, req); err != nil {
					return "error " + err.Error()
				}
				return out.String()
			}
			var answered []string // the points the streams rebuild
			for pi, at := range points {
				if pi%stride != ni%stride {
					continue
				}
				got := state(nodeLog, at, false)
				require.Equal(t, state(whole, at, false), got, "%s --node %s --at %s", what, node, at)
				fromArch := state(fromArchive, at, true)
				if stateLog != nil {
					require.Equal(t, fromArch, state(stateLog, at, true), "%s --node %s --at %s: --state", what, node, at)
				}
				if bytes.HasPrefix([]byte(got), []byte("error ")) {
					require.Contains(t, got, fromArch, "%s --node %s --at %s: archive", what, node, at)
					seen["410"]++
				} else {
					require.Equal(t, fromArch, got, "%s --node %s --at %s: archive", what, node, at)
					answered = append(answered, at)
					if bytes.Contains([]byte(got), []byte(`"rows":[{`)) {
						seen["rows"]++
					}
					if bytes.Contains([]byte(got), []byte(`"anomalies":[{`)) {
						seen["anomalies"]++
					}
					if bytes.Contains([]byte(got), []byte(`"key":"n1.\u003e"`)) || bytes.Contains([]byte(got), []byte(`"key":"n1.*"`)) {
						seen["wildcard"]++
					}
				}
			}
			// Diffs between random pairs of points, mostly of those the streams rebuild.
			for i := 0; i < diffs; i++ {
				from, to := points[r.IntN(len(points))], points[r.IntN(len(points))]
				if i%3 != 0 && len(answered) > 0 {
					from, to = answered[r.IntN(len(answered))], answered[r.IntN(len(answered))]
				}
				pf, err := replay.ParsePoint(from)
				require.NoError(t, err)
				pt, err := replay.ParsePoint(to)
				require.NoError(t, err)
				diff := func(l *replay.Log) string {
					var out bytes.Buffer
					c := &ReplayCommand{Stdout: &out, Stderr: io.Discard, jsonOut: true, from: from, to: to}
					if err := c.runDiff(ctx, l, req, pf, pt); err != nil {
						return "error " + err.Error()
					}
					return out.String()
				}
				got := diff(nodeLog)
				require.Equal(t, diff(whole), got, "%s --node %s --from %s --to %s", what, node, from, to)
				if stateLog != nil {
					require.Equal(t, diff(fromArchive), diff(stateLog), "%s --node %s --from %s --to %s: --state", what, node, from, to)
				}
				if !bytes.HasPrefix([]byte(got), []byte("error ")) {
					require.Equal(t, diff(fromArchive), got, "%s --node %s --from %s --to %s: archive", what, node, from, to)
					seen["diff"]++
				}
			}
		}
	}
	// The draw reached what it is for.
	require.NotZero(t, seen["rows"], "%v", seen)
	require.NotZero(t, seen["anomalies"], "%v", seen)
	require.NotZero(t, seen["diff"], "%v", seen)
	if removals {
		require.NotZero(t, seen["wildcard"], "%v", seen)
	}
	if removals || endRemoved {
		require.NotZero(t, seen["410"], "%v", seen)
	}
	t.Logf("%v", seen)

	// The command reads the node's subjects, and prints what the whole read prints.
	for _, at := range []string{"seq:3", msgs[len(msgs)/3].time.Format(time.RFC3339Nano), fmt.Sprintf("seq:%d", msgs[len(msgs)-1].seq)} {
		whole, err := replay.FromNATS(ctx, js, []string{provisioner.BucketNeeds, provisioner.BucketRegistry}, "nats", nil)
		require.NoError(t, err)
		var want, got bytes.Buffer
		c := &ReplayCommand{Stdout: &want, Stderr: io.Discard, jsonOut: true, at: at}
		werr := c.runState(ctx, whole, query.Request{What: "needs", Node: "n1"})
		whole.Close()
		err = (&ReplayCommand{Stdout: &got, Stderr: io.Discard}).Run(ctx, []string{"state", "needs", "--node", "n1", "--at", at, "--nats", url, "--json"})
		if werr != nil {
			require.EqualError(t, err, werr.Error(), at)
			continue
		}
		require.NoError(t, err, at)
		require.Equal(t, want.String(), got.String(), at)
	}
}
