package ingest

import (
	"fmt"
)

// Protocol bounds that are not tunable (PROTOCOL.md "Words" and "EventBatch").
const (
	// MaxEngineIDBytes is the longest engine id: [A-Za-z0-9_-]{1,64}.
	MaxEngineIDBytes = 64
	// MaxEpochBytes is the longest epoch string kvactors accepts.
	MaxEpochBytes = 256
	// ProtocolMaxRequestIDBytes is the protocol's bound on request ids;
	// Limits.MaxRequestIDBytes may only lower it.
	ProtocolMaxRequestIDBytes = 256
	// MaxBlockID is the largest block id: ids are uint32 on the wire.
	MaxBlockID = 1<<32 - 1
	// MaxGPUBlocks bounds num_gpu_blocks: the scheduler's layout indexes
	// blocks with int32 arithmetic (sched.NewLayout refuses more), so a
	// spec past it is refused here, as bad_spec, with the others.
	MaxGPUBlocks = 1 << 31
	// maxTypeBytes bounds the unknown "type" string copied into an
	// EventError, so a hostile body cannot make the error log huge.
	maxTypeBytes = 64
)

// Limits bounds what one body may contain, so that a single message cannot
// make kvactors allocate without bound. The zero value of a field means its
// default (WithDefaults); a negative value is invalid (Validate).
type Limits struct {
	// MaxIDs is the most hashes or block ids in one event, and the most
	// hashes (or ids per group) in one lookup or load body. Default 1<<20.
	MaxIDs int `json:"max_ids"`
	// MaxGroups is the most KV-cache groups in an EngineSpec and in a load
	// body; an event's group must be below it. Default 64.
	MaxGroups int `json:"max_groups"`
	// MaxRequestIDBytes is the longest request id in bytes, at most 256 (the
	// protocol's bound). Default 256.
	MaxRequestIDBytes int `json:"max_request_id_bytes"`
	// MaxHashBytes is the longest hash in raw bytes (hex string length / 2).
	// Default 64.
	MaxHashBytes int `json:"max_hash_bytes"`
	// MaxEvents is the most events in one batch; more rejects the batch.
	// Default 1<<16.
	MaxEvents int `json:"max_events"`
	// MaxSegments is the most segments in an EngineSpec. Default 64.
	MaxSegments int `json:"max_segments"`
	// MaxRegions is the most regions in one group of an EngineSpec (vLLM has
	// one region per layer). Default 4096.
	MaxRegions int `json:"max_regions"`
}

// DefaultLimits returns the default for every field.
func DefaultLimits() Limits {
	return Limits{
		MaxIDs:            1 << 20,
		MaxGroups:         64,
		MaxRequestIDBytes: ProtocolMaxRequestIDBytes,
		MaxHashBytes:      64,
		MaxEvents:         1 << 16,
		MaxSegments:       64,
		MaxRegions:        4096,
	}
}

// WithDefaults returns l with every zero field set to its default. Negative
// fields are kept, for Validate to report.
func (l Limits) WithDefaults() Limits {
	d := DefaultLimits()
	set := func(v *int, def int) {
		if *v == 0 {
			*v = def
		}
	}
	set(&l.MaxIDs, d.MaxIDs)
	set(&l.MaxGroups, d.MaxGroups)
	set(&l.MaxRequestIDBytes, d.MaxRequestIDBytes)
	set(&l.MaxHashBytes, d.MaxHashBytes)
	set(&l.MaxEvents, d.MaxEvents)
	set(&l.MaxSegments, d.MaxSegments)
	set(&l.MaxRegions, d.MaxRegions)
	return l
}

// Validate reports the first bad field of l (after defaults): a negative
// value, a request-id bound over the protocol's 256 bytes, or a bound so
// large that sizes computed from it could overflow.
func (l Limits) Validate() error {
	l = l.WithDefaults()
	const maxInt32 = 1<<31 - 1
	for _, f := range []struct {
		name string
		v    int
		max  int
	}{
		{"max_ids", l.MaxIDs, maxInt32},
		{"max_groups", l.MaxGroups, maxInt32},
		{"max_request_id_bytes", l.MaxRequestIDBytes, ProtocolMaxRequestIDBytes},
		{"max_hash_bytes", l.MaxHashBytes, 1 << 16},
		{"max_events", l.MaxEvents, maxInt32},
		{"max_segments", l.MaxSegments, maxInt32},
		{"max_regions", l.MaxRegions, maxInt32},
	} {
		if f.v < 1 || f.v > f.max {
			return &LimitError{Field: f.name, Value: f.v, Max: f.max}
		}
	}
	return nil
}

// LimitError is Validate's refusal: Field (its JSON name) is Value, not in
// 1..Max; a caller that gives the field another name (the node, a flag)
// can say it by that. errors.Is finds ErrBadLimits.
type LimitError struct {
	Field      string
	Value, Max int
}

func (e *LimitError) Error() string {
	return fmt.Sprintf("%v: %s = %d, want 1..%d (0 means the default)", ErrBadLimits, e.Field, e.Value, e.Max)
}

func (e *LimitError) Unwrap() error { return ErrBadLimits }
