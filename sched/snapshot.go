package sched

import "github.com/kvactors/kvactors/messages"

// RequestSnapshot is a point-in-time copy of a request's store state, for the
// P.E.status reply and for tests. It shares no memory with the Request.
type RequestSnapshot struct {
	Request  string `json:"request"`
	Phase    Phase  `json:"phase"`
	Prompt   int    `json:"prompt_tokens"`
	Computed int    `json:"computed"`
	Total    int    `json:"total"`
	// T is the offloadable tokens (PROTOCOL.md, "What kvactors does").
	T        int             `json:"offloadable_tokens"`
	Hashes   int             `json:"hashes"`
	InFlight []JobID         `json:"in_flight"` // store jobs not yet done, oldest first
	Groups   []GroupSnapshot `json:"groups"`
}

// GroupSnapshot is one group's part of a RequestSnapshot.
type GroupSnapshot struct {
	Cursor messages.ChunkIndex `json:"cursor"` // chunks below it were decided
	Ready  messages.ChunkIndex `json:"ready"`  // the ready prefix now
	// Deferred is the term holding back chunk Ready when something about it is
	// already known ("none" otherwise).
	Deferred DeferReason           `json:"deferred"`
	Blocks   int                   `json:"blocks"` // GPU block ids tracked
	Redo     []messages.ChunkIndex `json:"redo"`   // chunks below Cursor to offer again
}

// Snapshot returns the request's state now. It changes nothing.
func (r *Request) Snapshot() RequestSnapshot {
	tm := r.readyTerms()
	s := RequestSnapshot{Request: r.id, Phase: r.phase, Prompt: r.prompt, Computed: r.computed,
		Total: r.total, T: tm.tokens, Hashes: len(r.hashes), InFlight: []JobID{},
		Groups: make([]GroupSnapshot, len(r.groups))}
	for j := r.inflight; j != nil; j = j.next {
		s.InFlight = append(s.InFlight, j.ID)
	}
	for g := range r.groups {
		gr := &r.groups[g]
		rd, reason, best := r.ready(g, tm)
		if best <= rd {
			reason = DeferNone
		}
		s.Groups[g] = GroupSnapshot{Cursor: gr.cursor, Ready: rd, Deferred: reason,
			Blocks: len(gr.blocks), Redo: append([]messages.ChunkIndex{}, gr.redo()...)}
	}
	return s
}

// MarshalText makes a Phase a JSON string ("running", …).
func (p Phase) MarshalText() ([]byte, error) { return []byte(p.String()), nil }

// MarshalText makes a DeferReason a JSON string ("tokens", …).
func (r DeferReason) MarshalText() ([]byte, error) { return []byte(r.String()), nil }
