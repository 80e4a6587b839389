package messages

import "fmt"

// Key is an offload key: the raw bytes of the chunk's last block hash followed
// by the group index as 4 big-endian bytes. It is a string so it can be a map
// key without copying; on the wire it is lowercase hex.
type Key string

// Hash is one request-level block hash, as raw bytes (decoded from hex).
type Hash string

// BlockID is a GPU block id; 0 is the null block.
type BlockID uint32

// ChunkIndex is the index of a chunk within one group of one request.
type ChunkIndex int

// EventType is the protocol event type of an Event.
type EventType uint8

// Event types, in protocol order.
const (
	EvAdded EventType = iota + 1
	EvHashes
	EvBlocks
	EvTokens
	EvPreempted
	EvResumed
	EvFinished
)

var eventTypeNames = [...]string{"", "added", "hashes", "blocks", "tokens", "preempted", "resumed", "finished"}

// String returns the protocol name of the event type.
func (t EventType) String() string {
	if int(t) < len(eventTypeNames) && t != 0 {
		return eventTypeNames[t]
	}
	return fmt.Sprintf("EventType(%d)", t)
}

// ParseEventType maps a protocol name to its EventType (0 if unknown). It
// takes the name's bytes as decoded and allocates nothing (the event path
// calls it once per event).
func ParseEventType(name []byte) EventType {
	for i, n := range eventTypeNames {
		if i > 0 && n == string(name) {
			return EventType(i)
		}
	}
	return 0
}

// Event is one checked protocol event. It is a flat struct rather than one
// type per event so that a decoded batch is one slice with no per-event
// interface allocation (the event path is the hot path); Type says which
// fields are meaningful:
//
//	added:     Request, PromptTokens, MaxOffloadTokens (-1: unset)
//	hashes:    Request, Start, Hashes
//	blocks:    Request, Group, Start, IDs
//	tokens:    Request, Computed, Total
//	preempted, resumed: Request
//	finished:  Request, Aborted, Computed, Total
type Event struct {
	Type             EventType
	Aborted          bool
	Group            int
	Start            int
	PromptTokens     int
	MaxOffloadTokens int
	Computed         int
	Total            int
	Request          string
	Hashes           []Hash
	IDs              []BlockID
}

// EventBatch is one decoded P.E.events message.
type EventBatch struct {
	Engine string
	Epoch  string
	Seq    uint64
	Events []Event
}
