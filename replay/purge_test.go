package replay_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/replay"
	"github.com/novox/mesh-provisioner/store"
)

// needsPuts loads n needs, one key each, and returns the needs' stream and the time between the
// first and the last put.
func needsPuts(t *testing.T, js jetstream.JetStream, n int) (jetstream.Stream, time.Time) {
	t.Helper()
	ctx := context.Background()
	var ops []fixtures.Op
	for i := 0; i < n; i++ {
		ops = append(ops, fixtures.Op{Bucket: provisioner.BucketNeeds, Key: fmt.Sprintf("n%d.m.config.a", i), Op: provisioner.OpPut, Value: mp(i)})
	}
	require.NoError(t, fixtures.Load(ctx, js, ops[:n/2], 0, nil))
	mid := time.Now()
	require.NoError(t, fixtures.Load(ctx, js, ops[n/2:], 0, nil))
	s, err := js.Stream(ctx, provisioner.StreamName(provisioner.BucketNeeds))
	require.NoError(t, err)
	return s, mid
}

// requireGone asserts that a point is refused as one the log cannot rebuild.
func requireGone(t *testing.T, l *replay.Log, p replay.Point) {
	t.Helper()
	st, err := l.State(needsReq(""), p)
	require.Error(t, err, "%s: %s answered %d rows as of %d", l.Source, p, len(st.Rows), st.AsOf)
	require.Equal(t, 410, query.Code(err), "%s: %s: %v", l.Source, p, err)
	require.ErrorIs(t, err, store.ErrGap)
}

// A stream purged before it was read holds nothing, but it did hold messages: a point in its history
// is one the log cannot rebuild (410), not the empty state. Before the stream was created, and at
// seq:0, the state is empty as ever.
func TestReplay_APurgedStreamIsNotAnEmptyOne(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	before := time.Now()
	s, mid := needsPuts(t, js, 100)
	require.NoError(t, s.Purge(ctx))

	fromNATS, err := replay.FromNATS(ctx, js, []string{provisioner.BucketNeeds}, "nats", nil)
	require.NoError(t, err)
	defer fromNATS.Close()
	out := filepath.Join(t.TempDir(), "purged.mph")
	_, err = replay.ExportNATS(ctx, js, []string{provisioner.BucketNeeds}, out, "test", nil)
	require.NoError(t, err)
	fromArchive, err := replay.FromArchive(ctx, out, nil)
	require.NoError(t, err)
	defer fromArchive.Close()

	for _, l := range []*replay.Log{fromNATS, fromArchive} {
		requireGone(t, l, replay.Point{Time: mid})
		requireGone(t, l, replay.Point{Time: time.Now()})
		requireGone(t, l, replay.Point{Seq: 50})
		requireGone(t, l, replay.Point{Seq: 100})
		for _, p := range []replay.Point{{Seq: 0}, {Time: before.Add(-time.Hour)}} {
			st, err := l.State(needsReq(""), p)
			require.NoError(t, err, "%s: %s", l.Source, p)
			require.Empty(t, st.Rows)
		}
	}
}

// An export during which the stream is purged stops where the purge cut it: the archive must not
// read as a whole one whose stream ended there. Points up to what was read are exact; past it, 410.
func TestExport_StreamPurgedWhileExportingIsNoWholeArchive(t *testing.T) {
	// Pulls of a few thousand small messages, so that the export is midway after its first.
	defer replay.SetExportPullBytes(512 << 10)()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	const n = 10000
	s, mid := needsPuts(t, js, n)
	out := filepath.Join(t.TempDir(), "cut.mph")
	var purgedAt int64
	h, err := replay.ExportNATS(ctx, js, []string{provisioner.BucketNeeds}, out, "test", func(done, total int64) {
		if purgedAt == 0 && done > 0 && done < total {
			purgedAt = done
			require.NoError(t, s.Purge(ctx))
		}
	})
	require.NoError(t, err)
	require.NotZero(t, purgedAt, "the export was purged midway")
	require.Less(t, h.Buckets[0].Messages, uint64(n))
	require.Equal(t, uint64(n), h.Buckets[0].LastSeq, "the header says where the stream ended")

	l, err := replay.FromArchive(ctx, out, nil)
	require.NoError(t, err)
	defer l.Close()
	read := h.Buckets[0].Messages
	st, err := l.State(needsReq(""), replay.Point{Seq: read})
	require.NoError(t, err)
	require.Len(t, st.Rows, int(read), "every point up to what was read is exact")
	requireGone(t, l, replay.Point{Seq: read + 1})
	requireGone(t, l, replay.Point{Seq: n})
	requireGone(t, l, replay.Point{Time: time.Now()})
	if read < n/2 {
		requireGone(t, l, replay.Point{Time: mid})
	}
}

// An export of a stream whose last message was removed before the export began (its subject purged by
// an operator, a TTL without a marker) failed every time with "stopped at sequence 99 of 100; run
// export again", until something wrote to the bucket: its read ends at the last message the stream
// holds, with nothing pending after it, and the check meant for a read cut short took any message left
// before that end for one. The archive is written, with the removed end as a gap.
func TestExport_AStreamWhoseLastMessageWasRemoved(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	const n = 100
	s, _ := needsPuts(t, js, n)
	require.NoError(t, s.Purge(ctx, jetstream.WithPurgeSubject(provisioner.SubjectPrefix(provisioner.BucketNeeds)+fmt.Sprintf("n%d.m.config.a", n-1))))
	out := filepath.Join(t.TempDir(), "tail.mph")
	h, err := replay.ExportNATS(ctx, js, []string{provisioner.BucketNeeds}, out, "test", nil)
	require.NoError(t, err)
	require.Equal(t, uint64(n-1), h.Buckets[0].Messages)
	require.Equal(t, uint64(n), h.Buckets[0].LastSeq, "the header says where the stream ended")

	l, err := replay.FromArchive(ctx, out, nil)
	require.NoError(t, err)
	defer l.Close()
	st, err := l.State(needsReq(""), replay.Point{Seq: n - 1})
	require.NoError(t, err)
	require.Len(t, st.Rows, n-1)
	requireGone(t, l, replay.Point{Seq: n})
}

// An archive that is not whole, not one, or not for this tool is refused with what it is, never read
// as a shorter history; and the temporary store a refused archive was being read into is removed.
func TestFromArchive_DamagedArchivesAreRefused(t *testing.T) {
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	ctx := context.Background()
	needsPuts(t, js, 3000)
	dir := t.TempDir()
	good := filepath.Join(dir, "good.mph")
	_, err := replay.ExportNATS(ctx, js, []string{provisioner.BucketNeeds}, good, "test", nil)
	require.NoError(t, err)
	whole, err := os.ReadFile(good)
	require.NoError(t, err)
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)

	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, b, 0o600))
		return p
	}
	newer := func() []byte {
		var buf bytes.Buffer
		zw, err := zstd.NewWriter(&buf)
		require.NoError(t, err)
		require.NoError(t, msgpack.NewEncoder(zw).Encode(replay.ArchiveHeader{Format: replay.ArchiveFormat, Version: replay.ArchiveVersion + 1}))
		require.NoError(t, zw.Close())
		return buf.Bytes()
	}
	cases := map[string]struct {
		path string
		says string
	}{
		"empty":            {write("empty.mph", nil), "is empty"},
		"not zstd":         {write("text.mph", []byte("hello, this is not an archive\n")), "not a mesh-provisioner history archive"},
		"a directory":      {dir, "is a directory"},
		"a newer version":  {write("newer.mph", newer()), "newer than this tool reads"},
		"data after end":   {write("junk.mph", append(append([]byte(nil), whole...), "junk"...)), "after its end"},
		"two archives":     {write("two.mph", append(append([]byte(nil), whole...), whole...)), "after its end"},
		"header only":      {write("head.mph", whole[:40]), ""},
		"cut in the end":   {write("end.mph", whole[:len(whole)-3]), ""},
		"cut before end":   {write("mid.mph", whole[:len(whole)/2]), ""},
		"cut at one third": {write("third.mph", whole[:len(whole)/3]), ""},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			l, err := replay.FromArchive(ctx, tc.path, nil)
			if err == nil {
				l.Close()
				t.Fatalf("%s was read as an archive", tc.path)
			}
			require.Contains(t, err.Error(), tc.says)
			left, _ := filepath.Glob(filepath.Join(tmp, "mesh-provisioner-read-*"))
			require.Empty(t, left, "the temporary store is removed")
		})
	}
	// Every cut of the archive is refused.
	for n := 0; n < len(whole); n += max(1, len(whole)/50) {
		l, err := replay.FromArchive(ctx, write("cut.mph", whole[:n]), nil)
		if err == nil {
			l.Close()
			t.Fatalf("the archive cut at %d of %d bytes was read as whole", n, len(whole))
		}
	}
	l, err := replay.FromArchive(ctx, good, nil)
	require.NoError(t, err)
	l.Close()
}

// An export interrupted midway (the first SIGINT cancels the command's context) leaves nothing: no
// file of the archive's name for a later replay to read as whole, and no spool or temporary file.
func TestExport_InterruptedLeavesNothing(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServer(t)
	_, js := natstest.Connect(t, ns.ClientURL())
	needsPuts(t, js, 10000)
	dir := t.TempDir()
	out := filepath.Join(dir, "incident.mph")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	_, err := replay.ExportNATS(ctx, js, []string{provisioner.BucketNeeds}, out, "test", func(done, total int64) {
		if done > 0 && done < total {
			cancel()
		}
	})
	require.ErrorIs(t, err, context.Canceled)
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Empty(t, entries, "nothing left where the archive would be")
}
