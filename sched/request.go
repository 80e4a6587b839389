package sched

import (
	"fmt"
	"math"
	"strings"

	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
)

// Preparer is the part of the host pool a decision needs.
type Preparer interface {
	// PrepareStoreInto makes room for keys, sizes[i] bytes for keys[i],
	// and writes what it did over out, reusing its slices' backing arrays
	// except Ext's (hostpool.Pool.PrepareStoreInto): a decision reads them
	// before its scratch is pooled again, and a job keeps only its room.
	PrepareStoreInto(out *hostpool.Prepared, keys []messages.Key, sizes []int64) error
}

// Request is one request's store state. It is not safe for concurrent use:
// its owner (the request actor) is its only caller. Every live request holds
// one, so it holds no per-decision state: a decision's effects are built on
// the caller's stack and its working memory is pooled (scratch).
type Request struct {
	id         string
	lay        *Layout
	prompt     int
	maxOffload int // -1: unset
	computed   int
	total      int
	hashes     []messages.Hash
	groups     []group
	inflight   *StoreJob // jobs not yet done, oldest first, linked by StoreJob.next
	releases   []string  // release reasons owed once inflight drains
	nextJob    JobID
	// fence: the owed preempted releases wait for the jobs up to it (the copies
	// queued or in flight at the preemption), not for jobs made after resumed.
	fence JobID
	// Consecutive failures, saturating at MaxUint32 (a running request
	// retries for as long as the pool stays full).
	poolFails uint32 // decisions without room; reset by one with room
	copyFails uint32 // failed copies; reset by a copy that succeeds
	pendFails uint32 // decisions that met keys pending elsewhere
	phase     Phase
	reset     bool // Reset was called: its release is owed, not recomputed
	// cancelOwed: a preemption (a Step, which returns no Effects) asks to
	// cancel the copies up to fence; the next Effects carry it.
	cancelOwed bool
	// held: no release goes out until Unhold (see Hold).
	held bool
	// charged is what the request holds of its layout's StateBudget
	// (budget.go).
	charged int64
}

type candidate struct {
	group int
	chunk messages.ChunkIndex
}

// NewRequest starts the state of a request from its added event.
func NewRequest(l *Layout, added *messages.Event) *Request {
	r := &Request{id: added.Request, lay: l, prompt: added.PromptTokens,
		maxOffload: added.MaxOffloadTokens, groups: make([]group, len(l.Groups))}
	if added.Type != messages.EvAdded {
		r.maxOffload = -1
	}
	for i := range r.groups {
		r.groups[i].lastDefer.chunk = -1
	}
	return r
}

// ID is the request id.
func (r *Request) ID() string { return r.id }

// Phase is the lifecycle phase.
func (r *Request) Phase() Phase { return r.phase }

// HasBlocks reports whether any GPU block id is tracked now.
func (r *Request) HasBlocks() bool {
	for i := range r.groups {
		if len(r.groups[i].blocks) > 0 {
			return true
		}
	}
	return false
}

// Offloadable is T (PROTOCOL.md): min(computed, total), then capped by
// max_offload_tokens and, with offload_prompt_only, by prompt_tokens.
func (r *Request) Offloadable() int {
	t := min(r.computed, r.total)
	if r.maxOffload >= 0 {
		t = min(t, r.maxOffload)
	}
	if r.lay.OffloadPromptOnly {
		t = min(t, r.prompt)
	}
	return max(t, 0)
}

// ContinueJobs numbers the request's store jobs after last, for an actor
// that served an earlier request: a stale cancel it sent for that request's
// jobs (still on its way to the transfer side) must not name this one's.
// Call it before the first Advance.
func (r *Request) ContinueJobs(last JobID) { r.nextJob = max(r.nextJob, last) }

// LastJob is the ID of the request's latest store job (0: none yet, or the
// one ContinueJobs was given).
func (r *Request) LastJob() JobID { return r.nextJob }

// Step applies one event. A returned error rejects the event and leaves the
// request unchanged. Events that the lifecycle says to ignore (a second
// finished, preempted twice) return nil and change nothing.
func (r *Request) Step(ev *messages.Event) error {
	if ev.Request != r.id {
		return ErrWrongRequest
	}
	if r.phase == Done {
		return ErrReleased
	}
	switch ev.Type {
	case messages.EvAdded:
		if ev.PromptTokens != r.prompt {
			return ErrPromptMismatch
		}
		return nil // a resent added: ignored
	case messages.EvHashes:
		if ev.Start < 0 {
			return ErrNegative
		}
		if len(ev.Hashes) > r.lay.MaxHashes-ev.Start { // not Start+len: Start is the sender's
			return fmt.Errorf("%w: %d hashes from %d, at most %d in all", ErrTooLarge, len(ev.Hashes), ev.Start, r.lay.MaxHashes)
		}
		return r.applyHashes(ev.Start, ev.Hashes)
	case messages.EvBlocks:
		if ev.Group < 0 || ev.Group >= len(r.groups) {
			return ErrBadGroup
		}
		if r.phase == Preempted {
			return ErrPreempted // the engine freed these blocks
		}
		if r.phase == Finishing {
			return nil // blocks after finished change nothing: the final T is fixed
		}
		if ev.Start < 0 {
			return ErrNegative
		}
		most := r.lay.Groups[ev.Group].MaxBlocks
		if len(ev.IDs) > most-ev.Start {
			return fmt.Errorf("%w: group %d: %d block ids from %d, at most %d in all", ErrTooLarge, ev.Group, len(ev.IDs), ev.Start, most)
		}
		return r.applyBlocks(ev.Group, ev.Start, ev.IDs)
	case messages.EvTokens:
		if r.phase != Finishing { // the finished event's T is final
			r.computed, r.total = ev.Computed, ev.Total
		}
		return nil
	case messages.EvPreempted:
		if r.phase == Running {
			r.becomePreempted()
		}
		return nil
	case messages.EvResumed:
		if r.phase == Preempted {
			r.becomeRunning()
		}
		return nil
	case messages.EvFinished:
		if r.phase != Finishing {
			r.becomeFinishing(ev)
		}
		return nil
	}
	return fmt.Errorf("%w: %v", ErrBadEventType, ev.Type)
}

func (r *Request) applyHashes(start int, hs []messages.Hash) error {
	n := len(r.hashes)
	if start > n {
		return ErrHole
	}
	for i, h := range hs {
		if start+i < n && r.hashes[start+i] != h {
			return ErrConflict
		}
	}
	end := start + len(hs)
	if end <= n {
		return nil
	}
	add := hs[n-start:]
	bytes := bytesOf(add)
	// The first hashes reserve room for the prompt's.
	hashes, err := growCharged(r, r.hashes, end, r.promptUnits(r.lay.TokensPerHash, r.lay.MaxHashes),
		r.lay.MaxHashes, hashHeaderBytes, bytes)
	if err != nil {
		return err
	}
	r.hashes = hashes
	if n > start {
		// The event's hashes share one string (ingest): kept as they are,
		// the ones this request already had would stay reachable through
		// the new ones, uncharged. An engine resending a long overlap with
		// one new hash at a time would pin a batch's worth per hash.
		r.hashes = appendOwn(r.hashes, add, bytes)
		return nil
	}
	r.hashes = append(r.hashes, add...)
	return nil
}

// appendOwn appends ss to dst as substrings of one new string of their
// bytes (size in all), so dst keeps nothing else of theirs (hashes, keys).
func appendOwn[S ~string](dst, ss []S, size int64) []S {
	var b strings.Builder
	b.Grow(int(size))
	for _, s := range ss {
		b.WriteString(string(s))
	}
	all, off := b.String(), 0
	for _, s := range ss {
		dst = append(dst, S(all[off:off+len(s)]))
		off += len(s)
	}
	return dst
}

// applyBlocks appends ids to group gi's block ids at start (group.checkBlocks
// says what may), charging the list's growth.
func (r *Request) applyBlocks(gi, start int, ids []messages.BlockID) error {
	g := &r.groups[gi]
	n := len(g.blocks)
	if err := g.checkBlocks(start, ids, r.lay.NumGPUBlocks); err != nil {
		return err
	}
	end := start + len(ids)
	if end <= n {
		return nil
	}
	// Grown, the ids go to a fresh array, never over the old one: a store
	// job's chunks alias the ids they were built from (buildJob). The first
	// append reserves the prompt's.
	most := r.lay.Groups[gi].MaxBlocks
	blocks, err := growCharged(r, g.blocks, end, r.promptUnits(r.lay.Groups[gi].TokensPerBlock, most), most, blockIDBytes, 0)
	if err != nil {
		return err
	}
	g.blocks = append(blocks, ids[n-start:]...)
	return nil
}

// presizeMost bounds what presized reserves ahead (a 64k-token prompt's
// ids at 16 tokens a block): past it a list grows as it fills.
const presizeMost = 4096

// promptUnits is how many units of per tokens the prompt spans (blocks of
// a group, hashes), at most most and presizeMost: what a request's lists
// reach once its prompt is prefilled. Their first append reserves that
// much: a prefill's steps each append a few, and growing by doubling cost
// a request two or three allocations per list.
func (r *Request) promptUnits(per, most int) int {
	if per <= 0 || r.prompt <= 0 {
		return 0
	}
	return min((r.prompt+per-1)/per, most, presizeMost)
}

// readyTerms returns the request-level terms of its groups' ready prefixes.
func (r *Request) readyTerms() readyTerms {
	t := r.Offloadable()
	return readyTerms{tokens: t, hashes: len(r.hashes), decoding: r.phase != Finishing && t > r.prompt,
		bpc: r.lay.BlocksPerChunk}
}

// Advance takes one store decision for the request across all its groups
// and returns the effects. Call it after a batch of Steps, on a retry timer,
// and after JobDone.
//
// PROTOCOL.md: candidates are chunks [cursor, ready) (plus chunks whose copy
// failed) whose last block is not null (in a group that is not full
// attention, no block: group.storable); all go to the pool in one
// PrepareStore. No room: no job, cursors unchanged, a retry. Otherwise every
// cursor moves to max(cursor, ready).
func (r *Request) Advance(p Preparer) Effects { return r.advance(p, false) }

func (r *Request) advance(p Preparer, woken bool) Effects {
	e := Effects{woken: woken}
	r.cancelQueued(&e)
	if r.phase == Running || r.phase == Finishing {
		r.decide(p, &e)
	}
	r.settle(&e)
	return e
}

// AdvanceWoken is Advance for a retry woken before its backoff ended (the
// copy it waited for ended, or room may have freed): a failure there does
// not count towards FinishRetryLimit, so a finishing request gives up after
// as long as its timers alone would have taken (~10 s), not after sixteen
// wake-ups that can come milliseconds apart.
func (r *Request) AdvanceWoken(p Preparer) Effects {
	return r.advance(p, true)
}

// ready is group g's ready prefix (group.ready).
func (r *Request) ready(g int, tm readyTerms) (ready messages.ChunkIndex, reason DeferReason, best messages.ChunkIndex) {
	return r.groups[g].ready(&r.lay.Groups[g], tm)
}

// failAttempt records a failed decision and asks for a retry; a finishing
// request gives up after FinishRetryLimit attempts so the engine gets its
// blocks back.
//
// Pool-full and copy failures are counted apart: a decision that finds room
// does not end a run of failed copies (each retry of a failing copy finds
// room), and only a copy that succeeds does.
func (r *Request) failAttempt(reason RetryReason, e *Effects) {
	n := &r.poolFails
	switch reason {
	case RetryCopyFailed:
		n = &r.copyFails
	case RetryPending:
		n = &r.pendFails
	}
	if *n < math.MaxUint32 && (!e.woken || *n == 0) {
		*n++
	}
	if r.phase == Finishing && *n > FinishRetryLimit {
		e.GivenUp += r.giveUp()
		e.GivenUpReason = reason
		return
	}
	e.Retry = &Retry{Reason: reason, Attempt: int(*n), Backoff: backoff(int(*n))}
}

// giveUp forgets every undecided chunk so that a finishing request can be
// released, and returns how many ready chunks it gave up.
func (r *Request) giveUp() int {
	tm := r.readyTerms()
	dropped := 0
	for g := range r.groups {
		gr := &r.groups[g]
		rd, _, _ := r.ready(g, tm)
		for range gr.candidates(&r.lay.Groups[g], rd, tm.bpc) {
			dropped++
		}
		gr.cursor = max(gr.cursor, rd)
		r.uncharge(keysCost(gr.cachedKeys()))
		gr.retry = nil
	}
	return dropped
}
