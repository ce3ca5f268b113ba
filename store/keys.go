package store

import (
	"bytes"
	"encoding/binary"
	"strings"

	provisioner "github.com/novox/mesh-provisioner"
)

// Key prefixes: the first byte of every key says what it holds (doc.go has the whole layout).
const (
	prefixMeta       = 0x01
	prefixCheckpoint = 0x02
	prefixRow        = 0x03
	prefixIndex      = 0x04
	prefixAnomaly    = 0x05
	prefixHistory    = 0x06
	prefixEvent      = 0x07
	prefixPlan       = 0x08
	prefixMarks      = 0x09 // the event log's floor and gaps (history.go)
	prefixNodeAnom   = 0x0a // anomaly rows per node (nodeanom.go)
	prefixExpiry     = 0x0b // TTL'd puts still newest of their key (expiry.go)
)

// appendEsc appends s with every 0x00 byte written 0x00 0xff, so that the terminator 0x00 0x01 that
// follows a component sorts before any longer component with the same beginning, and byte order and
// prefixes of s are kept.
func appendEsc(dst []byte, s string) []byte {
	// Whole runs between zero bytes at a time: a key is appended on every write of every message, and
	// almost none hold a zero byte.
	for {
		i := strings.IndexByte(s, 0)
		if i < 0 {
			return append(dst, s...)
		}
		dst = append(dst, s[:i+1]...)
		dst = append(dst, 0xff)
		s = s[i+1:]
	}
}

// appendComp appends an escaped component and its terminator.
func appendComp(dst []byte, s string) []byte {
	return append(appendEsc(dst, s), 0x00, 0x01)
}

// unesc reverses appendEsc over a key's tail (it has no terminator).
func unesc(dst, b []byte) []byte {
	for i := 0; i < len(b); i++ {
		dst = append(dst, b[i])
		if b[i] == 0 && i+1 < len(b) && b[i+1] == 0xff {
			i++
		}
	}
	return dst
}

// hasZero reports whether b holds a 0x00 byte, i.e. whether unesc has anything to undo.
func hasZero(b []byte) bool { return bytes.IndexByte(b, 0) >= 0 }

func metaKey(name string) []byte { return append([]byte{prefixMeta}, name...) }

func checkpointKey(bucket string) []byte {
	return appendEsc([]byte{prefixCheckpoint}, bucket)
}

// bucketPrefix is the start of every key of kind p for a bucket.
func bucketPrefix(dst []byte, p byte, bucket string) []byte {
	return appendComp(append(dst, p), bucket)
}

func rowKey(dst []byte, bucket, key string) []byte {
	return appendEsc(bucketPrefix(dst, prefixRow, bucket), key)
}

// indexPrefix is the start of a secondary index's entries for one indexed value.
func indexPrefix(dst []byte, bucket string, idx provisioner.Index, value string) []byte {
	dst = append(bucketPrefix(dst, prefixIndex, bucket), byte(idx))
	return appendComp(dst, value)
}

func indexKey(dst []byte, bucket string, idx provisioner.Index, value, key string) []byte {
	return appendEsc(indexPrefix(dst, bucket, idx, value), key)
}

// Anomaly classes: a key has at most one anomaly row of each.
const (
	classShape byte = 1 << iota // token-count, bad-token, bad-escape, bad-build
	classValue                  // value-not-msgpack, bad-value
	classKind                   // unanswered-kind
)

func anomalyKey(dst []byte, bucket, key string, class byte) []byte {
	return append(appendComp(bucketPrefix(dst, prefixAnomaly, bucket), key), class)
}

func historyKey(dst []byte, bucket, key string, seq uint64) []byte {
	return binary.BigEndian.AppendUint64(appendComp(bucketPrefix(dst, prefixHistory, bucket), key), seq)
}

func eventKey(dst []byte, bucket string, seq uint64) []byte {
	return binary.BigEndian.AppendUint64(bucketPrefix(dst, prefixEvent, bucket), seq)
}

// prefixEnd returns the smallest key greater than every key that starts with p.
func prefixEnd(p []byte) []byte {
	end := append([]byte(nil), p...)
	for i := len(end) - 1; i >= 0; i-- {
		end[i]++
		if end[i] != 0 {
			return end[:i+1]
		}
	}
	return nil // p is all 0xff: no upper bound
}
