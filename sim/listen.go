package sim

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/messages"
)

// handle applies one release or stored message, on Run's goroutine.
func (e *engine) handle(m any) {
	switch m := m.(type) {
	case client.Release:
		e.onReleased(m)
	case messages.Stored:
		e.onStored(m)
	}
}

// onReleased frees the blocks given up at the request's oldest owed event:
// a release carries no event id, and each answers the oldest event still
// owed one (PROTOCOL.md step 11, client.Release), whatever its reason. Only
// now may the scheduler hand them out again. A reason that event may not
// get (releaseAnswers) fails the check; the blocks are freed all the same,
// as the SDK told the engine to, so the run goes on to its verdict rather
// than stall.
func (e *engine) onReleased(rel client.Release) {
	e.rep.Releases[rel.Reason]++
	r := e.byID[rel.Request]
	if r == nil {
		e.rep.UnknownReleases++
		e.rep.fail("released %q (%s): no such request", rel.Request, rel.Reason)
		return
	}
	if len(r.owedOrder) == 0 {
		r.received[rel.Reason]++ // nothing owed: a duplicate, counted by settleReleases
		return
	}
	reason := r.owedOrder[0]
	if !releaseAnswers(rel.Reason, reason, r.owedOrder[1:]) {
		e.badMessage("request %s: released %q for its oldest owed event, %q (owed %v)", r.id, rel.Reason, reason,
			r.owedOrder)
	}
	if rel.Reason == messages.ReasonNodeLost && reason != messages.ReasonPreempted {
		r.nodeLost = true // the final release: the chunks ready at the end may never have been stored
	}
	r.received[reason]++
	held := r.held[reason]
	r.held[reason], r.owedOrder = held[1:], r.owedOrder[1:]
	for g, ids := range held[0] {
		for _, id := range ids {
			if id != 0 {
				e.heldBlocks--
				e.scribble(g, id)
			}
		}
		if reason == messages.ReasonPreempted {
			e.al.putLast(g, ids)
		} else {
			e.al.put(g, ids)
		}
	}
	e.owed--
	e.progress()
}

// releaseAnswers reports whether a release of reason may answer ev, the
// reason of a request's oldest owed event; later are the reasons of the
// events it owes after that one, oldest first. The node and the SDK give
// such an event:
//   - its own reason: preempted for a preemption, finished or aborted as
//     the finished event said; so does a resync's new epoch, which
//     re-announces each owed event as one of its kind (SDK step 18);
//   - a later owed event's reason, when ev's release was lost: the node
//     releases a request's events in order, so a later one's release of
//     the same epoch may come before the resync that recovers the loss,
//     and the SDK answers ev with it; the new epoch then releases the
//     events still owed, the later ones (PROTOCOL.md step 11);
//   - engine_reset (the node reset the current epoch: its own NATS lapse,
//     this engine's silence), engine_gone (the node dropped the engine, or
//     the SDK answers for a node that forgot it and holds nothing of the
//     request) and node_lost (the SDK gave up on its node): these answer
//     every owed event, whatever its kind.
//
// Not accepted: aborted for an event of another kind, which the node gives
// a request whose actor failed (a node fault; the simulator injects none,
// and that release for a request owing nothing fails the check anyway, as
// UnexpectedReleases), and any other mismatch, such as a finished request
// released preempted.
func releaseAnswers(reason, ev string, later []string) bool {
	switch reason {
	case ev, messages.ReasonEngineReset, messages.ReasonEngineGone, messages.ReasonNodeLost:
		return true
	}
	return slices.Contains(later, reason)
}

// onStored records a completed store job after checking that each key is
// the one this engine's hashes give for that chunk.
func (e *engine) onStored(st messages.Stored) {
	r := e.byID[st.Request]
	if r == nil {
		e.badMessage("stored job %d for unknown request %q", st.Job, st.Request)
		return
	}
	e.rep.StoredJobs++
	e.rep.ChunksStored += len(st.Chunks)
	e.rep.BytesStored += st.Bytes
	var want int64
	for _, ch := range st.Chunks {
		ref := chunkRef{ch.Group, ch.Index}
		key, err := r.key(&e.cfg, ref)
		if err != nil {
			e.badMessage("stored job %d: %v", st.Job, err)
			continue
		}
		if key != ch.Key {
			e.badMessage("stored job %d of %s: chunk %d of group %d has key %s, want %s",
				st.Job, r.id, ch.Index, ch.Group, ch.Key, key)
			continue
		}
		r.stored[ref] = true
		e.log.Debug("sim: stored", "engine", e.cfg.Engine, "request", r.id, "job", st.Job, "group", ch.Group,
			"chunk", ch.Index, "key", ch.Key)
		if _, ok := e.storedKeys[key]; !ok {
			e.storedKeys[key] = keyRef{req: r, ch: ref}
		}
		// The simulator never stores a chunk with null blocks (package doc),
		// so every stored chunk is all its blocks.
		want += int64(e.cfg.BlocksPerChunk*e.cfg.RegionsPerGroup) * e.cfg.BlockBytes
	}
	if st.Bytes != want {
		e.badMessage("stored job %d of %s: %d bytes, want %d for %d chunks", st.Job, r.id, st.Bytes, want,
			len(st.Chunks))
	}
}

func (e *engine) badMessage(format string, a ...any) {
	e.rep.BadMessages++
	e.rep.fail(format, a...)
}

// onKVEvents runs on the NATS client's goroutine: it remembers every key
// evicted from this engine's namespace by any engine, so that a stored key
// found absent later can be told apart from a lost one.
func (e *engine) onKVEvents(m *nats.Msg) {
	var b messages.KVEventBatch
	err := json.Unmarshal(m.Data, &b)
	e.kv.mu.Lock()
	defer e.kv.mu.Unlock()
	e.kv.processed++
	if err != nil {
		return // not this engine's business to police routers' feed
	}
	for _, ev := range b.Events {
		if ev.Type != messages.KVBlockRemoved || (ev.Namespace != "" && ev.Namespace != e.namespace()) {
			continue
		}
		for _, h := range ev.BlockHashes {
			e.kv.evicted[strings.ToLower(h)+fmt.Sprintf("%08x", uint32(ev.GroupIdx))] = true
			e.kv.evictions++
		}
	}
}

// namespace is the engine's namespace as kvactors names it.
func (e *engine) namespace() string {
	if e.cfg.Namespace != "" {
		return e.cfg.Namespace
	}
	return e.cfg.Engine
}

// wasEvicted reports whether key was evicted. kvactors publishes an
// eviction's BlockRemoved from the actor that evicted, which can race with
// the load reply that found the key gone, so a miss waits (bounded) for
// the kv_events queue to drain and for late news.
func (e *engine) wasEvicted(sub *nats.Subscription, key string) bool {
	const grace, limit = 100 * time.Millisecond, 2 * time.Second
	start := time.Now()
	for {
		e.kv.mu.Lock()
		evicted, processed := e.kv.evicted[key], e.kv.processed
		e.kv.mu.Unlock()
		if evicted {
			return true
		}
		pending, _, _ := sub.Pending()
		delivered, _ := sub.Delivered()
		drained := pending == 0 && uint64(delivered) == processed
		if waited := time.Since(start); (drained && waited >= grace) || waited >= limit {
			return false
		}
		time.Sleep(5 * time.Millisecond) // polling a NATS client queue: it has no event to wait on
	}
}

// settleReleases drains what arrived and counts, per request and reason,
// releases beyond one per owed event (duplicates) and owed ones that never
// came (missing).
func (e *engine) settleReleases() {
	for {
		select {
		case m := <-e.msgs:
			e.handle(m)
			continue
		default:
		}
		break
	}
	for _, r := range e.reqs {
		for reason, got := range r.received {
			if want := r.expected[reason]; got > want {
				e.rep.DuplicateReleases += got - want
				e.rep.fail("request %s: %d %q releases for %d events", r.id, got, reason, want)
			}
		}
		for reason, want := range r.expected {
			if got := r.received[reason]; got < want {
				e.rep.MissingReleases += want - got
				e.rep.fail("request %s: %d %q releases for %d events", r.id, got, reason, want)
			}
		}
	}
	e.kv.mu.Lock()
	e.rep.Evictions = e.kv.evictions
	e.kv.mu.Unlock()
}
