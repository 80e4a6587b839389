package sched

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/quick"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
)

// footprint is what r keeps reachable of its hashes and block ids: the
// lists' capacity and the hashes' bytes. Its charge must equal it.
func footprint(r *Request) int64 {
	n := int64(cap(r.hashes)) * hashHeaderBytes
	for _, h := range r.hashes {
		n += int64(len(h))
	}
	for i := range r.groups {
		n += int64(cap(r.groups[i].blocks)) * blockIDBytes
		keys := r.groups[i].cachedKeys()
		n += int64(cap(keys)) * hashHeaderBytes
		for _, k := range keys {
			n += int64(len(k))
		}
	}
	return n
}

func budgetLayout(t testing.TB, limit int64) *Layout {
	s := spec(16, 2, full(16), swa(16, 64))
	s.NumGPUBlocks = 1 << 16
	lay := mustLayout(t, s)
	lay.Budget = NewStateBudget(limit)
	return lay
}

// TestStateBudgetBoundsAnEnginesRequests: past the budget an event that
// would grow a request's lists is rejected "limit" and changes nothing;
// what a request gives back (Forget, a preemption's cleared block ids) is
// taken again by the next.
func TestStateBudgetBoundsAnEnginesRequests(t *testing.T) {
	lay := budgetLayout(t, 4096)
	b := lay.Budget
	var reqs []*Request
	var refused error
	for i := 0; refused == nil; i++ {
		require.Less(t, i, 100, "never refused")
		r := NewRequest(lay, added(0))
		reqs = append(reqs, r)
		for j := 0; j < 8 && refused == nil; j++ {
			before := r.Snapshot()
			charged := r.StateBytes()
			refused = r.Step(hashes(j*4, 4))
			if refused != nil {
				require.Equal(t, before, r.Snapshot(), "a refused event changes nothing")
				require.Equal(t, charged, r.StateBytes())
				break
			}
			refused = r.Step(blocks(0, j*4, seq(j*4, 4)...))
		}
		require.Equal(t, footprint(r), r.StateBytes())
	}
	require.ErrorIs(t, refused, ErrStateBudget)
	require.Equal(t, messages.RejectLimit, messages.RejectLabel(refused))
	var sum int64
	for _, r := range reqs {
		sum += r.StateBytes()
	}
	require.Equal(t, sum, b.Held())
	require.LessOrEqual(t, b.Held(), int64(4096))

	// A preemption clears the block ids: their bytes come back.
	last := reqs[len(reqs)-1]
	first := reqs[0]
	require.NoError(t, first.Step(preempted()))
	require.NoError(t, first.Step(resumed()))
	require.Equal(t, footprint(first), first.StateBytes())
	held := b.Held()
	require.Less(t, held, sum)

	// Released: all of it comes back, and the refused request goes on.
	for _, r := range reqs[:len(reqs)-1] {
		r.Forget()
	}
	require.Equal(t, last.StateBytes(), b.Held())
	require.NoError(t, last.Step(hashes(len(last.hashes), 4)))
	last.Forget()
	require.Zero(t, b.Held())
}

// TestOverlappingHashesDoNotPinTheEventsString: an event's hashes share
// one string (ingest); a request that keeps only the new ones of an
// overlapping event must not keep the rest reachable through them.
func TestOverlappingHashesDoNotPinTheEventsString(t *testing.T) {
	lay := budgetLayout(t, 0)
	r := NewRequest(lay, added(0))
	const n, size = 100, 32
	raw := strings.Repeat("x", n*size) // one event's bytes, as ingest makes them
	hs := make([]messages.Hash, n)
	for i := range hs {
		hs[i] = messages.Hash(raw[i*size : (i+1)*size])
	}
	require.NoError(t, r.Step(hashList(0, hs[:n-1]...)))
	require.NoError(t, r.Step(hashList(0, hs...))) // one new hash at the end
	lo := uintptr(unsafe.Pointer(unsafe.StringData(raw)))
	p := uintptr(unsafe.Pointer(unsafe.StringData(string(r.hashes[n-1]))))
	require.False(t, p >= lo && p < lo+uintptr(len(raw)), "the new hash points into the event's string")
	require.Equal(t, hs[n-1], r.hashes[n-1])
	require.Equal(t, footprint(r), r.StateBytes())
}

// TestStateChargeQuickCheck: under random events of several requests
// sharing one budget, every request's charge is its footprint, the budget
// holds their sum and never more than its limit, a refused event changes
// nothing, and Forget gives everything back.
func TestStateChargeQuickCheck(t *testing.T) {
	f := func(seed uint64, limitKiB uint8) bool {
		rng := rand.New(rand.NewPCG(seed, 7))
		limit := int64(limitKiB) * 256 // 0 (none) to ~64 KiB
		lay := budgetLayout(t, limit)
		reqs := make([]*Request, 3)
		for i := range reqs {
			reqs[i] = NewRequest(lay, added(rng.IntN(256)))
		}
		for range 200 {
			r := reqs[rng.IntN(len(reqs))]
			var ev *messages.Event
			switch rng.IntN(6) {
			case 0, 1:
				start := max(0, len(r.hashes)-rng.IntN(4))
				k := 1 + rng.IntN(40)
				raw := strings.Repeat("h", k*(1+rng.IntN(64)))
				size := len(raw) / k
				hs := make([]messages.Hash, k)
				for i := range hs { // one string per event, as ingest makes them
					hs[i] = messages.Hash(raw[i*size : (i+1)*size])
				}
				copy(hs, r.hashes[start:]) // the overlap agrees
				ev = hashList(start, hs...)
			case 2, 3:
				g := rng.IntN(len(r.groups))
				start := max(0, len(r.groups[g].blocks)-rng.IntN(3))
				ids := seq(start, 1+rng.IntN(80))
				ev = blocks(g, start, ids...)
			case 4:
				ev = preempted()
			case 5:
				ev = resumed()
			}
			before, charged := r.Snapshot(), r.StateBytes()
			if err := r.Step(ev); err != nil {
				if !errors.Is(err, ErrStateBudget) && !errors.Is(err, ErrPreempted) && !errors.Is(err, ErrTooLarge) {
					t.Logf("unexpected %v", err)
					return false
				}
				if r.StateBytes() != charged || !snapshotsEqual(before, r.Snapshot()) {
					return false
				}
			}
			var sum int64
			for _, q := range reqs {
				if q.StateBytes() != footprint(q) {
					t.Logf("charged %d, footprint %d", q.StateBytes(), footprint(q))
					return false
				}
				sum += q.StateBytes()
			}
			if sum != lay.Budget.Held() || (limit > 0 && sum > limit) {
				return false
			}
		}
		for _, q := range reqs {
			q.Forget()
		}
		return lay.Budget.Held() == 0
	}
	require.NoError(t, quick.Check(f, &quick.Config{MaxCount: 300}))
}

func snapshotsEqual(a, b RequestSnapshot) bool { return reflect.DeepEqual(a, b) }

// TestStateBudgetConcurrentTakesNeverPassTheLimit: requests on their own
// goroutines share a budget (one per engine). With room for one take, no
// second is ever inside at once, and takes are refused at the limit.
func TestStateBudgetConcurrentTakesNeverPassTheLimit(t *testing.T) {
	const limit = 150
	b := NewStateBudget(limit)
	var wg sync.WaitGroup
	var inside, most, refused atomic.Int64
	for range 8 {
		wg.Go(func() {
			for range 2000 {
				if !b.take(100) {
					refused.Add(1)
					continue
				}
				n := inside.Add(1)
				for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
				}
				runtime.Gosched() // held a while: let the others try
				inside.Add(-1)
				b.give(100)
			}
		})
	}
	wg.Wait()
	require.Equal(t, int64(1), most.Load(), "more takes inside at once than the limit holds")
	require.Positive(t, refused.Load(), "the takes never met the limit")
	require.Zero(t, b.Held())
}

// TestCachedKeysAreCharged: a decision the pool has no room for caches its
// keys (one per group per chunk, more than the hashes they come from), and
// they are charged; past the budget none are cached, and the request
// stores the same chunks once there is room.
func TestCachedKeysAreCharged(t *testing.T) {
	for _, limit := range []int64{0, 150} {
		lay := layout(t, 4, 1, full(4), full(4))
		lay.Budget = NewStateBudget(limit)
		h := newHarness(t, lay, 4, added(16)) // 4 chunks: two per group
		h.step(hashes(0, 4), blocks(0, 0, seq(1, 4)...), blocks(1, 0, seq(11, 4)...), tokens(8, 8))
		first := h.advance()
		require.NotNil(t, first.Job)
		require.Len(t, first.Job.Chunks, 4)
		base := h.req.StateBytes()
		h.step(tokens(16, 16))
		e := h.advance() // the pool is full of the first job's pending chunks
		require.Nil(t, e.Job)
		require.NotNil(t, e.Retry)
		cached := len(h.req.groups[0].cachedKeys()) + len(h.req.groups[1].cachedKeys())
		if limit == 0 {
			require.Equal(t, 4, cached, "chunks 2 and 3 of each group")
			require.Greater(t, h.req.StateBytes(), base)
		} else {
			require.Less(t, cached, 4, "the budget took no more")
		}
		require.Equal(t, footprint(h.req), h.req.StateBytes())
		if limit > 0 {
			require.LessOrEqual(t, lay.Budget.Held(), limit)
		}
		// Room again: the same chunks are stored, the cache given back.
		for id := range h.jobs {
			h.done(id, true)
		}
		h.advance() // the retry's decision
		require.NotEmpty(t, h.jobs, "the waiting chunks' job")
		for id := range h.jobs {
			h.done(id, true)
		}
		require.Equal(t, 2, h.stored["0/2"]+h.stored["0/3"])
		require.Equal(t, 2, h.stored["1/2"]+h.stored["1/3"])
		require.Equal(t, base, h.req.StateBytes(), "no key cached any more")
		require.Equal(t, footprint(h.req), h.req.StateBytes())
		h.req.Forget()
		require.Zero(t, lay.Budget.Held())
	}
}

// TestAGivenUpRequestGivesItsCachedKeysBack: a finished request that
// never finds room gives its waiting chunks up, and their cached keys'
// charge with them.
func TestAGivenUpRequestGivesItsCachedKeysBack(t *testing.T) {
	lay := layout(t, 4, 1, full(4))
	lay.Budget = NewStateBudget(0)
	h := newHarness(t, lay, 2, added(16))
	h.step(hashes(0, 4), blocks(0, 0, seq(1, 4)...), tokens(8, 8))
	require.NotNil(t, h.advance().Job)
	h.step(finished(16, 16))
	require.Nil(t, h.advance().Job) // the pool is full of the first job's pending chunks
	require.NotEmpty(t, h.req.groups[0].cachedKeys())
	for i := 0; len(h.req.groups[0].cachedKeys()) > 0; i++ {
		require.LessOrEqual(t, i, FinishRetryLimit, "never gave up")
		h.advance()
	}
	require.Equal(t, footprint(h.req), h.req.StateBytes())
}

// refusingPool has no room for anything: every decision fails. It keeps
// the keys it was last offered.
type refusingPool struct{ offered []messages.Key }

func (p *refusingPool) PrepareStoreInto(_ *hostpool.Prepared, keys []messages.Key, _ []int64) error {
	p.offered = append(p.offered[:0], keys...)
	return hostpool.ErrNoRoom
}

// within reports whether s's bytes lie in the span of keys' bytes.
func within(s messages.Key, keys []messages.Key) bool {
	p := uintptr(unsafe.Pointer(unsafe.StringData(string(s))))
	for _, k := range keys {
		lo := uintptr(unsafe.Pointer(unsafe.StringData(string(k))))
		if p >= lo && p < lo+uintptr(len(k)) {
			return true
		}
	}
	return false
}

// TestCachedKeysDoNotPinKeysNotCached: a decision's new keys share one
// string (appendKeys). Those a group caches must not keep the rest of it
// reachable when the rest is not cached (a group's keys the budget
// refused, a redo chunk's): uncharged, one group's key cached per decision
// would pin another group's whole backlog of keys each time.
func TestCachedKeysDoNotPinKeysNotCached(t *testing.T) {
	s := spec(4, 1, full(4), full(4))
	s.NumGPUBlocks = 1024
	t.Run("a group refused", func(t *testing.T) {
		lay := mustLayout(t, s)
		lay.Budget = NewStateBudget(0)
		r := NewRequest(lay, added(256))
		require.NoError(t, r.Step(hashes(0, 64)))
		require.NoError(t, r.Step(blocks(0, 0, 1)))             // group 0: one chunk ready
		require.NoError(t, r.Step(blocks(1, 0, seq(1, 64)...))) // group 1: 64
		require.NoError(t, r.Step(tokens(256, 256)))
		lay.Budget.limit = lay.Budget.Held() + 64 // one key, not 64
		p := &refusingPool{}
		require.NotNil(t, r.Advance(p).Retry)
		require.Len(t, p.offered, 65)
		cached := r.groups[0].cachedKeys()
		require.Equal(t, []messages.Key{key(0, 0, 1)}, cached)
		require.Empty(t, r.groups[1].cachedKeys())
		require.False(t, within(cached[0], p.offered), "the cached key points into the decision's string, with group 1's keys")
		require.Equal(t, footprint(r), r.StateBytes())
	})
	t.Run("a redo chunk", func(t *testing.T) {
		lay := mustLayout(t, s)
		lay.Budget = NewStateBudget(0)
		r := NewRequest(lay, added(256))
		require.NoError(t, r.Step(hashes(0, 64)))
		require.NoError(t, r.Step(blocks(0, 0, seq(1, 8)...)))
		require.NoError(t, r.Step(blocks(1, 0, seq(101, 8)...)))
		require.NoError(t, r.Step(tokens(4, 256)))
		job := r.Advance(poolOf(lay, 16)).Job // chunk 0 of each group
		require.NotNil(t, job)
		r.JobDone(job.ID, false, false) // both to redo
		require.NoError(t, r.Step(tokens(32, 256)))
		p := &refusingPool{}
		require.NotNil(t, r.Advance(p).Retry)
		require.Len(t, p.offered, 16, "two redo chunks and 7 new ones a group")
		for g := range 2 {
			cached := r.groups[g].cachedKeys()
			require.Len(t, cached, 7)
			for _, k := range cached {
				require.False(t, within(k, p.offered), "a cached key points into the decision's string, with the redo chunks' keys")
			}
		}
		require.Equal(t, footprint(r), r.StateBytes())
	})
}

// TestAKeyCacheGrowsGeometrically: a prefill waiting on a full pool
// extends its key cache at every step; copied whole at each extension,
// the cache would cost the square of its length.
func TestAKeyCacheGrowsGeometrically(t *testing.T) {
	var g group
	arrays := 0
	for i := range 10000 {
		before := cap(g.cachedKeys())
		g.cacheKeys([]messages.Key{messages.Key(fmt.Sprintf("k%d", i))}, false)
		if cap(g.cachedKeys()) != before {
			arrays++
		}
	}
	require.Len(t, g.cachedKeys(), 10000)
	require.Equal(t, messages.Key("k9999"), g.cachedKeys()[9999])
	require.LessOrEqual(t, arrays, 40, "a new array at every few keys")
}

// TestAnExtendedKeyCacheIsChargedItsCapacity: a prefill that waits on a
// full pool extends its key cache one chunk at a time; the charge follows
// the cache's capacity as it grows.
func TestAnExtendedKeyCacheIsChargedItsCapacity(t *testing.T) {
	lay := layout(t, 4, 1, full(4))
	lay.Budget = NewStateBudget(0)
	h := newHarness(t, lay, 8, added(64))
	h.step(hashes(0, 16), blocks(0, 0, seq(1, 16)...), tokens(32, 32))
	require.NotNil(t, h.advance().Job) // chunks 0..7 fill the pool, pending
	for c := 9; c <= 15; c++ {
		h.step(tokens(4*c, 4*c))
		require.Nil(t, h.advance().Job)
		require.Len(t, h.req.groups[0].cachedKeys(), c-8, "one more key cached")
		require.Equal(t, footprint(h.req), h.req.StateBytes())
	}
	h.req.Forget()
	require.Zero(t, lay.Budget.Held())
}

// A list grows as append grows it but never past its request's bound
// (grownCap's most): room past MaxHashes or a group's MaxBlocks could never
// be used, and would be charged to the engine's budget for nothing.
func TestListsNeverGrowPastTheRequestsBound(t *testing.T) {
	s := spec(1, 1, full(1))
	s.MaxModelLen = 20
	lay := mustLayout(t, s)
	lay.Budget = NewStateBudget(0)
	r := NewRequest(lay, added(0)) // no prompt: no room reserved ahead
	for i := range 20 {
		require.NoError(t, r.Step(hashes(i, 1)))
		require.NoError(t, r.Step(blocks(0, i, messages.BlockID(i+1))))
		require.LessOrEqual(t, cap(r.hashes), lay.MaxHashes, "%d hashes", i+1)
		require.LessOrEqual(t, cap(r.groups[0].blocks), lay.Groups[0].MaxBlocks, "%d block ids", i+1)
		require.Equal(t, footprint(r), r.StateBytes())
	}
	require.Equal(t, 20, cap(r.hashes), "grown to the bound")
	require.Equal(t, footprint(r), lay.Budget.Held())
}
