package store

import (
	"bytes"
	"hash/maphash"
	"math/bits"

	"github.com/cockroachdb/pebble/v2"
)

// The anomaly sets. Apply must know, for every key a message touches, which anomaly classes the key
// holds, to tell whether a put or a delete clears an anomaly and how the counts move (anomaly rows in
// the checkpoint, per node, composed buckets together). Keeping each bucket's raw keys in memory, as a
// map from key to classes, cost about 100 bytes of heap an anomaly key (99.5 MiB with 1,000,000
// unanswered-kind needs, and a 3 s open; docs/performance.md, session 9), and anomalies at that scale
// are a module rolling out a kind the registry does not know yet, across a mesh.
//
// So a bucket keeps only a set of 64-bit hashes of its raw keys that hold anomaly rows (maphash, with
// a seed of this open's: nobody can choose keys that collide), 10.7 to 16 bytes a key, and the rows
// themselves answer the rest:
//
//   - a hash that is not in the set means the key holds no anomaly row: exact, with no read;
//   - a hash in the set is confirmed by reading the key's anomaly rows (at most three, adjacent in
//     the store) from the committed state, through one iterator per batch: the classes read are the
//     key's own, whichever other key shares its hash.
//
// Two keys may share a hash; shared counts the keys beyond the first of such a hash, so removing one
// key's last anomaly keeps the hash while another key still holds anomaly rows. The set is therefore
// exactly the hashes of the keys holding anomaly rows, as committed, and the classes Apply reads are
// the rows' own: answers are those of the map it replaced.
type anomSet struct {
	// slots is an open-addressing table of hashes, 0 for an empty slot (a hash of 0 is taken as 1),
	// probed linearly from each hash's home slot and kept at most 3/4 full: 8 bytes a slot, 10.7 to 16
	// bytes a key. A Go map of uint64 to struct{} takes 16 bytes a slot (its zero-size value pads the
	// slot) and up to twice the slots.
	slots  []uint64
	n      int               // hashes in slots
	shared map[uint64]uint32 // hashes held by more than one key: how many keys beyond the first
}

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

// find is the slot holding h, or the empty slot its probe ends at.
func (s *anomSet) find(h uint64) (int, bool) {
	i := s.home(h)
	for {
		switch s.slots[i] {
		case h:
			return i, true
		case 0:
			return i, false
		}
		if i++; i == len(s.slots) {
			i = 0
		}
	}
}

func (s *anomSet) has(h uint64) bool {
	if s.n == 0 {
		return false
	}
	_, ok := s.find(h)
	return ok
}

// add counts one more key holding anomaly rows with hash h.
func (s *anomSet) add(h uint64) {
	if s.n > 0 {
		if _, ok := s.find(h); ok {
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
	s.slots[i] = h
	s.n++
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
		k := s.home(s.slots[j])
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
	for _, h := range old {
		if h != 0 {
			i, _ := s.find(h)
			s.slots[i] = h
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

func (db *DB) anomHash(key string) uint64 {
	return nonZero(maphash.String(db.anomSeed, key) & anomHashMask)
}

func (db *DB) anomHashBytes(key []byte) uint64 {
	return nonZero(maphash.Bytes(db.anomSeed, key) & anomHashMask)
}

// nonZero keeps 0 for the table's empty slots.
func nonZero(h uint64) uint64 {
	if h == 0 {
		return 1
	}
	return h
}

// committedClasses reads the anomaly classes a key holds in the committed state: its anomaly rows,
// 0x05 <bucket> 00 01 <raw key> 00 01 <class>, adjacent. The batch's iterator is made at its first
// read; applies are serialised, so what is committed does not change until the batch commits.
func (a *applier) committedClasses(bucket, key string) (byte, error) {
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
