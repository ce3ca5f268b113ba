// Package msgget asks a stream's leader for one stored message ($JS.API.STREAM.MSG.GET), never a
// direct get. A KV stream allows direct gets, which any replica answers from what it holds: a follower
// that has not yet stored a message the leader took would say there is none, or name an older one, where
// the seat needs what the leader holds (the first message still held, a key's last message).
package msgget

import (
	"context"
	"encoding/json"
	"fmt"
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
