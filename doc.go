// Package provisioner holds what the mesh means to mesh-provisioner: the buckets it tails, the shape of
// each bucket's keys, the =XX escape of collection names, the anomaly reasons a key or value out of shape
// is reported under, and the registry table (registry.go).
//
// The mechanisms live in their own packages: store (the Pebble projection), projector (the consumers that
// tail the buckets' streams), query (the verb mesh-provisioner.provisioning), replay (forensics from the
// event log) and fixtures (synthetic meshes). This package imports none of them.
//
// A key is one or more tokens joined by '.'; a token is non-empty and made of A-Z a-z 0-9 - _ / =. A key
// that does not fit its bucket's shape is never dropped: ParseKey says why, and the store keeps it as an
// anomaly row until a later put that fits, or a delete, clears it.
package provisioner
