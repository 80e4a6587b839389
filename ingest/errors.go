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

// DetailedEventErrors is how many rejected events of one batch DecodeBatch
// reports one by one, each with a message naming its problem. The rest are
// counted, one EventError per reason, and nothing is formatted for them: a
// body of junk events (`1,` is one) cost about 500 bytes of error text per
// two-byte event, memory and CPU the node's intake byte budget does not see.
const DetailedEventErrors = 16

// EventError reports rejected events of a batch: one (Count 1), or past the
// batch's first DetailedEventErrors rejected events, all the others of one
// reason (a summary). The events are left out of the decoded batch; the
// events around them keep their order.
type EventError struct {
	// Index is the event's position in the batch's "events" array (a
	// summary's: that of the first event it counts).
	Index int
	// Type is the event's "type" as sent (truncated to 64 bytes), or "" if
	// it was missing or not a string. A summary's is "".
	Type string
	// Request is the event's request id if it was a valid one, else "". A
	// summary's is "".
	Request string
	// Err wraps ErrBadEvent and one reason sentinel (ErrWrongType...). A
	// summary's is the same error for every batch (it names no event).
	Err error
	// Count is how many rejected events this reports: 1, or a summary's
	// count.
	Count int
}

// Error implements error so an EventError can be logged or wrapped directly.
func (e EventError) Error() string {
	if e.Count > 1 {
		return fmt.Sprintf("%d events from index %d on: %v", e.Count, e.Index, e.Err)
	}
	return fmt.Sprintf("event %d (type %q, request %q): %v", e.Index, e.Type, e.Request, e.Err)
}

// terseErrs are the errors of the events a summary counts, per reason:
// built once, so such an event costs no formatting (and a summary is found
// by its error).
var terseErrs = func() map[error]error {
	const more = "details are given for the first %d rejected events of a batch only"
	m := map[error]error{nil: fmt.Errorf("%w: "+more, ErrBadEvent, DetailedEventErrors)}
	for _, r := range []error{ErrUnknownType, ErrBadRequestID, ErrWrongType, ErrOutOfRange, ErrBadHash, ErrTooLarge} {
		m[r] = fmt.Errorf("%w: %w: "+more, ErrBadEvent, r, DetailedEventErrors)
	}
	return m
}()

// terse is reason's error for an event a summary counts. A reason the table
// lacks gets one error for all (bad_event, PROTOCOL.md's label for "no more
// specific reason"), so summaries stay one per error.
func terse(reason error) error {
	if err, ok := terseErrs[reason]; ok {
		return err
	}
	return terseErrs[nil]
}

// Unwrap lets errors.Is see the sentinels inside Err.
func (e EventError) Unwrap() error { return e.Err }
