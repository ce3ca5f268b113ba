package query

import (
	"fmt"
	"unicode/utf8"

	"github.com/nats-io/nats.go"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/mpk"
)

// An answer is one NATS message, so it is bounded by the server's max_payload (1 MiB by default),
// whatever a request asks: a limit of 10000 rows, values of hundreds of KB, or keys of 4 KB that are
// all out of shape. Past the bound the message would not be sent at all and the asker would wait for
// its timeout, so the bound is kept while the answer is written:
//
//   - the answer's anomalies are written first, aside (writeAhead), to know what they take; rows stop
//     at the bound less what those anomalies take, or less a quarter of the bound when they take
//     more, and less the tail; the page ends early with next set, as at its limit. A page with few
//     anomalies thus carries rows up to near the whole bound, and three quarters stay the worst case;
//   - anomalies follow the rows, as written aside when they fit (byte for byte what writing them in
//     place gives), else written again in place up to what is left but for the tail;
//     anomalies_total still counts every one;
//   - a row that alone would take more than the rows' share is answered without its value:
//     "value": null and "value_omitted" with the value's size in bytes (the bucket still holds it);
//   - the text of an error answer, which may quote the request, is clipped to about maxErrorText.
//
// docs/decisions.md says the same for users.

const (
	// maxErrorText bounds the text of an error answer (header and body each carry it).
	maxErrorText = 1024
	// tailReserve is kept free for what follows the rows and anomalies: anomalies_total, as_of,
	// synced and next (whose key is counted on its own).
	tailReserve = 256
)

// clipText shortens s to about maxErrorText bytes by leaving out its middle (on rune boundaries),
// where a long quoted value sits, and keeps its end, which says what to do.
func clipText(s string) string {
	if len(s) <= maxErrorText {
		return s
	}
	head, tail := maxErrorText/2, len(s)-maxErrorText/4
	for head > 0 && !utf8.RuneStart(s[head]) {
		head--
	}
	for tail < len(s) && !utf8.RuneStart(s[tail]) {
		tail++
	}
	return fmt.Sprintf("%s... (%d bytes left out) ...%s", s[:head], tail-head, s[tail:])
}

// reserveTail keeps n bytes free for the tail beyond tailReserve: the next cursor, once rows are done.
func (e *Encoder) reserveTail(n int) { e.reserve = n }

// SetMaxBytes bounds the answers this encoder writes to n bytes (0: no bound). Reset keeps it.
func (e *Encoder) SetMaxBytes(n int) { e.max = n }

// rowsFull reports whether a row that was just written (and the key that would follow it as next)
// takes the answer past the rows' share of the bound.
func (e *Encoder) rowsFull(key []byte) bool {
	return e.max > 0 && len(e.buf)+len(key)+tailReserve > e.rowsShare()
}

// rowsShare is the bytes the answer may take up to the end of its rows, tail not counted: the bound
// less what the anomalies written ahead take, or less a quarter of it when they take more or were not
// written ahead.
func (e *Encoder) rowsShare() int {
	q := e.max / 4
	if e.part >= 0 && e.part < q {
		q = e.part
	}
	return e.max - q
}

// writeAhead writes, with write, a part of the answer that will follow its rows into an encoder
// aside, as it would be written in the answer's open map, and notes what it takes (rowsShare). It
// returns the encoder aside, or nil with nothing written when the answer has no bound.
func (e *Encoder) writeAhead(write func(a *Encoder) error) (*Encoder, error) {
	if e.max <= 0 {
		return nil, nil
	}
	if e.ahead == nil {
		e.ahead = &Encoder{}
	}
	a := e.ahead
	a.Reset(e.f)
	a.max = e.max
	a.openMap(-1)
	if a.f == FormatJSON {
		a.first[0] = false // members of the answer's map come before the part
	}
	head := len(a.buf)
	if err := write(a); err != nil {
		return nil, err
	}
	e.part = len(a.buf) - head
	return a, nil
}

// appendAhead appends the part a written ahead to the answer when it fits in the bound with the tail,
// and reports whether it did. The bytes are those that writing the part in place gives: the same
// calls from the same state of the open map, whose members in MessagePack are counted.
func (e *Encoder) appendAhead(a *Encoder) bool {
	if a == nil || len(e.buf)+e.part+tailReserve+e.reserve > e.max {
		return false
	}
	e.buf = append(e.buf, a.buf[len(a.buf)-e.part:]...)
	if e.f == FormatJSON {
		e.first[len(e.first)-1] = false
	} else {
		e.count[len(e.count)-1] += a.count[0]
	}
	return true
}

// mark is a point of the answer to go back to: the buffer's length and the open level's state.
type mark struct {
	n     int
	first bool
	count int
}

func (e *Encoder) mark() mark {
	m := mark{n: len(e.buf)}
	if e.f == FormatJSON {
		m.first = e.first[len(e.first)-1]
	} else {
		m.count = e.count[len(e.count)-1]
	}
	return m
}

// rewind drops what was written at the open level since m.
func (e *Encoder) rewind(m mark) {
	e.buf = e.buf[:m.n]
	if e.f == FormatJSON {
		e.first[len(e.first)-1] = m.first
	} else {
		e.count[len(e.count)-1] = m.count
	}
}

// rowOmitted writes a row whose value is too large for any answer: key, revision, created, "value":
// null and "value_omitted" with the stored value's size, and the key's parts.
func (e *Encoder) rowOmitted(w provisioner.What, row *provisioner.Row, p *provisioner.Parts) error {
	full := *row
	full.Value, full.Msgpack = []byte{0xc0}, true // a nil value, written the way every row is
	m := e.mark()
	if err := e.Row(w, &full, p); err != nil {
		return err
	}
	// Reopen the row's map to add value_omitted: in JSON drop the closing brace, in MessagePack write
	// the row again with one member more.
	if e.f == FormatJSON {
		e.buf = e.buf[:len(e.buf)-1]
		e.buf = append(e.buf, `,"value_omitted":`...)
		e.buf = fmt.Appendf(e.buf, "%d}", len(row.Value))
		return nil
	}
	body := append([]byte(nil), e.buf[m.n:]...)
	e.buf = e.buf[:m.n]
	n, hdr := mapLen(body)
	e.buf = mpk.AppendMapHeader(e.buf, n+1)
	e.buf = append(e.buf, body[hdr:]...)
	e.buf = mpk.AppendString(e.buf, "value_omitted")
	e.buf = mpk.AppendUint(e.buf, uint64(len(row.Value)))
	return nil
}

// mapLen reads a MessagePack map header: its member count and its length in bytes.
func mapLen(b []byte) (int, int) {
	switch {
	case b[0]&0xf0 == 0x80:
		return int(b[0] & 0x0f), 1
	case b[0] == 0xde:
		return int(b[1])<<8 | int(b[2]), 3
	default: // 0xdf
		return int(b[1])<<24 | int(b[2])<<16 | int(b[3])<<8 | int(b[4]), 5
	}
}

// boundedAnomaly returns a function that writes anomaly rows while they fit in the bound, and drops
// the rest (anomalies_total still counts them).
func (e *Encoder) boundedAnomaly() func(provisioner.Anomaly) {
	full := false
	return func(a provisioner.Anomaly) {
		if full {
			return
		}
		m := e.mark()
		e.Anomaly(a)
		if e.max > 0 && len(e.buf)+tailReserve+e.reserve > e.max {
			e.rewind(m)
			full = true
		}
	}
}

// maxAnswer is the largest answer the connection can send.
func maxAnswer(nc *nats.Conn) int {
	if nc == nil {
		return 0
	}
	return int(nc.MaxPayload())
}

// tooLarge is the error of an answer that could not be sent even so.
func tooLarge(n, max int) error {
	return fmt.Errorf("the answer is %d bytes, more than the %d bytes a NATS message may carry here: ask with a smaller limit", n, max)
}
