package sched

import (
	"fmt"
	"slices"

	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
)

// Extensions of the property test (property_test.go) for what one request
// alone never meets:
//   - a peer: a second request of the same engine sharing the pool and a
//     prefix of the request's hashes, whose copies complete, fail or are
//     cancelled (its engine reset) at random, so the request meets keys
//     ready (deduplicated) and pending in another copy (held, retried);
//   - an honest engine: its computed goes back to 0 at preemption and grows
//     only while it runs, so a job may only hold chunks whose tokens were
//     written in the current incarnation (PROTOCOL.md "tokens": KV of
//     [0, computed) is written);
//   - Hold/Unhold (an older request of the id may still copy its blocks);
//   - early wake-ups (AdvanceWoken);
//   - after every call, every chunk a decision moved below the cursor (or
//     took off its redo list) is accounted for: in the job, still held
//     (redo), not storable, or already ready in the pool (deduplicated, and
//     Effects.Deduped counts exactly those); never skipped silently;
//   - where the request actor would go idle, a finishing request waits for
//     a copy in flight, an armed retry or an Unhold (checkLive).

const peerID = "r2"

type peer struct {
	m        *model
	req      *Request
	prompt   int
	length   int
	hashes   []messages.Hash
	blocks   [][]messages.BlockID
	computed int
	inflight []JobID
	jobs     map[JobID]*mjob
	finished bool
	done     bool
}

// newPeer shares the first shared hashes of m's request; the rest are its own.
func newPeer(m *model) *peer {
	rng := m.rng
	p := &peer{m: m, jobs: map[JobID]*mjob{}}
	shared := rng.Intn(len(m.truthHashes) + 1)
	n := shared + rng.Intn(8)
	p.hashes = append([]messages.Hash(nil), m.truthHashes[:shared]...)
	for i := shared; i < n; i++ {
		p.hashes = append(p.hashes, messages.Hash(fmt.Sprintf("%speer%d", m.salt, i)))
	}
	p.length = n * m.lay.TokensPerHash
	p.prompt = max(1, p.length-rng.Intn(4))
	for _, gl := range m.lay.Groups {
		ids := make([]messages.BlockID, (p.length+gl.TokensPerBlock-1)/gl.TokensPerBlock)
		for i := range ids {
			if rng.Intn(7) != 0 {
				ids[i] = messages.BlockID(1 + rng.Intn(m.lay.NumGPUBlocks-1))
			}
		}
		p.blocks = append(p.blocks, ids)
	}
	p.req = NewRequest(m.lay, &messages.Event{Type: messages.EvAdded, Request: peerID, PromptTokens: p.prompt,
		MaxOffloadTokens: -1})
	p.req.ContinueJobs(1 << 20) // job ids apart from the request's, for the log
	return p
}

func (p *peer) pendingChunks() int {
	n := 0
	for _, id := range p.inflight {
		n += len(p.jobs[id].job.Chunks)
	}
	return n
}

// step is one random action of the peer: progress with every term caught
// up, a copy ending, a timer, its end or its engine's reset.
func (p *peer) step() {
	if p.done {
		return
	}
	m := p.m
	switch r := m.rng.Intn(100); {
	case r < 40:
		if p.finished {
			p.advance(false)
			return
		}
		p.computed = min(p.length, p.computed+m.rng.Intn(9))
		tph := m.lay.TokensPerHash
		p.must(&messages.Event{Type: messages.EvHashes, Request: peerID, Hashes: p.hashes[:min(len(p.hashes),
			max(p.prompt, p.computed)/tph)]})
		for g, gl := range m.lay.Groups {
			n := min(len(p.blocks[g]), (max(p.prompt, p.computed)+gl.TokensPerBlock-1)/gl.TokensPerBlock)
			p.must(&messages.Event{Type: messages.EvBlocks, Request: peerID, Group: g, IDs: p.blocks[g][:n]})
		}
		p.must(&messages.Event{Type: messages.EvTokens, Request: peerID, Computed: p.computed, Total: p.length})
		p.advance(false)
	case r < 80:
		p.completeOne()
	case r < 92:
		p.advance(m.rng.Intn(2) == 0)
	case r < 97:
		if !p.finished {
			p.finished = true
			p.must(&messages.Event{Type: messages.EvFinished, Request: peerID, Computed: p.computed, Total: p.length})
			p.advance(false)
		}
	default:
		p.finished = true
		p.effects(p.req.Reset(messages.ReasonEngineReset), "peer reset")
	}
}

func (p *peer) must(e *messages.Event) {
	if err := p.req.Step(e); err != nil {
		p.m.failf("peer %v event rejected: %v", e.Type, err)
	}
}

func (p *peer) advance(woken bool) {
	if p.done {
		return
	}
	if woken {
		p.effects(p.req.AdvanceWoken(p.m.pool), "peer advance woken")
		return
	}
	p.effects(p.req.Advance(p.m.pool), "peer advance")
}

func (p *peer) completeOne() {
	m := p.m
	if len(p.inflight) == 0 {
		return
	}
	id := p.inflight[m.rng.Intn(len(p.inflight))]
	j := p.jobs[id]
	cancelled := j.cancelAsk && j.queuedOnly
	ok := !cancelled && m.rng.Intn(100) >= 25
	m.pool.CompleteStore(j.job.Keys(), sumsIf(j.job.Keys(), ok))
	p.inflight = slices.DeleteFunc(p.inflight, func(x JobID) bool { return x == id })
	delete(p.jobs, id)
	if p.done {
		return
	}
	p.effects(p.req.JobDone(id, ok, cancelled), fmt.Sprintf("peer job %d done ok=%v cancelled=%v", id, ok, cancelled))
}

func (p *peer) effects(e Effects, where string) {
	m := p.m
	m.logf("  %s: job=%v cancel=%v retry=%v deduped=%d done=%v", where, jobChunks(e.Job), e.Cancel, e.Retry,
		e.Deduped, e.Done)
	for _, id := range e.Cancel {
		if j, ok := p.jobs[id]; ok && !j.cancelAsk {
			j.cancelAsk, j.queuedOnly = true, m.rng.Intn(2) == 0
		}
	}
	if j := e.Job; j != nil {
		p.jobs[j.ID] = &mjob{job: j}
		p.inflight = append(p.inflight, j.ID)
	}
	if e.Done {
		p.done = true
	}
	m.checkPool(where)
}

// checkLive: a finishing request that is not done must be waiting for
// something that will come by itself (a copy in flight, an armed retry, an
// Unhold); with none of them nothing would ever decide for it again, and
// the engine would wait for its blocks for good. It runs where the request
// actor would go idle.
func (m *model) checkLive(where string) {
	if m.phase == Finishing && !m.held && len(m.inflight) == 0 && !m.armed && !m.owesDecision {
		m.failf("%s: a finishing request with no copy in flight and no retry armed is never released", where)
	}
}

// checkPool compares the pool's pending chunks with the copies in flight.
func (m *model) checkPool(where string) {
	pending := 0
	for _, id := range m.inflight {
		pending += len(m.jobs[id].job.Chunks)
	}
	if m.peer != nil {
		pending += m.peer.pendingChunks()
	}
	if got := m.pool.Stats().Pending; got != pending {
		m.failf("%s: pool pending %d, chunks of the jobs in flight %d", where, got, pending)
	}
}

// account checks that every chunk the call took off the undecided set (the
// cursor passed it, or it left the redo list) went somewhere: into e.Job,
// back onto the redo list, nowhere because it is not storable, or nowhere
// because its key is ready in the pool (a dedup). Chunks given up are
// counted by GivenUp instead. It runs before check updates the cursors.
func (m *model) account(e *Effects, where string) {
	if e.GivenUp > 0 {
		return
	}
	s := m.req.Snapshot()
	inJob := map[gc]bool{}
	if e.Job != nil {
		for _, c := range e.Job.Chunks {
			inJob[gc{c.Group, c.Index}] = true
		}
	}
	deduped := 0
	bpc := m.lay.BlocksPerChunk
	for g, gs := range s.Groups {
		var left []messages.ChunkIndex
		for c := m.cursors[g]; c < gs.Cursor; c++ {
			left = append(left, c)
		}
		for _, c := range m.redo[g] {
			if !slices.Contains(gs.Redo, c) {
				left = append(left, c)
			}
		}
		for _, c := range left {
			k := gc{g, c}
			switch {
			case inJob[k], slices.Contains(gs.Redo, c):
				continue
			case int(c) >= m.naiveReady(g):
				// Only a decision moves the cursor, and only up to ready.
				m.failf("%s: chunk %d/%d passed while not ready (ready %d)", where, g, c, m.naiveReady(g))
			case !m.storable(g, m.truthBlocks[g][int(c)*bpc:(int(c)+1)*bpc]):
				continue
			}
			key := Key(0, m.truthHashes[(int(c)+1)*m.lay.Groups[g].HashesPerChunk-1], g)
			if st, _ := m.pool.Lookup(key); st != hostpool.Ready {
				m.failf("%s: chunk %d/%d skipped: not in the job, not held, key %v in the pool", where, g, c, st)
			}
			m.deduped[k] = true
			deduped++
		}
	}
	if deduped != e.Deduped {
		m.failf("%s: %d chunks deduplicated, Effects.Deduped %d", where, deduped, e.Deduped)
	}
	for _, k := range e.Pending {
		if st, _ := m.pool.Lookup(k); st != hostpool.Pending {
			m.failf("%s: retry waits for key %q, which is %v", where, k, st)
		}
	}
	if (e.Retry != nil && e.Retry.Reason == RetryPending) != (len(e.Pending) > 0) {
		m.failf("%s: retry %+v with pending keys %v", where, e.Retry, e.Pending)
	}
}

// checkWritten: a job's chunks hold only tokens the honest engine wrote
// into the blocks it holds now.
func (m *model) checkWritten(where string, c JobChunk) {
	if !m.honest {
		return
	}
	if end := (int(c.Index) + 1) * m.lay.Groups[c.Group].TokensPerChunk; end > m.written {
		m.failf("%s: chunk %d/%d ends at token %d, only %d written in these blocks", where, c.Group, c.Index,
			end, m.written)
	}
}
