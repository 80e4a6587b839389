package ingest

import (
	"errors"
	"fmt"

	"github.com/kvactors/kvactors/messages"
)

// Sentinel errors. Every error this package returns wraps exactly one of the
// first group (what was rejected) and, for events, one of the second group
// (why), so callers can count rejections by errors.Is without parsing text.
// Each names its reject label (messages.RejectLabel picks the "why" over the
// "what").
var (
	// ErrMalformed: a whole body was rejected (invalid JSON, wrong envelope,
	// over a batch-level limit).
	ErrMalformed = messages.NewRejection(messages.RejectMalformed, "malformed body")
	// ErrBadEvent: one event of a batch was rejected; the rest were kept.
	ErrBadEvent = messages.NewRejection(messages.RejectBadEvent, "bad event")
	// ErrBadSpec: an EngineSpec failed a structural check.
	ErrBadSpec = messages.NewRejection(messages.RejectBadSpec, "bad engine spec")
	// ErrBadSubject: a subject is not P.E.verb with a valid engine id.
	ErrBadSubject = messages.NewRejection(messages.RejectBadSubject, "bad subject")
	// ErrBadLimits: Limits.Validate found a bad value (configuration, not
	// input: it has no reject label).
	ErrBadLimits = errors.New("bad limits")

	// ErrUnknownType: the event "type" is missing or not a protocol type.
	ErrUnknownType = messages.NewRejection(messages.RejectUnknownType, "unknown event type")
	// ErrBadRequestID: the request id is missing, empty, too long or not UTF-8.
	ErrBadRequestID = messages.NewRejection(messages.RejectBadRequestID, "bad request id")
	// ErrWrongType: a field has the wrong JSON type (a string for an int...).
	ErrWrongType = messages.NewRejection(messages.RejectWrongType, "wrong JSON type")
	// ErrOutOfRange: a number is negative, not an integer, or too large.
	ErrOutOfRange = messages.NewRejection(messages.RejectOutOfRange, "value out of range")
	// ErrBadHash: a hash is not lowercase hex of an allowed even length.
	ErrBadHash = messages.NewRejection(messages.RejectBadHash, "bad hash")
	// ErrTooLarge: an array is over its limit.
	ErrTooLarge = messages.NewRejection(messages.RejectTooLarge, "over limit")
)

// EventError reports one rejected event of a batch. The event is left out of
// the decoded batch; the events around it keep their order.
type EventError struct {
	// Index is the event's position in the batch's "events" array.
	Index int
	// Type is the event's "type" as sent (truncated to 64 bytes), or "" if
	// it was missing or not a string.
	Type string
	// Request is the event's request id if it was a valid one, else "".
	Request string
	// Err wraps ErrBadEvent and one reason sentinel (ErrWrongType...).
	Err error
}

// Error implements error so an EventError can be logged or wrapped directly.
func (e EventError) Error() string {
	return fmt.Sprintf("event %d (type %q, request %q): %v", e.Index, e.Type, e.Request, e.Err)
}

// Unwrap lets errors.Is see the sentinels inside Err.
func (e EventError) Unwrap() error { return e.Err }
