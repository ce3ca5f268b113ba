package provisioner

import "fmt"

// Reason is the code of an anomaly row: why a key or value does not fit its bucket (CONTRACT section 2).
type Reason string

const (
	// ReasonTokenCount: the key has a different number of tokens than its bucket's shape.
	ReasonTokenCount Reason = "token-count"
	// ReasonBadToken: a token is empty or holds a byte outside A-Z a-z 0-9 - _ / =. The contract's keys
	// are made of such tokens but it names no code for one that is not; see docs/decisions.md.
	ReasonBadToken Reason = "bad-token"
	// ReasonBadEscape: a collection token holds '=' not followed by two hex digits, or decodes to
	// invalid UTF-8.
	ReasonBadEscape Reason = "bad-escape"
	// ReasonValueNotMsgpack: the value is not one complete MessagePack object. The key still answers.
	ReasonValueNotMsgpack Reason = "value-not-msgpack"
	// ReasonUnansweredKind: a need's kind is a kind no registry entry answers. The key still answers.
	ReasonUnansweredKind Reason = "unanswered-kind"
	// ReasonBadBuild: a composition's build is not a decimal number (plans' inputs only).
	ReasonBadBuild Reason = "bad-build"
	// ReasonBadValue: a plans' input value lacks what it must hold (plans' inputs only).
	ReasonBadValue Reason = "bad-value"
)

// Anomaly is one anomaly row: a key of a bucket that does not fit, and why.
type Anomaly struct {
	Bucket   string
	Key      string // the raw key
	Revision uint64 // stream sequence of the message
	Reason   Reason
	Detail   string // human text after the code, may be empty
}

// Text is the reason as answered: the code, then the human text after ": " when there is one.
func (a Anomaly) Text() string {
	if a.Detail == "" {
		return string(a.Reason)
	}
	return string(a.Reason) + ": " + a.Detail
}

// KeyError says why a key does not fit its bucket's shape.
type KeyError struct {
	Reason Reason
	Detail string
}

func (e *KeyError) Error() string {
	return fmt.Sprintf("key out of shape: %s: %s", e.Reason, e.Detail)
}
