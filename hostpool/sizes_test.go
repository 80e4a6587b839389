package hostpool

import (
	"errors"
	"fmt"
	"math/rand"
	"slices"
	"testing"
	"testing/quick"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// naiveFits is the model the size-class planner is checked against: it
// replays the allocation on copied page counts (evict the victims, empty
// pages become free, then place every piece first into a slot of its class,
// else into a free page) instead of counting slots and pages incrementally.
func naiveFits(p *Pool, victims []messages.Key, keys []messages.Key, sizes []int64) bool {
	used := make([]int32, len(p.pages))
	class := make([]int64, len(p.pages))
	for i, pg := range p.pages {
		used[i], class[i] = pg.used, pg.class
	}
	for _, k := range victims {
		for _, pc := range p.entries[lookupRef(p, k)].pieces {
			used[pc.pg]--
		}
	}
	for i := range used {
		if used[i] == 0 {
			class[i] = 0
		}
	}
	seen := map[messages.Key]bool{}
	for i, k := range keys {
		if _, ok := p.lookup(k); ok || seen[k] {
			continue
		}
		seen[k] = true
		for _, cs := range p.split(p.sizeOf(sizes, i), nil) {
			placed := false
			for pg := range used {
				if class[pg] == cs && int64(used[pg]+1)*cs <= p.pageBytes {
					used[pg]++
					placed = true
					break
				}
			}
			for pg := 0; !placed && pg < len(used); pg++ {
				if class[pg] == 0 {
					class[pg], used[pg] = cs, 1
					placed = true
				}
			}
			if !placed {
				return false
			}
		}
	}
	return true
}

// A quick-check of the size-class pool with mixed chunk sizes against the
// naive model: a store succeeds exactly when evicting some prefix of the
// evictable LRU keys makes room (replayed naively), evicts the shortest such
// prefix, and otherwise changes nothing; extents never overlap (the
// invariants, after every call).
func TestMixedSizesQuickCheck(t *testing.T) {
	sizeSet := []int64{1, 3, 4, 5, 16, 17, 24, 40, 64, 65, 100, 200}
	prop := func(seed int64, pagesByte uint8) bool {
		rng := rand.New(rand.NewSource(seed))
		p := New(int64(pagesByte%12)*64, 64)
		alphabet := 12 + rng.Intn(30)
		sizes := map[messages.Key]int64{}
		sizeOf := func(k messages.Key) int64 {
			if s, ok := sizes[k]; ok {
				return s
			}
			s := sizeSet[rng.Intn(len(sizeSet))]
			sizes[k] = s
			return s
		}
		var jobs, loads [][]messages.Key
		for range 120 {
			switch r := rng.Intn(100); {
			case r < 40:
				keys := make([]messages.Key, rng.Intn(8))
				sz := make([]int64, len(keys))
				for i := range keys {
					keys[i] = messages.Key(fmt.Sprintf("k%d", rng.Intn(alphabet)))
					sz[i] = sizeOf(keys[i])
				}
				checkMixedStore(t, p, keys, sz)
			case r < 65:
				if len(jobs) > 0 {
					i := rng.Intn(len(jobs))
					p.CompleteStore(jobs[i], okSums(jobs[i], rng.Intn(10) < 8))
					jobs = slices.Delete(jobs, i, i+1)
				}
			case r < 78:
				keys := []messages.Key{messages.Key(fmt.Sprintf("k%d", rng.Intn(alphabet)))}
				if p.PrepareLoad(keys) == nil {
					loads = append(loads, keys)
				}
			case r < 88:
				if len(loads) > 0 {
					i := rng.Intn(len(loads))
					p.CompleteLoad(loads[i])
					loads = slices.Delete(loads, i, i+1)
				}
			case r < 95:
				p.Touch([]messages.Key{messages.Key(fmt.Sprintf("k%d", rng.Intn(alphabet)))})
			default:
				key := messages.Key(fmt.Sprintf("k%d", rng.Intn(alphabet)))
				_, sum, _ := p.locate(key, nil)
				p.Drop(key, sum)
			}
			checkInvariants(t, p)
			jobs = pendingJobs(p, jobs)
		}
		return !t.Failed()
	}
	require.NoError(t, quick.Check(prop, &quick.Config{MaxCount: 300, Rand: rand.New(rand.NewSource(2))}))
}

func checkMixedStore(t *testing.T, p *Pool, keys []messages.Key, sizes []int64) {
	t.Helper()
	before := snapshot(p)
	offered := map[messages.Key]bool{}
	for _, k := range keys {
		offered[k] = true
	}
	var evictable []messages.Key
	for _, k := range before.LRU {
		if before.Entries[k].Pins == 0 && !offered[k] {
			evictable = append(evictable, k)
		}
	}
	want := -1 // shortest evicting prefix that fits
	for n := 0; n <= len(evictable); n++ {
		if naiveFits(p, evictable[:n], keys, sizes) {
			want = n
			break
		}
	}
	got, err := p.PrepareStore(keys, sizes)
	if want < 0 {
		require.ErrorIs(t, err, ErrNoRoom, "naive model finds no room")
		require.Equal(t, before, snapshot(p), "no room changes nothing")
		return
	}
	require.NoError(t, err, "naive model fits after evicting %d", want)
	if len(got.Keys) > 0 {
		require.Equal(t, nilIfEmpty(evictable[:want]), nilIfEmpty(got.Evicted), "shortest LRU prefix evicted")
	} else {
		require.Empty(t, got.Evicted)
	}
	for i, k := range keys {
		st, size := p.Lookup(k)
		require.NotEqual(t, Absent, st)
		if _, was := before.Entries[k]; !was {
			require.Equal(t, sizes[i], size)
		}
	}
}

// Fragmentation bound: filling an empty pool with chunks of random sizes
// until one does not fit leaves at most one partly used page per class and
// wastes under 1/16 of every full page, so the data is at least
// (pages - classes - free pages) * 15/16 of a page each, and the free pages
// are fewer than the failing chunk needs.
func TestFillBound(t *testing.T) {
	prop := func(seed int64) bool {
		rng := rand.New(rand.NewSource(seed))
		const page = 4096
		p := New(64*page, page)
		sizes := []int64{1 + rng.Int63n(page/2), 1 + rng.Int63n(2*page), 1 + rng.Int63n(9*page)}
		var last int64
		for i := 0; ; i++ {
			last = sizes[rng.Intn(len(sizes))]
			if _, err := p.PrepareStore([]messages.Key{messages.Key(fmt.Sprint(i))}, []int64{last}); err != nil {
				require.True(t, errors.Is(err, ErrNoRoom))
				break
			}
		}
		checkInvariants(t, p)
		st := p.Stats()
		pieces := int64(len(p.split(last, nil)))
		require.LessOrEqual(t, int64(st.FreePages), pieces, "the failing chunk's pieces need more pages")
		floor := int64(st.Pages-len(p.classes)-st.FreePages) * page * 15 / 16
		require.GreaterOrEqual(t, st.Data, floor, "sizes %v", sizes)
		return !t.Failed()
	}
	require.NoError(t, quick.Check(prop, &quick.Config{MaxCount: 100, Rand: rand.New(rand.NewSource(3))}))
}

// The target: with a mix of 256 B, 8 KiB and 2 MiB chunks from three
// engines churning through a 256 MiB pool (1 MiB pages), at least 90% of the
// pool's bytes hold data once it is full. Recorded in docs/BENCHMARKS.md.
func TestMixedChurnUsable(t *testing.T) {
	const poolBytes = 256 << 20
	p := New(poolBytes, DefaultPageBytes)
	rng := rand.New(rand.NewSource(4))
	sizes := []int64{256, 8 << 10, 2 << 20}
	minRatio, sum, n := 1.0, 0.0, 0
	for i := 0; i < 15000; i++ {
		// A decision offers 1-16 chunks of one engine (one size).
		size := sizes[rng.Intn(3)]
		keys := make([]messages.Key, 1+rng.Intn(16))
		sz := make([]int64, len(keys))
		for j := range keys {
			keys[j] = messages.Key(fmt.Sprintf("%d-%d", i, j))
			sz[j] = size
		}
		prep, err := p.PrepareStore(keys, sz)
		require.NoError(t, err)
		p.CompleteStore(prep.Keys, okSums(prep.Keys, true))
		if len(prep.Evicted) > 0 { // full: measure
			r := float64(p.Stats().Data) / poolBytes
			minRatio = min(minRatio, r)
			sum += r
			n++
		}
	}
	require.Positive(t, n)
	t.Logf("256 MiB pool, 256 B / 8 KiB / 2 MiB mix: data/capacity when full: mean %.4f, min %.4f over %d evicting stores",
		sum/float64(n), minRatio, n)
	require.GreaterOrEqual(t, sum/float64(n), 0.90)
}

// A page's slot count and slot indexes are int32: a page of 2 GiB or more
// cut into slots of a few bytes (a chunk of a page and a byte, say, whose
// tail is a one-byte slot) has more slots than an int32 holds. New bounds
// the page at MaxPageBytes, so any page size asked for and any chunk size
// is stored with its slots counted right.
func TestHugePagesCountTheirSlots(t *testing.T) {
	prop := func(shift uint8, tail uint16, whole bool) bool {
		page := int64(1) << (31 + shift%10) // 2 GiB .. 1 TiB asked for
		size := int64(tail%4096) + 1
		if whole {
			size += page
		}
		p := New(4*page, page)
		got, err := p.PrepareStore(k("a"), []int64{size})
		require.NoError(t, err)
		require.Equal(t, k("a"), got.Keys)
		var n int64
		for _, x := range got.Chunk(0) {
			n += x.Len
		}
		require.Equal(t, size, n)
		checkInvariants(t, p)
		return !t.Failed()
	}
	require.NoError(t, quick.Check(prop, &quick.Config{MaxCount: 200, Rand: rand.New(rand.NewSource(3))}))
}
