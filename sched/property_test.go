package sched

import (
	"fmt"
	"math/rand"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
)

// The property test (raft's quorum/quick_test.go habit): random layouts and
// random interleavings of an engine's events, checked after every step
// against a deliberately naive model of PROTOCOL.md "What kvactors does".
//
// The engine side knows the truth (every hash, every block id of the current
// incarnation) and sends it late, in pieces, out of step, with resends, holes
// and conflicts. The model side mirrors what sched must have accepted and
// recomputes the ready prefix from scratch. Checked:
//   - the incremental ready prefix equals the naive one, after every step;
//   - the request's charge is what its lists and cached keys hold (budget.go);
//   - the cursor never decreases;
//   - a job only holds chunks that are ready (tokens, key and every block
//     known), storable (last block not null; no null block at all in a
//     group that is not full attention), with the current block ids;
//   - no job while preempted;
//   - every chunk ready when the request finished (storable) is
//     stored exactly once over the run, unless Dropped > 0 was reported, and
//     no chunk is ever stored twice;
//   - one release per finished/preempted/reset event, in order, each only
//     after the copies it waits for are done or cancelled;
//   - and what property_extra_test.go adds: a second request sharing the
//     pool and a prefix (dedup, keys pending in its copies), an honest
//     engine's written tokens, Hold/Unhold, early wake-ups, every chunk the
//     cursor passes accounted for, and a finishing request never left with
//     nothing to wake it.

func TestPropertyRandomInterleavings(t *testing.T) {
	runs := 3000
	if n, err := strconv.Atoi(os.Getenv("KVACTORS_PROPERTY_RUNS")); err == nil && n > 0 {
		runs = n // a longer search, by hand: 200000 runs take about half a minute
	}
	if testing.Short() {
		runs = 300
	}
	for seed := int64(1); seed <= int64(runs); seed++ {
		m := newModel(t, seed)
		func() {
			defer func() { // require's FailNow unwinds through here
				if t.Failed() {
					t.Logf("seed %d: %s\n%s", seed, m.desc, strings.Join(m.log, "\n"))
				}
			}()
			m.run()
		}()
	}
}

type gc struct {
	g int
	c messages.ChunkIndex
}

type mjob struct {
	job        *StoreJob
	cancelAsk  bool // a Cancel effect named it
	queuedOnly bool // with cancelAsk: it had not started, so it is cancelled
}

type owed struct {
	reason  string
	waitFor []JobID // jobs that must be done before this release
}

type model struct {
	t    *testing.T
	rng  *rand.Rand
	desc string
	lay  *Layout
	pool *hostpool.Pool
	req  *Request
	salt string

	// engine truth
	prompt, length int
	maxOff         int
	truthHashes    []messages.Hash
	truthBlocks    [][]messages.BlockID // current incarnation, per group
	null           [][]bool             // null block positions, per group
	computed       int                  // engine's
	sentHashes     int
	sentBlocks     []int // this incarnation

	// mirror of what sched must hold
	phase       Phase
	mComputed   int
	mTotal      int
	hashesKnown int
	tracked     []int // block ids tracked per group
	aborted     bool
	reset       bool

	// run bookkeeping
	inflight  []JobID // ascending
	jobs      map[JobID]*mjob
	stored    map[gc]int
	owed      []owed
	cursors   []messages.ChunkIndex
	dropped   int
	mustStore map[gc]bool
	failPct   int
	calm      bool     // a run with no preemption: long stretches of stores
	log       []string // what happened, printed when a seed fails

	// property_extra_test.go
	peer         *peer                   // a second request sharing the pool; nil in some runs
	honest       bool                    // the engine's computed restarts at 0 at preemption
	written      int                     // honest: tokens written into the blocks held now
	held         bool                    // Hold was called, Unhold not yet
	resetReason  string                  // engine_reset or engine_gone
	armed        bool                    // a Retry was asked for and has not fallen due
	owesDecision bool                    // a completion's decision is still to come
	deduped      map[gc]bool             // chunks a decision found ready in the pool
	redo         [][]messages.ChunkIndex // per group, as of the last check
}

func (m *model) logf(format string, a ...any) { m.log = append(m.log, fmt.Sprintf(format, a...)) }

func newModel(t *testing.T, seed int64) *model {
	rng := rand.New(rand.NewSource(seed))
	m := &model{t: t, rng: rng, salt: fmt.Sprintf("s%d-", seed), jobs: map[JobID]*mjob{},
		stored: map[gc]int{}, failPct: 15, calm: rng.Intn(2) == 0}
	// Layout: 1-3 groups, any kinds, bpc 1-3, tph dividing every tokens_per_chunk.
	tph := []int{1, 2, 4}[rng.Intn(3)]
	bpc := 1 + rng.Intn(3)
	var groups []grp
	for range 1 + rng.Intn(3) {
		tpb := 1 + rng.Intn(8)
		for tpb*bpc%tph != 0 {
			tpb = 1 + rng.Intn(8)
		}
		switch rng.Intn(3) {
		case 0:
			groups = append(groups, full(tpb))
		case 1:
			groups = append(groups, swa(tpb, 1+rng.Intn(16)))
		default:
			groups = append(groups, eagle(tpb))
		}
	}
	s := spec(tph, bpc, groups...)
	s.OffloadPromptOnly = rng.Intn(5) == 0
	s.MaxModelLen = 1 << 20 // the naive model has no bound; TestStepTooLarge covers it
	m.lay = mustLayout(t, s)
	capacity := 256
	if rng.Intn(4) == 0 {
		capacity = 1 + rng.Intn(4) // tiny: forces no-room
	}
	m.pool = poolOf(m.lay, capacity)
	m.prompt = 1 + rng.Intn(40)
	m.length = m.prompt + rng.Intn(31)
	m.maxOff = -1
	if rng.Intn(5) == 0 {
		m.maxOff = rng.Intn(m.length + 1)
	}
	m.truthHashes = make([]messages.Hash, m.length/tph)
	for i := range m.truthHashes {
		m.truthHashes[i] = messages.Hash(fmt.Sprintf("%s%d", m.salt, i))
	}
	G := len(groups)
	m.truthBlocks = make([][]messages.BlockID, G)
	m.sentBlocks = make([]int, G)
	m.tracked = make([]int, G)
	m.cursors = make([]messages.ChunkIndex, G)
	m.newIncarnation()
	add := &messages.Event{Type: messages.EvAdded, Request: rid, PromptTokens: m.prompt, MaxOffloadTokens: m.maxOff}
	m.req = NewRequest(m.lay, add)
	m.deduped = map[gc]bool{}
	m.redo = make([][]messages.ChunkIndex, G)
	m.honest = rng.Intn(4) != 0
	m.resetReason = messages.ReasonEngineReset
	if rng.Intn(3) == 0 {
		m.resetReason = messages.ReasonEngineGone
	}
	if rng.Intn(2) == 0 {
		m.peer = newPeer(m)
	}
	if rng.Intn(8) == 0 {
		m.req.Hold()
		m.held = true
	}
	m.desc = fmt.Sprintf("tph=%d bpc=%d groups=%+v promptOnly=%v cap=%d prompt=%d length=%d maxOff=%d calm=%v "+
		"honest=%v peer=%v held=%v", tph, bpc, groups, s.OffloadPromptOnly, capacity, m.prompt, m.length, m.maxOff,
		m.calm, m.honest, m.peer != nil, m.held)
	return m
}

// newIncarnation draws fresh block ids (at start and at resumed). Which
// blocks are null depends on their position only (a sliding window skips the
// same blocks after a resume), so it is drawn once per run.
func (m *model) newIncarnation() {
	if m.null == nil {
		m.null = make([][]bool, len(m.lay.Groups))
		for g, gl := range m.lay.Groups {
			m.null[g] = make([]bool, (m.length+gl.TokensPerBlock-1)/gl.TokensPerBlock)
			for i := range m.null[g] {
				m.null[g][i] = m.rng.Intn(7) == 0
			}
		}
	}
	for g := range m.lay.Groups {
		ids := make([]messages.BlockID, len(m.null[g]))
		for i := range ids {
			if !m.null[g][i] {
				ids[i] = messages.BlockID(1 + m.rng.Intn(m.lay.NumGPUBlocks-1))
			}
		}
		m.truthBlocks[g] = ids
		m.sentBlocks[g] = 0
	}
}

func (m *model) ev(e messages.Event) *messages.Event {
	e.Request = rid
	return &e
}

func (m *model) run() {
	steps := 20 + m.rng.Intn(120)
	for i := 0; i < steps && m.phase != Done && !m.t.Failed(); i++ {
		m.engineStep()
	}
	if m.phase == Running || m.phase == Preempted {
		m.end()
	}
	m.drain()
	if m.t.Failed() {
		return
	}
	require.Equal(m.t, Done, m.phase, "the request is released for good")
	require.Empty(m.t, m.owed, "every owed release was published")
	require.Empty(m.t, m.inflight)
	for k, n := range m.stored {
		require.LessOrEqual(m.t, n, 1, "chunk %v stored at most once", k)
	}
	if m.rng.Intn(4) == 0 {
		e := m.req.Reset(messages.ReasonEngineReset)
		require.True(m.t, noWork(&e), "a reset after the release owes nothing: %+v", e)
	}
	if m.dropped == 0 {
		for k := range m.mustStore {
			if m.stored[k] == 0 && m.deduped[k] {
				continue // the peer stored it
			}
			require.Equal(m.t, 1, m.stored[k], "chunk %v ready at finish is stored exactly once", k)
		}
	}
}

// engineStep is one random engine action (or a timer, or a copy completion).
func (m *model) engineStep() {
	if m.peer != nil && m.rng.Intn(4) == 0 {
		m.peer.step()
		return
	}
	if m.held && m.rng.Intn(20) == 0 {
		m.unhold()
		return
	}
	r := m.rng.Intn(100)
	switch {
	case r < 25:
		m.sendTokens()
	case r < 42:
		m.sendHashes()
	case r < 62:
		m.sendBlocks(m.rng.Intn(len(m.lay.Groups)))
	case r < 75:
		m.completeOne()
	case r < 79:
		if m.calm {
			m.sendTokens()
			return
		}
		wasRunning := m.phase == Running
		m.apply(m.ev(messages.Event{Type: messages.EvPreempted}), nil)
		if wasRunning && m.honest { // its blocks go: it recomputes from 0 after resumed
			m.computed, m.written = 0, 0
		}
	case r < 84:
		m.apply(m.ev(messages.Event{Type: messages.EvResumed}), nil)
	case r < 89:
		m.sendBad()
	case r < 94:
		m.timer()
	case r < 96:
		m.end()
	case r < 97:
		m.apply(m.ev(messages.Event{Type: messages.EvAdded, PromptTokens: m.prompt}), nil)
	default:
		for g := range m.lay.Groups { // a batch that catches every term up
			m.sendBlocks(g)
		}
		m.sendHashes()
		m.sendTokens()
	}
}

func (m *model) sendTokens() {
	switch m.rng.Intn(20) {
	case 0: // computed > total: clamped
		m.apply(m.ev(messages.Event{Type: messages.EvTokens, Computed: m.computed + 1 + m.rng.Intn(5),
			Total: m.computed}), nil)
		return
	case 1: // computed goes down (after a preemption the engine recomputes)
		m.computed = max(0, m.computed-m.rng.Intn(6))
	default:
		if !m.honest || m.phase != Preempted { // an honest engine computes nothing while preempted
			m.computed = min(m.length, m.computed+m.rng.Intn(9))
		}
	}
	m.written = max(m.written, m.computed)
	m.apply(m.ev(messages.Event{Type: messages.EvTokens, Computed: m.computed, Total: m.totalNow()}), nil)
}

func (m *model) totalNow() int {
	return min(m.length, max(m.prompt, m.computed+m.rng.Intn(2)))
}

func (m *model) sendHashes() {
	avail := min(m.length, max(m.prompt, m.computed)) / m.lay.TokensPerHash
	if avail <= m.sentHashes && m.rng.Intn(2) == 0 {
		return
	}
	start := max(0, m.sentHashes-m.rng.Intn(3)) // a resent overlap now and then
	end := min(avail, m.sentHashes+1+m.rng.Intn(4))
	end = max(end, start)
	m.apply(m.ev(messages.Event{Type: messages.EvHashes, Start: start, Hashes: m.truthHashes[start:end]}), nil)
	m.sentHashes = max(m.sentHashes, end)
}

func (m *model) sendBlocks(g int) {
	gl := m.lay.Groups[g]
	avail := min(len(m.truthBlocks[g]), (max(m.prompt, m.computed)+gl.TokensPerBlock+gl.TokensPerBlock-1)/gl.TokensPerBlock)
	start := max(0, m.sentBlocks[g]-m.rng.Intn(3))
	end := max(start, min(avail, m.sentBlocks[g]+1+m.rng.Intn(4)))
	ids := m.truthBlocks[g][start:end]
	var want error
	if m.phase == Preempted {
		want = ErrPreempted
	}
	m.apply(m.ev(messages.Event{Type: messages.EvBlocks, Group: g, Start: start, IDs: ids}), want)
	if want == nil {
		m.sentBlocks[g] = max(m.sentBlocks[g], end)
	}
}

// sendBad sends an event PROTOCOL.md says to reject: a hole or a conflict.
func (m *model) sendBad() {
	switch m.rng.Intn(3) {
	case 0:
		m.apply(m.ev(messages.Event{Type: messages.EvHashes, Start: m.hashesKnown + 1,
			Hashes: []messages.Hash{"x"}}), ErrHole)
	case 1:
		if m.hashesKnown > 0 {
			m.apply(m.ev(messages.Event{Type: messages.EvHashes, Start: m.rng.Intn(m.hashesKnown),
				Hashes: []messages.Hash{"conflict"}}), ErrConflict)
		}
	default:
		g := m.rng.Intn(len(m.lay.Groups))
		if m.phase != Running {
			return
		}
		if m.tracked[g] > 0 && m.rng.Intn(2) == 0 {
			i := m.rng.Intn(m.tracked[g])
			bad := (m.truthBlocks[g][i] + 1) % messages.BlockID(m.lay.NumGPUBlocks)
			m.apply(m.ev(messages.Event{Type: messages.EvBlocks, Group: g, Start: i,
				IDs: []messages.BlockID{bad}}), ErrConflict)
			return
		}
		m.apply(m.ev(messages.Event{Type: messages.EvBlocks, Group: g, Start: m.tracked[g] + 1,
			IDs: []messages.BlockID{1}}), ErrHole)
	}
}

// end finishes (sometimes aborted) or resets the request.
func (m *model) end() {
	if m.rng.Intn(12) == 0 {
		m.doReset()
		return
	}
	switch m.rng.Intn(6) {
	case 0:
		if m.phase == Running { // a last step the tokens events did not tell
			m.computed = min(m.length, m.computed+m.rng.Intn(9))
			m.written = max(m.written, m.computed)
		}
	case 1: // fewer than the tokens events said (PROTOCOL.md: the finished event's T is final)
		m.computed = max(0, m.computed-1-m.rng.Intn(6))
	}
	e := messages.Event{Type: messages.EvFinished, Computed: m.computed, Total: m.totalNow()}
	if m.rng.Intn(5) == 0 {
		e.Aborted = true
	}
	m.apply(m.ev(e), nil)
}

func (m *model) doReset() {
	if m.phase == Done {
		return
	}
	if !m.reset {
		m.reset = true
		hadOwed := len(m.owed) > 0 // a release still owed stays owed, as engine_reset
		m.owed = m.owed[:0]
		// engine_reset only for a request with blocks tracked; engine_gone
		// for every request (PROTOCOL.md "unregister").
		if hadOwed || m.resetReason == messages.ReasonEngineGone ||
			slices.ContainsFunc(m.tracked, func(n int) bool { return n > 0 }) {
			m.owed = append(m.owed, owed{reason: m.resetReason, waitFor: slices.Clone(m.inflight)})
		}
	}
	for i := range m.owed {
		m.owed[i].waitFor = slices.Clone(m.inflight)
	}
	m.phase = Finishing
	m.mComputed, m.mTotal = 0, 0
	clear(m.tracked)
	m.mustStore = nil
	m.effects(m.req.Reset(m.resetReason), "reset")
	m.checkLive("reset")
}

// drain completes every copy and fires retry timers until the request is done.
// In some runs every copy fails from now on: the request must still be
// released, after FinishRetryLimit retries.
func (m *model) drain() {
	if m.rng.Intn(8) == 0 {
		m.failPct = 100
	}
	if m.held {
		m.unhold()
	}
	for i := 0; i < 2000 && m.phase != Done && !m.t.Failed(); i++ {
		switch {
		case m.rng.Intn(10) == 0 && m.phase != Done:
			m.sendHashes() // hashes after finished are accepted
		case m.peer != nil && m.rng.Intn(3) == 0:
			m.peer.step() // its copies end, or it decides again
		case len(m.inflight) > 0 && m.rng.Intn(3) != 0:
			m.completeOne()
		default:
			m.timer()
		}
	}
}

// apply steps one event: the mirror predicts acceptance (want) and the new
// state, then an Advance follows, as the request actor does after a batch.
func (m *model) apply(e *messages.Event, want error) {
	if m.phase == Done {
		want = ErrReleased
	}
	before := m.req.Snapshot()
	err := m.req.Step(e)
	m.logf("step %v start=%d group=%d n=%d/%d computed=%d total=%d aborted=%v -> %v", e.Type, e.Start, e.Group,
		len(e.Hashes), len(e.IDs), e.Computed, e.Total, e.Aborted, err)
	if want != nil {
		require.ErrorIs(m.t, err, want, "%v event", e.Type)
		require.Equal(m.t, before, m.req.Snapshot(), "a rejected %v event changes nothing", e.Type)
		return
	}
	if err != nil {
		m.failf("%v event rejected: %v", e.Type, err)
	}
	m.mirror(e)
	m.check("step " + e.Type.String())
	m.advance("advance")
	m.checkLive("after " + e.Type.String())
}

// mirror applies an accepted event to the model.
func (m *model) mirror(e *messages.Event) {
	switch e.Type {
	case messages.EvHashes:
		m.hashesKnown = max(m.hashesKnown, e.Start+len(e.Hashes))
	case messages.EvBlocks:
		if m.phase != Finishing {
			m.tracked[e.Group] = max(m.tracked[e.Group], e.Start+len(e.IDs))
		}
	case messages.EvTokens:
		if m.phase != Finishing {
			m.mComputed, m.mTotal = e.Computed, e.Total
		}
	case messages.EvPreempted:
		if m.phase == Running {
			m.phase = Preempted
			m.mComputed = 0 // kvactors forgets computed at preemption
			m.owed = append(m.owed, owed{reason: messages.ReasonPreempted, waitFor: slices.Clone(m.inflight)})
		}
	case messages.EvResumed:
		if m.phase == Preempted {
			m.phase = Running
			clear(m.tracked)
			m.newIncarnation()
		}
	case messages.EvFinished:
		if m.phase == Finishing {
			return
		}
		if m.phase == Preempted {
			clear(m.tracked)
		}
		m.phase = Finishing
		m.mComputed, m.mTotal, m.aborted = e.Computed, e.Total, e.Aborted
		reason := messages.ReasonFinished
		if e.Aborted {
			reason = messages.ReasonAborted
		}
		m.owed = append(m.owed, owed{reason: reason})
		for i := range m.owed {
			m.owed[i].waitFor = nil // a finished request waits for every copy
		}
		// Every chunk ready now that is storable must be stored.
		m.mustStore = map[gc]bool{}
		bpc := m.lay.BlocksPerChunk
		for g := range m.lay.Groups {
			for c := range m.naiveReady(g) {
				if m.storable(g, m.truthBlocks[g][c*bpc:(c+1)*bpc]) {
					m.mustStore[gc{g, messages.ChunkIndex(c)}] = true
				}
			}
		}
	}
}

// storable is PROTOCOL.md "block id 0" (a chunk whose last block id is 0 is
// never stored) and kvactors' choice (docs/PROTOCOL.md "block id 0"): in a
// group that is not full attention, nor one with any null block.
func (m *model) storable(g int, ids []messages.BlockID) bool {
	if m.lay.Groups[g].Kind == KindFull {
		return ids[len(ids)-1] != 0
	}
	return !slices.Contains(ids, 0)
}

// naiveT is T recomputed from the mirror (PROTOCOL.md "What kvactors does").
func (m *model) naiveT() int {
	t := min(m.mComputed, m.mTotal)
	if m.maxOff >= 0 {
		t = min(t, m.maxOff)
	}
	if m.lay.OffloadPromptOnly {
		t = min(t, m.prompt)
	}
	return max(t, 0)
}

// naiveReady recomputes ready[g] from scratch.
func (m *model) naiveReady(g int) int {
	gl := m.lay.Groups[g]
	t := m.naiveT()
	tok := t / gl.TokensPerChunk
	if gl.Kind == KindEagle && m.phase != Finishing && t > m.prompt {
		tok = max(tok-1, 0)
	}
	return min(tok, m.hashesKnown/gl.HashesPerChunk, m.tracked[g]/m.lay.BlocksPerChunk)
}

// advance is the decision the request actor takes after a batch of events
// and after a batch of copy completions.
func (m *model) advance(where string) {
	m.owesDecision = false
	m.effects(m.req.Advance(m.pool), where)
}

// timer is an armed retry falling due (its timer, or an early wake-up): the
// request actor's RetryDue takes the armed retry and decides again.
func (m *model) timer() {
	m.armed, m.owesDecision = false, false
	if m.rng.Intn(3) == 0 {
		m.effects(m.req.AdvanceWoken(m.pool), "retry woken")
	} else {
		m.effects(m.req.Advance(m.pool), "retry")
	}
	m.checkLive("retry")
}

func (m *model) unhold() {
	m.held = false
	m.effects(m.req.Unhold(), "unhold")
	m.checkLive("unhold")
}

// completeOne ends one copy in flight: cancelled if it was queued when its
// Cancel came, else ok or failed.
func (m *model) completeOne() {
	if len(m.inflight) == 0 {
		return
	}
	id := m.inflight[m.rng.Intn(len(m.inflight))]
	j := m.jobs[id]
	cancelled := j.cancelAsk && j.queuedOnly
	ok := !cancelled && m.rng.Intn(100) >= m.failPct
	m.pool.CompleteStore(j.job.Keys(), sumsIf(j.job.Keys(), ok))
	m.inflight = slices.DeleteFunc(m.inflight, func(x JobID) bool { return x == id })
	delete(m.jobs, id)
	if ok {
		for _, c := range j.job.Chunks {
			m.stored[gc{c.Group, c.Index}]++
		}
	}
	m.effects(m.req.JobDone(id, ok, cancelled), fmt.Sprintf("job %d done ok=%v cancelled=%v", id, ok, cancelled))
	if (ok || cancelled) && m.phase != Done {
		// The request actor decides after a batch of completions
		// (decideOwed); another message may come first (a batch of events,
		// which decides too).
		if m.rng.Intn(4) == 0 {
			m.owesDecision = true
			return
		}
		m.advance("advance after the job")
	}
	m.checkLive("job done")
}

// effects checks and records what a call asked for.
func (m *model) effects(e Effects, where string) {
	t := m.t
	m.logf("  %s: job=%v cancel=%v retry=%v deduped=%d dropped=%d releases=%v drop=%v deferred=%v", where,
		jobChunks(e.Job), e.Cancel, e.Retry, e.Deduped, e.GivenUp, e.Releases, e.Done, e.Deferred.All())
	bpc := m.lay.BlocksPerChunk
	for _, id := range e.Cancel {
		j, ok := m.jobs[id]
		require.True(t, ok, "%s: cancel names job %d in flight", where, id)
		if !j.cancelAsk {
			j.cancelAsk, j.queuedOnly = true, m.rng.Intn(2) == 0
		}
	}
	if j := e.Job; j != nil {
		require.Contains(t, []Phase{Running, Finishing}, m.phase, "%s: no job while %v", where, m.phase)
		require.NotEmpty(t, j.Chunks)
		for _, c := range j.Chunks {
			g, ci := c.Group, int(c.Index)
			hpc := m.lay.Groups[g].HashesPerChunk
			switch {
			case ci >= m.naiveReady(g):
				m.failf("%s: chunk %d/%d offered before it is ready (ready %d)", where, g, ci, m.naiveReady(g))
			case c.Key != Key(0, m.truthHashes[(ci+1)*hpc-1], g):
				m.failf("%s: chunk %d/%d key %q", where, g, ci, c.Key)
			case !slices.Equal(c.Blocks, m.truthBlocks[g][ci*bpc:(ci+1)*bpc]):
				m.failf("%s: chunk %d/%d blocks %v, current ids %v", where, g, ci, c.Blocks, m.truthBlocks[g][ci*bpc:(ci+1)*bpc])
			case c.Blocks[bpc-1] == 0:
				m.failf("%s: chunk %d/%d has a null last block", where, g, ci)
			case !m.storable(g, c.Blocks):
				m.failf("%s: chunk %d/%d of a %v group has a null block", where, g, ci, m.lay.Groups[g].Kind)
			case m.stored[gc{g, c.Index}] > 0:
				m.failf("%s: chunk %d/%d stored already", where, g, ci)
			}
			m.checkWritten(where, c)
			for _, other := range m.jobs {
				for _, oc := range other.job.Chunks {
					if oc.Group == g && oc.Index == c.Index {
						m.failf("%s: chunk %d/%d in two jobs", where, g, ci)
					}
				}
			}
		}
		require.NotContains(t, m.jobs, j.ID)
		m.jobs[j.ID] = &mjob{job: j}
		m.inflight = append(m.inflight, j.ID)
	}
	for _, d := range e.Deferred.All() {
		if int(d.Chunk) != m.naiveReady(d.Group) {
			m.failf("%s: deferral %+v does not name the first chunk not ready (%d)", where, d, m.naiveReady(d.Group))
		}
	}
	m.dropped += e.GivenUp
	if e.Retry != nil {
		m.armed = true
	}
	if m.held && (len(e.Releases) > 0 || e.Done) {
		m.failf("%s: released %v (done %v) while held", where, e.Releases, e.Done)
	}
	for _, reason := range e.Releases {
		require.NotEmpty(t, m.owed, "%s: release %q owed", where, reason)
		o := m.owed[0]
		m.owed = m.owed[1:]
		require.Equal(t, o.reason, reason, "%s: releases in event order", where)
		if o.reason == messages.ReasonPreempted && m.phase != Finishing {
			for _, id := range o.waitFor {
				require.NotContains(t, m.inflight, id, "%s: preempted released before job %d is done", where, id)
			}
			if m.phase == Preempted {
				clear(m.tracked) // PROTOCOL.md "preempted": clear block ids
			}
		} else {
			require.Empty(t, m.inflight, "%s: %s released with copies in flight", where, reason)
		}
	}
	// PROTOCOL.md "preempted": released once the copies in flight at the
	// preemption are done, also when resumed came first.
	if (m.phase == Running || m.phase == Preempted) && len(m.owed) > 0 && where != "reset" && !m.held {
		for _, o := range m.owed {
			for _, id := range o.waitFor {
				if slices.Contains(m.inflight, id) {
					goto waiting
				}
			}
		}
		require.Fail(t, "preempted release withheld", "%s: owed %v with the copies it waits for done", where, m.owed)
	}
waiting:
	m.account(&e, where) // before Done: ready is the finished request's
	if e.Done {
		if !m.reset || m.resetReason == messages.ReasonEngineGone { // engine_reset without blocks owes none
			require.NotEmpty(t, e.Releases, "%s: dropped without its release", where)
		}
		require.Empty(t, m.owed)
		m.phase = Done
	}
	m.check(where)
	if e.More { // the request actor decides again at once
		require.False(t, e.Done, "%s: more to decide for a request done", where)
		m.effects(m.req.Advance(m.pool), "more")
	}
}

// check compares the request with the model after every call. It runs after
// every step, so it compares plainly and calls the testing package only to
// fail (require's t.Helper walks the stack on every call).
func (m *model) check(where string) {
	s := m.req.Snapshot()
	m.checkPool(where)
	switch {
	case s.Phase != m.phase:
		m.failf("%s: phase %v, model %v", where, s.Phase, m.phase)
	case s.T != m.naiveT():
		m.failf("%s: T %d, naive %d", where, s.T, m.naiveT())
	case s.Hashes != m.hashesKnown:
		m.failf("%s: hashes %d, model %d", where, s.Hashes, m.hashesKnown)
	case !slices.Equal(s.InFlight, m.inflight):
		m.failf("%s: jobs in flight %v, model %v", where, s.InFlight, m.inflight)
	case m.req.StateBytes() != footprint(m.req): // cached keys included (budget.go)
		m.failf("%s: charged %d bytes, the request holds %d", where, m.req.StateBytes(), footprint(m.req))
	}
	for g, gs := range s.Groups {
		switch {
		case gs.Blocks != m.tracked[g]:
			m.failf("%s: group %d blocks %d, model %d", where, g, gs.Blocks, m.tracked[g])
		case int(gs.Ready) != m.naiveReady(g):
			m.failf("%s: group %d ready prefix %d, naive recomputation %d", where, g, gs.Ready, m.naiveReady(g))
		case gs.Cursor < m.cursors[g]:
			m.failf("%s: group %d cursor went down from %d to %d", where, g, m.cursors[g], gs.Cursor)
		}
		m.cursors[g] = gs.Cursor
		m.redo[g] = gs.Redo
	}
}

func (m *model) failf(format string, a ...any) {
	m.t.Helper()
	m.t.Fatalf(format, a...)
}
