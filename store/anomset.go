package store

import (
	"bytes"
	"errors"
	"hash/maphash"
	"math/bits"

	"github.com/cockroachdb/pebble/v2"
)

// The anomaly sets. Apply must know, for every key a message touches, which anomaly classes the key
// holds, to tell whether a put or a delete clears an anomaly and how the counts move (anomaly rows in
// the checkpoint, per node, composed buckets together). Keeping each bucket's raw keys in memory, as a
// map from key to classes, cost about 100 bytes of heap an anomaly key (99.5 MiB with 1,000,000
// unanswered-kind needs, and a 2.7 s open; docs/performance.md, session 9), and anomalies at that
// scale are a module rolling out a kind the registry does not know yet, across a mesh.
//
// So a bucket keeps only a set of 60-bit hashes of its raw keys that hold anomaly rows (maphash, with
// a seed of this open's: nobody can choose keys that collide), each with the classes of the key that
// holds it, in one 64-bit word: 10.7 to 16 bytes a key. The rows themselves confirm the rest:
//
//   - a hash that is not in the set means the key holds no anomaly row: exact, with no read;
//   - a hash that one key holds, with its classes: the key is that one exactly when it holds the
//     anomaly row of one of those classes, one point read (Get), which finds a row written lately in
//     the memtable and stops there;
//   - a hash that more than one key has held since the open (unknown): the key's anomaly rows are read
//     (at most three, adjacent), through one iterator per batch.
//
// A step that touches many keys in key order (a rollup's removals, the re-evaluation of every need
// of a kind the registry gained or lost) reads every key whose hash is in the set through that
// iterator, as for an unknown hash: each seek steps forward from the one before, where a Get each
// searched every level again (a Get a key took 5 to 7 µs there, doubling the CPU of a whole-bucket
// rollup of needs that all held an anomaly).
//
// shared counts the keys beyond the first of a hash, so removing one key's last anomaly keeps the hash
// while another key still holds anomaly rows; a hash once shared stays unknown, the classes of the
// key left being those its rows say. The set is therefore exactly the hashes of the keys holding
// anomaly rows, as committed, and the classes Apply reads are the rows' own: answers are those of the
// map it replaced.
type anomSet struct {
	// slots is an open-addressing table of words: the hash in the top 60 bits, 0 for an empty slot
	// (a hash of 0 is taken as 1), and the low bits anomClasses and anomUnknown; probed linearly
	// from each hash's home slot and kept at most 3/4 full: 8 bytes a slot, 10.7 to 16 bytes a key.
	// A Go map of uint64 to struct{} takes 16 bytes a slot (its zero-size value pads the slot) and up
	// to twice the slots.
	slots  []uint64
	n      int               // hashes in slots
	shared map[uint64]uint32 // hashes held by more than one key: how many keys beyond the first
}

const (
	anomClasses uint64 = 0x7 // the classes of the one key holding the hash
	anomUnknown uint64 = 0x8 // more than one key has held the hash: read the key's rows
	anomMeta           = anomClasses | anomUnknown
)

// newAnomSet makes a set with room for about hint keys.
func newAnomSet(hint int) anomSet {
	if hint <= 0 {
		return anomSet{}
	}
	return anomSet{slots: make([]uint64, max(16, hint*3/2))}
}

// home is the slot a hash's probe starts at (a multiply-shift: any table size will do).
func (s *anomSet) home(h uint64) int {
	hi, _ := bits.Mul64(h, uint64(len(s.slots)))
	return int(hi)
}

// find is the slot holding hash h (its meta bits clear), or the empty slot its probe ends at.
func (s *anomSet) find(h uint64) (int, bool) {
	i := s.home(h)
	for {
		switch w := s.slots[i]; {
		case w&^anomMeta == h:
			return i, true
		case w == 0:
			return i, false
		}
		if i++; i == len(s.slots) {
			i = 0
		}
	}
}

// lookup is the meta bits of hash h, when the set holds it.
func (s *anomSet) lookup(h uint64) (uint64, bool) {
	if s.n == 0 {
		return 0, false
	}
	i, ok := s.find(h)
	if !ok {
		return 0, false
	}
	return s.slots[i] & anomMeta, true
}

func (s *anomSet) has(h uint64) bool {
	_, ok := s.lookup(h)
	return ok
}

// add counts one more key holding anomaly rows with hash h, of the given classes.
func (s *anomSet) add(h uint64, classes byte) {
	if s.n > 0 {
		if i, ok := s.find(h); ok {
			s.slots[i] |= anomUnknown
			if s.shared == nil {
				s.shared = map[uint64]uint32{}
			}
			s.shared[h]++
			return
		}
	}
	if (s.n+1)*4 > len(s.slots)*3 {
		s.resize(max(16, (s.n+1)*2))
	}
	i, _ := s.find(h)
	s.slots[i] = h | uint64(classes)&anomClasses
	s.n++
}

// update records the classes the key holding hash h holds now (still some), when it is the one key.
func (s *anomSet) update(h uint64, classes byte) {
	if s.n == 0 {
		return
	}
	if i, ok := s.find(h); ok && s.slots[i]&anomUnknown == 0 {
		s.slots[i] = h | uint64(classes)&anomClasses
	}
}

// remove counts one key fewer holding anomaly rows with hash h.
func (s *anomSet) remove(h uint64) {
	if k, ok := s.shared[h]; ok {
		if k <= 1 {
			delete(s.shared, h)
		} else {
			s.shared[h] = k - 1
		}
		return
	}
	if s.n == 0 {
		return
	}
	i, ok := s.find(h)
	if !ok {
		return
	}
	// Backward shift: each hash after i in its run moves into the hole when its probe passes it.
	for j := i; ; {
		if j++; j == len(s.slots) {
			j = 0
		}
		if s.slots[j] == 0 {
			break
		}
		k := s.home(s.slots[j] &^ anomMeta)
		if i <= j && (k <= i || k > j) || i > j && k <= i && k > j {
			s.slots[i] = s.slots[j]
			i = j
		}
	}
	s.slots[i] = 0
	s.n--
	if s.n == 0 {
		s.slots = nil
	} else if len(s.slots) > 64 && s.n*8 < len(s.slots) {
		s.resize(s.n * 2) // a set whose anomalies cleared gives its memory back
	}
}

func (s *anomSet) resize(size int) {
	old := s.slots
	s.slots = make([]uint64, size)
	for _, w := range old {
		if w != 0 {
			i, _ := s.find(w &^ anomMeta)
			s.slots[i] = w
		}
	}
}

// keys is how many keys hold anomaly rows.
func (s *anomSet) keys() int {
	n := s.n
	for _, k := range s.shared {
		n += int(k)
	}
	return n
}

// anomHashMask narrows the hashes (tests: a few bits make keys share hashes, to exercise shared).
var anomHashMask = ^uint64(0)

// anomHash is a raw key's hash in its bucket's set: 60 bits, never 0.
func (db *DB) anomHash(key string) uint64 {
	return anomTag(maphash.String(db.anomSeed, key))
}

func (db *DB) anomHashBytes(key []byte) uint64 { return anomTag(maphash.Bytes(db.anomSeed, key)) }

func anomTag(h uint64) uint64 {
	h = (h & anomHashMask) << 4
	if h == 0 {
		return 1 << 4
	}
	return h
}

// anomRead, when set (tests), is told each read that confirms a hash found in a set: a Get
// (hasAnomalyRow) or the key's rows through the batch's iterator (committedClasses).
var anomRead func(get bool)

// hasAnomalyRow reads whether a key holds the committed anomaly row of one class.
func (a *applier) hasAnomalyRow(bucket, key string, class byte) (bool, error) {
	if anomRead != nil {
		anomRead(true)
	}
	a.anomKey = anomalyKey(a.anomKey[:0], bucket, key, class)
	_, closer, err := a.db.pdb.Get(a.anomKey)
	if errors.Is(err, pebble.ErrNotFound) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return true, closer.Close()
}

// committedClasses reads the anomaly classes a key holds in the committed state: its anomaly rows,
// 0x05 <bucket> 00 01 <raw key> 00 01 <class>, adjacent. The batch's iterator is made at its first
// read; applies are serialised, so what is committed does not change until the batch commits.
func (a *applier) committedClasses(bucket, key string) (byte, error) {
	if anomRead != nil {
		anomRead(false)
	}
	if a.anomIt == nil {
		it, err := a.db.pdb.NewIter(&pebble.IterOptions{LowerBound: []byte{prefixAnomaly}, UpperBound: []byte{prefixAnomaly + 1}})
		if err != nil {
			return 0, err
		}
		a.anomIt = it
	}
	a.anomKey = appendComp(bucketPrefix(a.anomKey[:0], prefixAnomaly, bucket), key)
	n := len(a.anomKey)
	// Seeks only, each past the class found (no Next): a seek to a key after the one before steps
	// forward from where that one stopped (Pebble's seek-using-next), so keys read in order cost little.
	var c byte
	for seek := a.anomKey; a.anomIt.SeekGE(seek); {
		k := a.anomIt.Key()
		if len(k) != n+1 || !bytes.HasPrefix(k, a.anomKey[:n]) {
			break
		}
		c |= k[n]
		if k[n] == 0xff {
			break
		}
		a.anomKey = append(a.anomKey[:n], k[n]+1)
		seek = a.anomKey
	}
	return c, a.anomIt.Error()
}
