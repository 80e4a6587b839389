package store

import (
	"math/rand"
	"testing"
	"testing/quick"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
)

// Fits is what register refuses an engine by, and what a disk record must
// pass to be a hit: it must say exactly whether an empty pool stores the
// chunk. A chunk just under the pool's capacity whose tail the pool cuts
// into slots of two sizes needs a page for each, one more than its bytes
// say: accepted by a Fits that compared bytes only, every store of it was
// "no room" for ever.
func TestFitsIsWhetherAnEmptyPoolStoresTheChunk(t *testing.T) {
	prop := func(pick, pages uint8, sizeSeed uint32) bool {
		page := []int64{64, 100, 1024, 4096}[pick%4]
		n := int64(pages%6) + 1
		size := int64(sizeSeed)%((n+1)*page) + 1
		s := New(heapArena(make([]byte, n*page)), page, nil, metrics.NewPool(nil))
		_, err := s.pool.PrepareStore([]messages.Key{"a"}, []int64{size})
		require.Equal(t, err == nil, s.Fits(size), "page %d, %d pages, chunk %d: %v", page, n, size, err)
		return !t.Failed()
	}
	require.NoError(t, quick.Check(prop, &quick.Config{MaxCount: 2000, Rand: rand.New(rand.NewSource(4))}))
}
