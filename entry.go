package provisioner

import (
	"math"
	"strconv"
	"strings"
	"time"
)

// Op is what a message of a bucket's stream does to its key.
type Op uint8

const (
	OpPut    Op = 1 // a value
	OpDelete Op = 2 // KV-Operation: DEL
	OpPurge  Op = 3 // KV-Operation: PURGE (with Nats-Rollup: sub)
	OpExpire Op = 4 // a TTL marker: Nats-Marker-Reason set
)

func (o Op) String() string {
	switch o {
	case OpPut:
		return "PUT"
	case OpDelete:
		return "DEL"
	case OpPurge:
		return "PURGE"
	case OpExpire:
		return "EXPIRE"
	}
	return "UNKNOWN"
}

// The headers that make a KV message other than a put (CONTRACT section 1).
const (
	// HeaderKVOperation is KV-Operation: DEL or PURGE (a purge also carries Nats-Rollup: sub).
	HeaderKVOperation = "KV-Operation"
	// HeaderMarkerReason is set on a TTL marker, whatever its value.
	HeaderMarkerReason = "Nats-Marker-Reason"
)

// OpOfHeaders reads what a KV message does to its key from its headers (a nats.Header): KV-Operation
// DEL or PURGE, a TTL marker when Nats-Marker-Reason is set with any value (the empty one too), a put
// otherwise. The projector and the registry writer both read messages by it, so what one takes for a
// removed key the other does too.
func OpOfHeaders(h map[string][]string) Op {
	if v := h[HeaderKVOperation]; len(v) > 0 {
		switch v[0] {
		case "DEL":
			return OpDelete
		case "PURGE":
			return OpPurge
		}
	}
	if _, marker := h[HeaderMarkerReason]; marker {
		return OpExpire
	}
	return OpPut
}

// Rollup is what a message's Nats-Rollup header made the server remove from the stream as it stored
// the message: every earlier message of the subjects the message's subject matches (sub), or of the
// whole stream (all). A KV purge is a rollup of its own key; a rollup on a subject with a wildcard
// token (the server stores `$KV.<bucket>.n1.>` as published) or of the whole stream removes other
// keys too, and the projection removes them with it (RemovesOthers).
type Rollup uint8

const (
	RollupNone Rollup = 0
	RollupSub  Rollup = 1 // Nats-Rollup: sub
	RollupAll  Rollup = 2 // Nats-Rollup: all
)

// HeaderRollup is the header that makes a stored message a rollup.
const HeaderRollup = "Nats-Rollup"

// RollupOfHeaders reads a message's rollup; the server reads the value without regard to case.
func RollupOfHeaders(h map[string][]string) Rollup {
	if v := h[HeaderRollup]; len(v) > 0 {
		switch strings.ToLower(v[0]) {
		case "sub":
			return RollupSub
		case "all":
			return RollupAll
		}
	}
	return RollupNone
}

// RemovesOthers reports whether the message's rollup removed keys other than its own: a rollup of
// the whole stream, or of a subject with a wildcard token. A rollup of the whole stream on a subject
// that is no key of the bucket (Foreign) removes every key of it; one of its own subject removes
// none: the stream's subjects never overlap, so no subject added by hand matches a key's.
func (m *Message) RemovesOthers() bool {
	return m.Rollup == RollupAll || m.Rollup == RollupSub && !m.Foreign && HasWildcard(m.Key)
}

// HasWildcard reports whether a key has a token that NATS reads as a wildcard when it matches
// subjects against it: `*`, or `>` as the last token, each the whole token ("a*b" is a literal, and so
// is a `>` with tokens after it: the server's subject tree reads `n1.>.x` as that one subject, and a
// rollup on it purges no other).
func HasWildcard(key string) bool {
	for tok := range strings.SplitSeq(key, ".") {
		if tok == "*" {
			return true
		}
	}
	return key == ">" || strings.HasSuffix(key, ".>")
}

// RollupMatches reports whether a rollup of pattern removes key's earlier messages, as NATS matches a
// subject against a filter: `*` is any one token, a last `>` one or more remaining tokens (any other
// token, a `>` with tokens after it too, is itself).
func RollupMatches(pattern, key string) bool {
	for {
		ptok, prest, pmore := strings.Cut(pattern, ".")
		if ptok == ">" && !pmore {
			return key != ""
		}
		ktok, krest, kmore := strings.Cut(key, ".")
		if ptok != "*" && ptok != ktok {
			return false
		}
		if !pmore || !kmore {
			return pmore == kmore
		}
		pattern, key = prest, krest
	}
}

// HeaderTTL is a message's per-message TTL (jetstream.KeyTTL on a KV put or create).
const HeaderTTL = "Nats-TTL"

// ExpiresOfHeaders reads when the server removes a message stored at t (Unix ns) from its Nats-TTL
// header, as nats-server reads it (getMessageTTL): "never", a Go duration of at least a second, or a
// decimal number of seconds; the server expires it at t plus the TTL in whole seconds (a duration is
// truncated to them). 0 when the message has no TTL, never expires, or has one the server refuses.
// The server writes the TTL it applies into the stored header (raised to the bucket's LimitMarkerTTL
// when shorter), so the stored message says its own expiry.
func ExpiresOfHeaders(h map[string][]string, t int64) int64 {
	v := h[HeaderTTL]
	if len(v) == 0 || v[0] == "" {
		return 0
	}
	var secs int64
	if d, err := time.ParseDuration(v[0]); err == nil {
		if d < time.Second {
			return 0
		}
		secs = int64(d / time.Second)
	} else {
		n, err := strconv.ParseUint(v[0], 10, 63)
		if err != nil || n == 0 {
			return 0 // "never" (any case), or a value the server refuses
		}
		secs = int64(n)
	}
	if secs > (math.MaxInt64-t)/int64(time.Second) {
		return 0 // past any time a seat will see
	}
	return t + secs*int64(time.Second)
}

// ParseOp reads an operation back from its String form.
func ParseOp(s string) (Op, bool) {
	for _, o := range []Op{OpPut, OpDelete, OpPurge, OpExpire} {
		if o.String() == s {
			return o, true
		}
	}
	return 0, false
}

// Message is one message of a bucket's stream as the projection applies it.
type Message struct {
	Seq   uint64 // stream sequence: the key's revision
	Time  int64  // the message's time, Unix nanoseconds
	Key   string // the raw key: the subject after $KV.<bucket>.
	Op    Op
	Value []byte // the value of a put
	// Rollup is the message's Nats-Rollup; the store reads it only when it RemovesOthers.
	Rollup Rollup
	// Foreign says the message's subject is not of $KV.<bucket>. (a subject added to the bucket's
	// stream by hand): it is no key of the bucket, which the KV never reads, and it changes nothing but
	// the applied sequence, unless it is a rollup of the whole stream (Nats-Rollup: all), which the
	// server applied to every key of the bucket too (RemovesOthers). Key is then the whole subject, Op
	// is none, and Value is kept for such a rollup alone.
	Foreign bool
	// Expires is when the server removes a put carrying a per-message TTL (header Nats-TTL): its time
	// plus the TTL, Unix nanoseconds (ExpiresOfHeaders); 0 for a put without one and for any other
	// message. The store remembers such a put while it is its key's newest (store/expiry.go).
	Expires int64
}

// Row is one current entry of a bucket as the store holds it. Key and Value alias the store's memory and
// are valid only until the callback that received the Row returns.
type Row struct {
	Key      []byte // the raw key
	Revision uint64 // stream sequence of the put
	Created  int64  // the put's time, Unix nanoseconds
	Msgpack  bool   // Value is one complete MessagePack object
	Value    []byte
}

// Index names a way of reaching a bucket's rows in one bounded range scan.
type Index byte

const (
	// IndexPrimary: every row by raw key; narrowed by a prefix of the raw key (node, node+module).
	IndexPrimary Index = 'r'
	// IndexModule: needs and applied by module.
	IndexModule Index = 'm'
	// IndexKind: needs by kind.
	IndexKind Index = 'k'
	// IndexCollection: collect by decoded collection name (and node, by raw key prefix within it).
	IndexCollection Index = 'c'
	// IndexContributor: collect by contributor.
	IndexContributor Index = 't'
)

// Range is one bounded scan of a bucket's rows, in byte order of their raw keys.
type Range struct {
	Bucket string
	Index  Index
	Value  string // the indexed value (module, kind, decoded collection, contributor); unused for IndexPrimary
	Prefix string // only raw keys that start with this
	After  string // only raw keys after this one (a cursor); empty for none
}

// Indexes appends to dst the secondary indexes a bucket keeps and, for a key's parts, the value each
// indexes. It is on the path of every message applied: give it a small array's slice, and nothing is
// allocated.
func Indexes(dst []IndexValue, bucket string, p Parts) []IndexValue {
	switch bucket {
	case BucketNeeds:
		return append(dst, IndexValue{IndexModule, p.Module}, IndexValue{IndexKind, p.Kind})
	case BucketApplied:
		return append(dst, IndexValue{IndexModule, p.Module})
	case BucketCollect:
		return append(dst, IndexValue{IndexCollection, p.Collection}, IndexValue{IndexContributor, p.Contributor})
	}
	return dst
}

// IndexValue is one secondary index entry of a key.
type IndexValue struct {
	Index Index
	Value string
}
