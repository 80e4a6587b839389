package sched

import (
	"fmt"
	"runtime"
	"testing"

	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
)

// Benchmarks of the event path (STYLE.md: speed is measured with go test
// -bench, not with timed tests). Layout: 2 full-attention groups of 16-token
// blocks, tph 16, bpc 1.

func benchLayout(b *testing.B) *Layout { return layout(b, 16, 1, full(16), full(16)) }

// decodeEvents is a request's event stream, one hash block at a time: the
// blocks of both groups, the tokens, then the hash. n hash blocks.
func decodeEvents(n int, hs []messages.Hash) []messages.Event {
	evs := make([]messages.Event, 0, 4*n)
	for i := range n {
		evs = append(evs,
			messages.Event{Type: messages.EvBlocks, Request: rid, Group: 0, Start: i, IDs: []messages.BlockID{messages.BlockID(1 + i%1000)}},
			messages.Event{Type: messages.EvBlocks, Request: rid, Group: 1, Start: i, IDs: []messages.BlockID{messages.BlockID(1001 + i%1000)}},
			messages.Event{Type: messages.EvTokens, Request: rid, Computed: 16 * (i + 1), Total: 16*(i+1) + 1},
			messages.Event{Type: messages.EvHashes, Request: rid, Start: i, Hashes: hs[i : i+1]})
	}
	return evs
}

func benchHashes(n int, salt string) []messages.Hash {
	hs := make([]messages.Hash, n)
	for i := range hs {
		hs[i] = messages.Hash(fmt.Sprintf("%s%031d", salt, i)[:32])
	}
	return hs
}

// BenchmarkStep: applying one event (blocks, tokens and hashes appends,
// amortized over a 16k-token request) to a request with 2 groups.
func BenchmarkStep(b *testing.B) {
	s := spec(16, 1, full(16), full(16))
	s.NumGPUBlocks = 4096
	lay := mustLayout(b, s)
	const blocksPerReq = 1024
	evs := decodeEvents(blocksPerReq, benchHashes(blocksPerReq, "h"))
	add := added(16 * blocksPerReq)
	r := NewRequest(lay, add)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		j := i % len(evs)
		if j == 0 && i > 0 {
			b.StopTimer()
			r = NewRequest(lay, add)
			b.StartTimer()
		}
		if err := r.Step(&evs[j]); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkAdvance: steady decode. Each operation is one tokens event (+1
// token) and one Advance; the blocks and hash of a chunk arrive as decode
// reaches them, so a chunk per group is stored every 16 events (its job
// completes at once: CompleteStore + JobDone).
func BenchmarkAdvance(b *testing.B) {
	s := spec(16, 1, full(16), full(16))
	s.NumGPUBlocks = 4096
	lay := mustLayout(b, s)
	const tokensPerReq = 16 * 1024
	// Two hash sets, alternating between requests, and a pool smaller than a
	// request: keys are evicted before they come again, so every chunk is
	// stored (no dedup) and eviction is part of the steady state.
	hashSets := [2][]messages.Hash{benchHashes(tokensPerReq/16, "a"), benchHashes(tokensPerReq/16, "b")}
	hs := hashSets[0]
	pool := poolOf(lay, 1024)
	add := added(16)
	r := NewRequest(lay, add)
	var blocks [2]messages.Event
	var hashEv, tok messages.Event
	hashEv = messages.Event{Type: messages.EvHashes, Request: rid}
	tok = messages.Event{Type: messages.EvTokens, Request: rid}
	ids := [2][]messages.BlockID{{0}, {0}}
	for g := range blocks {
		blocks[g] = messages.Event{Type: messages.EvBlocks, Request: rid, Group: g}
	}
	step := func(ev *messages.Event) {
		if err := r.Step(ev); err != nil {
			b.Fatal(err)
		}
	}
	var m0, m1 runtime.MemStats
	runtime.ReadMemStats(&m0)
	chunks := 0
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t := i%tokensPerReq + 1 // tokens computed after this event
		if t == 1 && i > 0 {
			b.StopTimer()
			r = NewRequest(lay, add)
			hs = hashSets[(i/tokensPerReq)%2]
			b.StartTimer()
		}
		if t%16 == 1 { // a new block is allocated for the tokens to come
			for g := range blocks {
				ids[g][0] = messages.BlockID(1 + (t/16)%2000 + 2000*g)
				blocks[g].Start, blocks[g].IDs = t/16, ids[g]
				step(&blocks[g])
			}
		}
		if t%16 == 0 { // a hash block is full
			hashEv.Start, hashEv.Hashes = t/16-1, hs[t/16-1:t/16]
			step(&hashEv)
		}
		tok.Computed, tok.Total = t, t+1
		step(&tok)
		e := r.Advance(pool)
		if e.Job != nil {
			chunks += len(e.Job.Chunks)
			pool.CompleteStore(e.Job.Keys(), sumsIf(e.Job.Keys(), true))
			r.JobDone(e.Job.ID, true, false)
		}
	}
	b.StopTimer()
	runtime.ReadMemStats(&m1)
	if chunks > 0 { // allocs/op rounds down: report the exact cost of a stored chunk
		b.ReportMetric(float64(m1.Mallocs-m0.Mallocs)/float64(chunks), "allocs/chunk")
	}
}

// BenchmarkAdvancePending: a prefill step whose keys another copy is still
// filling (two requests prefilling one shared prompt at once). Each op is one
// request of 8 chunks per group (2 groups) made ready by one batch: a
// decision that holds them all (RetryPending), the other copy completing,
// and the retry that deduplicates them. Sets of hashes rotate through a
// pool that holds a quarter of them, so each op's keys were evicted.
func BenchmarkAdvancePending(b *testing.B) {
	lay := benchLayout(b)
	const chunks, sets = 8, 256
	pool := poolOf(lay, sets*chunks*len(lay.Groups)/4)
	type set struct {
		evs  []messages.Event
		keys []messages.Key
	}
	all := make([]set, sets)
	for i := range all {
		hs := make([]messages.Hash, chunks)
		for c := range hs {
			hs[c] = messages.Hash(fmt.Sprintf("p%03d-%027d", i, c)) // 32 bytes, as benchHashes
		}
		s := &all[i]
		for g := range lay.Groups {
			s.evs = append(s.evs, messages.Event{Type: messages.EvBlocks, Request: rid, Group: g, IDs: seq(1, chunks)})
			for _, h := range hs {
				s.keys = append(s.keys, lay.Key(h, g))
			}
		}
		s.evs = append(s.evs, messages.Event{Type: messages.EvHashes, Request: rid, Hashes: hs},
			messages.Event{Type: messages.EvTokens, Request: rid, Computed: 16 * chunks, Total: 16*chunks + 1})
	}
	add := added(16*chunks + 1)
	sums := make([]uint32, chunks*len(lay.Groups))
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		s := &all[i%sets]
		other, err := pool.PrepareStore(s.keys, nil) // the other request's copy
		if err != nil || len(other.Keys) != len(s.keys) {
			b.Fatalf("the other copy prepared %d of %d keys: %v", len(other.Keys), len(s.keys), err)
		}
		r := NewRequest(lay, add)
		for j := range s.evs {
			if err := r.Step(&s.evs[j]); err != nil {
				b.Fatal(err)
			}
		}
		if e := r.Advance(pool); e.Job != nil || e.Retry == nil || len(e.Pending) != len(s.keys) {
			b.Fatalf("pending decision: job %v, retry %v, %d pending", e.Job, e.Retry, len(e.Pending))
		}
		pool.CompleteStore(other.Keys, sums)
		if e := r.Advance(pool); e.Job != nil || e.Retry != nil || e.Deduped != len(s.keys) {
			b.Fatalf("retry: job %v, retry %v, %d deduplicated", e.Job, e.Retry, e.Deduped)
		}
	}
}

// BenchmarkRequestMemory reports the heap a live request holds: 2 groups,
// 1,000 tokens, 16-token blocks (63 blocks per group, 62 hashes of 32 bytes
// each decoded afresh, as ingest does), measured with runtime.MemStats over
// many requests.
func BenchmarkRequestMemory(b *testing.B) {
	const n, tokens = 2000, 1000
	lay := benchLayout(b)
	build := func(i int, store bool, pool *hostpool.Pool) *Request {
		r := NewRequest(lay, added(tokens))
		nb := (tokens + 15) / 16
		hs := benchHashes(tokens/16, fmt.Sprintf("r%d-", i))
		for g := range 2 {
			ids := make([]messages.BlockID, nb)
			for j := range ids {
				ids[j] = messages.BlockID(1 + j)
			}
			_ = r.Step(&messages.Event{Type: messages.EvBlocks, Request: rid, Group: g, IDs: ids})
		}
		_ = r.Step(&messages.Event{Type: messages.EvHashes, Request: rid, Hashes: hs})
		_ = r.Step(&messages.Event{Type: messages.EvTokens, Request: rid, Computed: tokens, Total: tokens + 1})
		if store {
			e := r.Advance(pool)
			if e.Job == nil {
				b.Fatal("no job")
			}
			pool.CompleteStore(e.Job.Keys(), sumsIf(e.Job.Keys(), true))
			r.JobDone(e.Job.ID, true, false)
		}
		return r
	}
	for _, tc := range []struct {
		name  string
		store bool
	}{{"events_applied", false}, {"all_chunks_stored", true}} {
		b.Run(tc.name, func(b *testing.B) {
			var perReq float64
			for b.Loop() {
				reqs := make([]*Request, n)
				pool := hostpool.New(1<<20*lay.MaxChunkBytes(), 0) // default pages: 1<<20 one-page chunks would cost 80 MB of bookkeeping
				var before, after runtime.MemStats
				runtime.GC()
				runtime.ReadMemStats(&before)
				for i := range reqs {
					reqs[i] = build(i, tc.store, pool)
				}
				pool = nil // the pool's entries are the pool's, not the requests'
				runtime.GC()
				runtime.ReadMemStats(&after)
				perReq = (float64(after.HeapAlloc) - float64(before.HeapAlloc)) / n
				runtime.KeepAlive(reqs)
			}
			b.ReportMetric(perReq, "bytes/request")
		})
	}
}
