package replay

import (
	"time"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/store"
)

// forgottenBefore refuses plans asked as of a time t (Unix ns) that a forgotten composed-<node>
// bucket's history was needed for: the seat forgot the bucket when its stream was deleted
// (store.DB.Forget), with its event log, so the plans of its node before then can no longer be folded
// again. Asked for one node, only that node's bucket counts; asked for every node (narrowed by module
// or not), any. From the forgetting on the bucket is known to be gone (it was deleted before), and a
// bucket of the name created later has its own log from its first message: those times answer exactly.
func forgottenBefore(v *store.View, node string, t int64) error {
	refuse := func(bucket string, at int64) error {
		return query.Gone("plans as of %s need the history of %s, which was deleted and forgotten at %s; ask at that time or later%s",
			time.Unix(0, t).UTC().Format(time.RFC3339Nano), bucket, time.Unix(0, at).UTC().Format(time.RFC3339Nano), otherNodes(node))
	}
	if node != "" {
		bucket := provisioner.ComposedPrefix + node
		at, found, err := v.ForgottenAt(bucket)
		if err != nil {
			return err
		}
		if found && t < at {
			return refuse(bucket, at)
		}
		return nil
	}
	var gone string
	var goneAt int64
	err := v.Forgotten(func(bucket string, at int64) {
		if gone == "" && t < at {
			gone, goneAt = bucket, at
		}
	})
	if err != nil {
		return err
	}
	if gone != "" {
		return refuse(gone, goneAt)
	}
	return nil
}

func otherNodes(node string) string {
	if node != "" {
		return ""
	}
	return ", or for another node"
}
