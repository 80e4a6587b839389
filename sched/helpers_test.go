package sched

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
)

// Test helpers shared by the sched tests: layouts, event constructors and a
// harness that drives one Request against a real hostpool.Pool the way the
// request and transfer actors do (Step, Advance, CompleteStore + JobDone).

const testBlockBytes = 64

// grp describes one group of a test layout.
type grp struct {
	kind   string
	tpb    int
	window int
}

func full(tpb int) grp  { return grp{kind: messages.KindFull, tpb: tpb} }
func eagle(tpb int) grp { return grp{kind: messages.KindEagle, tpb: tpb} }
func swa(tpb, window int) grp {
	return grp{kind: messages.KindSlidingWindow, tpb: tpb, window: window}
}

// spec builds an EngineSpec with one shm segment and one region per group.
func spec(tph, bpc int, groups ...grp) *messages.EngineSpec {
	s := &messages.EngineSpec{TokensPerHash: tph, BlocksPerChunk: bpc, NumGPUBlocks: 64,
		Segments: []messages.Segment{{Shm: "seg"}}}
	for i, g := range groups {
		s.Groups = append(s.Groups, messages.GroupSpec{Kind: g.kind, TokensPerBlock: g.tpb,
			SlidingWindow: g.window, Regions: []messages.Region{{Segment: 0,
				Offset: int64(i) << 20, BlockStride: testBlockBytes, BlockBytes: testBlockBytes}}})
	}
	return s
}

func mustLayout(t testing.TB, s *messages.EngineSpec) *Layout {
	t.Helper()
	l, err := NewLayout(s)
	require.NoError(t, err)
	return l
}

func layout(t testing.TB, tph, bpc int, groups ...grp) *Layout {
	t.Helper()
	return mustLayout(t, spec(tph, bpc, groups...))
}

const rid = "r1"

// hash is the test's block hash i: distinct per position, like a prefix hash.
func hash(i int) messages.Hash { return messages.Hash(fmt.Sprintf("h%04d", i)) }

func hashRange(start, n int) []messages.Hash {
	hs := make([]messages.Hash, n)
	for i := range hs {
		hs[i] = hash(start + i)
	}
	return hs
}

// key is the offload key of chunk c of group g under hpc hashes per chunk.
func key(g, c, hpc int) messages.Key { return Key(0, hash((c+1)*hpc-1), g) }

func added(prompt int) *messages.Event {
	return &messages.Event{Type: messages.EvAdded, Request: rid, PromptTokens: prompt, MaxOffloadTokens: -1}
}

func addedMax(prompt, maxOffload int) *messages.Event {
	e := added(prompt)
	e.MaxOffloadTokens = maxOffload
	return e
}

func hashes(start, n int) *messages.Event {
	return &messages.Event{Type: messages.EvHashes, Request: rid, Start: start, Hashes: hashRange(start, n)}
}

func hashList(start int, hs ...messages.Hash) *messages.Event {
	return &messages.Event{Type: messages.EvHashes, Request: rid, Start: start, Hashes: hs}
}

func blocks(g, start int, ids ...messages.BlockID) *messages.Event {
	return &messages.Event{Type: messages.EvBlocks, Request: rid, Group: g, Start: start, IDs: ids}
}

func tokens(computed, total int) *messages.Event {
	return &messages.Event{Type: messages.EvTokens, Request: rid, Computed: computed, Total: total}
}

func finished(computed, total int) *messages.Event {
	return &messages.Event{Type: messages.EvFinished, Request: rid, Computed: computed, Total: total}
}

func aborted(computed, total int) *messages.Event {
	e := finished(computed, total)
	e.Aborted = true
	return e
}

func preempted() *messages.Event { return &messages.Event{Type: messages.EvPreempted, Request: rid} }
func resumed() *messages.Event   { return &messages.Event{Type: messages.EvResumed, Request: rid} }

// seq returns n consecutive block ids from first.
func seq(first, n int) []messages.BlockID {
	ids := make([]messages.BlockID, n)
	for i := range ids {
		ids[i] = messages.BlockID(first + i)
	}
	return ids
}

// harness drives one request against a real pool, as the actors do.
type harness struct {
	t      *testing.T
	lay    *Layout
	pool   *hostpool.Pool
	req    *Request
	jobs   map[JobID]*StoreJob // in flight
	stored map[string]int      // "g/c" -> successful stores
	rels   []string            // every release published, in order
}

// sumsIf is a completion: stand-in checksums when ok, nil (failed) otherwise.
func sumsIf(keys []messages.Key, ok bool) []uint32 {
	if !ok {
		return nil
	}
	return make([]uint32, len(keys))
}

// poolOf is a pool holding capacity of lay's largest chunks (one per page).
func poolOf(lay *Layout, capacity int) *hostpool.Pool {
	c := lay.MaxChunkBytes()
	return hostpool.New(int64(capacity)*c, c)
}

func newHarness(t *testing.T, lay *Layout, capacity int, add *messages.Event) *harness {
	t.Helper()
	return &harness{t: t, lay: lay, pool: poolOf(lay, capacity), req: NewRequest(lay, add),
		jobs: map[JobID]*StoreJob{}, stored: map[string]int{}}
}

// step applies events, each of which must be accepted.
func (h *harness) step(evs ...*messages.Event) {
	h.t.Helper()
	for _, ev := range evs {
		require.NoError(h.t, h.req.Step(ev), "event %v", ev.Type)
	}
}

// reject applies ev, which must be rejected with want and change nothing.
func (h *harness) reject(ev *messages.Event, want error) {
	h.t.Helper()
	before := h.req.Snapshot()
	err := h.req.Step(ev)
	require.ErrorIs(h.t, err, want)
	require.Equal(h.t, before, h.req.Snapshot(), "a rejected event changes nothing")
}

// advance takes a decision and records what it asked for.
func (h *harness) advance() Effects {
	h.t.Helper()
	return h.record(h.req.Advance(h.pool))
}

// done completes job id as the transfer actor reports it: the pool side first
// (CompleteStore), then JobDone.
func (h *harness) done(id JobID, ok bool) Effects {
	h.t.Helper()
	j, found := h.jobs[id]
	require.True(h.t, found, "job %d is in flight", id)
	delete(h.jobs, id)
	h.pool.CompleteStore(j.Keys(), sumsIf(j.Keys(), ok))
	if ok {
		for _, c := range j.Chunks {
			h.stored[chunkName(c.Group, c.Index)]++
		}
	}
	return h.record(h.req.JobDone(id, ok, false))
}

// cancel reports job id cancelled while queued.
func (h *harness) cancel(id JobID) Effects {
	h.t.Helper()
	j, found := h.jobs[id]
	require.True(h.t, found, "job %d is in flight", id)
	delete(h.jobs, id)
	h.pool.CompleteStore(j.Keys(), nil)
	return h.record(h.req.JobDone(id, false, true))
}

func (h *harness) record(e Effects) Effects {
	h.t.Helper()
	if e.Job != nil {
		h.jobs[e.Job.ID] = e.Job
		for _, c := range e.Job.Chunks {
			// PROTOCOL.md "offload key": hashes[(c+1)*hashes_per_chunk[g] - 1] + g.
			require.Equal(h.t, key(c.Group, int(c.Index), h.lay.Groups[c.Group].HashesPerChunk), c.Key,
				"key of chunk %s", chunkName(c.Group, c.Index))
		}
	}
	h.rels = append(h.rels, e.Releases...)
	// Effects' slices are valid until the next call: keep copies.
	e.Cancel = append([]JobID(nil), e.Cancel...)
	e.Releases = append([]string(nil), e.Releases...)
	return e
}

func (h *harness) cursors() []messages.ChunkIndex {
	s := h.req.Snapshot()
	out := make([]messages.ChunkIndex, len(s.Groups))
	for i, g := range s.Groups {
		out[i] = g.Cursor
	}
	return out
}

func chunkName(g int, c messages.ChunkIndex) string { return fmt.Sprintf("%d/%d", g, c) }

// jobChunks names a job's chunks "g/c" in job order; nil for no job.
func jobChunks(j *StoreJob) []string {
	if j == nil {
		return nil
	}
	out := make([]string, len(j.Chunks))
	for i, c := range j.Chunks {
		out[i] = chunkName(c.Group, c.Index)
	}
	return out
}

// cur is shorthand for a cursor list.
func cur(cs ...int) []messages.ChunkIndex {
	out := make([]messages.ChunkIndex, len(cs))
	for i, c := range cs {
		out[i] = messages.ChunkIndex(c)
	}
	return out
}

// op is one step of a scenario; want is what it must produce.
type op struct {
	evs     []*messages.Event // applied with Step (must be accepted), then Advance
	done    JobID             // instead of events: complete this job
	fail    bool              // with done: the copy failed
	cancel  JobID             // instead of events: this job was cancelled while queued
	do      func(h *harness)  // run before evs (pool setup, rejected events)
	noAdv   bool              // apply evs without an Advance
	want    want
	comment string
}

type want struct {
	job      []string              // chunks "g/c" of the job made; nil: none
	cursors  []messages.ChunkIndex // nil: not checked
	releases []string              // nil: none
	drop     bool                  // Effects.Done
	retry    *Retry                // nil: none
	cancel   []JobID               // nil: none
	deduped  int                   //
	dropped  int                   // Effects.GivenUp
	deferred []Deferral            // nil: not checked
	evicted  int                   // number of evicted keys
	blocks   [][]messages.BlockID  // per job chunk, when non-nil
}

func ev(evs ...*messages.Event) []*messages.Event { return evs }

// run plays ops and checks each want.
func (h *harness) run(ops []op) {
	h.t.Helper()
	for i, o := range ops {
		var e Effects
		switch {
		case o.done != 0:
			e = h.done(o.done, !o.fail)
		case o.cancel != 0:
			e = h.cancel(o.cancel)
		default:
			if o.do != nil {
				o.do(h)
			}
			h.step(o.evs...)
			if o.noAdv {
				continue
			}
			e = h.advance()
		}
		h.check(i, o, e)
	}
}

func (h *harness) check(i int, o op, e Effects) {
	h.t.Helper()
	msg := fmt.Sprintf("op %d %s", i, o.comment)
	w := o.want
	require.Equal(h.t, w.job, jobChunks(e.Job), "%s: job chunks", msg)
	if w.cursors != nil {
		require.Equal(h.t, w.cursors, h.cursors(), "%s: cursors", msg)
	}
	require.Equal(h.t, w.releases, nilIfEmpty(e.Releases), "%s: releases", msg)
	require.Equal(h.t, w.drop, e.Done, "%s: done", msg)
	require.Equal(h.t, w.retry, e.Retry, "%s: retry", msg)
	// A pending retry names the keys it waits for, each still pending in
	// the pool (their copies' end wakes it); no other decision names any.
	if e.Retry != nil && e.Retry.Reason == RetryPending {
		require.NotEmpty(h.t, e.Pending, "%s: a pending retry names its keys", msg)
		for _, k := range e.Pending {
			st, _ := h.pool.Lookup(k)
			require.Equal(h.t, hostpool.Pending, st, "%s: %s pending", msg, k)
		}
	} else {
		require.Empty(h.t, e.Pending, "%s: pending keys without a pending retry", msg)
	}
	require.Equal(h.t, w.cancel, nilIfEmpty(e.Cancel), "%s: cancel", msg)
	require.Equal(h.t, w.deduped, e.Deduped, "%s: deduped", msg)
	require.Equal(h.t, w.dropped, e.GivenUp, "%s: given up", msg)
	require.Equal(h.t, w.evicted, e.Evicted, "%s: evicted", msg)
	switch {
	case w.deferred == nil:
	case len(w.deferred) == 0:
		require.Empty(h.t, e.Deferred.All(), "%s: deferred", msg)
	default:
		require.Equal(h.t, w.deferred, e.Deferred.All(), "%s: deferred", msg)
	}
	if w.blocks != nil {
		require.NotNil(h.t, e.Job, msg)
		got := make([][]messages.BlockID, len(e.Job.Chunks))
		for i, c := range e.Job.Chunks {
			got[i] = c.Blocks
		}
		require.Equal(h.t, w.blocks, got, "%s: job blocks", msg)
	}
}

func nilIfEmpty[T any](s []T) []T {
	if len(s) == 0 {
		return nil
	}
	return s
}

// noWork reports whether effects ask the caller for nothing (a dedup count
// alone is no work).
func noWork(e *Effects) bool {
	return len(e.Cancel) == 0 && e.Job == nil && e.Evicted == 0 && len(e.Deferred.All()) == 0 &&
		e.Retry == nil && len(e.Releases) == 0 && e.GivenUp == 0 && !e.Done
}
