package provisioner

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
