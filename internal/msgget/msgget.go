// Package msgget asks a stream's leader for one stored message ($JS.API.STREAM.MSG.GET), not a direct
// get. A KV stream allows direct gets, which any replica answers from what it holds: a follower that has
// not yet stored a message the leader took would say there is none, or name an older one, where the seat
// needs what the leader holds (the first message still held, a key's last message). LastOfMany is the
// one direct get here, many keys' last messages at once, with the answering replica's last sequence
// for its caller to check.
package msgget

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Request says which message to get: the one at Seq; with Next, the first at or after Seq whose
// subject matches Next; with Last, the last whose subject matches Last.
type Request struct {
	Seq  uint64 `json:"seq,omitempty"`
	Next string `json:"next_by_subj,omitempty"`
	Last string `json:"last_by_subj,omitempty"`
}

// Msg is a stored message as the leader answers it; Header is in the NATS/1.0 wire form.
type Msg struct {
	Subject string    `json:"subject"`
	Seq     uint64    `json:"seq"`
	Header  []byte    `json:"hdrs"`
	Data    []byte    `json:"data"`
	Time    time.Time `json:"time"`
}

// APIError is an error the JetStream API answered: Code its HTTP-like status (404 for no such message
// and for no such stream alike), ErrCode the JetStream code that tells them apart.
type APIError struct {
	Code        int    `json:"code"`
	ErrCode     int    `json:"err_code"`
	Description string `json:"description"`
}

func (e *APIError) Error() string {
	return fmt.Sprintf("message get: %d %s", e.Code, e.Description)
}

// Get asks the leader of stream for the message req names, on the JetStream API whose subjects start
// with api ("$JS.API." by default). found is false when the stream holds no such message (not when
// there is no stream: that is an *APIError, as every other refusal is).
func Get(ctx context.Context, nc *nats.Conn, api, stream string, req Request) (m Msg, found bool, err error) {
	body, err := json.Marshal(req)
	if err != nil {
		return Msg{}, false, err
	}
	reply, err := nc.RequestWithContext(ctx, api+"STREAM.MSG.GET."+stream, body)
	if err != nil {
		return Msg{}, false, err
	}
	var resp struct {
		Error   *APIError `json:"error"`
		Message *Msg      `json:"message"`
	}
	if err := json.Unmarshal(reply.Data, &resp); err != nil {
		return Msg{}, false, fmt.Errorf("message get: %w", err)
	}
	switch {
	case resp.Error != nil && resp.Error.ErrCode == int(jetstream.JSErrCodeMessageNotFound):
		return Msg{}, false, nil
	case resp.Error != nil:
		return Msg{}, false, resp.Error
	case resp.Message == nil:
		return Msg{}, false, fmt.Errorf("message get: no message in the answer %q", reply.Data)
	}
	return *resp.Message, true, nil
}

// MaxLasts is the most subjects one LastOfMany asks about: nats-server answers a multi_last get of
// more with 413 Too Many Results.
const MaxLasts = 1024

// Last is a subject's last message as a direct get answers it.
type Last struct {
	Subject string
	Seq     uint64
	Time    time.Time
	Header  nats.Header // the message's own headers, with the direct get's Nats-* ones added
	Data    []byte
}

// Lasts is a multi_last direct get's answer.
type Lasts struct {
	// Msgs are the last messages of the subjects asked about that the stream holds, by sequence.
	Msgs []Last
	// UpTo is the answering replica's last sequence: every message up to it was stored there. 0 when
	// it did not say (an answer with no message at all).
	UpTo uint64
	// Complete is false when maxBytes cut the answer short: a subject with no message in Msgs may then
	// hold one.
	Complete bool
	// Stream is the stream whose store answered (its messages' Nats-Stream header): the one asked, or a
	// mirror of it with MirrorDirect, which answers for its origin under its own name from its own
	// store. Empty when no message came (404).
	Stream string
}

// LastOfMany asks stream for the last message of each subject (at most MaxLasts, none a wildcard) by
// one direct get ($JS.API.DIRECT.GET.<stream> with multi_last), whose messages stop once maxBytes of
// them were sent (the one that passes it included). Unlike Get, any replica of the stream may answer
// (nats-server has no leader-only direct get): a caller that needs what the leader holds checks UpTo
// against a sequence it read from the leader. nats-server 2.15 adds a follower to the stream's direct
// get queue group once it is caught up (checked every 2 s after a leader change: current, or 90% of the
// entries it knows committed applied), and a mirror with MirrorDirect once fewer than 10 messages
// behind (Lasts.Stream then names the mirror: it answers from its own store, at the origin's
// sequences, so UpTo is comparable, but what it removed is its own doing); neither leaves the group
// when it falls behind later (a slow follower, one cut off from its leader but not from its clients),
// and a client's request goes to any member, its own server's or not. A stream that does not allow
// direct gets, or a denied subject, is an error (no responders, or ctx's deadline).
func LastOfMany(ctx context.Context, nc *nats.Conn, api, stream string, subjects []string, maxBytes int) (Lasts, error) {
	if len(subjects) > MaxLasts {
		return Lasts{}, fmt.Errorf("direct get: %d subjects, at most %d", len(subjects), MaxLasts)
	}
	body, err := json.Marshal(struct {
		MultiLast []string `json:"multi_last"`
		MaxBytes  int      `json:"max_bytes,omitempty"`
	}{subjects, maxBytes})
	if err != nil {
		return Lasts{}, err
	}
	inbox := nc.NewRespInbox()
	sub, err := nc.SubscribeSync(inbox)
	if err != nil {
		return Lasts{}, err
	}
	defer sub.Unsubscribe()
	if err := nc.PublishRequest(api+"DIRECT.GET."+stream, inbox, body); err != nil {
		return Lasts{}, err
	}
	var out Lasts
	for {
		m, err := sub.NextMsgWithContext(ctx)
		if err != nil {
			return Lasts{}, fmt.Errorf("direct get: %w", err)
		}
		switch status := m.Header.Get("Status"); status {
		case "":
		case "204": // end of batch
			out.UpTo, _ = strconv.ParseUint(m.Header.Get("Nats-UpTo-Sequence"), 10, 64)
			pending, _ := strconv.ParseUint(m.Header.Get("Nats-Num-Pending"), 10, 64)
			out.Complete = pending == 0
			return out, nil
		case "404": // none of the subjects holds a message
			return Lasts{Complete: true}, nil
		case "503":
			return Lasts{}, fmt.Errorf("direct get: %w", nats.ErrNoResponders)
		default:
			return Lasts{}, fmt.Errorf("direct get: %s %s", status, m.Header.Get("Description"))
		}
		seq, err := strconv.ParseUint(m.Header.Get("Nats-Sequence"), 10, 64)
		if err != nil {
			return Lasts{}, fmt.Errorf("direct get: sequence: %w", err)
		}
		t, err := time.Parse(time.RFC3339Nano, m.Header.Get("Nats-Time-Stamp"))
		if err != nil {
			return Lasts{}, fmt.Errorf("direct get: time stamp: %w", err)
		}
		// nats-server appends its Nats-* headers to the message's own (server/client.go genHeader): the
		// last value is the server's.
		if names := m.Header.Values("Nats-Stream"); len(names) > 0 {
			out.Stream = names[len(names)-1]
		}
		out.Msgs = append(out.Msgs, Last{Subject: m.Header.Get("Nats-Subject"), Seq: seq, Time: t, Header: m.Header, Data: m.Data})
	}
}
