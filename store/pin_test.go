package store_test

import (
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/store"
)

// TestDB_ARollupInPartsIsAtomicToConcurrentReaders: while a rollup of n1.> has its removals
// committed in parts, readers in other goroutines (View and RowsView, as the verb and replay open
// them) read either the whole state before it, as of the message before, or the whole state after
// it, as of the rollup: never some of n1's keys gone. A reader that waits for the rollup's sequence
// (min_seq) reads the state after it. A view opened during the parts and closed after the store is
// closed does not panic.
func TestDB_ARollupInPartsIsAtomicToConcurrentReaders(t *testing.T) {
	b := provisioner.BucketNeeds
	all := provisioner.Range{Bucket: b, Index: provisioner.IndexPrimary}
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	var msgs []provisioner.Message
	var before, after []string
	for i := range 60 {
		node := "n1"
		if i%3 == 0 {
			node = "n2"
		}
		key := fmt.Sprintf("%s.m.config.a%02d", node, i)
		msgs = append(msgs, put(uint64(i+1), key, []byte{0xc0}))
		before = append(before, key)
		if node == "n2" {
			after = append(after, key)
		}
	}
	require.NoError(t, db.Apply(b, msgs, 0, false))
	slices.Sort(before)
	slices.Sort(after) // the rollup's own key n1.> is out of shape: an anomaly, no row
	const rollupSeq = 61

	type reader interface {
		Rows(provisioner.Range, func(*provisioner.Row) bool) error
		Checkpoint(string) (store.Checkpoint, error)
		Close() error
	}
	read := func(v reader) (uint64, []string, error) {
		defer v.Close()
		var keys []string
		if err := v.Rows(all, func(row *provisioner.Row) bool {
			keys = append(keys, string(row.Key))
			return true
		}); err != nil {
			return 0, nil, err
		}
		cp, err := v.Checkpoint(b)
		return cp.Applied, keys, err
	}
	check := func(asOf uint64, keys []string) error {
		switch {
		case asOf == rollupSeq-1 && slices.Equal(keys, before), asOf == rollupSeq && slices.Equal(keys, after):
			return nil
		}
		return fmt.Errorf("as of %d: %d keys %v", asOf, len(keys), keys)
	}

	stop := make(chan struct{})
	var wg sync.WaitGroup
	var reads atomic.Int64
	errs := make(chan error, 16)
	for g := range 4 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				var v reader
				var err error
				if g%2 == 0 {
					v, err = db.View()
				} else {
					v, err = db.RowsView()
				}
				if err == nil {
					var asOf uint64
					var keys []string
					if asOf, keys, err = read(v); err == nil {
						err = check(asOf, keys)
					}
				}
				if err != nil {
					errs <- err
					return
				}
				reads.Add(1)
			}
		})
	}
	// A reader waiting for the rollup's sequence, as a request with min_seq does.
	waited := make(chan error, 1)
	go func() {
		for {
			ch := db.Changed(b)
			if seq, _ := db.Applied(b); seq >= rollupSeq {
				break
			}
			<-ch
		}
		v, err := db.RowsView()
		if err != nil {
			waited <- err
			return
		}
		asOf, keys, err := read(v)
		if err == nil && (asOf < rollupSeq || !slices.Equal(keys, after)) {
			err = fmt.Errorf("woken by the rollup, read as of %d: %v", asOf, keys)
		}
		waited <- err
	}()

	var held *store.View
	restore := store.SetRollupPart(5, func(int) error {
		// Each part waits for readers to have read beside it.
		for n := reads.Load(); reads.Load() < n+4; {
			select {
			case err := <-errs:
				return err
			default:
			}
		}
		if held == nil {
			var err error
			held, err = db.View()
			return err
		}
		return nil
	})
	defer restore()
	require.NoError(t, db.Apply(b, []provisioner.Message{rollup(put(rollupSeq, "n1.>", []byte{0xc0}), provisioner.RollupSub)}, 0, false))
	require.NoError(t, <-waited)
	close(stop)
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	asOf, keys, err := read(mustRowsView(t, db))
	require.NoError(t, err)
	require.EqualValues(t, rollupSeq, asOf)
	require.Equal(t, after, keys)

	require.NotNil(t, held)
	require.Error(t, db.Close(), "Pebble says a snapshot is still open")
	require.NotPanics(t, func() { held.Close() })
}

func mustRowsView(t *testing.T, db *store.DB) *store.RowsView {
	t.Helper()
	v, err := db.RowsView()
	require.NoError(t, err)
	return v
}

// TestDB_ARollupStoppedInAPartUnpins: a part that fails ends the pin: views read what is committed
// (the parts before, under the checkpoint before the rollup, while the projector retries), the
// message applied again removes the rest, and the store closes with no snapshot left open.
func TestDB_ARollupStoppedInAPartUnpins(t *testing.T) {
	b := provisioner.BucketNeeds
	all := provisioner.Range{Bucket: b, Index: provisioner.IndexPrimary}
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	var msgs []provisioner.Message
	for i := range 20 {
		msgs = append(msgs, put(uint64(i+1), fmt.Sprintf("n%02d.m.config.a", i), []byte{0xc0}))
	}
	require.NoError(t, db.Apply(b, msgs, 0, false))
	stopped := fmt.Errorf("stopped")
	parts := 0
	restore := store.SetRollupPart(5, func(int) error {
		if parts++; parts == 2 {
			return stopped
		}
		return nil
	})
	roll := rollup(put(21, "n99.m.config.z", []byte{0xc0}), provisioner.RollupAll)
	require.ErrorIs(t, db.Apply(b, []provisioner.Message{roll}, 0, false), stopped)
	restore()
	require.Len(t, rows(t, db, all), 10, "the two parts committed are read")
	asOf, _, err := func() (uint64, []string, error) {
		v := mustRowsView(t, db)
		defer v.Close()
		cp, err := v.Checkpoint(b)
		return cp.Applied, nil, err
	}()
	require.NoError(t, err)
	require.EqualValues(t, 20, asOf)
	require.NoError(t, db.Apply(b, []provisioner.Message{roll}, 0, false))
	require.Equal(t, []string{"n99.m.config.z"}, rows(t, db, all))
	require.NoError(t, db.Close(), "no pinned snapshot left open")
}

// TestDB_ARegistryRollupInPartsRaisesNeedsAtOnce: a rollup of the whole registry removes its kinds in
// parts, and each part raises the needs' unanswered-kind anomalies of the kinds it removed; views
// read none of them until the rollup's own batch, then all of them, with the registry's as_of.
func TestDB_ARegistryRollupInPartsRaisesNeedsAtOnce(t *testing.T) {
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	var regs, needs []provisioner.Message
	entries := provisioner.Registry.Entries
	require.Greater(t, len(entries), 3)
	for i, e := range entries {
		regs = append(regs, put(uint64(i+1), e.Kind, e.Value()))
		needs = append(needs, put(uint64(i+1), "n1.m."+e.Kind+".a", []byte{0x01}))
	}
	require.NoError(t, db.Apply(provisioner.BucketRegistry, regs, 0, false))
	require.NoError(t, db.Apply(provisioner.BucketNeeds, needs, 0, false))
	a, total := anomalies(t, db, provisioner.BucketNeeds, "")
	require.Empty(t, a)
	require.Zero(t, total)

	parts := 0
	restore := store.SetRollupPart(2, func(int) error {
		parts++
		a, total := anomalies(t, db, provisioner.BucketNeeds, "")
		require.Empty(t, a, "part %d", parts)
		require.Zero(t, total, "part %d", parts)
		require.Len(t, rows(t, db, provisioner.Range{Bucket: provisioner.BucketRegistry, Index: provisioner.IndexPrimary}), len(entries), "part %d", parts)
		return nil
	})
	defer restore()
	seq := uint64(len(entries) + 1)
	require.NoError(t, db.Apply(provisioner.BucketRegistry, []provisioner.Message{rollup(put(seq, "zz-none", []byte{0xc0}), provisioner.RollupAll)}, 0, false))
	require.Greater(t, parts, 1)
	a, total = anomalies(t, db, provisioner.BucketNeeds, "")
	require.Len(t, a, len(entries), "every kind removed: every need unanswered")
	require.EqualValues(t, len(entries), total)
}

// TestDB_AViewOpenedAsARollupPinsReadsOneSide: a View that found no pin and is about to snapshot the
// committed state when a rollup in parts starts reads the state before the rollup or after it, never
// a state with some parts committed under the as_of before it. The hook holds the View at that point
// until the rollup has committed two parts (or, when the View holds the rollup off, for a while).
func TestDB_AViewOpenedAsARollupPinsReadsOneSide(t *testing.T) {
	b := provisioner.BucketNeeds
	all := provisioner.Range{Bucket: b, Index: provisioner.IndexPrimary}
	db, err := store.Open(t.TempDir(), store.Options{})
	require.NoError(t, err)
	defer db.Close()
	var msgs []provisioner.Message
	var before []string
	for i := range 20 {
		key := fmt.Sprintf("n1.m.config.a%02d", i)
		msgs = append(msgs, put(uint64(i+1), key, []byte{0xc0}))
		before = append(before, key)
	}
	require.NoError(t, db.Apply(b, msgs, 0, false))

	twoParts := make(chan struct{})
	release := make(chan struct{})
	parts := 0
	defer store.SetRollupPart(5, func(int) error {
		if parts++; parts == 2 {
			close(twoParts)
			<-release
		}
		return nil
	})()
	applied := make(chan error, 1)
	var once sync.Once
	defer store.SetViewSnapshotHook(func() {
		once.Do(func() {
			go func() {
				applied <- db.Apply(b, []provisioner.Message{rollup(put(21, "n1.>", []byte{0xc0}), provisioner.RollupSub)}, 0, false)
			}()
			select {
			case <-twoParts: // the View did not hold the rollup off: it snapshots between parts
			case <-time.After(500 * time.Millisecond): // it did: the rollup waits for the View's snapshot
			}
		})
	})()
	v, err := db.View()
	require.NoError(t, err)
	close(release)
	var keys []string
	require.NoError(t, v.Rows(all, func(row *provisioner.Row) bool {
		keys = append(keys, string(row.Key))
		return true
	}))
	cp, err := v.Checkpoint(b)
	require.NoError(t, err)
	require.NoError(t, v.Close())
	require.NoError(t, <-applied)
	require.EqualValues(t, 20, cp.Applied)
	require.Equal(t, before, keys, "as of 20, every key of n1 is there")
}
