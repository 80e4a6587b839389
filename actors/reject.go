package actors

import (
	"errors"
	"slices"

	"github.com/kvactors/kvactors/sched"
)

// Reject reasons (metric label values) for inputs refused outside sched.
const (
	ReasonBadEvent      = "bad_event"
	ReasonUnknownEngine = "unknown_engine"
	ReasonUnknownReq    = "unknown_request"
	ReasonBadSpec       = "bad_spec"
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
	{sched.ErrBadEventType, ReasonBadEvent},
	{sched.ErrWrongRequest, ReasonBadEvent},
}

// RejectReasons lists every label RejectReason and the Reason* constants
// give (metrics preset them at 0).
func RejectReasons() []string {
	out := []string{ReasonUnknownEngine, ReasonUnknownReq, ReasonBadSpec, ReasonOther}
	for _, r := range rejectReasons {
		if !slices.Contains(out, r.reason) {
			out = append(out, r.reason)
		}
	}
	return out
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
