package ingest

import (
	"errors"
	"fmt"
)

// Sentinel errors. Every error this package returns wraps exactly one of the
// first group (what was rejected) and, for events, one of the second group
// (why), so callers can count rejections by errors.Is without parsing text.
var (
	// ErrMalformed: a whole body was rejected (invalid JSON, wrong envelope,
	// over a batch-level limit).
	ErrMalformed = errors.New("malformed body")
	// ErrBadEvent: one event of a batch was rejected; the rest were kept.
	ErrBadEvent = errors.New("bad event")
	// ErrBadSpec: an EngineSpec failed a structural check.
	ErrBadSpec = errors.New("bad engine spec")
	// ErrBadSubject: a subject is not P.E.verb with a valid engine id.
	ErrBadSubject = errors.New("bad subject")
	// ErrBadLimits: Limits.Validate found a bad value.
	ErrBadLimits = errors.New("bad limits")

	// ErrUnknownType: the event "type" is missing or not a protocol type.
	ErrUnknownType = errors.New("unknown event type")
	// ErrBadRequestID: the request id is missing, empty, too long or not UTF-8.
	ErrBadRequestID = errors.New("bad request id")
	// ErrWrongType: a field has the wrong JSON type (a string for an int...).
	ErrWrongType = errors.New("wrong JSON type")
	// ErrOutOfRange: a number is negative, not an integer, or too large.
	ErrOutOfRange = errors.New("value out of range")
	// ErrBadHash: a hash is not lowercase hex of an allowed even length.
	ErrBadHash = errors.New("bad hash")
	// ErrTooLarge: an array is over its limit.
	ErrTooLarge = errors.New("over limit")
)

// reasons pairs each "why" sentinel with its metric label; Reason walks it in
// order, so the first match wins.
var reasons = []struct {
	err   error
	label string
}{
	{ErrUnknownType, "unknown_type"},
	{ErrBadRequestID, "bad_request_id"},
	{ErrWrongType, "wrong_type"},
	{ErrOutOfRange, "out_of_range"},
	{ErrBadHash, "bad_hash"},
	{ErrTooLarge, "too_large"},
	{ErrBadSpec, "bad_spec"},
	{ErrBadSubject, "bad_subject"},
	{ErrMalformed, "malformed"},
	{ErrBadEvent, "bad_event"},
}

// reasonOther labels an error not from this package.
const reasonOther = "other"

// Reasons lists every label Reason returns (metrics preset them at 0).
func Reasons() []string {
	out := make([]string, 0, len(reasons)+1)
	for _, r := range reasons {
		out = append(out, r.label)
	}
	return append(out, reasonOther)
}

// Reason returns a short, bounded label for err (for a metric label or a
// span attribute): "unknown_type", "bad_request_id", "wrong_type",
// "out_of_range", "bad_hash", "too_large", "bad_spec", "bad_subject",
// "malformed", "bad_event", or "other" for an error not from this package.
func Reason(err error) string {
	for _, r := range reasons {
		if errors.Is(err, r.err) {
			return r.label
		}
	}
	return reasonOther
}

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
