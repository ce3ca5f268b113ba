package registry_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/registry"
)

// contractTable is CONTRACT section 4 as a reader decodes the bucket: each kind's value, a map of kind,
// module, and either bucket and key_shape, or verb. Written out here, not taken from the table the
// writer writes, so that a wrong table fails.
var contractTable = map[string]map[string]any{
	"config":       {"kind": "config", "module": "mesh-config", "bucket": "mesh-config_values", "key_shape": "<node>.<module>.<name>"},
	"secret":       {"kind": "secret", "module": "mesh-vault", "verb": "mesh-vault.secret"},
	"bound":        {"kind": "bound", "module": "<provider-module>", "bucket": "<provider-module>_bound", "key_shape": "<node>.<module>.<provision>[.<local>]"},
	"consumers":    {"kind": "consumers", "module": "mesh-vault", "verb": "mesh-vault.consumers"},
	"collected":    {"kind": "collected", "module": "mesh-provisioner", "bucket": "mesh-provisioner_collect", "key_shape": "<node>.<collection>.<contributor>"},
	"shell":        {"kind": "shell", "module": "mesh-provisioner", "bucket": "mesh-provisioner_collect", "key_shape": "<node>.<collection>.<contributor>"},
	"environment":  {"kind": "environment", "module": "mesh-provisioner", "bucket": "mesh-provisioner_collect", "key_shape": "<node>.<collection>.<contributor>"},
	"contribution": {"kind": "contribution", "module": "mesh-provisioner", "bucket": "mesh-provisioner_collect", "key_shape": "<node>.<collection>.<contributor>"},
	"dir":          {"kind": "dir", "module": "mesh-controller", "bucket": "mesh-controller_assignments", "key_shape": "<node>.<module>"},
	"access":       {"kind": "access", "module": "mesh-controller", "bucket": "mesh-controller_assignments", "key_shape": "<node>.<module>"},
	"port":         {"kind": "port", "module": "mesh-controller", "bucket": "mesh-controller_assignments", "key_shape": "<node>.<module>"},
	"seat":         {"kind": "seat", "module": "mesh-controller", "bucket": "mesh-controller_assignments", "key_shape": "<node>.<module>"},
	"machine":      {"kind": "machine", "module": "mesh-controller", "bucket": "mesh-controller_assignments", "key_shape": "<node>.<module>"},
}

const interval = 50 * time.Millisecond

type stored struct {
	value []byte
	rev   uint64
}

// live reads the last message of every key of the registry's stream, leaving out deleted keys: what a
// node client reads, including keys the KV API cannot name.
func live(t *testing.T, js jetstream.JetStream) map[string]stored {
	t.Helper()
	ctx := context.Background()
	stream, err := js.Stream(ctx, provisioner.StreamName(provisioner.BucketRegistry))
	require.NoError(t, err)
	prefix := provisioner.SubjectPrefix(provisioner.BucketRegistry)
	out := map[string]stored{}
	for k := range messages(t, js) {
		m, err := stream.GetLastMsgForSubject(ctx, prefix+k)
		require.NoError(t, err)
		if provisioner.OpOfHeaders(m.Header) != provisioner.OpPut {
			continue // removed, as the projection reads it
		}
		out[k] = stored{value: m.Data, rev: m.Sequence}
	}
	return out
}

// equalsContract says how the bucket differs from the contract's table, or nil.
func equalsContract(t *testing.T, js jetstream.JetStream) error {
	t.Helper()
	got := live(t, js)
	for k := range got {
		if _, ok := contractTable[k]; !ok {
			return fmt.Errorf("stray key %q is still there", k)
		}
	}
	for kind, want := range contractTable {
		s, ok := got[kind]
		if !ok {
			return fmt.Errorf("kind %q is missing", kind)
		}
		var m map[string]any
		rd := bytes.NewReader(s.value)
		if err := msgpack.NewDecoder(rd).Decode(&m); err != nil || rd.Len() > 0 {
			return fmt.Errorf("kind %q: value %x is not one MessagePack map", kind, s.value)
		}
		if fmt.Sprint(m) != fmt.Sprint(want) {
			return fmt.Errorf("kind %q: value %v, want %v", kind, m, want)
		}
	}
	return nil
}

// messages counts the registry stream's messages per key (puts and delete markers).
func messages(t *testing.T, js jetstream.JetStream) map[string]uint64 {
	t.Helper()
	ctx := context.Background()
	stream, err := js.Stream(ctx, provisioner.StreamName(provisioner.BucketRegistry))
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

func start(t *testing.T, js jetstream.JetStream, log *slog.Logger) *registry.Writer {
	t.Helper()
	w := registry.New(js, provisioner.Registry, interval, log)
	w.Start(context.Background())
	t.Cleanup(w.Stop)
	return w
}

// startedOnServer starts a writer of the compiled table on a server of its own, after its first pass.
func startedOnServer(t *testing.T) (jetstream.JetStream, *registry.Writer) {
	t.Helper()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	w := start(t, js, nil)
	waitPasses(t, w, 1)
	return js, w
}

// waitPasses waits until w has completed at least n passes.
func waitPasses(t *testing.T, w *registry.Writer, n int) {
	t.Helper()
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if p, _ := w.Stats(); p < n {
			return fmt.Errorf("%d passes of %d", p, n)
		}
		return nil
	})
}

func passes(w *registry.Writer) int {
	p, _ := w.Stats()
	return p
}

func writes(w *registry.Writer) int {
	_, n := w.Stats()
	return n
}

func TestWriter_FreshBucket(t *testing.T) {
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	_, err := js.KeyValue(context.Background(), provisioner.BucketRegistry)
	require.ErrorIs(t, err, jetstream.ErrBucketNotFound)

	w := start(t, js, nil)
	waitPasses(t, w, 1)
	require.NoError(t, equalsContract(t, js))
	require.Equal(t, len(contractTable), writes(w), "one write per kind")
	for kind, n := range messages(t, js) {
		require.EqualValues(t, 1, n, "kind %q is written once", kind)
	}
}

// In a cluster the writer creates the bucket with the replicas it is given (serve's
// --registry-replicas), so the registry outlives the loss of one server; a bucket that exists is
// used as it is.
func TestWriter_CreatesWithReplicas(t *testing.T) {
	c := natstest.RunCluster(t, 3)
	ctx := context.Background()
	_, js := natstest.Connect(t, c.URLs())
	w := registry.New(js, provisioner.Registry, time.Hour, nil)
	w.Replicas = 3
	natstest.CheckFor(t, 30*time.Second, 100*time.Millisecond, func() error {
		_, err := w.Pass(ctx) // the cluster's meta leader may still be elected
		return err
	})
	s, err := js.Stream(ctx, provisioner.StreamName(provisioner.BucketRegistry))
	require.NoError(t, err)
	require.Equal(t, 3, s.CachedInfo().Config.Replicas)
	require.NoError(t, equalsContract(t, js))

	// Another writer, given other replicas, keeps the bucket as it is.
	w2 := registry.New(js, provisioner.Registry, time.Hour, nil)
	w2.Replicas = 1
	_, err = w2.Pass(ctx)
	require.NoError(t, err)
	info, err := s.Info(ctx)
	require.NoError(t, err)
	require.Equal(t, 3, info.Config.Replicas)
}

func TestWriter_RestartUnchanged(t *testing.T) {
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	first := registry.New(js, provisioner.Registry, interval, nil)
	first.Start(context.Background())
	waitPasses(t, first, 1)
	first.Stop()
	before := live(t, js)
	require.Len(t, before, len(contractTable))

	// A new process: its own connection, a writer with the same table.
	_, js2 := natstest.Connect(t, ns.ClientURL())
	w := start(t, js2, nil)
	waitPasses(t, w, 3)
	require.Zero(t, writes(w), "an unchanged table writes nothing")
	require.Equal(t, before, live(t, js), "no kind has a new revision")
}

// hand writes registry keys the way an operator with `nats kv put` would.
type hand struct {
	t  *testing.T
	js jetstream.JetStream
	kv jetstream.KeyValue
}

func (h hand) put(key string, value []byte) uint64 {
	h.t.Helper()
	rev, err := h.kv.Put(context.Background(), key, value)
	require.NoError(h.t, err)
	return rev
}

// encode writes a map of strings with its keys in the order given; str16 makes every string wider
// than it needs to be.
func encode(t *testing.T, wide bool, kvs ...string) []byte {
	t.Helper()
	var b bytes.Buffer
	enc := msgpack.NewEncoder(&b)
	require.NoError(t, enc.EncodeMapLen(len(kvs)/2))
	for _, s := range kvs {
		if wide {
			b.WriteByte(0xda)
			b.Write([]byte{byte(len(s) >> 8), byte(len(s))})
			b.WriteString(s)
			continue
		}
		require.NoError(t, enc.EncodeString(s))
	}
	return b.Bytes()
}

func TestWriter_PutsBackHandEdits(t *testing.T) {
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	w := start(t, js, nil)
	waitPasses(t, w, 1)
	kv, err := js.KeyValue(ctx, provisioner.BucketRegistry)
	require.NoError(t, err)
	h := hand{t: t, js: js, kv: kv}

	// The same entries, encoded otherwise: equal as decoded, so they stay as written.
	sameConfig := h.put("config", encode(t, false, "key_shape", "<node>.<module>.<name>", "bucket", "mesh-config_values", "module", "mesh-config", "kind", "config"))
	sameSecret := h.put("secret", encode(t, true, "verb", "mesh-vault.secret", "kind", "secret", "module", "mesh-vault"))
	// Changed by hand: each is put back.
	changed := []string{"consumers", "port", "seat", "dir", "machine", "access"}
	h.put("consumers", encode(t, false, "kind", "consumers", "module", "mesh-vault", "verb", "mesh-vault.consumers", "note", "extra field"))
	h.put("port", []byte("not msgpack"))
	h.put("seat", encode(t, false, "kind", "seat", "module", "someone-else", "bucket", "mesh-controller_assignments", "key_shape", "<node>.<module>"))
	require.NoError(t, kv.Delete(ctx, "dir"))
	require.NoError(t, kv.Purge(ctx, "machine"))
	h.put("access", encode(t, false, "kind", "access", "module", "mesh-controller", "bucket", "mesh-controller_assignments")) // key_shape missing
	// Strays: a kind no entry has, a key of two tokens, and one the KV API cannot name.
	strays := []string{"gadget", "dir.extra", "a:b"}
	h.put("gadget", encode(t, false, "kind", "gadget", "module", "nobody", "verb", "nobody.gadget"))
	h.put("dir.extra", provisioner.Registry.Entries[0].Value())
	_, err = js.Publish(ctx, provisioner.SubjectPrefix(provisioner.BucketRegistry)+"a:b", []byte{0x80})
	require.NoError(t, err)

	p := passes(w)
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error { return equalsContract(t, js) })
	waitPasses(t, w, p+3) // and then some: nothing more is written
	require.NoError(t, equalsContract(t, js))

	got := live(t, js)
	require.Equal(t, sameConfig, got["config"].rev, "another map order is the same entry: not rewritten")
	require.Equal(t, sameSecret, got["secret"].rev, "wider encodings are the same entry: not rewritten")
	// Counted from the stream, whenever the passes ran between the edits: each edited kind has its first
	// write, the hand edit and one write putting it back (a purge leaves only its marker of the first
	// two); each stray its hand write and one delete marker.
	after := messages(t, js)
	for _, kind := range changed {
		want := uint64(3)
		if kind == "machine" {
			want = 2
		}
		require.Equal(t, want, after[kind], "kind %q is put back with one write", kind)
	}
	for _, k := range strays {
		require.EqualValues(t, 2, after[k], "stray %q is deleted with one delete marker", k)
	}
	require.EqualValues(t, 2, after["config"], "config: first write and the hand edit")
	require.EqualValues(t, 2, after["secret"], "secret: first write and the hand edit")
	st, err := js.Stream(ctx, provisioner.StreamName(provisioner.BucketRegistry))
	require.NoError(t, err)
	last, err := st.GetLastMsgForSubject(ctx, provisioner.SubjectPrefix(provisioner.BucketRegistry)+"a:b")
	require.NoError(t, err)
	require.Equal(t, "DEL", last.Header.Get("KV-Operation"), "a raw-subject stray gets the KV delete marker")
}

func TestWriter_TwoWritersConverge(t *testing.T) {
	ns := natstest.RunServer(t)
	ctx := context.Background()

	t.Run("passes at once on a fresh bucket", func(t *testing.T) {
		// Four writers race to create the bucket, then every kind: each kind is written exactly once.
		ns := natstest.RunServer(t)
		var ws []*registry.Writer
		for i := 0; i < 4; i++ {
			_, js := natstest.Connect(t, ns.ClientURL())
			ws = append(ws, registry.New(js, provisioner.Registry, interval, nil))
		}
		var wg sync.WaitGroup
		errs := make([]error, len(ws))
		gate := make(chan struct{})
		for i, w := range ws {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-gate
				_, errs[i] = w.Pass(ctx)
			}()
		}
		close(gate)
		wg.Wait()
		total := 0
		for i, w := range ws {
			require.NoError(t, errs[i], "writer %d", i)
			total += writes(w)
		}
		_, js := natstest.Connect(t, ns.ClientURL())
		require.NoError(t, equalsContract(t, js))
		require.Equal(t, len(contractTable), total, "the writers made one write per kind between them")
		for kind, n := range messages(t, js) {
			require.EqualValues(t, 1, n, "kind %q has one revision", kind)
		}
	})

	_, admin := natstest.Connect(t, ns.ClientURL())
	_, js1 := natstest.Connect(t, ns.ClientURL())
	_, js2 := natstest.Connect(t, ns.ClientURL())
	w1, w2 := start(t, js1, nil), start(t, js2, nil)
	waitPasses(t, w1, 3)
	waitPasses(t, w2, 3)
	require.NoError(t, equalsContract(t, admin))
	for kind, n := range messages(t, admin) {
		require.EqualValues(t, 1, n, "kind %q has one revision", kind)
	}
	require.Equal(t, len(contractTable), writes(w1)+writes(w2), "one write per kind between them")

	// A hand edit and a stray: the two writers fix each with one write between them, and then stay.
	kv, err := admin.KeyValue(ctx, provisioner.BucketRegistry)
	require.NoError(t, err)
	before := writes(w1) + writes(w2)
	_, err = kv.Put(ctx, "secret", []byte{0x80})
	require.NoError(t, err)
	_, err = kv.Put(ctx, "gadget", []byte{0x80})
	require.NoError(t, err)
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error { return equalsContract(t, admin) })
	p1, p2 := passes(w1), passes(w2)
	waitPasses(t, w1, p1+3)
	waitPasses(t, w2, p2+3)
	require.Equal(t, before+2, writes(w1)+writes(w2), "one put and one delete between them")
	after := messages(t, admin)
	require.EqualValues(t, 3, after["secret"], "secret: written, edited, put back once")
	require.EqualValues(t, 2, after["gadget"], "gadget: written by hand, deleted once")
	for kind, n := range after {
		if kind != "secret" && kind != "gadget" {
			require.EqualValues(t, 1, n, "kind %q was never written again", kind)
		}
	}
}

func TestWriter_FailedPassRetriesAndLogsOnce(t *testing.T) {
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	// A stream of the registry's name that is no KV bucket (no per-key history): every pass fails.
	_, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: provisioner.StreamName(provisioner.BucketRegistry),
		Subjects: []string{provisioner.SubjectPrefix(provisioner.BucketRegistry) + ">"}})
	require.NoError(t, err)

	var logs natstest.LogBuffer
	w := registry.New(js, provisioner.Registry, interval, slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo})))
	registry.SetRetry(w, time.Millisecond, 10*time.Millisecond)
	w.Start(ctx)
	t.Cleanup(w.Stop)
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if n := w.Failures(); n < 5 {
			return fmt.Errorf("%d failed passes", n)
		}
		return nil
	})
	require.Zero(t, passes(w))

	// The operator removes the stream: the next retry creates the bucket and writes the table.
	require.NoError(t, js.DeleteStream(ctx, provisioner.StreamName(provisioner.BucketRegistry)))
	waitPasses(t, w, 1)
	require.NoError(t, equalsContract(t, js))
	require.Equal(t, 1, strings.Count(logs.String(), "registry pass failed; retrying with backoff"), logs.String())
	require.Equal(t, 1, strings.Count(logs.String(), "registry pass recovered"), logs.String())
}

// TestWriter_StopsDuringAPass checks that Stop returns while a pass waits on NATS: here the server is
// gone, so every request hangs until its deadline.
func TestWriter_StopsDuringAPass(t *testing.T) {
	ns := natstest.RunServer(t)
	nc, js := natstest.Connect(t, ns.ClientURL())
	ns.Shutdown()
	ns.WaitForShutdown()
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if nc.IsConnected() {
			return fmt.Errorf("still connected")
		}
		return nil
	})
	w := registry.New(js, provisioner.Registry, interval, nil)
	w.Start(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		w.Stop()
	}()
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		select {
		case <-done:
			return nil
		default:
			return fmt.Errorf("Stop has not returned")
		}
	})
}

// TestWriter_StrayIsWhatTheProjectionReads: CONTRACT section 4, "a key of the bucket that is not in the
// table is deleted". A key is deleted when its last message is a delete, a purge or a TTL marker of any
// value (section 1), exactly as the projection reads it: a message with another KV-Operation is a put,
// which the seat answers as a registry entry, so the writer deletes it; one with an empty
// Nats-Marker-Reason is a marker, which removed the key already, so the writer leaves it.
func TestWriter_StrayIsWhatTheProjectionReads(t *testing.T) {
	js, w := startedOnServer(t)
	ctx := context.Background()
	prefix := provisioner.SubjectPrefix(provisioner.BucketRegistry)
	publish := func(key, header, value string) {
		m := nats.NewMsg(prefix + key)
		m.Header.Set(header, value)
		m.Data = provisioner.Registry.Entries[0].Value()
		_, err := js.PublishMsg(ctx, m)
		require.NoError(t, err)
	}
	publish("odd-op", "KV-Operation", "del") // not DEL: a put
	publish("empty-marker", jetstream.MarkerReasonHeader, "")

	p := passes(w)
	waitPasses(t, w, p+3)
	require.NoError(t, equalsContract(t, js))
	stream, err := js.Stream(ctx, provisioner.StreamName(provisioner.BucketRegistry))
	require.NoError(t, err)
	last, err := stream.GetLastMsgForSubject(ctx, prefix+"odd-op")
	require.NoError(t, err)
	require.Equal(t, "DEL", last.Header.Get("KV-Operation"), "a stray put with another KV-Operation is deleted")
	after := messages(t, js)
	require.EqualValues(t, 2, after["odd-op"], "the put and one delete marker")
	require.EqualValues(t, 1, after["empty-marker"], "a marker removed the key already: nothing is written")
}

// TestWriter_PutsBackKindsRemovedByAnyMarker: CONTRACT section 1, a message with Nats-Marker-Reason set,
// any value, removes its key, and the projection reads it so (provisioner.OpOfHeaders): the writer
// must read it so too and write the kind again, even when the marker carries the entry's own bytes.
// nats.go's KV Get takes a marker of a reason it does not know (or an empty one) for a put.
func TestWriter_PutsBackKindsRemovedByAnyMarker(t *testing.T) {
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	w := registry.New(js, provisioner.Registry, time.Hour, nil)
	_, err := w.Pass(ctx)
	require.NoError(t, err)
	marked := map[string]string{"config": "", "secret": "Whatever", "port": "MaxAge"}
	for kind, reason := range marked {
		e, ok := provisioner.Registry.Lookup(kind)
		require.True(t, ok)
		m := nats.NewMsg(provisioner.SubjectPrefix(provisioner.BucketRegistry) + kind)
		m.Header[jetstream.MarkerReasonHeader] = []string{reason}
		m.Data = e.Value() // the entry's own bytes, behind a marker
		_, err := js.PublishMsg(ctx, m)
		require.NoError(t, err)
	}
	require.Error(t, equalsContract(t, js), "the marked kinds are removed")
	n, err := w.Pass(ctx)
	require.NoError(t, err)
	require.Equal(t, len(marked), n, "one write per marked kind")
	require.NoError(t, equalsContract(t, js))
	n, err = w.Pass(ctx)
	require.NoError(t, err)
	require.Zero(t, n, "and then nothing")
}

// TestWriter_WakeWritesLostKindsOnly: a Wake (a seat whose projection lost a kind) writes the kinds
// whose key has no value, and nothing else: an edited value and a stray wait for the pass. So two
// writers with different tables (a rolling upgrade) do not answer each other's writes at once, over
// and over: each wakes only for a kind of its own that the other's pass deleted.
func TestWriter_WakeWritesLostKindsOnly(t *testing.T) {
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	oldTable := provisioner.Registry
	var entries []provisioner.RegistryEntry
	for _, e := range oldTable.Entries {
		switch e.Kind {
		case "port": // the new table drops port
		case "secret": // and moves secret
			e.Verb = "mesh-vault.secret.v2"
			entries = append(entries, e)
		default:
			entries = append(entries, e)
		}
	}
	entries = append(entries, provisioner.RegistryEntry{Kind: "gadget", Module: "mesh-gadget", Verb: "mesh-gadget.get"})
	newTable := provisioner.NewRegistryTable(oldTable.Version+1, entries...)

	old := registry.New(js, oldTable, time.Hour, nil)
	neu := registry.New(js, newTable, time.Hour, nil)
	for _, w := range []*registry.Writer{old, neu} {
		registry.SetWakeGap(w, time.Millisecond)
	}
	old.Start(ctx)
	t.Cleanup(old.Stop)
	waitPasses(t, old, 1)
	require.NoError(t, equalsContract(t, js))
	neu.Start(ctx) // its first pass: gadget written, secret moved, port deleted
	t.Cleanup(neu.Stop)
	waitPasses(t, neu, 1)
	require.Equal(t, 3, writes(neu))

	waitWrites := func(w *registry.Writer, n int) {
		t.Helper()
		natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
			if got := writes(w); got != n {
				return fmt.Errorf("%d writes, want %d", got, n)
			}
			return nil
		})
	}
	// The old seat's projection lost port (the newer table's delete) and config (deleted by hand): its
	// repair writes config alone. Port stays deleted (a newer table's), secret moved and gadget kept:
	// an edit or a stray waits for the pass, and a newer table's key is never downgraded.
	kv, err := js.KeyValue(ctx, provisioner.BucketRegistry)
	require.NoError(t, err)
	require.NoError(t, kv.Delete(ctx, "config"))
	old.Wake()
	waitWrites(old, len(contractTable)+1)
	got := live(t, js)
	require.Contains(t, got, "config")
	require.NotContains(t, got, "port", "the newer table deleted it")
	require.Contains(t, got, "gadget", "a newer table's kind")
	require.True(t, newTable.Entries[indexOf(t, newTable, "secret")].Matches(got["secret"].value), "a newer table's value")
	// The new seat's projection lost config too, but the old seat wrote it back: its repair writes nothing.
	neu.Wake()
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if neu.Repairs() == 0 {
			return fmt.Errorf("no repair yet")
		}
		return nil
	})
	require.Equal(t, 3, writes(neu))
	require.Equal(t, 1, old.Repairs())
	require.Equal(t, len(contractTable)+1, writes(old))
}

// upgradeTable is a newer binary's table: port dropped, secret moved, gadget added, at a higher
// version than the compiled one.
func upgradeTable() provisioner.RegistryTable {
	var entries []provisioner.RegistryEntry
	for _, e := range provisioner.Registry.Entries {
		switch e.Kind {
		case "port":
		case "secret":
			e.Verb = "mesh-vault.secret.v2"
			entries = append(entries, e)
		default:
			entries = append(entries, e)
		}
	}
	entries = append(entries, provisioner.RegistryEntry{Kind: "gadget", Module: "mesh-gadget", Verb: "mesh-gadget.get"})
	return provisioner.NewRegistryTable(provisioner.Registry.Version+1, entries...)
}

// TestWriter_RollingUpgradeLeavesTheNewerTable: seats of an old and a new binary run together, each
// passing every interval. The old one never puts back what the new table changed or deleted, nor
// deletes the kind it added: the bucket holds the new table, with no revision after the new seat's
// first pass (they fought every interval: each rewrote the other's kinds and deleted its new ones).
func TestWriter_RollingUpgradeLeavesTheNewerTable(t *testing.T) {
	ns := natstest.RunServer(t)
	_, admin := natstest.Connect(t, ns.ClientURL())
	_, js1 := natstest.Connect(t, ns.ClientURL())
	_, js2 := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	newTable := upgradeTable()
	var logs natstest.LogBuffer
	old := registry.New(js1, provisioner.Registry, interval, slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo})))
	old.Start(ctx)
	t.Cleanup(old.Stop)
	waitPasses(t, old, 1)
	require.NoError(t, equalsContract(t, admin))

	neu := registry.New(js2, newTable, interval, nil)
	neu.Start(ctx)
	t.Cleanup(neu.Stop)
	waitPasses(t, neu, 1)
	require.Equal(t, 3, writes(neu), "gadget written, secret moved, port deleted")
	before := messages(t, admin)
	oldWrites := writes(old)
	waitPasses(t, old, passes(old)+5)
	waitPasses(t, neu, passes(neu)+5)

	require.Equal(t, before, messages(t, admin), "no revision after the new table's first pass")
	require.Equal(t, oldWrites, writes(old), "the old seat wrote nothing over the newer table")
	require.Equal(t, 3, writes(neu))
	got := live(t, admin)
	require.Len(t, got, len(newTable.Entries))
	for _, e := range newTable.Entries {
		require.True(t, e.Matches(got[e.Kind].value), "kind %q holds the new table's entry", e.Kind)
	}
	require.Contains(t, logs.String(), `msg="registry keys of a newer table left alone" component=registry version=1 keys="port secret gadget"`)

	// Every write names its table's version, the delete of port included.
	stream, err := admin.Stream(ctx, provisioner.StreamName(provisioner.BucketRegistry))
	require.NoError(t, err)
	for kind, want := range map[string]string{"config": "1", "secret": "2", "gadget": "2", "port": "2"} {
		m, err := stream.GetLastMsgForSubject(ctx, provisioner.SubjectPrefix(provisioner.BucketRegistry)+kind)
		require.NoError(t, err)
		require.Equal(t, want, m.Header.Get(provisioner.HeaderRegistryVersion), kind)
	}

	// After the new seats stop, a seat of the old binary alone still leaves the newer table; once an
	// operator deletes the newer keys (a rollback), it writes its own table again.
	neu.Stop()
	kv, err := admin.KeyValue(ctx, provisioner.BucketRegistry)
	require.NoError(t, err)
	for _, k := range []string{"secret", "gadget", "port"} {
		require.NoError(t, kv.Purge(ctx, k))
	}
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error { return equalsContract(t, admin) })
}

// TestWriter_NewerHeaderOnNoEntryIsPutRight: the version header is believed only on what a table's
// writer writes. A value that is not MessagePack, or a map of another kind, under a newer version's
// header (a message copied by hand with its headers, a tool that sets the header) is no table's: the
// seat puts the kind right and deletes such a stray, as it does a hand edit. It left them for ever.
func TestWriter_NewerHeaderOnNoEntryIsPutRight(t *testing.T) {
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	w := registry.New(js, provisioner.Registry, time.Hour, nil)
	_, err := w.Pass(ctx)
	require.NoError(t, err)
	require.NoError(t, equalsContract(t, js))

	newer := strconv.FormatUint(provisioner.Registry.Version+1, 10)
	pub := func(key string, data []byte) {
		t.Helper()
		m := nats.NewMsg(provisioner.SubjectPrefix(provisioner.BucketRegistry) + key)
		m.Data = data
		m.Header.Set(provisioner.HeaderRegistryVersion, newer)
		_, err := js.PublishMsg(ctx, m)
		require.NoError(t, err)
	}
	pub("config", []byte("not msgpack"))
	pub("secret", encode(t, false, "kind", "port", "module", "mesh-vault", "verb", "mesh-vault.secret.v2"))
	pub("gizmo", []byte{0xc1})
	n, err := w.Pass(ctx)
	require.NoError(t, err)
	require.Equal(t, 3, n, "config and secret put right, gizmo deleted")
	require.NoError(t, equalsContract(t, js))

	// A newer table's entry under the same header is still left alone.
	pub("secret", encode(t, false, "kind", "secret", "module", "mesh-vault", "verb", "mesh-vault.secret.v2"))
	n, err = w.Pass(ctx)
	require.NoError(t, err)
	require.Zero(t, n)
}

// TestWriter_NewerRepairWinsALossPutBackByAnOlderSeat: during a rolling upgrade an operator deletes a
// kind the newer table changed. The loss wakes the seats of both binaries; when the older one's repair
// puts its value back first, the newer one's repair writes the newer value over it at once. It found the
// key holding a value and left the older table's entry for up to an interval (an hour), and the kind's
// needs were answered by the old entry meanwhile.
func TestWriter_NewerRepairWinsALossPutBackByAnOlderSeat(t *testing.T) {
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	newTable := upgradeTable()
	old := registry.New(js, provisioner.Registry, time.Hour, nil)
	neu := registry.New(js, newTable, time.Hour, nil)
	for _, w := range []*registry.Writer{old, neu} {
		registry.SetWakeGap(w, time.Millisecond)
	}
	old.Start(ctx)
	t.Cleanup(old.Stop)
	waitPasses(t, old, 1)
	neu.Start(ctx)
	t.Cleanup(neu.Stop)
	waitPasses(t, neu, 1)
	require.Equal(t, 3, writes(neu))

	kv, err := js.KeyValue(ctx, provisioner.BucketRegistry)
	require.NoError(t, err)
	require.NoError(t, kv.Delete(ctx, "secret"))
	oldWrites := writes(old)
	old.Wake() // the older seat's repair comes first and puts its own secret back
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if writes(old) != oldWrites+1 {
			return fmt.Errorf("the old seat has not put secret back")
		}
		return nil
	})
	require.True(t, provisioner.Registry.Entries[indexOf(t, provisioner.Registry, "secret")].Matches(live(t, js)["secret"].value))
	neu.Wake()
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if neu.Repairs() == 0 {
			return fmt.Errorf("no repair yet")
		}
		return nil
	})
	require.True(t, newTable.Entries[indexOf(t, newTable, "secret")].Matches(live(t, js)["secret"].value), "the newer table's secret")
	require.Equal(t, 4, writes(neu))
	// And the older seat leaves it: its repairs and passes write nothing more.
	old.Wake()
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if old.Repairs() < 2 {
			return fmt.Errorf("no second repair yet")
		}
		return nil
	})
	n, err := old.Pass(ctx)
	require.NoError(t, err)
	require.Zero(t, n)
	require.Equal(t, oldWrites+1, writes(old))
}

func indexOf(t *testing.T, table provisioner.RegistryTable, kind string) int {
	t.Helper()
	for i, e := range table.Entries {
		if e.Kind == kind {
			return i
		}
	}
	t.Fatalf("no kind %q", kind)
	return -1
}

// TestWriter_LogNamesWhatAPassChanged: one info line a pass that writes, naming the kinds it wrote and
// the strays it deleted (docs/decisions.md, The registry: an operator sees what was put back).
func TestWriter_LogNamesWhatAPassChanged(t *testing.T) {
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	var logs natstest.LogBuffer
	w := registry.New(js, provisioner.Registry, time.Hour, slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo})))
	_, err := w.Pass(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, strings.Count(logs.String(), "msg=\"registry written\""), logs.String())
	require.Equal(t, 1, strings.Count(logs.String(), "changed=\"access bound collected config"), logs.String())
	kv, err := js.KeyValue(ctx, provisioner.BucketRegistry)
	require.NoError(t, err)
	require.NoError(t, kv.Delete(ctx, "secret"))
	_, err = kv.Put(ctx, "gadget", []byte{0x80})
	require.NoError(t, err)
	_, err = w.Pass(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, strings.Count(logs.String(), `changed="secret -gadget"`), logs.String())
	_, err = w.Pass(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, strings.Count(logs.String(), "msg=\"registry written\""), "a pass that writes nothing says nothing")
}

// TestWriter_DeniedPublishFailsAtOnce: a writer whose user may not publish on the registry's keys (an
// account set up without $KV.mesh-provisioner_registry.>) got no answer to its first put, which NATS
// drops, and waited out the pass's 30 s deadline each pass; its warn line said "context deadline
// exceeded". Each pass fails as soon as NATS reports the violation, and the line names the subject
// refused and what to grant. Granted again, the next pass writes the table.
func TestWriter_DeniedPublishFailsAtOnce(t *testing.T) {
	ns := natstest.RunServerSeatDenied(t, "$KV.mesh-provisioner_registry.>")
	_, admin := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("admin", "admin"))
	_, err := admin.CreateKeyValue(context.Background(), jetstream.KeyValueConfig{Bucket: provisioner.BucketRegistry, History: 8})
	require.NoError(t, err)
	// The grant below reloads the server's options while the writer retries its passes.
	natstest.NoDirectGets(t, admin, provisioner.StreamName(provisioner.BucketRegistry))
	_, js := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("seat", "seat"))

	var logs natstest.LogBuffer
	w := registry.New(js, provisioner.Registry, interval, slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo})))
	registry.SetRetry(w, time.Millisecond, 10*time.Millisecond)
	w.Start(context.Background())
	t.Cleanup(w.Stop)
	// Well under one pass's 30 s deadline, however loaded the machine: each denied pass takes about
	// one round trip.
	natstest.CheckFor(t, 20*time.Second, 5*time.Millisecond, func() error {
		if n := w.Failures(); n < 3 {
			return fmt.Errorf("%d failed passes", n)
		}
		return nil
	})
	require.Zero(t, passes(w))
	require.Contains(t, logs.String(), "registry pass failed; retrying with backoff")
	require.Contains(t, logs.String(), `Permissions Violation for Publish to \"$KV.mesh-provisioner_registry.`, "names the subject refused")
	require.Contains(t, logs.String(), "grant this NATS user publish on $KV.mesh-provisioner_registry.>", "names what to grant")
	require.NotContains(t, logs.String(), "deadline exceeded")

	natstest.DenySeat(t, ns) // granted
	waitPasses(t, w, 1)
	require.NoError(t, equalsContract(t, js))
}

// A pass whose request the server never answers, because the connection dropped with it in flight,
// ends at the drop and says so: nats.go keeps waiting for the answer across the reconnect, and a pass
// cut by a server's restart waited out its 30 s timeout before the writer tried again (seen in
// TestFault_ServerRestartsMidIngest). Once reconnected, the next pass writes the table.
func TestWriter_PassEndsWhenTheConnectionDrops(t *testing.T) {
	ns := natstest.RunServer(t)
	p := natstest.RunProxy(t, ns.Addr().String())
	_, js := natstest.Connect(t, p.URL(), nats.ReconnectWait(20*time.Millisecond), nats.MaxReconnects(-1))
	w := registry.New(js, provisioner.Registry, time.Hour, slog.New(slog.DiscardHandler))

	p.Hold() // the server's answers are held back: the pass's first request waits for its answer
	sent := func() uint64 {
		v, err := ns.Varz(nil)
		require.NoError(t, err)
		return uint64(v.InMsgs)
	}
	before := sent()
	errc := make(chan error, 1)
	go func() {
		_, err := w.Pass(context.Background())
		errc <- err
	}()
	natstest.CheckFor(t, 10*time.Second, time.Millisecond, func() error {
		if sent() == before {
			return fmt.Errorf("the pass has sent nothing yet")
		}
		return nil
	})
	p.Cut()
	p.Release()
	err := natstest.Receive(t, errc, 25*time.Second, "the pass to end")
	require.ErrorIs(t, err, registry.ErrDisconnected, "ended by the drop, not by its timeout")

	n, err := w.Pass(context.Background())
	require.NoError(t, err)
	require.Equal(t, len(provisioner.Registry.Entries), n, "the next pass writes every kind")
}
