package sched

import (
	"fmt"
	"runtime"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
)

// TestStateSizes bounds the long-lived structs: every live request holds one
// Request and one group per KV-cache group (size classes 176 and 48 bytes on
// 64-bit; they were 352 and 112).
func TestStateSizes(t *testing.T) {
	t.Logf("Request %d B, group %d B", unsafe.Sizeof(Request{}), unsafe.Sizeof(group{}))
	require.LessOrEqual(t, unsafe.Sizeof(Request{}), uintptr(176))
	require.LessOrEqual(t, unsafe.Sizeof(group{}), uintptr(48))
}

// BenchmarkLiveRequestMemory reports the heap a live request's sched state
// holds, over many requests, in the bench's scale geometry (full + sliding
// window, 16-token blocks and hashes, 4 blocks per chunk). The hash strings
// are made before the first reading: what is counted is sched's own memory.
//   - new: NewRequest alone;
//   - scale_live: as bench --phases scale seeds them: 50 tokens computed, 4
//     blocks per group, 3 hashes, one decision (a deferral);
//   - stored: 80 tokens, a chunk per group stored, then decoding on.
func BenchmarkLiveRequestMemory(b *testing.B) {
	const n = 4000
	s := spec(16, 4, full(16), swa(16, 1024))
	s.NumGPUBlocks = 8192
	lay := mustLayout(b, s)
	ids := []messages.BlockID{1, 2, 3, 4, 5, 6, 7, 8}
	build := func(hs []messages.Hash, tokens, blocks int, store bool, pool *hostpool.Pool) *Request {
		r := NewRequest(lay, added(16))
		if tokens == 0 {
			return r
		}
		for g := range 2 {
			_ = r.Step(&messages.Event{Type: messages.EvBlocks, Request: rid, Group: g, IDs: ids[:blocks]})
		}
		_ = r.Step(&messages.Event{Type: messages.EvHashes, Request: rid, Hashes: hs[:tokens/16]})
		_ = r.Step(&messages.Event{Type: messages.EvTokens, Request: rid, Computed: tokens, Total: tokens + 1})
		e := r.Advance(pool)
		if store {
			if e.Job == nil {
				b.Fatal("no job")
			}
			pool.CompleteStore(e.Job.Keys(), sumsIf(e.Job.Keys(), true))
			r.JobDone(e.Job.ID, true, false)
			_ = r.Step(&messages.Event{Type: messages.EvTokens, Request: rid, Computed: tokens + 1, Total: tokens + 2})
			r.Advance(pool)
		}
		return r
	}
	for _, tc := range []struct {
		name           string
		tokens, blocks int
		store          bool
	}{{"new", 0, 0, false}, {"scale_live", 50, 4, false}, {"stored", 80, 6, true}} {
		b.Run(tc.name, func(b *testing.B) {
			var perReq float64
			for b.Loop() {
				reqs := make([]*Request, n)
				hsets := make([][]messages.Hash, n) // distinct keys: every request stores
				for i := range hsets {
					hsets[i] = benchHashes(8, fmt.Sprintf("r%d-", i))
				}
				pool := hostpool.New(4*n*lay.MaxChunkBytes(), 0)
				var before, after runtime.MemStats
				runtime.GC()
				runtime.ReadMemStats(&before)
				for i := range reqs {
					reqs[i] = build(hsets[i], tc.tokens, tc.blocks, tc.store, pool)
				}
				pool = nil
				runtime.GC()
				runtime.ReadMemStats(&after)
				perReq = (float64(after.HeapAlloc) - float64(before.HeapAlloc)) / n
				runtime.KeepAlive(reqs)
				runtime.KeepAlive(hsets)
			}
			b.ReportMetric(perReq, "bytes/request")
		})
	}
}

// A request's hashes and each group's block ids get room for the prompt
// with their first append: a prefill in four steps allocates one list each,
// not one per doubling. A prompt past the layout's bounds reserves no more
// than the bounds (and presizeMost).
func TestAPrefillAllocatesEachListOnce(t *testing.T) {
	lay := layout(t, 4, 1, full(4), full(4)) // 64 tokens: 16 hashes, 16 blocks a group
	add := added(64)
	steps := make([][]*messages.Event, 4)
	for s := range steps {
		steps[s] = []*messages.Event{hashes(4*s, 4), blocks(0, 4*s, 1, 2, 3, 4), blocks(1, 4*s, 5, 6, 7, 8)}
	}
	bare := testing.AllocsPerRun(50, func() { NewRequest(lay, add) })
	prefilled := testing.AllocsPerRun(50, func() {
		r := NewRequest(lay, add)
		for _, evs := range steps {
			for _, ev := range evs {
				if err := r.Step(ev); err != nil {
					t.Fatal(err)
				}
			}
		}
	})
	require.Equal(t, 3.0, prefilled-bare, "hashes and two groups' ids: one allocation each")

	r := NewRequest(lay, added(1<<40))
	require.NoError(t, r.Step(hashes(0, 1)))
	require.NoError(t, r.Step(blocks(0, 0, 1)))
	require.LessOrEqual(t, cap(r.hashes), min(lay.MaxHashes, presizeMost))
	require.LessOrEqual(t, cap(r.groups[0].blocks), min(lay.Groups[0].MaxBlocks, presizeMost))
}
