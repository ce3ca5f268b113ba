package streamread

import (
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// ackPrefix begins the reply subject of every message a JetStream consumer delivers.
const ackPrefix = "$JS.ACK."

// parseMetadata fills md from a delivered message's reply subject (its ack subject), as nats.go's
// Metadata does, in one pass over it and without allocating: nats.go's counts the dots, cuts the
// subject token by token and allocates the metadata, 18% of a bare reader's CPU (docs/performance.md,
// session 20). The subject is, from older servers,
//
//	$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<timestamp>.<pending>
//
// and from newer ones, with the domain ("_" for none) and the account's hash before the stream, and
// tokens after the pending count that nats.go ignores (a random one now):
//
//	$JS.ACK.<domain>.<hash>.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<timestamp>.<pending>.<token>
//
// A subject of 9 tokens, or of 11 and more, is taken; any other is an error. A number token that is
// not all digits is 0, and one past the range of uint64 wraps, as nats.go has them (its fuzz test,
// FuzzParseMetadata, holds the two alike).
func parseMetadata(reply string, md *jetstream.MsgMetadata) error {
	if !strings.HasPrefix(reply, ackPrefix) {
		return fmt.Errorf("%w: reply subject %q", jetstream.ErrNotJSMessage, reply)
	}
	// The tokens after the prefix: the first 9 kept (the newer form's up to its pending count), all
	// counted.
	var toks [9]string
	n := 0
	start := len(ackPrefix)
	for {
		i := strings.IndexByte(reply[start:], '.')
		end := start + i
		if i < 0 {
			end = len(reply)
		}
		if n < len(toks) {
			toks[n] = reply[start:end]
		}
		n++
		if i < 0 {
			break
		}
		start = end + 1
	}
	var t []string
	domain := ""
	switch {
	case n == 7:
		t = toks[:7]
	case n >= 9:
		domain, t = toks[0], toks[2:9]
		if domain == "_" {
			domain = ""
		}
	default:
		return fmt.Errorf("%w: reply subject %q", jetstream.ErrNotJSMessage, reply)
	}
	*md = jetstream.MsgMetadata{
		Stream:       t[0],
		Consumer:     t[1],
		NumDelivered: parseNum(t[2]),
		Timestamp:    time.Unix(0, int64(parseNum(t[5]))),
		NumPending:   parseNum(t[6]),
		Domain:       domain,
	}
	md.Sequence.Stream = parseNum(t[3])
	md.Sequence.Consumer = parseNum(t[4])
	return nil
}

// parseNum is nats.go's reading of a number token: its decimal digits, or 0 when it holds anything
// else or nothing; past the range of uint64 it wraps.
func parseNum(s string) uint64 {
	var n uint64
	for i := 0; i < len(s); i++ {
		d := s[i] - '0'
		if d > 9 {
			return 0
		}
		n = n*10 + uint64(d)
	}
	return n
}
