package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/replay"
	"github.com/novox/mesh-provisioner/store"
)

// countdownCtx is a context whose Err says it was cancelled once it has been asked a given number of
// times: a Ctrl-C that lands in the middle of a walk, wherever the walk asks, with no clock involved.
type countdownCtx struct {
	context.Context
	left atomic.Int64
}

func (c *countdownCtx) Err() error {
	if c.left.Add(-1) < 0 {
		return context.Canceled
	}
	return nil
}

func countdown(n int64) *countdownCtx {
	c := &countdownCtx{Context: context.Background()}
	c.left.Store(n)
	return c
}

// cancelOnWrite cancels a context at its first write: Ctrl-C once the answer has started to print.
type cancelOnWrite struct {
	cancel context.CancelFunc
	buf    bytes.Buffer
}

func (w *cancelOnWrite) Write(p []byte) (int, error) {
	w.cancel()
	return w.buf.Write(p)
}

// bigLog writes a state dir whose needs hold many keys, one of them with many revisions.
func bigLog(t *testing.T, keys, revisions int) (dir, hot string) {
	t.Helper()
	dir = filepath.Join(t.TempDir(), "state")
	db, err := store.OpenState(dir, store.Options{})
	require.NoError(t, err)
	hot = "n1.m1.config.hot"
	now := time.Now().UnixNano()
	var msgs []provisioner.Message
	seq := uint64(0)
	add := func(key string) {
		seq++
		msgs = append(msgs, provisioner.Message{Seq: seq, Time: now + int64(seq), Key: key, Op: provisioner.OpPut, Value: []byte{0xa3, 'a', 'b', 'c'}})
	}
	for i := 0; i < keys; i++ {
		add(fmt.Sprintf("n%d.m1.config.k%d", i%50, i))
	}
	for i := 0; i < revisions; i++ {
		add(hot)
	}
	require.NoError(t, db.Apply(provisioner.BucketNeeds, msgs, now, true))
	require.NoError(t, db.Close())
	return dir, hot
}

// Ctrl-C stops every question of replay in the middle of its walk, once the source is read: a history
// of a key with a long life, or a diff or state of a whole bucket, used to run to its end, printing
// everything, whatever the operator pressed.
func TestReplayCommand_CancelStopsEachQuestion(t *testing.T) {
	t.Parallel()
	dir, hot := bigLog(t, 5000, 5000)
	mid := "seq:2500"
	// Uncancelled, each answer holds a key of node n9, whose keys come last in byte order (the state's
	// last page of a thousand rows, the diff's last added).
	stateKey, diffKey := "k2459", "k4959" // n9.m1.config.k2459 (seq 2460), n9.m1.config.k4959 (seq 4960)
	for args, key := range map[string]string{"state needs --at " + mid: stateKey, "diff needs --from " + mid + " --to seq:10000": diffKey} {
		for _, format := range [][]string{{"--json"}, nil} {
			var out bytes.Buffer
			require.NoError(t, (&ReplayCommand{Stdout: &out, Stderr: io.Discard}).Run(context.Background(), append(append(strings.Fields(args), "--state", dir), format...)))
			require.Contains(t, out.String(), key, "%v %v", args, format)
		}
	}

	t.Run("history", func(t *testing.T) {
		for _, format := range [][]string{{"--json"}, nil} {
			ctx, cancel := context.WithCancel(context.Background())
			w := &cancelOnWrite{cancel: cancel}
			err := (&ReplayCommand{Stdout: w, Stderr: io.Discard}).Run(ctx, append([]string{"history", "needs", hot, "--state", dir}, format...))
			require.ErrorIs(t, err, context.Canceled, "%v", format)
			require.Less(t, strings.Count(w.buf.String(), `"PUT"`)+strings.Count(w.buf.String(), "PUT\t"), 5000, "%v: printed every revision", format)
			cancel()
		}
	})
	// state prints each page as it is read: Ctrl-C once it has started to print stops it before the
	// next page, in a table as in JSON (a table was printed once every page had been read and held).
	t.Run("state prints as it reads", func(t *testing.T) {
		for _, format := range [][]string{{"--json"}, nil} {
			ctx, cancel := context.WithCancel(context.Background())
			w := &cancelOnWrite{cancel: cancel}
			err := (&ReplayCommand{Stdout: w, Stderr: io.Discard}).Run(ctx, append([]string{"state", "needs", "--at", mid, "--state", dir}, format...))
			require.ErrorIs(t, err, context.Canceled, "%v", format)
			require.NotContains(t, w.buf.String(), stateKey, "%v: printed the end of the answer", format)
			cancel()
		}
	})
	// diff walks the two states into temporary files, then prints them: Ctrl-C once it has started to
	// print stops the printing too (it printed every line of the diff, a bucket's worth of them).
	t.Run("diff stops printing", func(t *testing.T) {
		for _, format := range [][]string{{"--json"}, nil} {
			ctx, cancel := context.WithCancel(context.Background())
			w := &cancelOnWrite{cancel: cancel}
			err := (&ReplayCommand{Stdout: w, Stderr: io.Discard}).Run(ctx, append([]string{"diff", "needs", "--from", mid, "--to", "seq:10000", "--state", dir}, format...))
			require.ErrorIs(t, err, context.Canceled, "%v", format)
			require.NotEmpty(t, w.buf.String(), "%v: printing had begun", format)
			require.NotContains(t, w.buf.String(), diffKey, "%v: printed the end of the answer", format)
			cancel()
		}
	})
	for _, tc := range []struct {
		name string
		args []string
		asks int64  // how often the walk asks before it is told it was cancelled
		key  string // a key printed near the end
	}{
		{"diff", []string{"diff", "needs", "--from", mid, "--to", "seq:10000"}, 200, diffKey},
		{"state", []string{"state", "needs", "--at", mid}, 1, stateKey}, // asked between pages of a thousand rows
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, format := range [][]string{{"--json"}, nil} {
				var out bytes.Buffer
				err := (&ReplayCommand{Stdout: &out, Stderr: io.Discard}).Run(countdown(tc.asks), append(append(tc.args, "--state", dir), format...))
				require.ErrorIs(t, err, context.Canceled, "%v", format)
				require.NotContains(t, out.String(), tc.key, "%v: printed the end of the answer", format)
			}
		})
	}
}

// Ctrl-C stops a state within its first page: the page counts the state's anomalies, a read of every key
// of the bucket (of a module's range, every key too, filtered by its parts), which asked no context and
// ran to its end, millions of keys, before the command looked at it between pages.
func TestReplayCommand_CancelStopsAStateWithinAPage(t *testing.T) {
	t.Parallel()
	dir, _ := bigLog(t, 5000, 10)
	for _, args := range [][]string{
		{"state", "needs", "--at", "seq:5000"},
		{"state", "needs", "--at", "seq:5000", "--module", "m1"},
	} {
		for _, format := range [][]string{{"--json"}, nil} {
			var out bytes.Buffer
			// Asked once before the first page, then at the page's first keys.
			err := (&ReplayCommand{Stdout: &out, Stderr: io.Discard}).Run(countdown(3), append(append(args, "--state", dir), format...))
			require.ErrorIs(t, err, context.Canceled, "%v %v", args, format)
			require.Zero(t, out.Len(), "%v %v: a page was answered", args, format)
		}
	}
}

// bigLogToExport opens bigLog(5000, 5000), closed at the test's end, and names an archive to write.
func bigLogToExport(t *testing.T) (*replay.Log, string) {
	t.Helper()
	dir, _ := bigLog(t, 5000, 5000)
	l, err := replay.OpenState(dir)
	require.NoError(t, err)
	t.Cleanup(func() { l.Close() })
	return l, filepath.Join(t.TempDir(), "big.mph")
}

// Reading an archive stops on Ctrl-C whether or not a progress is told: replay.FromArchive asked its
// context only when it had a progress to report to, so a caller without one read it to its end.
func TestFromArchive_CancelWithoutProgress(t *testing.T) {
	t.Parallel()
	l, archive := bigLogToExport(t)
	_, err := replay.ExportLog(context.Background(), l.DB, archive, "test", nil)
	require.NoError(t, err)
	a, err := replay.FromArchive(countdown(1), archive, nil)
	if err == nil {
		a.Close()
	}
	require.ErrorIs(t, err, context.Canceled)
}

// Ctrl-C stops an export as it writes the archive: once every record is spooled, the spool is copied
// into the archive, gigabytes for a large mesh, with no context asked; an export cancelled then wrote
// its archive whole. It now leaves none, as one cancelled earlier does.
func TestExportLog_CancelWhileTheArchiveIsWritten(t *testing.T) {
	t.Parallel()
	l, archive := bigLogToExport(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	_, err := replay.ExportLog(ctx, l.DB, archive, "test", func(done, total int64) {
		if total > 0 && done == total { // told once every record is spooled
			cancel()
		}
	})
	require.ErrorIs(t, err, context.Canceled)
	require.NoFileExists(t, archive)
	left, err := filepath.Glob(filepath.Join(filepath.Dir(archive), ".big.mph.tmp-*"))
	require.NoError(t, err)
	require.Empty(t, left, "the archive's temporary file is removed")
}
