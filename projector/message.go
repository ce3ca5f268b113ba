package projector

import (
	"strings"
	"time"

	"github.com/nats-io/nats.go"

	provisioner "github.com/novox/mesh-provisioner"
)

// MessageOf reads a raw message of a bucket's stream (from an archive, or read by hand) as the store
// applies it, with the same rules as the live consumer: the key is the subject after $KV.<bucket>., the
// operation comes from the headers, and only a put keeps its data. A subject of another form is no key
// of the bucket (provisioner.Message.Foreign); of such a message only a rollup is read, and its data is
// kept when it rolls up the whole stream (the store logs it).
func MessageOf(bucket, subject string, h nats.Header, data []byte, seq uint64, t time.Time) (provisioner.Message, error) {
	return messageOf(provisioner.SubjectPrefix(bucket), subject, h, data, seq, t.UnixNano()), nil
}

// messageOf is MessageOf for a bucket's subject prefix, and the live consumer's reading (convert).
func messageOf(prefix, subject string, h nats.Header, data []byte, seq uint64, t int64) provisioner.Message {
	if !strings.HasPrefix(subject, prefix) {
		m := provisioner.Message{Seq: seq, Time: t, Key: subject, Foreign: true, Rollup: provisioner.RollupOfHeaders(h)}
		if m.Rollup == provisioner.RollupAll {
			m.Value = data
		}
		return m
	}
	m := provisioner.Message{Seq: seq, Time: t, Key: subject[len(prefix):], Op: provisioner.OpPut}
	if len(h) > 0 {
		m.Op, m.Rollup = provisioner.OpOfHeaders(h), provisioner.RollupOfHeaders(h)
	}
	if m.Op == provisioner.OpPut {
		m.Value = data
		if len(h) > 0 {
			m.Expires = provisioner.ExpiresOfHeaders(h, t)
		}
	}
	return m
}

// HeadersOf writes the headers a KV message of an operation carries: what MessageOf reads back. The
// event log keeps the operation, not the headers, so this is how a message is written out again; it
// keeps a rollup too when the rollup removed other keys (provisioner.Message.RemovesOthers).
func HeadersOf(op provisioner.Op, rollup provisioner.Rollup) nats.Header {
	var h nats.Header
	switch op {
	case provisioner.OpDelete:
		h = nats.Header{provisioner.HeaderKVOperation: {"DEL"}}
	case provisioner.OpPurge:
		h = nats.Header{provisioner.HeaderKVOperation: {"PURGE"}, provisioner.HeaderRollup: {"sub"}}
	case provisioner.OpExpire:
		h = nats.Header{"Nats-Marker-Reason": {"MaxAge"}}
	}
	if v := rollupValues[rollup]; v != "" {
		if h == nil {
			h = nats.Header{}
		}
		h[provisioner.HeaderRollup] = []string{v}
	}
	return h
}

// rollupValues are the Nats-Rollup values HeadersOf writes.
var rollupValues = map[provisioner.Rollup]string{provisioner.RollupSub: "sub", provisioner.RollupAll: "all"}
