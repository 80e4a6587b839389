package actors

import (
	"errors"

	"github.com/kvactors/kvactors/sched"
)

// Reject reasons (metric label values) for inputs refused outside sched.
const (
	ReasonBadEvent      = "bad_event"
	ReasonUnknownEngine = "unknown_engine"
	ReasonUnknownReq    = "unknown_request"
	ReasonBadSpec       = "bad_spec"
	ReasonTooLarge      = "too_large" // over max_model_len (ingest's label for over-limit arrays too)
	ReasonLimit         = "limit"     // past a node bound: engines, requests per engine, segments
	ReasonOther         = "other"
)

var rejectReasons = []struct {
	err    error
	reason string
}{
	{sched.ErrHole, "hole"},
	{sched.ErrConflict, "conflict"},
	{sched.ErrBadGroup, "bad_group"},
	{sched.ErrBlockRange, "block_range"},
	{sched.ErrNegative, "out_of_range"},
	{sched.ErrPreempted, "preempted"},
	{sched.ErrReleased, "released"},
	{sched.ErrPromptMismatch, "prompt_mismatch"},
	{sched.ErrTooLarge, ReasonTooLarge},
	{sched.ErrBadEventType, ReasonBadEvent},
	{sched.ErrWrongRequest, ReasonBadEvent},
}

// RejectReason maps a rejection error to its metric label.
func RejectReason(err error) string {
	for _, r := range rejectReasons {
		if errors.Is(err, r.err) {
			return r.reason
		}
	}
	return ReasonOther
}
