package messages

import "errors"

// Reject labels: the one table of reasons an input is refused, as counted in
// kvactors_events_rejected_total{reason} and listed in docs/PROTOCOL.md. The
// order is the priority when an error carries several (the most specific
// "why" first, the broad "what" last).
const (
	RejectUnknownType    = "unknown_type"
	RejectBadRequestID   = "bad_request_id"
	RejectWrongType      = "wrong_type"
	RejectOutOfRange     = "out_of_range"
	RejectBadHash        = "bad_hash"
	RejectTooLarge       = "too_large"
	RejectHole           = "hole"
	RejectConflict       = "conflict"
	RejectBadGroup       = "bad_group"
	RejectBlockRange     = "block_range"
	RejectPreempted      = "preempted"
	RejectReleased       = "released"
	RejectPromptMismatch = "prompt_mismatch"
	RejectUnknownEngine  = "unknown_engine"
	RejectUnknownRequest = "unknown_request"
	RejectUnknownVerb    = "unknown_verb"
	RejectOverflow       = "overflow"
	RejectLimit          = "limit" // past a node bound: engines, requests per engine, mapped segments or bytes, max_model_len
	RejectBadSpec        = "bad_spec"
	RejectBadSubject     = "bad_subject"
	RejectBadReply       = "bad_reply"
	RejectMalformed      = "malformed"
	RejectBadEvent       = "bad_event"
	RejectOther          = "other"
)

// RejectLabels lists every label in priority order (metrics initialise them).
var RejectLabels = []string{RejectUnknownType, RejectBadRequestID, RejectWrongType, RejectOutOfRange,
	RejectBadHash, RejectTooLarge, RejectHole, RejectConflict, RejectBadGroup, RejectBlockRange,
	RejectPreempted, RejectReleased, RejectPromptMismatch, RejectUnknownEngine, RejectUnknownRequest,
	RejectUnknownVerb, RejectOverflow, RejectLimit, RejectBadSpec, RejectBadSubject, RejectBadReply, RejectMalformed, RejectBadEvent,
	RejectOther}

// Rejection is a sentinel error that names its reject label. Packages that
// refuse input (ingest, sched) declare their sentinels with NewRejection, so
// the label lives with the error and RejectLabel needs no second table.
type Rejection struct {
	Label string
	msg   string
}

// NewRejection is a sentinel error with a reject label.
func NewRejection(label, msg string) *Rejection { return &Rejection{Label: label, msg: msg} }

func (r *Rejection) Error() string { return r.msg }

// RejectLabel is err's reject label: of the Rejections err wraps (through
// any mix of %w and errors.Join), the one earliest in RejectLabels;
// RejectOther when it wraps none.
func RejectLabel(err error) string {
	best := len(RejectLabels)
	var walk func(error)
	walk = func(e error) {
		for e != nil {
			if r, ok := e.(*Rejection); ok {
				for i, l := range RejectLabels[:best] {
					if l == r.Label {
						best = i
						break
					}
				}
			}
			if m, ok := e.(interface{ Unwrap() []error }); ok {
				for _, x := range m.Unwrap() {
					walk(x)
				}
				return
			}
			e = errors.Unwrap(e)
		}
	}
	walk(err)
	if best == len(RejectLabels) {
		return RejectOther
	}
	return RejectLabels[best]
}
