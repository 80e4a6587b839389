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

// onReleased frees the blocks held for the oldest owed release of that
// reason. Only now may the scheduler hand them out again. A release the
// node did not give for that event (node_lost when the SDK lost its node,
// engine_reset or engine_gone, and the releases of a recovery after lost
// ones) answers the oldest owed event.
func (e *engine) onReleased(rel client.Release) {
	e.rep.Releases[rel.Reason]++
	r := e.byID[rel.Request]
	if r == nil {
		e.rep.UnknownReleases++
		e.rep.fail("released %q (%s): no such request", rel.Request, rel.Reason)
		return
	}
	reason := rel.Reason
	if len(r.held[reason]) == 0 && len(r.owedOrder) > 0 {
		reason = r.owedOrder[0]
	}
	if rel.Reason == messages.ReasonNodeLost && reason != messages.ReasonPreempted {
		r.nodeLost = true // the final release: the chunks ready at the end may never have been stored
	}
	r.received[reason]++
	held := r.held[reason]
	if len(held) == 0 {
		return // a duplicate, or a reason never owed: counted by settleReleases
	}
	r.held[reason] = held[1:]
	if i := slices.Index(r.owedOrder, reason); i >= 0 {
		r.owedOrder = slices.Delete(r.owedOrder, i, i+1)
	}
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
