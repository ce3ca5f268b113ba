//go:build linux

package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/store"
)

// serve run out of descriptors where Pebble must create its next log exits 71 with the documented
// message (docs/operations.md: `store: out of file descriptors`), and the state dir it leaves opens
// holding every batch it committed: a second serve answers each of those keys as soon as it answers.
//
// The built binary serves a NATS of the test's from an empty state dir. Once it is idle (every bucket
// synced), the test lowers its RLIMIT_NOFILE to the descriptor of its log (starve): every number
// below is held, so the number Pebble frees when it closes the log to create the next cannot be had
// again, as in a seat out of descriptors whose freed number another open (a client accepted, a table
// read) took first. An empty store holds no table to open, and an idle seat opens no file; puts then
// fill the first memtable (256 KiB, pebble's initialMemTableSize), and its rotation is the first
// file Pebble creates: its new log. Starving the child from outside by holding descriptors (ulimit
// -n and clients of its metrics listener) is not steady: the log's own number comes back to it at the
// rotation unless something races for it, and a flush's table, the first file Pebble creates with a
// number of its own, fails into Pebble's retries rather than an exit.
func TestServe_OutOfDescriptorsForItsLogExits71(t *testing.T) {
	t.Parallel()
	bin := buildBinary(t)
	ns := natstest.RunServer(t)
	nc, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	var buckets []string
	for _, sh := range provisioner.ProvisionerShapes {
		buckets = append(buckets, sh.Bucket)
	}
	require.NoError(t, fixtures.CreateBuckets(ctx, js, buckets...))
	dir := t.TempDir()
	state := filepath.Join(dir, "state")

	cmd := exec.Command(bin, "serve", "--nats", ns.ClientURL(), "--state", state, "--no-registry", "--plans=false", "--log-format", "json")
	stderr, exited := startChild(t, cmd)
	natstest.CheckFor(t, 30*time.Second, 20*time.Millisecond, func() error {
		a, _, err := natstest.Ask(nc, query.Subject, []byte(`{"what":"needs"}`), false)
		if err != nil {
			return fmt.Errorf("%v\n%s", err, stderr.String())
		}
		if !a.Synced {
			return errors.New("not synced yet")
		}
		// The first fill has no log: the seat answers from a checkpoint of it with one once caught up
		// (seat/relog.go), and that store's log is the one starved below.
		if !strings.Contains(stderr.String(), "answering from the store with a log") {
			return errors.New("not answering from the store with a log yet")
		}
		return nil
	})

	kv, err := js.KeyValue(ctx, provisioner.BucketNeeds)
	require.NoError(t, err)
	value, err := msgpack.Marshal(map[string]any{"required": true, "default": strings.Repeat("d", 200), "since": 1000})
	require.NoError(t, err)
	var keys []string
	put := func() {
		key := fmt.Sprintf("%s.mod-000.config.k%05d", fixtures.NodeName(0), len(keys))
		_, err := kv.Put(ctx, key, value)
		require.NoError(t, err)
		keys = append(keys, key)
	}
	// Some puts applied first (a fraction of the memtable), so that something was committed whatever
	// the batch the seat dies in holds.
	for range 50 {
		put()
	}
	natstest.CheckFor(t, 30*time.Second, 20*time.Millisecond, func() error {
		a, _, err := natstest.Ask(nc, query.Subject, []byte(`{"what":"needs","limit":1}`), false)
		if err == nil && a.AsOf < 50 {
			err = fmt.Errorf("applied up to %d", a.AsOf)
		}
		return err
	})

	limit := starve(t, cmd.Process.Pid, state)

	// More puts, until the seat stops (some hundreds fill the memtable).
	var code int
	for i := 0; code == 0; i++ {
		require.Less(t, i, 20_000, "serve did not stop after 20,000 puts:\n%s", stderr.String())
		put()
		select {
		case err := <-exited:
			exited <- err
			var ee *exec.ExitError
			require.True(t, errors.As(err, &ee), "serve ended with %v:\n%s", err, stderr.String())
			code = ee.ExitCode()
		default:
		}
	}
	out := stderr.String()
	require.Equal(t, exitNoFDs, code, "%s", out)
	require.Contains(t, out, "mesh-provisioner: store: out of file descriptors: the process has no file descriptor left (EMFILE, limit "+strconv.Itoa(limit), out)
	require.Regexp(t, `Pebble cannot create \S+\.log`, out)
	require.Contains(t, out, `"msg":"stopping: out of file descriptors"`)
	require.NotContains(t, out, "panic", "said, not a panic's stack")

	// The state dir opens, holding exactly the puts up to the sequence it says it applied.
	db, err := store.OpenState(state, store.Options{})
	require.NoError(t, err)
	applied, _ := db.Applied(provisioner.BucketNeeds)
	var stored []string
	v, err := db.View()
	require.NoError(t, err)
	require.NoError(t, v.Rows(provisioner.Range{Bucket: provisioner.BucketNeeds, Index: provisioner.IndexPrimary}, func(r *provisioner.Row) bool {
		stored = append(stored, string(r.Key))
		return true
	}))
	v.Close()
	require.NoError(t, db.Close())
	require.GreaterOrEqual(t, int(applied), 50, "the puts it had applied before it ran out")
	require.Less(t, int(applied), len(keys), "the seat stopped before it applied every put")
	require.Equal(t, keys[:applied], stored)

	// A second serve, under the test's limit, answers each of them as soon as it answers.
	s, err := startServe(dir, "--nats", ns.ClientURL(), "--no-registry", "--plans=false")
	require.NoError(t, err)
	defer func() { require.NoError(t, s.stop()) }()
	rows, _, err := natstest.AskAll(nc, query.Subject, map[string]any{"what": "needs", "node": fixtures.NodeName(0)}, false)
	require.NoError(t, err)
	answered := map[string]bool{}
	for _, r := range rows {
		answered[fmt.Sprint(r["key"])] = true
	}
	for _, k := range keys[:applied] {
		require.True(t, answered[k], "%s, committed, is not answered", k)
	}
}

// starve lowers the RLIMIT_NOFILE of the process pid, as prlimit(1) would, to its log's descriptor
// (a file NNNNNN.log under state), or to the lowest descriptor it does not hold if that is lower,
// and returns that limit. Every descriptor below the limit is held, and checked to be still held
// once it is set; those at or above it (the log's) still work, but a number freed there cannot be
// had again: Pebble closes its log before it creates the next (pebble v2.1.7 rotateWAL), and under
// this limit that creation fails with EMFILE, as it does in a process out of descriptors when another
// open took the number the old log freed in between.
func starve(t *testing.T, pid int, state string) int {
	t.Helper()
	var limit int
	natstest.CheckFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		held := heldFDs(t, pid)
		limit = 0
		for held[limit] {
			limit++
		}
		log := -1
		for fd := range held {
			if path, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%d", pid, fd)); err == nil && strings.HasPrefix(path, state) && strings.HasSuffix(path, ".log") {
				log = fd
			}
		}
		if log < 0 {
			return errors.New("serve holds no log under its state dir")
		}
		limit = min(limit, log)
		lim := syscall.Rlimit{Cur: uint64(limit), Max: uint64(limit)}
		if _, _, errno := syscall.RawSyscall6(syscall.SYS_PRLIMIT64, uintptr(pid), syscall.RLIMIT_NOFILE, uintptr(unsafe.Pointer(&lim)), 0, 0, 0); errno != 0 {
			t.Fatalf("prlimit %d: %v", pid, errno)
		}
		now := heldFDs(t, pid)
		for fd := range limit {
			if !now[fd] {
				return fmt.Errorf("descriptor %d closed under the limit %d", fd, limit)
			}
		}
		return nil
	})
	return limit
}

// heldFDs is the set of descriptors the process pid holds.
func heldFDs(t *testing.T, pid int) map[int]bool {
	t.Helper()
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	require.NoError(t, err)
	held := map[int]bool{}
	for _, e := range ents {
		fd, err := strconv.Atoi(e.Name())
		require.NoError(t, err)
		held[fd] = true
	}
	return held
}

// serve's embedded server holds at most --embedded-max-conn clients, by default half the descriptors
// it is left: under `ulimit -n 1024`, 128 (store.EmbeddedMaxConn). A flood of clients past it is
// refused by the server ("maximum connections exceeded"), this seat's own connection being one of
// the 128, and the seat goes on applying and answering; once the flood leaves, clients are taken
// again.
func TestServe_EmbeddedServerRefusesClientsPastItsBound(t *testing.T) {
	t.Parallel()
	bin := buildBinary(t)
	dir := t.TempDir()
	cmd := exec.Command("sh", "-c", `ulimit -n 1024 && exec "$0" "$@"`, bin, "serve", "--state", filepath.Join(dir, "state"),
		"--embedded-listen", "127.0.0.1:0", "--embedded-store", filepath.Join(dir, "nats"), "--plans=false", "--log-format", "json")
	stderr, exited := startChild(t, cmd)
	var start map[string]any
	natstest.CheckFor(t, 30*time.Second, 20*time.Millisecond, func() error {
		for _, l := range strings.Split(stderr.String(), "\n") {
			var m map[string]any
			if json.Unmarshal([]byte(l), &m) == nil && m["msg"] == "mesh-provisioner starting" {
				start = m
				return nil
			}
		}
		return fmt.Errorf("no start line:\n%s", stderr.String())
	})
	require.EqualValues(t, 1024, start["nofile"])
	require.EqualValues(t, 256, start["pebble_max_open_files"])
	require.EqualValues(t, 128, start["embedded_max_conn"])
	url := fmt.Sprint(start["nats"])

	nc, js := natstest.Connect(t, url)
	require.NoError(t, fixtures.CreateBuckets(context.Background(), js, provisioner.BucketNeeds))

	// The flood: clients until the server refuses one.
	var flood []*nats.Conn
	t.Cleanup(func() {
		for _, c := range flood {
			c.Close()
		}
	})
	for {
		c, err := nats.Connect(url, nats.NoReconnect())
		if err != nil {
			break
		}
		flood = append(flood, c)
		require.Less(t, len(flood), 1024, "the embedded server took 1,024 clients under a limit of 1,024")
	}
	require.Contains(t, natstest.Greeting(t, url), "-ERR 'maximum connections exceeded'")
	require.Equal(t, 128, len(flood)+2, "the flood's, the test's and the seat's")

	// The seat applies and answers meanwhile.
	kv, err := js.KeyValue(context.Background(), provisioner.BucketNeeds)
	require.NoError(t, err)
	rev, err := kv.Put(context.Background(), fixtures.NodeName(0)+".mod-000.config.during-the-flood", []byte{0x80})
	require.NoError(t, err)
	a, _, err := natstest.Ask(nc, query.Subject, []byte(fmt.Sprintf(`{"what":"needs","node":%q,"min_seq":%d,"wait_ms":10000}`, fixtures.NodeName(0), rev)), false)
	require.NoError(t, err, "%s", stderr.String())
	require.Len(t, a.Rows, 1)
	require.Equal(t, fixtures.NodeName(0)+".mod-000.config.during-the-flood", a.Rows[0]["key"])

	// Once the flood leaves, a client is taken again.
	for _, c := range flood {
		c.Close()
	}
	flood = nil
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		c, err := nats.Connect(url, nats.NoReconnect())
		if err == nil {
			c.Close()
		}
		return err
	})
	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	require.NoError(t, natstest.Receive(t, exited, 30*time.Second, "serve to stop"), "%s", stderr.String())
	exited <- nil
}

// startChild starts cmd (the built binary) with the NATS environment cleared and its output in one
// buffer, and kills and reaps it when the test ends. exited has its Wait's error; a test that reads
// it puts it back, for that cleanup.
func startChild(t *testing.T, cmd *exec.Cmd) (*natstest.LogBuffer, chan error) {
	t.Helper()
	cmd.Env = append(os.Environ(), "NATS_URL=", "NATS_USER=", "NATS_PASSWORD=", "NATS_CREDS=", "NATS_INBOX_PREFIX=")
	out := &natstest.LogBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	require.NoError(t, cmd.Start())
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
	})
	return out, exited
}
