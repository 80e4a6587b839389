package hostpool

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"testing/quick"

	"github.com/kvactors/kvactors/messages"
)

// HoldsEmpty answers what an empty pool's allocation does: every set of
// chunks it says fits is stored whole by PrepareStore, and every set it
// says does not is refused, for page sizes that cut tails into one class,
// into 1/16-page units and a smaller slot, and into whole pages, with and
// without a chunk cap (SetMaxChunks).
func TestHoldsEmptyMatchesTheAllocation(t *testing.T) {
	check := func(seed uint64) bool {
		rng := rand.New(rand.NewPCG(seed, 1))
		pageBytes := int64(64 + rng.IntN(2000))
		pages := 1 + rng.IntN(12)
		p := New(int64(pages)*pageBytes, pageBytes)
		groups := 1 + rng.IntN(3)
		sizes := make([]int64, groups)
		counts := make([]int64, groups)
		var keys []messages.Key
		var all []int64
		for g := range sizes {
			sizes[g] = 1 + rng.Int64N(3*pageBytes)
			if !p.Fits(sizes[g]) {
				sizes[g] = 1 + rng.Int64N(pageBytes)
			}
			counts[g] = rng.Int64N(int64(pages)*pageBytes/sizes[g] + 3)
			for i := range counts[g] {
				keys = append(keys, messages.Key(fmt.Sprintf("g%d-%d", g, i)))
				all = append(all, sizes[g])
			}
		}
		if rng.IntN(3) == 0 {
			p.SetMaxChunks(1 + rng.IntN(len(keys)+2))
		}
		says := p.HoldsEmpty(sizes, counts)
		_, err := p.PrepareStore(keys, all)
		if says != (err == nil) {
			t.Logf("page %d × %d, cap %d, sizes %v counts %v: HoldsEmpty %v, PrepareStore %v", pageBytes, pages, p.maxChunks,
				sizes, counts, says, err)
			return false
		}
		return true
	}
	if err := quick.Check(check, &quick.Config{MaxCount: 3000}); err != nil {
		t.Fatal(err)
	}
}

// The review's case: 192 KiB chunks in 1 MiB pages, five to a page. The
// bytes of 1365 of them are within 256 MiB; their pages are not.
func TestHoldsEmptyCountsPagesNotBytes(t *testing.T) {
	p := New(256<<20, 1<<20)
	if int64(1365)*(192<<10) > p.Capacity() {
		t.Fatal("the case needs a set within the capacity")
	}
	if p.HoldsEmpty([]int64{192 << 10}, []int64{1365}) {
		t.Fatal("1365 chunks of 192 KiB held by 256 pages that take 5 each")
	}
	if !p.HoldsEmpty([]int64{192 << 10}, []int64{1280}) {
		t.Fatal("1280 chunks of 192 KiB not held by 256 pages that take 5 each")
	}
}

// A pool that holds one chunk of each size at once, empty, holds each
// alone: HoldsEmpty of one of each implies Fits of each (node's register
// checks Fits of the largest first only for its plainer error).
func TestHoldsEmptyOfOneOfEachImpliesEachFits(t *testing.T) {
	check := func(seed uint64) bool {
		rng := rand.New(rand.NewPCG(seed, 2))
		pageBytes := int64(64 + rng.IntN(2000))
		p := New(int64(1+rng.IntN(12))*pageBytes, pageBytes)
		sizes, ones := make([]int64, 1+rng.IntN(4)), make([]int64, 0, 4)
		for g := range sizes {
			sizes[g] = 1 + rng.Int64N(int64(len(p.pages)+2)*pageBytes)
			ones = append(ones, 1)
		}
		if !p.HoldsEmpty(sizes, ones) {
			return true
		}
		for _, s := range sizes {
			if !p.Fits(s) {
				t.Logf("page %d × %d, sizes %v: HoldsEmpty, but %d does not fit", pageBytes, len(p.pages), sizes, s)
				return false
			}
		}
		return true
	}
	if err := quick.Check(check, &quick.Config{MaxCount: 5000}); err != nil {
		t.Fatal(err)
	}
}
