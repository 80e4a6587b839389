package sched

import "github.com/kvactors/kvactors/messages"

// Phase is a request's lifecycle phase. Only the become* methods change it.
type Phase uint8

const (
	Running   Phase = iota
	Preempted       // between preempted and resumed: no new jobs
	Finishing       // finished seen: final passes until every job is done
	Done            // released for good; drop the request
)

var phaseNames = [...]string{"running", "preempted", "finishing", "done"}

func (p Phase) String() string { return phaseNames[p] }

// becomePreempted: no new jobs, cancel queued copies, wait for in-flight ones,
// then release (PROTOCOL.md, "preempted").
//
// computed goes back to 0: the blocks the request resumes with hold no KV
// until the engine reports tokens again (it may do so before resumed), so an
// engine that never lowers computed after a preemption cannot get unwritten
// blocks copied (docs/PROTOCOL.md).
func (r *Request) becomePreempted() {
	r.phase = Preempted
	r.computed = 0
	r.releases = append(r.releases, messages.ReasonPreempted)
	r.fence = r.nextJob
	r.cancelOwed = true
}

// cancelQueued hands over the cancels a preemption owes: the copies made
// before it that are still in flight.
func (r *Request) cancelQueued(e *Effects) {
	if !r.cancelOwed {
		return
	}
	r.cancelOwed = false
	for j := r.inflight; j != nil; j = j.next {
		if j.ID <= r.fence {
			e.Cancel = append(e.Cancel, j.ID)
		}
	}
}

// becomeRunning: resumed. Block ids of every group are cleared; fresh blocks
// events from start 0 follow. Hashes and cursors stay (the content is stored).
func (r *Request) becomeRunning() {
	r.phase = Running
	r.clearBlocks()
}

func (r *Request) becomeFinishing(ev *messages.Event) {
	if r.phase == Preempted {
		r.clearBlocks() // the engine freed them at preemption: no job may read them
	}
	r.phase = Finishing
	r.computed, r.total = ev.Computed, ev.Total
	reason := messages.ReasonFinished
	if ev.Aborted {
		reason = messages.ReasonAborted
	}
	r.releases = append(r.releases, reason)
	// A finished request retries at most FinishRetryLimit times from here:
	// failures while it ran (keys pending in a copy that a fence holds, say)
	// are not charged to it.
	r.poolFails, r.copyFails, r.pendFails = 0, 0, 0
}

// clearBlocks forgets every block id. The ids go to a fresh array from
// here on, never over the old one: a store job's chunks alias the ids they
// were built from (buildJob), and a copy may still be reading them.
func (r *Request) clearBlocks() {
	for i := range r.groups {
		r.uncharge(int64(cap(r.groups[i].blocks)) * blockIDBytes)
		r.groups[i].blocks = nil
	}
}

// Reset ends the request for an engine reset (reason engine_reset) or the
// engine's end (engine_gone: unregister or expiry): queued copies are
// cancelled, in-flight ones finish, and one release with reason is owed —
// for engine_reset only if the request has GPU blocks tracked or a release
// still owed (PROTOCOL.md "EventBatch"), for engine_gone always ("every request of the engine gets
// one released"). A release it already owed (finished, preempted) is
// replaced, never added to. Further events are rejected. Resetting again, or
// a request already released, adds nothing.
func (r *Request) Reset(reason string) Effects {
	var e Effects
	if r.phase == Done {
		return e // released for good: nothing is owed
	}
	if !r.reset {
		r.reset = true
		// A release still owed (preempted or finished, waiting for a copy)
		// is owed even when the block ids are already forgotten (finished
		// after preempted forgets them).
		owed := len(r.releases) > 0
		r.releases = r.releases[:0]
		if r.HasBlocks() || owed || reason != messages.ReasonEngineReset {
			r.releases = append(r.releases, reason)
		}
	}
	r.cancelOwed = false
	for j := r.inflight; j != nil; j = j.next { // every in-flight job, once
		e.Cancel = append(e.Cancel, j.ID)
	}
	r.phase = Finishing
	r.computed, r.total = 0, 0 // no further stores
	r.clearBlocks()
	r.settle(&e)
	return e
}

// JobDone records the end of store job id: ok, failed (its chunks are offered
// again, with a retry, unless a finishing request can offer nothing more), or
// cancelled (its chunks are offered again once their blocks are tracked
// again). The caller has already completed the pool side
// (CompleteStore). Call Advance afterwards to act on a retry or a release.
func (r *Request) JobDone(id JobID, ok, cancelled bool) Effects {
	var e Effects
	r.cancelQueued(&e)
	for p := &r.inflight; *p != nil; p = &(*p).next {
		j := *p
		if j.ID != id {
			continue
		}
		*p, j.next = j.next, nil // a done job holds on to no other
		if ok {
			r.copyFails = 0
			break
		}
		for _, c := range j.Chunks {
			r.groups[c.Group].addRedo(c.Index)
		}
		// A finishing request's T and block ids are final (a reset one's
		// are gone): with nothing it can still offer, a retry would store
		// nothing and only hold its release back a backoff.
		if !cancelled && r.phase != Done && (r.phase != Finishing || r.pendingChunks()) {
			r.failAttempt(RetryCopyFailed, &e)
		}
		break
	}
	r.settle(&e)
	return e
}

// settle publishes owed releases. A finishing request is released once no
// copy of it is in flight and nothing is left to store (or it gave up), and
// is then Done. A preemption is released once the copies made before it are
// done (PROTOCOL.md "preempted": "wait for copies in flight; publish
// released"), also when resumed came first; a still preempted request's block
// ids are then cleared.
func (r *Request) settle(e *Effects) {
	if r.held {
		return
	}
	switch r.phase {
	case Finishing:
		if r.inflight != nil || e.Retry != nil || e.More || r.pendingChunks() {
			return // a copy is in flight, or a final chunk is still to be stored or decided
		}
		r.phase = Done
		e.Done = true
	case Preempted, Running:
		if len(r.releases) == 0 || r.inflightUpTo(r.fence) {
			return
		}
		if r.phase == Preempted {
			r.clearBlocks() // the engine may reuse the blocks once released
		}
	default:
		return
	}
	e.Releases = r.releases // owed reasons are rare: the next owed one allocates anew
	r.releases = nil
}

// Hold keeps every release of the request back until Unhold: another
// request of the same id, of an engine epoch that ended, may still be
// copying from the blocks this one names (the engine re-announced them),
// and a release here would let the engine reuse them under that copy.
func (r *Request) Hold() { r.held = true }

// Unhold lets the request's releases go out: the effects carry those owed
// meanwhile (and Done, if it was finishing).
func (r *Request) Unhold() Effects {
	var e Effects
	r.held = false
	r.settle(&e)
	return e
}

// inflightUpTo reports whether a job numbered id or lower is in flight.
func (r *Request) inflightUpTo(id JobID) bool {
	for j := r.inflight; j != nil; j = j.next {
		if j.ID <= id {
			return true
		}
	}
	return false
}

// pendingChunks reports whether some group still has a ready chunk not yet
// decided (a redo chunk, or one past the cursor).
func (r *Request) pendingChunks() bool {
	tm := r.readyTerms()
	for g := range r.groups {
		gr := &r.groups[g]
		rd, _, _ := r.ready(g, tm)
		if gr.cursor < rd { // a decision is owed, even if every chunk is null: it moves the cursor
			return true
		}
		for range gr.candidates(&r.lay.Groups[g], rd, tm.bpc) {
			return true
		}
	}
	return false
}
