// Package registry keeps mesh-provisioner_registry equal to the compiled table (provisioner.Registry):
// at start and every interval it puts each kind whose stored value differs, and deletes each key the
// table does not hold. Every write names the revision it read (create, or update at that revision), so
// several writers at once converge on the table and never flap: a writer that loses a race reads again
// and finds nothing left to do.
package registry

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"reflect"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	provisioner "github.com/novox/mesh-provisioner"
)

// Writer keeps the registry bucket.
type Writer struct {
	js       jetstream.JetStream
	table    provisioner.RegistryTable
	interval time.Duration
	log      *slog.Logger

	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu     sync.Mutex
	passes int
	writes int
}

// New returns a Writer of table that runs a pass every interval (0 means one hour).
func New(js jetstream.JetStream, table provisioner.RegistryTable, interval time.Duration, log *slog.Logger) *Writer {
	if interval <= 0 {
		interval = time.Hour
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Writer{js: js, table: table, interval: interval, log: log.With("component", "registry")}
}

// Start runs a pass now and every interval until Stop. A failed pass is retried with backoff and
// logged once; it never stops the verb.
func (w *Writer) Start(ctx context.Context) {
	ctx, w.cancel = context.WithCancel(ctx)
	w.wg.Add(1)
	go func() {
		defer w.wg.Done()
		w.loop(ctx)
	}()
}

// Stop stops the writer and waits for it.
func (w *Writer) Stop() {
	if w.cancel != nil {
		w.cancel()
	}
	w.wg.Wait()
}

// Stats says how many passes completed and how many writes (puts and deletes) they made.
func (w *Writer) Stats() (passes, writes int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.passes, w.writes
}

func (w *Writer) loop(ctx context.Context) {
	delay := time.Duration(0)
	failing := false
	backoff := 250 * time.Millisecond
	for {
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		n, err := w.Pass(ctx)
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			if !failing {
				w.log.Warn("registry pass failed; retrying with backoff", "err", err)
				failing = true
			}
			delay = backoff
			backoff = min(backoff*2, 30*time.Second)
			continue
		}
		if failing {
			w.log.Info("registry pass recovered")
			failing = false
		}
		backoff = 250 * time.Millisecond
		if n > 0 {
			w.log.Info("registry written", "writes", n, "kinds", len(w.table.Entries))
		}
		delay = w.interval
	}
}

// Pass makes the bucket equal to the table once, creating the bucket when there is none, and returns
// how many writes it made.
func (w *Writer) Pass(ctx context.Context) (int, error) {
	kv, err := w.js.KeyValue(ctx, provisioner.BucketRegistry)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		kv, err = w.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: provisioner.BucketRegistry, History: 8,
			Description: "mesh-provisioner: which domain answers which kind of placeholder"})
		if errors.Is(err, jetstream.ErrBucketExists) {
			kv, err = w.js.KeyValue(ctx, provisioner.BucketRegistry)
		}
	}
	if err != nil {
		return 0, fmt.Errorf("registry bucket: %w", err)
	}
	writes := 0
	for _, e := range w.table.Entries {
		n, err := w.putKind(ctx, kv, e)
		writes += n
		if err != nil {
			return writes, err
		}
	}
	keys, err := kv.ListKeys(ctx)
	if err != nil {
		return writes, fmt.Errorf("list registry keys: %w", err)
	}
	var stray []string
	for k := range keys.Keys() {
		if _, ok := w.table.Lookup(k); !ok {
			stray = append(stray, k)
		}
	}
	for _, k := range stray {
		entry, err := kv.Get(ctx, k)
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			continue
		}
		if err != nil {
			return writes, fmt.Errorf("read stray kind %q: %w", k, err)
		}
		if err := kv.Delete(ctx, k, jetstream.LastRevision(entry.Revision())); err != nil {
			if isWrongRevision(err) {
				continue // another writer got there first; the next pass looks again
			}
			return writes, fmt.Errorf("delete stray kind %q: %w", k, err)
		}
		writes++
	}
	w.mu.Lock()
	w.passes++
	w.writes += writes
	w.mu.Unlock()
	return writes, nil
}

// putKind writes one kind unless its stored value already decodes to the entry. A lost race is read
// again, a few times at most.
func (w *Writer) putKind(ctx context.Context, kv jetstream.KeyValue, e provisioner.RegistryEntry) (int, error) {
	for attempt := 0; attempt < 5; attempt++ {
		cur, err := kv.Get(ctx, e.Kind)
		switch {
		case errors.Is(err, jetstream.ErrKeyNotFound):
			if _, err := kv.Create(ctx, e.Kind, e.Value()); err != nil {
				if errors.Is(err, jetstream.ErrKeyExists) || isWrongRevision(err) {
					continue
				}
				return 0, fmt.Errorf("create kind %q: %w", e.Kind, err)
			}
			return 1, nil
		case err != nil:
			return 0, fmt.Errorf("read kind %q: %w", e.Kind, err)
		}
		if have, err := provisioner.DecodeRegistryEntry(cur.Value()); err == nil && reflect.DeepEqual(have, e) {
			return 0, nil
		}
		if _, err := kv.Update(ctx, e.Kind, e.Value(), cur.Revision()); err != nil {
			if isWrongRevision(err) {
				continue
			}
			return 0, fmt.Errorf("update kind %q: %w", e.Kind, err)
		}
		return 1, nil
	}
	return 0, fmt.Errorf("kind %q: lost the race to another writer 5 times", e.Kind)
}

func isWrongRevision(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence
}
