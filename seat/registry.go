package seat

import (
	"context"

	provisioner "github.com/novox/mesh-provisioner"
)

// wakeRegistryOnLoss wakes the registry writer whenever the projection of the registry bucket, synced,
// lacks a kind of the table: someone deleted, purged or expired it, and every need of that kind is
// unanswered until the writer's next pass, up to --registry-interval away. Only a loss wakes it: a
// value edited by hand or a stray waits for the pass, so two seats with different tables (a rolling
// upgrade) do not answer each other's writes at once, over and over.
func (s *Seat) wakeRegistryOnLoss(ctx context.Context) {
	for {
		changed := s.reader.Changed(provisioner.BucketRegistry)
		if s.registryLacksAKind() {
			s.Registry.Wake()
		}
		select {
		case <-ctx.Done():
			return
		case <-changed:
		}
	}
}

// registryLacksAKind reports whether the synced projection of the registry lacks a kind of the table.
func (s *Seat) registryLacksAKind() bool {
	v, synced, err := s.reader.View(provisioner.BucketRegistry)
	if err != nil {
		return false // closed: the seat is stopping, or a rebuild swaps stores and Changed fires again
	}
	defer v.Close()
	if !synced {
		return false // not caught up yet: what it lacks may be on its way
	}
	all := provisioner.Range{Bucket: provisioner.BucketRegistry, Index: provisioner.IndexPrimary}
	for _, e := range s.Registry.Table().Entries {
		if ok, err := v.HasRow(all, e.Kind); err == nil && !ok {
			return true
		}
	}
	return false
}
