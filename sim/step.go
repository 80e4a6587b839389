package sim

import (
	"math/rand/v2"

	"github.com/kvactors/kvactors/messages"
)

// arrivals paces request arrival: ArrivalsPerStep on average, jittered.
type arrivals struct {
	rng  *rand.Rand
	rate float64
	acc  float64
}

func newArrivals(c *Config) *arrivals {
	return &arrivals{rng: newRand(c.Seed, stringSeed(c.Engine), stringSeed("arrivals")), rate: c.ArrivalsPerStep}
}

// next is how many requests arrive this step.
func (a *arrivals) next() int {
	a.acc += a.rate * (0.5 + a.rng.Float64())
	n := int(a.acc)
	a.acc -= float64(n)
	return n
}

// step is one scheduler step, in vLLM's order with async scheduling: the
// forward pass scheduled last step has completed (its KV is written, then
// announced), then this step schedules the next one (blocks allocated ahead
// of the tokens). Everything the step tells kvactors goes in one batch.
func (e *engine) step() error {
	e.rep.Steps++
	e.b.Reset()
	e.arrive()
	e.abortQueued()
	e.complete()
	e.schedule()
	return e.publish()
}

// arrive admits new requests to the waiting queue.
func (e *engine) arrive() {
	for n := e.arrivals.next(); n > 0 && len(e.reqs) < e.cfg.Requests; n-- {
		r := e.newRequest(len(e.reqs))
		e.reqs = append(e.reqs, r)
		e.byID[r.id] = r
		e.rep.Requests++
		e.b.Added(r.id, r.prompt)
		if r.queuedAbort {
			e.doomed = append(e.doomed, r)
		} else {
			e.waiting = append(e.waiting, r)
		}
		e.progress()
	}
}

// abortQueued aborts doomed requests whose time has come: they never got a
// block, so kvactors must release them at once.
func (e *engine) abortQueued() {
	keep := e.doomed[:0]
	for _, r := range e.doomed {
		if r.abortStep--; r.abortStep > 0 {
			keep = append(keep, r)
			continue
		}
		e.rep.AbortedQueued++
		e.end(r, true)
	}
	e.doomed = keep
}

// complete finishes last step's forward pass for every running request:
// hashes of the tokens announced last step go out now (the async lag),
// then the new KV is written into the blocks and announced, then the
// request samples, finishes, aborts or is preempted on purpose.
func (e *engine) complete() {
	tph := e.cfg.TokensPerHash
	keep := e.running[:0]
	for _, r := range e.running {
		e.publishHashes(r, r.computed/tph)
		if r.inflight <= r.computed {
			keep = append(keep, r) // not scheduled last step: nothing completed
			continue
		}
		e.rep.TokensComputed += int64(r.inflight - r.computed)
		r.computed = r.inflight
		e.writeBlocks(r)
		e.progress()
		switch {
		case r.abortAt > 0 && r.gen == 0 && r.computed >= r.abortAt:
			e.rep.AbortedMidPrefill++
			e.end(r, true)
			continue
		case r.computed == len(r.tokens):
			r.sample(tph)
			if r.gen >= r.output {
				e.rep.Finished++
				e.end(r, false)
				continue
			}
		}
		e.b.Tokens(r.id, r.computed, len(r.tokens))
		if r.preemptAt > 0 && r.computed >= r.preemptAt {
			r.preemptAt = 0
			e.preempt(r)
			continue
		}
		keep = append(keep, r)
	}
	clear(e.running[len(keep):])
	e.running = keep
}

// publishHashes announces hashes [pubHash, n).
func (e *engine) publishHashes(r *request, n int) {
	n = min(n, len(r.hashes))
	if n > r.pubHash {
		e.b.BeginHashes(r.id, r.pubHash)
		for i := r.pubHash; i < n; i++ {
			e.b.Hash(r.hashes[i][:])
		}
		e.b.EndHashes()
		r.pubHash = n
	}
}

// writeBlocks fills every block whose tokens are all computed and that has
// not been written since it was allocated. This happens before the tokens
// event that covers it is published: kvactors may copy a block as soon as
// it reads that event.
func (e *engine) writeBlocks(r *request) {
	c := &e.cfg
	for g, gc := range c.Groups {
		full := min(r.computed/gc.TokensPerBlock, len(r.blocks[g]))
		for b := r.written[g]; b < full; b++ {
			if id := r.blocks[g][b]; id != 0 {
				last := blockHash(r.hashes, b, gc.TokensPerBlock, c.TokensPerHash)
				for reg := range c.RegionsPerGroup {
					FillBlock(e.mem.block(g, reg, id), last, g, reg, b)
				}
			}
		}
		r.written[g] = max(r.written[g], full)
	}
}

// scribble overwrites released block id of group g in every region: the
// engine may reuse it now, and a copy of it the node made after the
// release (a protocol fault) must read bytes no chunk has.
func (e *engine) scribble(g int, id uint32) {
	for reg := range e.cfg.RegionsPerGroup {
		b := e.mem.block(g, reg, id)
		for i := range b {
			b[i] = scribbleByte
		}
	}
}

// blockHash is the last hash inside block b (the root hash for a block
// shorter than one hash block).
func blockHash(hs []Hash, b, tpb, tph int) Hash {
	if i := blockLastHash(b, tpb, tph); i >= 0 {
		return hs[i]
	}
	return rootHash
}

// end finishes or aborts r: every known hash is announced (the engine knows
// them all by now), then finished; its blocks wait for `released`.
func (e *engine) end(r *request, aborted bool) {
	e.publishHashes(r, r.computed/e.cfg.TokensPerHash)
	e.b.Finished(r.id, aborted, r.computed, len(r.tokens))
	r.phase, r.aborted = ended, aborted
	r.finalT, r.finalHashes = min(r.computed, len(r.tokens)), r.pubHash
	r.finalBlocks = make([][]uint32, len(r.blocks))
	for g := range r.blocks {
		r.finalBlocks[g] = append([]uint32(nil), r.blocks[g]...)
	}
	reason := messages.ReasonFinished
	if aborted {
		reason = messages.ReasonAborted
	}
	e.logEnd(r, reason)
	e.hold(r, reason)
	e.ended++
	e.progress()
	if e.cfg.OnRequestDone != nil {
		e.cfg.OnRequestDone()
	}
}

// hold owes r a release for reason and keeps its blocks until it arrives.
func (e *engine) hold(r *request, reason string) {
	for _, ids := range r.blocks {
		for _, id := range ids {
			if id != 0 {
				e.heldBlocks++
			}
		}
	}
	r.hold(reason)
	e.owed++
}

func (e *engine) logEnd(r *request, reason string) {
	e.log.Debug("sim: ended", "engine", e.cfg.Engine, "request", r.id, "reason", reason, "computed", r.computed,
		"total", len(r.tokens), "hashes", r.pubHash)
}

// preempt frees r's blocks (once released) and puts it back at the front
// of the waiting queue; the caller removes it from running. A resume may
// find the tokens computed so far in the local prefix cache.
func (e *engine) preempt(r *request) {
	e.rep.Preemptions++
	e.b.Preempted(r.id)
	e.hold(r, messages.ReasonPreempted)
	r.phase = preempted
	r.hit = 0
	if r.rng.Float64() < e.cfg.ResumeHitRatio {
		r.hit = min(r.computed, len(r.tokens)-1) / e.lcmBlock * e.lcmBlock
	}
	r.inflight = r.computed
	e.waiting = append([]*request{r}, e.waiting...)
	e.log.Debug("sim: preempted", "engine", e.cfg.Engine, "request", r.id, "computed", r.computed,
		"resume_hit", r.hit)
}

// schedule gives this step's token budget to running requests first, in
// order, then admits waiting requests while blocks and the budget allow.
//
// Out of blocks, vLLM preempts from the back of the running list and reuses
// the victim's blocks at once. The simulated engine may not reuse them
// before `released`, so it preempts one victim and lets requests that find
// no block wait a step while any preempted or finished blocks are on their
// way back; and it admits no one in a step where a running request waited.
func (e *engine) schedule() {
	c := &e.cfg
	budget := c.StepTokens
	starved := false
	for i := 0; i < len(e.running) && budget > 0; i++ {
		r := e.running[i]
		n := min(c.PrefillChunk, len(r.tokens)-r.computed, budget)
		if e.allocate(r, r.computed+n, 0) {
			r.inflight = r.computed + n
			budget -= n
			continue
		}
		starved = true
		if e.heldBlocks > 0 {
			continue // blocks are coming back: r waits
		}
		victim := e.running[len(e.running)-1]
		e.running = e.running[:len(e.running)-1]
		e.rep.PreemptedPressure++
		e.preempt(victim)
		if victim == r {
			break
		}
	}
	if starved {
		return
	}
	for len(e.waiting) > 0 && len(e.running) < c.MaxRunning && budget > 0 {
		r := e.waiting[0]
		start := 0
		if r.phase == preempted {
			start = r.hit
		}
		n := min(c.PrefillChunk, len(r.tokens)-start, budget)
		if !e.canAllocate(r, start+n, start) {
			break // no preemption to admit: wait for blocks to come back
		}
		e.waiting = e.waiting[1:]
		if r.phase == preempted {
			e.rep.Resumes++
			e.b.Resumed(r.id)
			e.log.Debug("sim: resumed", "engine", e.cfg.Engine, "request", r.id, "hit", start)
			if start > 0 {
				e.rep.ResumeHits++
			}
		}
		if r.phase == preempted {
			// kvactors forgot computed at the preemption; this says the
			// prefix-cache hit's KV (written into the fresh blocks before
			// this batch goes out) is there, where the recompute starts.
			e.b.Tokens(r.id, start, len(r.tokens))
		}
		r.phase = running
		e.allocate(r, start+n, start)
		r.computed = start
		e.writeBlocks(r) // the prefix-cache hit, if any: written before the batch goes out
		r.inflight = start + n
		budget -= n
		e.running = append(e.running, r)
	}
}

// need is how many new block ids each group needs so that r covers end
// tokens. A sliding-window group gets the null block for whole chunks that
// end at or before hit - window: a resume with a prefix-cache hit of hit
// tokens never reads them (vLLM skips such blocks one by one; whole chunks
// keep a key's stored bytes the same whoever stored it).
func (e *engine) need(r *request, end, hit int, g int) (total, real int) {
	gc := &e.cfg.Groups[g]
	total = ceilDiv(end, gc.TokensPerBlock) - len(r.blocks[g])
	if total <= 0 {
		return 0, 0
	}
	real = total
	if gc.Kind == messages.KindSlidingWindow && hit > 0 {
		tpc := gc.TokensPerBlock * e.cfg.BlocksPerChunk
		nullChunks := max(0, hit-gc.SlidingWindow) / tpc
		nullBlocks := nullChunks*e.cfg.BlocksPerChunk - len(r.blocks[g])
		real -= min(max(nullBlocks, 0), total)
	}
	return total, real
}

// canAllocate reports whether every group has the blocks r needs.
func (e *engine) canAllocate(r *request, end, hit int) bool {
	for g := range e.cfg.Groups {
		if _, real := e.need(r, end, hit, g); real > len(e.al.free[g]) {
			return false
		}
	}
	return true
}

// allocate extends r's blocks to cover end tokens, in every group or none,
// and announces the new ids.
func (e *engine) allocate(r *request, end, hit int) bool {
	if !e.canAllocate(r, end, hit) {
		return false
	}
	for g := range e.cfg.Groups {
		total, real := e.need(r, end, hit, g)
		if total == 0 {
			continue
		}
		start := len(r.blocks[g])
		ids := make([]uint32, total-real, total) // leading null blocks
		for b := start; b < start+total-real; b++ {
			r.nulled[chunkRef{g, b / e.cfg.BlocksPerChunk}] = true
		}
		ids = append(ids, e.al.take(g, real)...)
		r.blocks[g] = append(r.blocks[g], ids...)
		e.b.Blocks(r.id, g, start, ids)
	}
	return true
}
