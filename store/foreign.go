package store

import (
	"strings"

	provisioner "github.com/novox/mesh-provisioner"
)

// A message on a subject added to a bucket's stream by hand (provisioner.Message.Foreign) is no key of
// the bucket and leaves nothing in the log, but one with Nats-Rollup: all purged the whole stream: it
// is a rollup of the whole bucket at its sequence, and the log keeps it as it keeps a rollup on a
// key's subject (the removed keys' purges, and the message's own event under 0x06 and 0x07), so that
// a time point after it resolves to it and export writes it back. Its own event is logged under
// foreignPrefix + its subject, as a purge: no subject NATS routes holds white space (the protocol
// splits on it), so no key of a bucket can be that key, and as a purge of a key no answer ever holds
// it, the trim drops it as any other purge, and a binary that does not know the form reads it as a
// purge of that key with the same rollup, which removes what this one removes (its marker too).

// foreignPrefix starts the logged key of a foreign rollup's own event.
const foreignPrefix = " "

// logForm is the key and op a message is logged and marked under.
func logForm(m *provisioner.Message) (string, provisioner.Op) {
	if m.Foreign {
		return foreignPrefix + m.Key, provisioner.OpPurge
	}
	return m.Key, m.Op
}

// fromLogForm reads back a message logged under key with op and rollup: the foreign rollup it was, or
// the key's message.
func fromLogForm(m provisioner.Message) provisioner.Message {
	if subject, ok := strings.CutPrefix(m.Key, foreignPrefix); ok && m.Op == provisioner.OpPurge && m.Rollup == provisioner.RollupAll {
		m.Key, m.Op, m.Foreign = subject, 0, true
	}
	return m
}

// Message is the message an event of key was logged from, as Apply takes it again (a foreign rollup's
// too). Its Value aliases the event's.
func (ev *Event) Message(key []byte) provisioner.Message {
	return fromLogForm(provisioner.Message{Seq: ev.Seq, Time: ev.Time, Key: string(key), Op: ev.Op, Value: ev.Value, Rollup: ev.Rollup})
}
