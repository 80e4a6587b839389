package sched

import "github.com/kvactors/kvactors/messages"

// Errors returned by Request.Step. Each rejects one event and leaves the
// request unchanged (PROTOCOL.md: "rejects that event with a counted, logged
// error and changes nothing"). Check with errors.Is; each names its reject
// label (messages.RejectLabel).
var (
	ErrHole           = messages.NewRejection(messages.RejectHole, "start past the known length (hole)")
	ErrNegative       = messages.NewRejection(messages.RejectOutOfRange, "negative start")
	ErrConflict       = messages.NewRejection(messages.RejectConflict, "overlap disagrees with what is known")
	ErrBadGroup       = messages.NewRejection(messages.RejectBadGroup, "group out of range")
	ErrBlockRange     = messages.NewRejection(messages.RejectBlockRange, "block id out of range")
	ErrPreempted      = messages.NewRejection(messages.RejectPreempted, "blocks for a preempted request")
	ErrWrongRequest   = messages.NewRejection(messages.RejectBadEvent, "event for another request")
	ErrBadEventType   = messages.NewRejection(messages.RejectBadEvent, "event type not handled by a request")
	ErrReleased       = messages.NewRejection(messages.RejectReleased, "request already released")
	ErrPromptMismatch = messages.NewRejection(messages.RejectPromptMismatch, "added again with a different prompt_tokens")
	// ErrTooLarge: the event would hold more hashes or block ids than
	// max_model_len allows (PROTOCOL.md "Isolation", bounds).
	ErrTooLarge = messages.NewRejection(messages.RejectTooLarge, "more than max_model_len allows")
)
