package sched

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// Lifecycle edge cases (PROTOCOL.md, "Lifecycle edge cases, so that a resent or
// reordered batch never does harm") and the release rules of "What kvactors
// does".

// prefill3 makes a 12-token request with its three chunks ready under
// oneGroup4.
var prefill3 = ev(hashes(0, 3), blocks(0, 0, 1, 2, 3), tokens(12, 12))

func TestLifecycleScenarios(t *testing.T) {
	runScenarios(t, []scenario{
		{
			// PROTOCOL.md: "A second finished ... is ignored: released is never
			// published twice for one event."
			name: "a second finished is ignored and released is published once",
			rule: "lifecycle: second finished",
			lay:  oneGroup4, add: added(12),
			ops: []op{
				{evs: prefill3, want: want{job: []string{"0/0", "0/1", "0/2"}, cursors: cur(3)}},
				{evs: ev(finished(12, 12)), want: want{cursors: cur(3)}},
				{evs: ev(finished(12, 12), aborted(4, 12)), want: want{cursors: cur(3)}},
				{done: 1, want: want{releases: released(messages.ReasonFinished), drop: true}},
				{noAdv: true, do: func(h *harness) {
					require.ErrorIs(h.t, h.req.Step(finished(12, 12)), ErrReleased)
					require.ErrorIs(h.t, h.req.Step(hashes(3, 1)), ErrReleased)
					require.Equal(h.t, []string{messages.ReasonFinished}, h.rels)
					e := h.advance()
					require.True(h.t, noWork(&e), "a done request does nothing: %+v", e)
				}},
			},
			after: storedOnce("0/0", "0/1", "0/2"),
		},
		{
			// docs/PROTOCOL.md: "A second finished, or preempted before resumed, is ignored".
			name: "preempted twice releases once",
			rule: "lifecycle: preempted twice",
			lay:  oneGroup4, add: added(12),
			ops: []op{
				{evs: prefill3, want: want{job: []string{"0/0", "0/1", "0/2"}, cursors: cur(3)}},
				{evs: ev(preempted()), want: want{cancel: []JobID{1}, cursors: cur(3)}},
				{evs: ev(preempted()), want: want{cursors: cur(3)}},
				{done: 1, want: want{releases: released(messages.ReasonPreempted)}},
				{evs: ev(preempted()), want: want{}},
				{noAdv: true, do: func(h *harness) {
					require.Equal(h.t, []string{messages.ReasonPreempted}, h.rels)
				}},
			},
			after: storedOnce("0/0", "0/1", "0/2"),
		},
		{
			// PROTOCOL.md: "preempted for a request with no block ids tracked is
			// released at once."
			name: "preempted with no blocks is released at once",
			rule: "lifecycle: preempted without blocks",
			lay:  oneGroup4, add: added(12),
			ops: []op{
				{evs: ev(hashes(0, 3), tokens(12, 12), preempted()),
					want: want{releases: released(messages.ReasonPreempted), cursors: cur(0)}},
			},
		},
		{
			// PROTOCOL.md: "Between preempted and resumed, blocks events are
			// rejected (the engine freed those blocks); hashes and tokens are
			// accepted."
			name: "blocks between preempted and resumed are rejected and change nothing",
			rule: "lifecycle: blocks while preempted",
			lay:  oneGroup4, add: added(12),
			ops: []op{
				{evs: ev(hashes(0, 1), blocks(0, 0, 1), tokens(4, 12)), want: want{job: []string{"0/0"}, cursors: cur(1)}},
				{done: 1},
				{evs: ev(preempted()), want: want{releases: released(messages.ReasonPreempted), cursors: cur(1)}},
				{do: func(h *harness) {
					h.reject(blocks(0, 0, 1, 2), ErrPreempted)
					h.reject(blocks(0, 1, 2), ErrPreempted)
				}, evs: ev(hashes(1, 2), tokens(12, 12)), comment: "hashes and tokens accepted", want: want{cursors: cur(1)}},
				{evs: ev(resumed(), blocks(0, 0, 4, 5, 6)),
					want: want{job: []string{"0/1", "0/2"}, cursors: cur(3), blocks: [][]messages.BlockID{{5}, {6}}}},
				{done: 2},
			},
			after: storedOnce("0/0", "0/1", "0/2"),
		},
		{
			// PROTOCOL.md "preempted": wait for copies in flight, then publish
			// released. A resumed that arrives before that release does not cancel
			// it: the release for the preemption is still owed and published once
			// the copies in flight at the preemption are done.
			name: "resumed before the preempted release still releases once the old copies finish",
			rule: "preempted / resumed",
			lay:  oneGroup4, add: added(12),
			ops: []op{
				{evs: ev(hashes(0, 3), blocks(0, 0, 1, 2, 3), tokens(4, 12)), want: want{job: []string{"0/0"}, cursors: cur(1)}},
				{evs: ev(preempted()), want: want{cancel: []JobID{1}, cursors: cur(1)}},
				{evs: ev(resumed(), blocks(0, 0, 7, 8, 9), tokens(12, 12)),
					want: want{job: []string{"0/1", "0/2"}, cursors: cur(3), blocks: [][]messages.BlockID{{8}, {9}}}},
				{done: 1, comment: "the copy in flight at the preemption is done",
					want: want{releases: released(messages.ReasonPreempted)}},
				{done: 2, want: want{}},
				{evs: ev(finished(12, 12)), want: want{releases: released(messages.ReasonFinished), drop: true, cursors: cur(3)}},
				{noAdv: true, do: func(h *harness) {
					require.Equal(h.t, []string{messages.ReasonPreempted, messages.ReasonFinished}, h.rels)
				}},
			},
			after: storedOnce("0/0", "0/1", "0/2"),
		},
		{
			// PROTOCOL.md "preempted" then "finished": one release per event, both
			// after the copies in flight.
			name: "finished while preempted releases both after the copy in flight",
			rule: "preempted / finished",
			lay:  oneGroup4, add: added(12),
			ops: []op{
				{evs: prefill3, want: want{job: []string{"0/0", "0/1", "0/2"}, cursors: cur(3)}},
				{evs: ev(preempted(), finished(12, 12)), want: want{cancel: []JobID{1}, cursors: cur(3)}},
				{done: 1, want: want{releases: []string{messages.ReasonPreempted, messages.ReasonFinished}, drop: true}},
			},
			after: storedOnce("0/0", "0/1", "0/2"),
		},
		{
			// PROTOCOL.md "preempted": the content is still stored, so cursors stay
			// and a resumed request does not store chunks again.
			name: "resumed request does not store stored chunks again",
			rule: "preempted / resumed",
			lay:  oneGroup4, add: added(12),
			ops: []op{
				{evs: prefill3, want: want{job: []string{"0/0", "0/1", "0/2"}, cursors: cur(3)}},
				{done: 1},
				{evs: ev(preempted()), want: want{releases: released(messages.ReasonPreempted), cursors: cur(3)}},
				{evs: ev(resumed(), blocks(0, 0, 7, 8, 9)), want: want{cursors: cur(3)}},
			},
			after: storedOnce("0/0", "0/1", "0/2"),
		},
		{
			// PROTOCOL.md epoch: "queued copies are cancelled; in-flight copies
			// finish; one released with reason engine_reset per request that had
			// GPU blocks tracked".
			name: "engine reset with blocks tracked cancels, waits and releases engine_reset",
			rule: "engine reset",
			lay:  oneGroup4, add: added(12),
			ops: []op{
				{evs: ev(hashes(0, 3), blocks(0, 0, 1, 2, 3), tokens(4, 12)), want: want{job: []string{"0/0"}, cursors: cur(1)}},
				{evs: ev(tokens(8, 12)), want: want{job: []string{"0/1"}, cursors: cur(2)}},
				{noAdv: true, do: func(h *harness) {
					e := h.record(h.req.Reset(messages.ReasonEngineReset))
					h.check(-1, op{want: want{cancel: []JobID{1, 2}}}, e)
					e = h.record(h.req.Reset(messages.ReasonEngineReset))
					h.check(-1, op{comment: "reset twice", want: want{cancel: []JobID{1, 2}}}, e)
				}},
				{cancel: 1, want: want{}},
				{comment: "no store after a reset", want: want{}},
				{done: 2, want: want{releases: released(messages.ReasonEngineReset), drop: true}},
				{noAdv: true, do: func(h *harness) {
					e := h.record(h.req.Reset(messages.ReasonEngineReset))
					require.True(h.t, noWork(&e), "reset after release: %+v", e)
					require.Equal(h.t, []string{messages.ReasonEngineReset}, h.rels)
				}},
			},
			after: storedOnce("0/1"),
		},
		{
			name: "engine reset without blocks releases nothing",
			rule: "engine reset",
			lay:  oneGroup4, add: added(12),
			ops: []op{
				{evs: ev(hashes(0, 3), tokens(12, 12)), want: want{cursors: cur(0)}},
				{noAdv: true, do: func(h *harness) {
					e := h.record(h.req.Reset(messages.ReasonEngineReset))
					h.check(-1, op{want: want{drop: true}}, e)
				}},
			},
		},
		{
			// Engine reset of a preempted request whose release is owed: the
			// engine_reset release replaces it (the engine restarted).
			name: "engine reset of a preempted request owes one engine_reset",
			rule: "engine reset",
			lay:  oneGroup4, add: added(12),
			ops: []op{
				{evs: prefill3, want: want{job: []string{"0/0", "0/1", "0/2"}, cursors: cur(3)}},
				{evs: ev(preempted()), want: want{cancel: []JobID{1}, cursors: cur(3)}},
				{noAdv: true, do: func(h *harness) {
					e := h.record(h.req.Reset(messages.ReasonEngineReset))
					h.check(-1, op{want: want{cancel: []JobID{1}}}, e)
				}},
				{done: 1, want: want{releases: released(messages.ReasonEngineReset), drop: true}},
			},
			after: storedOnce("0/0", "0/1", "0/2"),
		},
		{
			// Regression: finished after preempted forgets the block ids while
			// both releases are still owed (a copy in flight); a reset then
			// still owes one release, or the engine would wait for ever.
			name: "engine reset of a finished-after-preempted request still releases",
			rule: "engine reset",
			lay:  oneGroup4, add: added(12),
			ops: []op{
				{evs: prefill3, want: want{job: []string{"0/0", "0/1", "0/2"}, cursors: cur(3)}},
				{evs: ev(preempted()), want: want{cancel: []JobID{1}, cursors: cur(3)}},
				{evs: ev(finished(12, 12)), want: want{cursors: cur(3)}},
				{noAdv: true, do: func(h *harness) {
					require.False(h.t, h.req.HasBlocks())
					e := h.record(h.req.Reset(messages.ReasonEngineReset))
					h.check(-1, op{want: want{cancel: []JobID{1}}}, e)
				}},
				{done: 1, want: want{releases: released(messages.ReasonEngineReset), drop: true}},
			},
			after: storedOnce("0/0", "0/1", "0/2"),
		},
	})
}

// PROTOCOL.md: hashes and blocks with start < known length must agree with
// what is known (the overlap is ignored); a disagreement, or start > known
// length (a hole), rejects that event and changes nothing. Block ids are in
// [0, num_gpu_blocks); group in [0, G).
func TestRejectedEventsChangeNothing(t *testing.T) {
	lay := layout(t, 4, 1, full(4), full(4))
	base := func(t *testing.T) *harness {
		h := newHarness(t, lay, 64, added(12))
		h.step(hashes(0, 2), blocks(0, 0, 1, 2), blocks(1, 0, 5), tokens(12, 12))
		return h
	}
	wrong := tokens(1, 1)
	wrong.Request = "other"
	for _, tc := range []struct {
		name string
		ev   *messages.Event
		want error
	}{
		{"hashes hole", hashes(3, 1), ErrHole},
		{"hashes conflict in the overlap", hashList(1, "zz", hash(2)), ErrConflict},
		{"hashes negative start", hashList(-1, hash(0)), ErrNegative},
		{"blocks hole", blocks(0, 3, 9), ErrHole},
		{"blocks conflict in the overlap", blocks(0, 1, 9, 3), ErrConflict},
		{"blocks negative start", blocks(0, -1, 7), ErrNegative},
		{"blocks id at num_gpu_blocks after valid ids", blocks(0, 2, 3, 64), ErrBlockRange},
		{"blocks id max uint32", blocks(1, 1, math.MaxUint32), ErrBlockRange},
		{"blocks group -1", blocks(-1, 0, 1), ErrBadGroup},
		{"blocks group G", blocks(2, 0, 1), ErrBadGroup},
		{"wrong request", wrong, ErrWrongRequest},
		{"unknown event type", &messages.Event{Type: 99, Request: rid}, ErrBadEventType},
		{"zero event type", &messages.Event{Request: rid}, ErrBadEventType},
		{"added again with another prompt", added(13), ErrPromptMismatch},
		// PROTOCOL.md "Isolation", bounds: max_model_len defaults to 64 blocks *
		// 4 tokens = 256 tokens: 64 hashes, 64 block ids per group.
		{"hashes past max_model_len", hashes(2, 63), ErrTooLarge},
		{"hashes start near MaxInt", hashList(math.MaxInt, hash(0)), ErrTooLarge},
		{"blocks past max_model_len", blocks(0, 2, seq(3, 63)...), ErrTooLarge},
		{"blocks start near MaxInt", blocks(1, math.MaxInt, 1), ErrTooLarge},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := base(t)
			h.reject(tc.ev, tc.want)
			e := h.advance()
			require.Equal(t, []string{"0/0", "0/1", "1/0"}, jobChunks(e.Job), "state as before the rejection")
		})
	}
}

// PROTOCOL.md: the overlap of a resent hashes/blocks event is ignored, and a
// resent added with the same prompt_tokens is ignored.
func TestResentEventsAreIdempotent(t *testing.T) {
	lay := oneGroup4(t)
	for _, tc := range []struct {
		name string
		evs  []*messages.Event
	}{
		{"same events twice", ev(hashes(0, 3), blocks(0, 0, 1, 2, 3), hashes(0, 3), blocks(0, 0, 1, 2, 3))},
		{"overlapping extension", ev(hashes(0, 2), hashes(1, 2), blocks(0, 0, 1, 2), blocks(0, 1, 2, 3))},
		{"empty events", ev(hashes(0, 0), hashes(0, 3), blocks(0, 0), blocks(0, 0, 1, 2, 3), blocks(0, 3))},
		{"added again", ev(added(12), hashes(0, 3), blocks(0, 0, 1, 2, 3), added(12))},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, lay, 64, added(12))
			h.step(tc.evs...)
			h.step(tokens(12, 12))
			s := h.req.Snapshot()
			require.Equal(t, 3, s.Hashes)
			require.Equal(t, 3, s.Groups[0].Blocks)
			e := h.advance()
			require.Equal(t, []string{"0/0", "0/1", "0/2"}, jobChunks(e.Job))
		})
	}
}

// PROTOCOL.md "What kvactors does": T = min(computed, total), then
// min(T, max_offload_tokens) if set, then min(T, prompt_tokens) if
// offload_prompt_only. "The latest tokens event wins, also when computed goes
// down after a preemption. computed > total is clamped."
func TestOffloadableTokens(t *testing.T) {
	for _, tc := range []struct {
		name       string
		promptOnly bool
		add        *messages.Event
		evs        []*messages.Event
		wantT      int
		wantCursor int
	}{
		{"computed below total", false, added(12), ev(tokens(9, 12)), 9, 2},
		{"computed above total is clamped", false, added(12), ev(tokens(20, 12)), 12, 3},
		{"max_offload_tokens caps", false, addedMax(12, 8), ev(tokens(12, 12)), 8, 2},
		{"max_offload_tokens 0 stores nothing", false, addedMax(12, 0), ev(tokens(12, 12)), 0, 0},
		{"offload_prompt_only caps at the prompt", true, added(8), ev(tokens(12, 13)), 8, 2},
		{"offload_prompt_only and max_offload_tokens", true, addedMax(8, 5), ev(tokens(12, 13)), 5, 1},
		{"the latest tokens event wins", false, added(12), ev(tokens(12, 12), tokens(5, 12)), 5, 1},
		{"negative computed is zero", false, added(12), ev(tokens(-4, 12)), 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := spec(4, 1, full(4))
			s.OffloadPromptOnly = tc.promptOnly
			h := newHarness(t, mustLayout(t, s), 64, tc.add)
			h.step(hashes(0, 4), blocks(0, 0, 1, 2, 3, 4))
			h.step(tc.evs...)
			require.Equal(t, tc.wantT, h.req.Offloadable())
			require.Equal(t, tc.wantT, h.req.Snapshot().T)
			h.advance()
			require.Equal(t, cur(tc.wantCursor), h.cursors())
		})
	}
}

// PROTOCOL.md "finished: one final pass with the finished event's T": tokens
// and blocks events after finished change nothing; a finished event's
// computed > total is clamped like a tokens event's.
func TestFinishedTIsFinal(t *testing.T) {
	h := newHarness(t, oneGroup4(t), 64, added(12))
	h.step(hashes(0, 3), blocks(0, 0, 1, 2), tokens(4, 12), finished(30, 8))
	require.Equal(t, 8, h.req.Offloadable())
	h.step(tokens(12, 12), blocks(0, 2, 3))
	require.Equal(t, 8, h.req.Offloadable())
	require.Equal(t, 2, h.req.Snapshot().Groups[0].Blocks, "blocks after finished are ignored")
	e := h.advance()
	require.Equal(t, []string{"0/0", "0/1"}, jobChunks(e.Job))
	e = h.done(1, true)
	require.Equal(t, []string{messages.ReasonFinished}, e.Releases)
}

// PROTOCOL.md "A chunk at or beyond ready[g] is deferred, never skipped"; a
// Deferral is reported once per chunk per reason change, not once per event.
func TestDeferralsReportedOncePerChunkAndReason(t *testing.T) {
	h := newHarness(t, oneGroup4(t), 64, added(16))
	var got []Deferral
	apply := func(evs ...*messages.Event) {
		h.step(evs...)
		got = append(got, h.advance().Deferred.All()...)
	}
	apply(blocks(0, 0, 1, 2, 3, 4), hashes(0, 1), tokens(8, 16)) // chunk 1 lags on hashes
	apply(tokens(12, 16))
	apply(tokens(16, 16))
	apply(blocks(0, 0, 1, 2)) // a resent overlap
	apply()                   // a retry timer
	require.Equal(t, []Deferral{{Group: 0, Chunk: 1, Reason: DeferHashes}}, got,
		"one deferral for the lagging chunk across several events")

	got = nil
	apply(hashes(1, 1)) // chunk 1 stored; chunk 2 now lags on hashes
	apply(tokens(16, 16))
	require.Equal(t, []Deferral{{Group: 0, Chunk: 2, Reason: DeferHashes}}, got)
	require.Equal(t, cur(2), h.cursors())

	// A reason change for the same chunk is reported again.
	h2 := newHarness(t, oneGroup4(t), 64, added(8))
	h2.step(hashes(0, 2), blocks(0, 0, 1), tokens(4, 8))
	require.Equal(t, []Deferral{{Group: 0, Chunk: 1, Reason: DeferTokens}}, h2.advance().Deferred.All(),
		"chunk 1's key is known, its tokens are not")
	h2.step(tokens(8, 8))
	require.Equal(t, []Deferral{{Group: 0, Chunk: 1, Reason: DeferBlocks}}, h2.advance().Deferred.All())
	require.Empty(t, h2.advance().Deferred.All())
}

// A held request (another request of its id, from an epoch that ended, may
// still be copying from its blocks) publishes no release, a preemption's or
// its last, until Unhold, which carries what was owed meanwhile; it still
// stores meanwhile.
func TestAHeldRequestReleasesNothingUntilUnheld(t *testing.T) {
	h := newHarness(t, oneGroup4(t), 8, added(12))
	h.req.Hold()
	h.step(prefill3...)
	e := h.advance()
	require.NotNil(t, e.Job, "held, it still stores")
	h.step(preempted())
	e = h.advance()
	require.Len(t, e.Cancel, 1, "the preemption cancels the copy made before it, as usual")
	h.done(e.Cancel[0], true)
	require.Empty(t, h.rels, "held: the preempted release waits")
	e = h.record(h.req.Unhold())
	require.Equal(t, []string{messages.ReasonPreempted}, e.Releases)

	h = newHarness(t, oneGroup4(t), 8, added(12))
	h.req.Hold()
	h.step(prefill3...)
	e = h.advance()
	h.step(finished(12, 12))
	h.advance()
	h.done(e.Job.ID, true)
	require.Empty(t, h.rels, "held: the finished release waits")
	require.Equal(t, Finishing, h.req.Phase())
	e = h.record(h.req.Unhold())
	require.Equal(t, []string{messages.ReasonFinished}, e.Releases)
	require.True(t, e.Done)
	require.Equal(t, Done, h.req.Phase())

	h = newHarness(t, oneGroup4(t), 8, added(12))
	h.req.Hold()
	h.step(prefill3...)
	e = h.record(h.req.Reset(messages.ReasonEngineReset))
	require.Empty(t, e.Releases, "held: a reset's release waits too")
	e = h.record(h.req.Unhold())
	require.Equal(t, []string{messages.ReasonEngineReset}, e.Releases)
	require.True(t, e.Done)
}

// A reset cancels every copy in flight once (PROTOCOL.md "EventBatch"):
// the cancels a preemption still owed (its Step returns no effects) are in
// the reset's, and no later effects name them again.
func TestAResetAfterAPreemptionCancelsEachCopyOnce(t *testing.T) {
	h := newHarness(t, oneGroup4(t), 64, added(8))
	h.step(hashes(0, 2), blocks(0, 0, 1, 2), tokens(8, 8))
	job := h.advance().Job
	require.NotNil(t, job)
	h.step(preempted()) // no Advance: its cancel is owed
	e := h.record(h.req.Reset(messages.ReasonEngineReset))
	require.Equal(t, []JobID{job.ID}, e.Cancel)
	require.Empty(t, h.advance().Cancel, "cancelled already")
	e = h.cancel(job.ID)
	require.Empty(t, e.Cancel, "cancelled already")
	require.Equal(t, []string{messages.ReasonEngineReset}, e.Releases)
	require.True(t, e.Done)
}
