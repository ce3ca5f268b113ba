package store_test

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/cockroachdb/pebble/v2"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/store"
)

// dump is every key and value of a store, in key order, as "key=value" in hex.
func dump(tb testing.TB, db *store.DB) map[string]string {
	tb.Helper()
	require.NoError(tb, db.Flush())
	it, err := db.Pebble().NewIter(&pebble.IterOptions{})
	require.NoError(tb, err)
	defer it.Close()
	out := map[string]string{}
	for it.First(); it.Valid(); it.Next() {
		out[string(it.Key())] = fmt.Sprintf("%x", it.Value())
	}
	return out
}

// applyAll applies each bucket's messages, in batches of 50, to db.
func applyAll(tb testing.TB, db *store.DB, hist map[string][]provisioner.Message, skip string) {
	tb.Helper()
	var buckets []string
	for b := range hist {
		if b != skip {
			buckets = append(buckets, b)
		}
	}
	slices.Sort(buckets)
	for _, b := range buckets {
		msgs := hist[b]
		for i := 0; i < len(msgs); i += 50 {
			require.NoError(tb, db.Apply(b, msgs[i:min(i+50, len(msgs))], 1, false))
		}
	}
}

// isOf reports whether a store key belongs to what forgetting bucket (of node) removes or rewrites:
// the bucket's families (prefix byte, then the bucket's terminated name), its checkpoint, the node's
// build records and plan rows, and the rows' module index entries.
func isOf(k, bucket, node string) bool {
	name := bucket + "\x00\x01"
	switch k[0] {
	case 0x01:
		return k == "\x01composed-anomalies" // the sum of every composed-<node> bucket's anomaly rows
	case 0x02:
		return k[1:] == bucket
	case 0x03, 0x04, 0x05, 0x06, 0x07, 0x09, 0x0a, 0x0b:
		return strings.HasPrefix(k[1:], name)
	case 0x08:
		return strings.HasPrefix(k[1:], "b"+node+"\x00\x01") || strings.HasPrefix(k[1:], "r"+node+".") ||
			(k[1] == 'm' && strings.Contains(k, "\x00\x01"+node+"."))
	}
	return false
}

// TestForget_EqualsNeverRead: forgetting a composed-<node> bucket leaves the store byte for byte as a
// store that never read it (but for the forgotten mark), touches no key of anything else, and a stream
// of the same name read afterwards from its first message leaves it as a store that read only that.
func TestForget_EqualsNeverRead(t *testing.T) {
	for seed := uint64(1); seed <= 4; seed++ {
		t.Run(fmt.Sprint("seed ", seed), func(t *testing.T) {
			hist := randomPlanHistory(t, seed, 700)
			const node = "n2"
			bucket := provisioner.ComposedPrefix + node
			require.NotEmpty(t, hist[bucket])
			// A bucket whose name the forgotten one's is a prefix of, which must be kept.
			hist[bucket+"0"] = hist[bucket]

			db, err := store.Open(t.TempDir(), store.Options{})
			require.NoError(t, err)
			defer db.Close()
			applyAll(t, db, hist, "")
			// The bucket's log trimmed, and a gap: its marks must go too.
			msgs := hist[bucket]
			_, err = db.TrimHistory(context.Background(), bucket, msgs[len(msgs)/2].Seq, msgs[len(msgs)/2].Time)
			require.NoError(t, err)
			last := msgs[len(msgs)-1]
			require.NoError(t, db.Apply(bucket, []provisioner.Message{{Seq: last.Seq + 5, Time: last.Time + 1, Key: "m1.1", Op: provisioner.OpDelete}}, 1, false))
			v, err := db.View()
			require.NoError(t, err)
			marks, err := v.HistoryMarks(bucket)
			v.Close()
			require.NoError(t, err)
			require.NotZero(t, marks.Floor)
			require.NotEmpty(t, marks.Gaps)
			before := dump(t, db)

			require.NoError(t, db.Forget(bucket, 1234))
			after := dump(t, db)
			never, err := store.Open(t.TempDir(), store.Options{})
			require.NoError(t, err)
			defer never.Close()
			applyAll(t, never, hist, bucket)
			want := dump(t, never)

			v, err = db.View()
			require.NoError(t, err)
			at, found, err := v.ForgottenAt(bucket)
			require.NoError(t, err)
			require.True(t, found)
			require.Equal(t, int64(1234), at)
			var listed []string
			require.NoError(t, v.Forgotten(func(b string, _ int64) { listed = append(listed, b) }))
			require.Equal(t, []string{bucket}, listed)
			v.Close()
			markKey := ""
			for k := range after {
				if _, ok := before[k]; !ok && k[0] == 0x09 {
					markKey = k
				}
			}
			require.NotEmpty(t, markKey, "the forgotten mark")
			delete(after, markKey)
			require.Equal(t, want, after, "forgotten, the store is the one that never read the bucket")

			changed := 0
			for k, val := range before {
				if isOf(k, bucket, node) {
					if after[k] != val {
						changed++
					}
					continue
				}
				require.Equal(t, val, after[k], "key %q of something else", k)
			}
			require.NotZero(t, changed)
			require.NotContains(t, db.Buckets(), bucket)
			require.Zero(t, db.Checkpoint(bucket).Applied)

			// Forgotten again earlier: the later time stays.
			require.NoError(t, db.Forget(bucket, 1000))
			v, err = db.View()
			require.NoError(t, err)
			at, _, err = v.ForgottenAt(bucket)
			v.Close()
			require.NoError(t, err)
			require.Equal(t, int64(1234), at)
			// So does a mark set from an archive (SetForgottenAt), earlier or later.
			markAt := func() int64 {
				v, err := db.View()
				require.NoError(t, err)
				defer v.Close()
				at, _, err := v.ForgottenAt(bucket)
				require.NoError(t, err)
				return at
			}
			require.NoError(t, db.SetForgottenAt(bucket, 1000))
			require.Equal(t, int64(1234), markAt())
			require.NoError(t, db.SetForgottenAt(bucket, 1300))
			require.Equal(t, int64(1300), markAt())
			require.NoError(t, db.Forget(bucket, 1234))
			require.Equal(t, int64(1300), markAt())

			// Created again: its stream is read from sequence 1.
			for i := 0; i < len(msgs); i += 50 {
				require.NoError(t, db.Apply(bucket, msgs[i:min(i+50, len(msgs))], 1, false))
			}
			again := dump(t, db)
			delete(again, markKey)
			full, err := store.Open(t.TempDir(), store.Options{})
			require.NoError(t, err)
			defer full.Close()
			applyAll(t, full, hist, bucket)
			for i := 0; i < len(msgs); i += 50 {
				require.NoError(t, full.Apply(bucket, msgs[i:min(i+50, len(msgs))], 1, false))
			}
			require.Equal(t, dump(t, full), again, "read again from its start, as a store that read only the new stream")
			require.True(t, bytes.Equal([]byte(markKey[1:len(bucket)+1]), []byte(bucket)))
		})
	}
}

// TestForget_OnlyComposed: the fixed buckets are never forgotten (a deletion of one rebuilds).
func TestForget_OnlyComposed(t *testing.T) {
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	for _, b := range []string{provisioner.BucketNeeds, provisioner.BucketHostModules, "composed-"} {
		require.Error(t, db.Forget(b, 1), b)
	}
}

// TestForget_HistoryLocksDropped: each trim and Forget takes its bucket's history lock; once the last
// holder lets go the lock is gone, so a seat that reads and forgets buckets for months keeps none of
// them. Trims and forgets of the same bucket at once still exclude each other (run it with -race).
func TestForget_HistoryLocksDropped(t *testing.T) {
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	ctx := context.Background()
	const buckets = 200
	done := make(chan error, 2*buckets)
	for i := range buckets {
		bucket := fmt.Sprintf("composed-n%05d", i)
		require.NoError(t, db.Apply(bucket, []provisioner.Message{
			{Seq: 1, Time: 1, Key: "m.1", Op: provisioner.OpPut, Value: []byte{0x80}},
			{Seq: 2, Time: 2, Key: "m.1", Op: provisioner.OpDelete},
		}, 1, false))
		go func() {
			_, err := db.TrimHistory(ctx, bucket, 2, 2)
			if err != nil && strings.Contains(err.Error(), "only 0 is applied") {
				err = nil // the Forget came first: nothing is left to trim
			}
			done <- err
		}()
		go func() { done <- db.Forget(bucket, 3) }()
	}
	var errs []error
	for range 2 * buckets {
		if err := <-done; err != nil {
			errs = append(errs, err)
		}
	}
	require.Empty(t, errs)
	require.Zero(t, db.HistoryLocks(), "every bucket's history lock is dropped once its last holder unlocks")
}
