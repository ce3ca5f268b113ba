package replay_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/faultfs"
	"github.com/novox/mesh-provisioner/replay"
	"github.com/novox/mesh-provisioner/store"
)

const (
	noFDsEnv  = "REPLAY_TEST_NO_FDS" // the child's source: state:<dir> or archive:<file>
	noFDsExit = 71
)

func noFDsMsgs(seq uint64) []provisioner.Message {
	var msgs []provisioner.Message
	for i := range uint64(50) {
		n := seq + i
		msgs = append(msgs, provisioner.Message{Seq: n, Time: int64(n) * 1e9, Key: fmt.Sprintf("n%04d.mod.config.c%d", n, n), Op: provisioner.OpPut, Value: []byte(fmt.Sprintf("\xd9\x20%032x", n))})
	}
	return msgs
}

// The stores a Log reads (a copy of a state dir, a temporary store filled from an archive) carry the
// OnFatal SetOnFatal gave: one that cannot create its new log for want of a descriptor says so to it
// (the command's exits 71) instead of Pebble's panic and its stacks, which is what they did without.
func TestSetOnFatal_LogStores(t *testing.T) {
	if src := os.Getenv(noFDsEnv); src != "" {
		noFDsChild(src)
		return
	}
	state := t.TempDir()
	db, err := store.OpenState(state, store.Options{MinFreeBytes: -1})
	require.NoError(t, err)
	require.NoError(t, db.Apply(provisioner.BucketNeeds, noFDsMsgs(1), 1, true))
	archive := filepath.Join(t.TempDir(), "needs.archive")
	_, err = replay.ExportLog(context.Background(), db, archive, "test", nil)
	require.NoError(t, err)
	require.NoError(t, db.Close())

	for _, src := range []string{"state:" + state, "archive:" + archive} {
		t.Run(strings.SplitN(src, ":", 2)[0], func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.run=^TestSetOnFatal_LogStores$", "-test.count=1")
			cmd.Env = append(os.Environ(), noFDsEnv+"="+src, "TMPDIR="+t.TempDir())
			out, err := cmd.CombinedOutput()
			var exit *exec.ExitError
			require.ErrorAs(t, err, &exit, "%s", out)
			require.Equal(t, noFDsExit, exit.ExitCode(), "%s", out)
			require.NotContains(t, string(out), "WRONG", "%s", out)
			require.NotContains(t, string(out), "goroutine ", "%s", out)
			require.Contains(t, string(out), "FATAL: store: out of file descriptors: the process has no file descriptor left (EMFILE", "%s", out)
		})
	}
}

// noFDsChild opens a Log of src, applies a batch to its store and flushes it with no descriptor
// left for the new log.
func noFDsChild(src string) {
	var on atomic.Bool
	defer replay.SetOfflineFS(faultfs.NoDescriptors(".log", &on))()
	replay.SetOnFatal(func(err error) {
		if !errors.Is(err, store.ErrNoFDs) {
			fmt.Println("WRONG: not ErrNoFDs")
		}
		fmt.Println("FATAL:", err)
		os.Exit(noFDsExit)
	})
	kind, path, _ := strings.Cut(src, ":")
	var l *replay.Log
	var err error
	if kind == "state" {
		l, err = replay.OpenState(path)
	} else {
		l, err = replay.FromArchive(context.Background(), path, nil)
	}
	if err != nil {
		fmt.Println("WRONG: open:", err)
		return
	}
	if err := l.DB.Apply(provisioner.BucketNeeds, noFDsMsgs(1000), 1, true); err != nil {
		fmt.Println("WRONG: apply:", err)
		return
	}
	on.Store(true)
	err = l.DB.Pebble().Flush()
	fmt.Println("WRONG: the flush returned:", err)
}
