package replay

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/nats-io/nats.go/jetstream"

	provisioner "github.com/novox/mesh-provisioner"
)

// NearKeysInStream lists at most max keys of the bucket's stream that look like key, closest first
// (edit distance, then byte order), for a history that found no revision of key to suggest what was
// meant. It never lists the bucket: the stream is asked for its subjects under filters around the key
// (stream info with a subjects filter, which the server answers from its index of subjects), each as
// narrow as the key allows, in turn, until one finds a key:
//
//   - the key's node and module (`<t0>.<t1>.>`), for a key of three tokens or more;
//   - the key's node (`<t0>.>`);
//   - the same key on any node (`*.<t1>...`), for a typo in the node.
//
// So what is read is bounded by one node's keys (or one key's nodes), not the bucket's, and a bucket of
// millions of keys answers as fast as a small one. A token a filter cannot name literally (a wildcard,
// white space, an empty token) drops the filters that would hold it.
func NearKeysInStream(ctx context.Context, js jetstream.JetStream, bucket, key string, max int) ([]string, error) {
	if _, ok := provisioner.ShapeOf(bucket); !ok {
		return nil, fmt.Errorf("replay: %q is not a bucket the seat tails", bucket)
	}
	s, err := js.Stream(ctx, provisioner.StreamName(bucket))
	if err != nil {
		return nil, fmt.Errorf("stream of %s: %w", bucket, err)
	}
	prefix := provisioner.SubjectPrefix(bucket)
	for _, f := range nearFilters(key) {
		info, err := s.Info(ctx, jetstream.WithSubjectFilter(prefix+f))
		if err != nil {
			return nil, fmt.Errorf("subjects of %s under %s: %w", bucket, f, err)
		}
		keys := make([]string, 0, len(info.State.Subjects))
		for subj := range info.State.Subjects {
			if k := strings.TrimPrefix(subj, prefix); k != key {
				keys = append(keys, k)
			}
		}
		if len(keys) > 0 {
			return closest(key, keys, max), nil
		}
	}
	return nil, nil
}

// nearFilters are the subject filters, without the bucket's prefix, that NearKeysInStream asks in
// turn.
func nearFilters(key string) []string {
	toks := strings.Split(key, ".")
	literal := func(t string) bool {
		return t != "" && t != "*" && t != ">" && !strings.ContainsAny(t, " \t\n\f\r")
	}
	var fs []string
	if len(toks) >= 3 && literal(toks[0]) && literal(toks[1]) {
		fs = append(fs, toks[0]+"."+toks[1]+".>")
	}
	if len(toks) >= 2 && literal(toks[0]) {
		fs = append(fs, toks[0]+".>")
	}
	if len(toks) >= 2 && !slices.ContainsFunc(toks[1:], func(t string) bool { return !literal(t) }) {
		fs = append(fs, "*."+strings.Join(toks[1:], "."))
	}
	return fs
}

// closest sorts keys by their edit distance to key, then in byte order, and keeps the first max.
func closest(key string, keys []string, max int) []string {
	dist := make(map[string]int, len(keys))
	for _, k := range keys {
		dist[k] = editDistance(key, k)
	}
	slices.SortFunc(keys, func(a, b string) int {
		if d := dist[a] - dist[b]; d != 0 {
			return d
		}
		return strings.Compare(a, b)
	})
	return keys[:min(max, len(keys))]
}

// editDistance is the optimal string alignment distance between a and b, in bytes: an insertion, a
// deletion, a substitution or two neighbours swapped each cost one, since a swap is the typo a key's
// reader most often makes (mod-wbe for mod-web).
func editDistance(a, b string) int {
	d := make([][]int, len(a)+1)
	for i := range d {
		d[i] = make([]int, len(b)+1)
		d[i][0] = i
	}
	for j := range d[0] {
		d[0][j] = j
	}
	for i := 1; i <= len(a); i++ {
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			d[i][j] = min(d[i-1][j]+1, d[i][j-1]+1, d[i-1][j-1]+cost)
			if i > 1 && j > 1 && a[i-1] == b[j-2] && a[i-2] == b[j-1] {
				d[i][j] = min(d[i][j], d[i-2][j-2]+1)
			}
		}
	}
	return d[len(a)][len(b)]
}
