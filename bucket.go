package provisioner

import "strings"

// The four buckets of the provisioner (CONTRACT section 1).
const (
	BucketRegistry = "mesh-provisioner_registry"
	BucketNeeds    = "mesh-provisioner_needs"
	BucketApplied  = "mesh-provisioner_applied"
	BucketCollect  = "mesh-provisioner_collect"
)

// The plans' input buckets (CONTRACT section 6), read only.
const (
	BucketHostModules   = "mesh-host_modules"
	BucketIndexerBuilds = "mesh-indexer_builds"
	// ComposedPrefix starts the name of every node's composition bucket, composed-<node>.
	ComposedPrefix = "composed-"
)

// What names a question the verb answers and, for the four provisioner buckets, the bucket it reads.
type What string

const (
	WhatRegistry What = "registry"
	WhatNeeds    What = "needs"
	WhatApplied  What = "applied"
	WhatCollect  What = "collect"
	WhatPlans    What = "plans"
)

// Shape is the key shape of a bucket: how many tokens its keys have and what they are called.
type Shape struct {
	Bucket string
	What   What
	// Tokens names the key's tokens in order, as written in the contract (<node>, <module>, ...).
	Tokens []string
	// Escaped is the index of the token that holds an =XX escaped name (the collection), or -1.
	Escaped int
}

// String is the shape as the contract writes it: <node>.<module>.<kind>.<name>.
func (s Shape) String() string {
	var b strings.Builder
	for i, t := range s.Tokens {
		if i > 0 {
			b.WriteByte('.')
		}
		b.WriteByte('<')
		b.WriteString(t)
		b.WriteByte('>')
	}
	return b.String()
}

// The shapes of the provisioner's buckets.
var (
	ShapeRegistry = Shape{Bucket: BucketRegistry, What: WhatRegistry, Tokens: []string{"kind"}, Escaped: -1}
	ShapeNeeds    = Shape{Bucket: BucketNeeds, What: WhatNeeds, Tokens: []string{"node", "module", "kind", "name"}, Escaped: -1}
	ShapeApplied  = Shape{Bucket: BucketApplied, What: WhatApplied, Tokens: []string{"node", "module"}, Escaped: -1}
	ShapeCollect  = Shape{Bucket: BucketCollect, What: WhatCollect, Tokens: []string{"node", "collection", "contributor"}, Escaped: 1}

	ShapeHostModules   = Shape{Bucket: BucketHostModules, What: WhatPlans, Tokens: []string{"node", "module"}, Escaped: -1}
	ShapeIndexerBuilds = Shape{Bucket: BucketIndexerBuilds, What: WhatPlans, Tokens: []string{"module"}, Escaped: -1}
	// ShapeComposed is the shape of every composed-<node> bucket; Bucket is the prefix.
	ShapeComposed = Shape{Bucket: ComposedPrefix, What: WhatPlans, Tokens: []string{"module", "build"}, Escaped: -1}
)

// ProvisionerShapes are the four buckets of the provisioner, in the order the projector starts them.
var ProvisionerShapes = []Shape{ShapeRegistry, ShapeNeeds, ShapeApplied, ShapeCollect}

// ShapeOf returns the shape of a bucket by name, including composed-<node> buckets.
func ShapeOf(bucket string) (Shape, bool) {
	switch bucket {
	case BucketRegistry:
		return ShapeRegistry, true
	case BucketNeeds:
		return ShapeNeeds, true
	case BucketApplied:
		return ShapeApplied, true
	case BucketCollect:
		return ShapeCollect, true
	case BucketHostModules:
		return ShapeHostModules, true
	case BucketIndexerBuilds:
		return ShapeIndexerBuilds, true
	}
	if node, ok := ComposedNode(bucket); ok && ValidToken(node) {
		s := ShapeComposed
		s.Bucket = bucket
		return s, true
	}
	return Shape{}, false
}

// ComposedNode returns the node of a composed-<node> bucket name.
func ComposedNode(bucket string) (string, bool) {
	if !strings.HasPrefix(bucket, ComposedPrefix) || len(bucket) == len(ComposedPrefix) {
		return "", false
	}
	return bucket[len(ComposedPrefix):], true
}

// IsComposedBucket reports whether a bucket is a composed-<node> bucket the seat reads: its node is a
// key token (IsPlanInput). Such a bucket is forgotten on its own when its stream is deleted or reset.
func IsComposedBucket(bucket string) bool {
	node, ok := ComposedNode(bucket)
	return ok && ValidToken(node)
}

// ShapeOfWhat returns the shape of the bucket a question reads; plans has none of its own.
func ShapeOfWhat(w What) (Shape, bool) {
	switch w {
	case WhatRegistry:
		return ShapeRegistry, true
	case WhatNeeds:
		return ShapeNeeds, true
	case WhatApplied:
		return ShapeApplied, true
	case WhatCollect:
		return ShapeCollect, true
	}
	return Shape{}, false
}

// StreamName is the JetStream stream behind a KV bucket.
func StreamName(bucket string) string { return "KV_" + bucket }

// SubjectPrefix is the prefix of every subject of a KV bucket's stream; the key follows it.
func SubjectPrefix(bucket string) string { return "$KV." + bucket + "." }
