package actors

import (
	"context"
	"sync"

	"github.com/kvactors/kvactors/messages"
)

// kvStepMaxHashes bounds the block hashes one step holds before it publishes
// what it has (in order) and goes on: a step of many large evictions stays
// far below NATS's max_payload (4,096 32-byte hashes are ~280 KB of JSON).
const kvStepMaxHashes = 4096

// KVStep gathers the kv_events of one step of work: an engine actor's batch
// (with the request actors it runs inline) or the transfer actor's batch of
// completions. Publish sends them as one P.E.kv_events message per engine,
// engines in the order of their first event, each message's events in the
// order they were added (PROTOCOL.md "kvactors' choice, kv_events").
//
// Events are only added after what they announce happened (bytes ready, key
// evicted), so publishing them later, at the step's end, keeps every
// BlockStored after its bytes were ready and every BlockRemoved after its key
// stopped being loadable.
//
// A request actor normally adds from the step's own goroutine; one whose
// mailbox was busy handles the message later, on another goroutine, and may
// find the step published: Add then says so and the caller publishes itself.
// The lock also keeps such a late message's events behind the step's.
type KVStep struct {
	out    *Outbox
	mu     sync.Mutex
	closed bool
	hashes int
	parts  []kvPart
}

type kvPart struct {
	ctx    context.Context // the first contributor's trace context
	engine string
	events *[]messages.KVEvent // from kvEventsPool; back to it once published
}

// kvEventsPool recycles the steps' event lists: a step lives for one batch
// and Outbox.KVEvents keeps nothing of what it encodes.
var kvEventsPool = sync.Pool{New: func() any { return new([]messages.KVEvent) }}

// kvEventsKeep is the largest list put back: a rare huge step's array is
// left to the collector rather than held for ever.
const kvEventsKeep = 1024

// NewKVStep starts a step that publishes through o (nil for a nil Outbox:
// every Add then reports false).
func (o *Outbox) NewKVStep() *KVStep {
	if o == nil {
		return nil
	}
	return &KVStep{out: o}
}

// Add appends events for engine's kv_events and reports whether the step
// took them; false once the step was published (or s is nil), and the
// caller publishes them itself.
func (s *KVStep) Add(ctx context.Context, engine string, events []messages.KVEvent) bool {
	if s == nil {
		return false
	}
	if len(events) == 0 {
		return true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	i := 0
	for i < len(s.parts) && s.parts[i].engine != engine {
		i++
	}
	if i == len(s.parts) {
		s.parts = append(s.parts, kvPart{ctx: ctx, engine: engine, events: kvEventsPool.Get().(*[]messages.KVEvent)})
	}
	*s.parts[i].events = append(*s.parts[i].events, events...)
	for _, ev := range events {
		s.hashes += len(ev.BlockHashes)
	}
	if s.hashes >= kvStepMaxHashes {
		s.publishLocked()
	}
	return true
}

// Publish sends what the step gathered and closes it.
func (s *KVStep) Publish() {
	if s == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	s.publishLocked()
}

// publishLocked publishes under the lock, so an Add that finds the step
// closed publishes after it.
func (s *KVStep) publishLocked() {
	for i := range s.parts {
		p := &s.parts[i]
		ctx := p.ctx
		if ctx == nil {
			ctx = context.Background()
		}
		s.out.KVEvents(ctx, p.engine, *p.events)
		if cap(*p.events) <= kvEventsKeep {
			clear(*p.events) // drop the hash strings
			*p.events = (*p.events)[:0]
			kvEventsPool.Put(p.events)
		}
	}
	clear(s.parts)
	s.parts, s.hashes = s.parts[:0], 0
}
