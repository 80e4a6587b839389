package engine

import (
	"slices"
	"sync"
	"sync/atomic"

	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/internal/slicepool"
	"github.com/kvactors/kvactors/messages"
)

// One batch is one engine step: forward lays its events out per request
// and the request actors apply them in the step's turn. This file holds
// the layout and the recycling of a step's memory.

// groupEvents lays the routed events (fwd, in batch order) out request by
// request, keeping their order, and leaves in counts (each request's event
// count on entry) the end of each request's part. When the parts are
// already runs it compacts events in place and says so (inPlace);
// otherwise it copies them into a new slice.
func groupEvents(events []messages.Event, fwd []routed, counts []int) (all []messages.Event, inPlace bool) {
	if grouped(fwd) {
		for w, f := range fwd { // f.event >= w: nothing unread is overwritten
			if f.event != w {
				events[w] = events[f.event]
			}
		}
		for idx := 1; idx < len(counts); idx++ {
			counts[idx] += counts[idx-1]
		}
		return events[:len(fwd)], true
	}
	all = make([]messages.Event, len(fwd))
	start := 0
	for idx, n := range counts {
		counts[idx] = start // now the next free position of request idx
		start += n
	}
	for _, f := range fwd {
		all[counts[f.request]] = events[f.event]
		counts[f.request]++
	}
	return all, false
}

// heldEvents is a batch's event slice shared by the request actors that got
// parts of it; the last to let go hands it back (Batch.Recycle).
type heldEvents struct {
	left    atomic.Int32
	events  []messages.Event
	msgs    []request.Events
	recycle func([]messages.Event)
}

// heldPool recycles heldEvents: one a batch, and the last share's release
// is the end of its use (every holder signals once, then drops it).
var heldPool = sync.Pool{New: func() any { return new(heldEvents) }}

// getHeldEvents returns a heldEvents for events holding one share, the
// caller's.
func getHeldEvents(events []messages.Event, recycle func([]messages.Event)) *heldEvents {
	h := heldPool.Get().(*heldEvents)
	h.events, h.recycle = events, recycle
	h.left.Store(1)
	return h
}

// Signal is a request actor's release of its share (request.Events.Applied).
func (h *heldEvents) Signal() { h.release() }

func (h *heldEvents) release() {
	if h.left.Add(-1) == 0 {
		h.recycle(clearEvents(h.events))
		putEventMsgs(h.msgs)
		h.events, h.msgs, h.recycle = nil, nil, nil // nothing kept alive through the pool
		heldPool.Put(h)
	}
}

// eventMsgs recycles the steps' request messages along with their events
// (heldEvents): the request actors hold them exactly as long.
var eventMsgs = slicepool.Pool[request.Events]{New: 16, Keep: 1024}

func getEventMsgs(n int) []request.Events { return slices.Grow(eventMsgs.Get(), n)[:n] }

func putEventMsgs(msgs []request.Events) {
	clear(msgs) // nothing kept alive through the pool
	eventMsgs.Put(msgs)
}

// clearEvents drops what events point to (ids, hashes, request ids) and
// returns the slice emptied, for reuse.
func clearEvents(events []messages.Event) []messages.Event {
	clear(events)
	return events[:0]
}

// grouped reports whether each request's routed events come in one run
// (requests are indexed in first-seen order, so the runs are ascending).
func grouped(fwd []routed) bool {
	for i := 1; i < len(fwd); i++ {
		if fwd[i].request < fwd[i-1].request {
			return false
		}
	}
	return true
}
