package sched

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
)

// The vLLM OffloadingConnector store-path scenarios (tests/v1/kv_offload),
// adapted to kvactors' events: each drives one sched.Request through
// Step/Advance/JobDone against a real hostpool.Pool.

type scenario struct {
	name string
	rule string // the PROTOCOL.md rule the scenario checks
	lay  func(t *testing.T) *Layout
	cap  int
	add  *messages.Event
	ops  []op
	// after checks the end state (stores, snapshot); may be nil.
	after func(t *testing.T, h *harness)
}

func runScenarios(t *testing.T, cases []scenario) {
	t.Helper()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			capacity := tc.cap
			if capacity == 0 {
				capacity = 64
			}
			h := newHarness(t, tc.lay(t), capacity, tc.add)
			h.run(tc.ops)
			if tc.after != nil {
				tc.after(t, h)
			}
		})
	}
}

func oneGroup4(t *testing.T) *Layout { return layout(t, 4, 1, full(4)) }

// storedOnce requires that exactly the chunks named were stored, once each.
func storedOnce(names ...string) func(t *testing.T, h *harness) {
	return func(t *testing.T, h *harness) {
		want := map[string]int{}
		for _, n := range names {
			want[n] = 1
		}
		require.Equal(t, want, h.stored)
		require.Empty(t, h.jobs, "no job left in flight")
	}
}

var released = func(reason string) []string { return []string{reason} }

func TestStoreScenarios(t *testing.T) {
	runScenarios(t, []scenario{
		{
			// PROTOCOL.md "finished": a request aborted while queued (no blocks)
			// makes no job and is released at once.
			name: "aborted while queued with hashes but no blocks is released at once",
			rule: "finished",
			lay:  oneGroup4, add: added(12),
			ops: []op{
				{evs: ev(hashes(0, 3), tokens(0, 12), aborted(0, 12)),
					want: want{releases: released(messages.ReasonAborted), drop: true, cursors: cur(0)}},
			},
			after: storedOnce(),
		},
		{
			name: "aborted while queued with computed tokens but no blocks is released at once",
			rule: "finished",
			lay:  oneGroup4, add: added(12),
			ops: []op{
				{evs: ev(hashes(0, 3), aborted(12, 12)),
					want: want{releases: released(messages.ReasonAborted), drop: true, cursors: cur(0)}},
			},
			after: storedOnce(),
		},
		{
			// PROTOCOL.md "ready prefix" (chunks whose key is known) and "deferred,
			// never skipped": chunk 1 waits for its hash, then is stored.
			name: "missing key stores chunk 0 only then chunk 1 after the hash arrives",
			rule: "ready prefix / deferred",
			lay:  oneGroup4, add: added(8),
			ops: []op{
				{evs: ev(blocks(0, 0, 1, 2), hashes(0, 1), tokens(8, 8)),
					want: want{job: []string{"0/0"}, cursors: cur(1),
						deferred: []Deferral{{Group: 0, Chunk: 1, Reason: DeferHashes}}}},
				{evs: ev(hashes(1, 1)), want: want{job: []string{"0/1"}, cursors: cur(2), deferred: []Deferral{}}},
				{done: 1}, {done: 2},
			},
			after: storedOnce("0/0", "0/1"),
		},
		{
			// PROTOCOL.md "ready prefix" (complete tracked GPU-block chunks).
			name: "blocks lagging stores chunk 0 then 1 and 2 when blocks arrive",
			rule: "ready prefix / deferred",
			lay:  oneGroup4, add: added(12),
			ops: []op{
				{evs: ev(tokens(12, 12), hashes(0, 3), blocks(0, 0, 1)),
					want: want{job: []string{"0/0"}, cursors: cur(1), blocks: [][]messages.BlockID{{1}},
						deferred: []Deferral{{Group: 0, Chunk: 1, Reason: DeferBlocks}}}},
				{evs: ev(blocks(0, 1, 2, 3)),
					want: want{job: []string{"0/1", "0/2"}, cursors: cur(3), blocks: [][]messages.BlockID{{2}, {3}}}},
				{done: 2}, {done: 1},
			},
			after: storedOnce("0/0", "0/1", "0/2"),
		},
		{
			// PROTOCOL.md "finished": one final pass with the finished event's T
			// (aborted: computed only); released once no copy is in flight.
			name: "abort mid-prefill stores only computed chunks",
			rule: "finished",
			lay:  oneGroup4, add: added(12),
			ops: []op{
				{evs: ev(hashes(0, 3), blocks(0, 0, 1, 2, 3), tokens(4, 12)),
					want: want{job: []string{"0/0"}, cursors: cur(1)}},
				{evs: ev(aborted(8, 12)), want: want{job: []string{"0/1"}, cursors: cur(2)}},
				{done: 1, want: want{}},
				{done: 2, want: want{releases: released(messages.ReasonAborted), drop: true}},
			},
			after: storedOnce("0/0", "0/1"),
		},
		{
			// PROTOCOL.md "tokens_per_chunk[g] = tokens_per_block[g] * bpc":
			// 4-token blocks, bpc 3 → 12-token chunks of 3 hashes.
			name: "bpc 3 with 4-token blocks: 35 tokens make 2 chunks, 36 make 3",
			rule: "tokens_per_chunk / offload key",
			lay:  func(t *testing.T) *Layout { return layout(t, 4, 3, full(4)) }, add: added(36),
			ops: []op{
				{evs: ev(hashes(0, 8), blocks(0, 0, seq(1, 9)...), tokens(35, 36)),
					want: want{job: []string{"0/0", "0/1"}, cursors: cur(2),
						blocks: [][]messages.BlockID{{1, 2, 3}, {4, 5, 6}}}},
				{evs: ev(hashes(8, 1), tokens(36, 36)),
					want: want{job: []string{"0/2"}, cursors: cur(3), blocks: [][]messages.BlockID{{7, 8, 9}}}},
				{done: 1}, {done: 2},
			},
			after: storedOnce("0/0", "0/1", "0/2"),
		},
		{
			// PROTOCOL.md "ready prefix" is per group: 12- and 16-token blocks
			// under tph 4 advance independently.
			name: "two groups with 12- and 16-token blocks advance independently",
			rule: "ready prefix (per group)",
			lay:  func(t *testing.T) *Layout { return layout(t, 4, 1, full(12), full(16)) }, add: added(49),
			ops: []op{
				{evs: ev(hashes(0, 7), blocks(0, 0, 1, 2, 3), blocks(1, 0, 11, 12), tokens(31, 31)),
					want: want{job: []string{"0/0", "0/1", "1/0"}, cursors: cur(2, 1)}},
				{evs: ev(hashes(7, 2), tokens(36, 36)),
					want: want{job: []string{"0/2", "1/1"}, cursors: cur(3, 2)}},
				{evs: ev(hashes(9, 3), blocks(0, 3, 4, 5), blocks(1, 2, 13, 14), tokens(49, 49)),
					want: want{job: []string{"0/3", "1/2"}, cursors: cur(4, 3),
						blocks: [][]messages.BlockID{{4}, {13}}}},
				{done: 1}, {done: 2}, {done: 3},
			},
			after: storedOnce("0/0", "0/1", "0/2", "0/3", "1/0", "1/1", "1/2"),
		},
		{
			// PROTOCOL.md "kind": an eagle group holds back its trailing chunk
			// while the request is decoding (T > prompt) and not finished.
			name: "eagle holds back its trailing chunk while decoding and stores it at finish",
			rule: "ready prefix (eagle)",
			lay:  func(t *testing.T) *Layout { return layout(t, 4, 1, full(4), eagle(4)) }, add: added(8),
			ops: []op{
				{evs: ev(hashes(0, 2), blocks(0, 0, 1, 2, 3), blocks(1, 0, 11, 12, 13), tokens(8, 8)),
					comment: "prefill done, not decoding: nothing held back",
					want:    want{job: []string{"0/0", "0/1", "1/0", "1/1"}, cursors: cur(2, 2)}},
				{evs: ev(tokens(9, 9), hashes(2, 1), tokens(12, 13)),
					comment: "decoding: eagle holds back chunk 2",
					want: want{job: []string{"0/2"}, cursors: cur(3, 2),
						deferred: []Deferral{}}}, // eagle chunk 2 was already reported deferred on tokens
				{evs: ev(finished(12, 13)), want: want{job: []string{"1/2"}, cursors: cur(3, 3)}},
				{done: 1}, {done: 2},
				{done: 3, want: want{releases: released(messages.ReasonFinished), drop: true}},
			},
			after: storedOnce("0/0", "0/1", "0/2", "1/0", "1/1", "1/2"),
		},
		{
			// PROTOCOL.md "block id 0": a chunk whose last block id is 0 is never
			// stored; the cursor still moves past it.
			name: "null last block is passed over while the cursor moves",
			rule: "block id 0 / candidates",
			lay:  func(t *testing.T) *Layout { return layout(t, 4, 1, swa(4, 8)) }, add: added(12),
			ops: []op{
				{evs: ev(hashes(0, 3), blocks(0, 0, 5, 0, 7), tokens(12, 12)),
					want: want{job: []string{"0/0", "0/2"}, cursors: cur(3)}},
				{done: 1},
			},
			after: storedOnce("0/0", "0/2"),
		},
		{
			name: "only null last blocks: no job, cursor moves",
			rule: "block id 0 / candidates",
			lay:  func(t *testing.T) *Layout { return layout(t, 4, 1, swa(4, 8)) }, add: added(12),
			ops: []op{
				{evs: ev(hashes(0, 3), blocks(0, 0, 0, 0, 0), tokens(12, 12)), want: want{cursors: cur(3)}},
			},
			after: storedOnce(),
		},
		{
			// PROTOCOL.md "A chunk's host copy is its blocks in order": a chunk
			// of a full-attention group with a null first block but a real last
			// block is stored; its null block keeps its place (Ranges skips it).
			name: "null inner block is kept in place and its chunk stored",
			rule: "block id 0 / host copy",
			lay:  func(t *testing.T) *Layout { return layout(t, 4, 2, full(4)) }, add: added(24),
			ops: []op{
				{evs: ev(hashes(0, 6), blocks(0, 0, 0, 5, 6, 0, 7, 8), tokens(24, 24)),
					want: want{job: []string{"0/0", "0/2"}, cursors: cur(3),
						blocks: [][]messages.BlockID{{0, 5}, {7, 8}}}},
				{done: 1},
			},
			after: func(t *testing.T, h *harness) {
				storedOnce("0/0", "0/2")(t, h)
			},
		},
		{
			// kvactors' choice (docs/PROTOCOL.md "block id 0"): in a group that
			// is not full attention, a chunk with any null block is not stored
			// (a lookup would count its zeros as present); the cursor still
			// moves past it, and the whole chunks are stored.
			name: "sliding-window chunk with a null block is passed over",
			rule: "block id 0 / candidates",
			lay:  func(t *testing.T) *Layout { return layout(t, 4, 2, full(4), swa(4, 8)) }, add: added(24),
			ops: []op{
				{evs: ev(hashes(0, 6), blocks(0, 0, 1, 2, 3, 4, 5, 6), blocks(1, 0, 0, 15, 16, 0, 17, 18),
					tokens(24, 24)),
					want: want{job: []string{"0/0", "0/1", "0/2", "1/2"}, cursors: cur(3, 3),
						blocks: [][]messages.BlockID{{1, 2}, {3, 4}, {5, 6}, {17, 18}}}},
				{done: 1},
			},
			after: storedOnce("0/0", "0/1", "0/2", "1/2"),
		},
		{
			// PROTOCOL.md "If the pool cannot make room: no job, cursor
			// unchanged; the same chunks are retried later".
			name: "pool without room keeps the cursor and retries the same chunks",
			rule: "retry (pool full)",
			lay:  oneGroup4, add: added(12), cap: 6,
			ops: []op{
				{do: func(h *harness) {
					_, err := h.pool.PrepareStore(otherKeys(5), nil)
					require.NoError(h.t, err)
				}, evs: ev(hashes(0, 3), blocks(0, 0, 1, 2, 3), tokens(12, 12)),
					want: want{cursors: cur(0), retry: &Retry{Reason: RetryPoolFull, Attempt: 1, Backoff: RetryBase}}},
				{comment: "retry timer, still no room",
					want: want{cursors: cur(0), retry: &Retry{Reason: RetryPoolFull, Attempt: 2, Backoff: 2 * RetryBase}}},
				{do: func(h *harness) { h.pool.CompleteStore(otherKeys(5), make([]uint32, 5)) },
					comment: "room made: the other keys are ready, hence evictable",
					want:    want{job: []string{"0/0", "0/1", "0/2"}, cursors: cur(3), evicted: 2}},
				{done: 1},
			},
			after: storedOnce("0/0", "0/1", "0/2"),
		},
		{
			// PROTOCOL.md "dedup: keys already present, ready or pending, are not
			// stored again"; the cursor still moves.
			name: "all keys present advances the cursor with no job",
			rule: "candidates (dedup)",
			lay:  oneGroup4, add: added(12),
			ops: []op{
				{do: func(h *harness) {
					ks := []messages.Key{key(0, 0, 1), key(0, 1, 1), key(0, 2, 1)}
					_, err := h.pool.PrepareStore(ks, nil)
					require.NoError(h.t, err)
					h.pool.CompleteStore(ks[:2], make([]uint32, 2)) // two ready, one pending
				}, evs: ev(hashes(0, 3), blocks(0, 0, 1, 2, 3), tokens(12, 12)),
					// the pending one is held for a retry, not counted as stored
					want: want{cursors: cur(3), deduped: 2,
						retry: &Retry{Reason: RetryPending, Attempt: 1, Backoff: RetryBase}}},
				{do: func(h *harness) { h.pool.CompleteStore([]messages.Key{key(0, 2, 1)}, make([]uint32, 1)) },
					comment: "the other copy completes: the retry deduplicates it", want: want{cursors: cur(3), deduped: 1}},
			},
			after: storedOnce(),
		},
		{
			name: "some keys present stores only the others",
			rule: "candidates (dedup)",
			lay:  oneGroup4, add: added(12),
			ops: []op{
				{do: func(h *harness) {
					_, err := h.pool.PrepareStore([]messages.Key{key(0, 1, 1)}, nil)
					require.NoError(h.t, err)
				}, evs: ev(hashes(0, 3), blocks(0, 0, 1, 2, 3), tokens(12, 12)),
					want: want{job: []string{"0/0", "0/2"}, cursors: cur(3),
						retry: &Retry{Reason: RetryPending, Attempt: 1, Backoff: RetryBase}}},
				{done: 1},
				{do: func(h *harness) { h.pool.CompleteStore([]messages.Key{key(0, 1, 1)}, make([]uint32, 1)) },
					comment: "the other copy completes: the retry deduplicates it", want: want{cursors: cur(3), deduped: 1}},
			},
			after: storedOnce("0/0", "0/2"),
		},
		{
			// The chaos 4 failure: an engine reset cancels a dead epoch's queued
			// copy (its pending keys are freed) after the new epoch's request
			// was deduplicated against them. A key pending in another copy is
			// not stored yet: the chunk is held and offered again ("never
			// skipped"), and its request is not released before it is stored.
			name: "a key pending in a copy that is then cancelled is offered again, never skipped",
			rule: "candidates (dedup of a pending key)",
			lay:  oneGroup4, add: added(12),
			ops: []op{
				{do: func(h *harness) {
					_, err := h.pool.PrepareStore([]messages.Key{key(0, 1, 1)}, nil) // the old epoch's queued copy
					require.NoError(h.t, err)
				}, evs: ev(hashes(0, 3), blocks(0, 0, 1, 2, 3), tokens(12, 12), finished(12, 12)),
					want: want{job: []string{"0/0", "0/2"}, cursors: cur(3),
						retry: &Retry{Reason: RetryPending, Attempt: 1, Backoff: RetryBase}}},
				{done: 1, comment: "not released: chunk 1 is not stored"},
				{do: func(h *harness) { h.pool.CompleteStore([]messages.Key{key(0, 1, 1)}, nil) },
					comment: "the old copy is cancelled: its key is freed; the retry stores chunk 1",
					want:    want{job: []string{"0/1"}, cursors: cur(3)}},
				{done: 2, want: want{releases: []string{messages.ReasonFinished}, drop: true}},
			},
			after: storedOnce("0/0", "0/1", "0/2"),
		},
		{
			// PROTOCOL.md "preempted": no new job; cancel queued copies; wait for
			// copies in flight; release; clear block ids; keep hashes and cursors.
			name: "preemption cancels queued jobs, waits, releases, and resumes with a redo",
			rule: "preempted / resumed",
			lay:  oneGroup4, add: added(12),
			ops: []op{
				{evs: ev(hashes(0, 3), blocks(0, 0, 1, 2, 3), tokens(4, 12)),
					want: want{job: []string{"0/0"}, cursors: cur(1)}},
				{evs: ev(tokens(8, 12)), want: want{job: []string{"0/1"}, cursors: cur(2)}},
				{evs: ev(preempted()), want: want{cancel: []JobID{1, 2}, cursors: cur(2)}},
				{do: func(h *harness) { h.reject(blocks(0, 3, 4), ErrPreempted) },
					evs: ev(tokens(12, 12)), comment: "no new job while preempted", want: want{cursors: cur(2)}},
				{done: 1, comment: "job 1 had started: it completes", want: want{}},
				{cancel: 2, comment: "job 2 was queued: cancelled",
					want: want{releases: released(messages.ReasonPreempted)}},
				{noAdv: true, do: func(h *harness) {
					s := h.req.Snapshot()
					require.Equal(h.t, Preempted, s.Phase)
					require.Equal(h.t, 0, s.Groups[0].Blocks, "block ids cleared after release")
					require.Equal(h.t, 3, s.Hashes, "hashes kept")
					require.Equal(h.t, messages.ChunkIndex(2), s.Groups[0].Cursor, "cursor kept")
					require.Equal(h.t, []messages.ChunkIndex{1}, s.Groups[0].Redo, "cancelled chunk to redo")
				}},
				{evs: ev(resumed(), blocks(0, 0, 7, 8, 9)),
					comment: "fresh blocks: the cancelled chunk is offered again with its new block",
					want:    want{job: []string{"0/1", "0/2"}, cursors: cur(3), blocks: [][]messages.BlockID{{8}, {9}}}},
				{done: 3},
			},
			after: storedOnce("0/0", "0/1", "0/2"),
		},
		{
			// docs/PROTOCOL.md: "A failed copy frees its pending slots and its chunks are offered again with a retry".
			name: "failed copy is retried and stored",
			rule: "store job (failed copy)",
			lay:  oneGroup4, add: added(12),
			ops: []op{
				{evs: ev(hashes(0, 3), blocks(0, 0, 1, 2, 3), tokens(12, 12)),
					want: want{job: []string{"0/0", "0/1", "0/2"}, cursors: cur(3)}},
				{done: 1, fail: true, want: want{retry: &Retry{Reason: RetryCopyFailed, Attempt: 1, Backoff: RetryBase}}},
				{comment: "retry timer", want: want{job: []string{"0/0", "0/1", "0/2"}, cursors: cur(3)}},
				{done: 2},
			},
			after: storedOnce("0/0", "0/1", "0/2"),
		},
		{
			// PROTOCOL.md "finished": released only when no copy of this request is
			// queued or in flight; a failed final copy is retried first.
			name: "finished request holds its release until the failed copy is stored",
			rule: "finished / failed copy",
			lay:  oneGroup4, add: added(12),
			ops: []op{
				{evs: ev(hashes(0, 3), blocks(0, 0, 1, 2, 3), tokens(12, 12)),
					want: want{job: []string{"0/0", "0/1", "0/2"}, cursors: cur(3)}},
				{evs: ev(finished(12, 12)), want: want{cursors: cur(3)}},
				{done: 1, fail: true, want: want{retry: &Retry{Reason: RetryCopyFailed, Attempt: 1, Backoff: RetryBase}}},
				{comment: "retry timer", want: want{job: []string{"0/0", "0/1", "0/2"}}},
				{done: 2, want: want{releases: released(messages.ReasonFinished), drop: true}},
			},
			after: storedOnce("0/0", "0/1", "0/2"),
		},
	})
}

// PROTOCOL.md "finished" + sched.FinishRetryLimit: the engine holds a finished
// request's GPU blocks until released, so a copy that keeps failing is given
// up after FinishRetryLimit retries, counted in Dropped.
func TestFinishedGivesUpAfterRetryLimit(t *testing.T) {
	for _, tc := range []struct {
		name   string
		cap    int
		fail   func(h *harness) Effects // one failed attempt
		reason RetryReason
	}{
		{name: "copy keeps failing", cap: 64, reason: RetryCopyFailed, fail: func(h *harness) Effects {
			e := h.advance()
			require.NotNil(h.t, e.Job, "the chunks are offered again")
			require.Equal(h.t, []string{"0/0", "0/1", "0/2"}, jobChunks(e.Job))
			return h.done(e.Job.ID, false)
		}},
		{name: "pool keeps no room", cap: 4, reason: RetryPoolFull, fail: func(h *harness) Effects {
			return h.advance()
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, oneGroup4(t), tc.cap, added(12))
			if tc.reason == RetryPoolFull { // another request's copies hold every page, for good
				_, err := h.pool.PrepareStore(otherKeys(tc.cap), nil)
				require.NoError(t, err)
			}
			h.step(hashes(0, 3), blocks(0, 0, 1, 2, 3), tokens(12, 12), finished(12, 12))
			for attempt := 1; attempt <= FinishRetryLimit; attempt++ {
				e := tc.fail(h)
				require.Equal(t, &Retry{Reason: tc.reason, Attempt: attempt, Backoff: backoff(attempt)}, e.Retry)
				require.Empty(t, e.Releases, "attempt %d: not released while retrying", attempt)
				require.Zero(t, e.GivenUp)
			}
			e := tc.fail(h)
			require.Nil(t, e.Retry)
			require.Equal(t, 3, e.GivenUp, "the three ready chunks are given up")
			require.Equal(t, []string{messages.ReasonFinished}, e.Releases)
			require.True(t, e.Done)
			require.Equal(t, Done, h.req.Phase())
			require.Empty(t, h.stored)
		})
	}
}

// PROTOCOL.md "the same chunks are retried later (next event of the request,
// and a retry timer with backoff)": the backoff doubles up to RetryMax.
func TestBackoffDoublesToMax(t *testing.T) {
	for _, tc := range []struct {
		attempt int
		want    int64
	}{{1, 10}, {2, 20}, {3, 40}, {7, 640}, {8, 1000}, {100, 1000}} {
		require.Equal(t, tc.want, backoff(tc.attempt).Milliseconds(), "attempt %d", tc.attempt)
	}
}

// PROTOCOL.md "If the pool cannot make room: no job, cursor unchanged": the
// same on the node's shared pool (the actors pass hostpool.Shared as the
// Preparer) as on a plain one.
func TestAdvanceWithSharedPool(t *testing.T) {
	lay := oneGroup4(t)
	r := NewRequest(lay, added(12))
	for _, e := range ev(hashes(0, 3), blocks(0, 0, 1, 2, 3), tokens(12, 12)) {
		require.NoError(t, r.Step(e))
	}
	c := lay.MaxChunkBytes()
	sp := hostpool.NewShared(6*c, c)
	_, err := sp.PrepareStore(otherKeys(4), nil) // another request's copies: 2 pages free
	require.NoError(t, err)
	e := r.Advance(sp)
	require.Nil(t, e.Job)
	require.Equal(t, RetryPoolFull, e.Retry.Reason)
	sp2 := hostpool.NewShared(6*c, c)
	e = r.Advance(sp2)
	require.Equal(t, []string{"0/0", "0/1", "0/2"}, jobChunks(e.Job))
	require.Equal(t, 3, sp2.Stats().Pending)
}

// otherKeys are n keys of another request (one chunk of oneGroup4 each).
func otherKeys(n int) []messages.Key {
	keys := make([]messages.Key, n)
	for i := range keys {
		keys[i] = Key(0, messages.Hash(fmt.Sprintf("other%d", i)), 0)
	}
	return keys
}
