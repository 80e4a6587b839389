package sched

import "errors"

// Errors returned by Request.Step. Each rejects one event and leaves the
// request unchanged (PROTOCOL.md: "rejects that event with a counted, logged
// error and changes nothing"). Check with errors.Is.
var (
	ErrHole           = errors.New("start past the known length (hole)")
	ErrNegative       = errors.New("negative start")
	ErrConflict       = errors.New("overlap disagrees with what is known")
	ErrBadGroup       = errors.New("group out of range")
	ErrBlockRange     = errors.New("block id out of range")
	ErrPreempted      = errors.New("blocks for a preempted request")
	ErrWrongRequest   = errors.New("event for another request")
	ErrBadEventType   = errors.New("event type not handled by a request")
	ErrReleased       = errors.New("request already released")
	ErrPromptMismatch = errors.New("added again with a different prompt_tokens")
	// ErrTooLarge: the event would hold more hashes or block ids than
	// max_model_len allows (PROTOCOL.md "Isolation", bounds).
	ErrTooLarge = errors.New("more than max_model_len allows")
)
