package disk

import (
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// told records Notify's calls in their order.
type told struct {
	mu    sync.Mutex
	calls []toldCall
	// first, if set, runs (under the tier's lock, as Notify does) at the
	// next call that tells chunks stored, then is cleared.
	first func()
}

type toldCall struct {
	stored bool
	keys   []messages.Key
}

func (t *told) notify(_ string, stored, removed []messages.Key) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(stored) > 0 {
		t.calls = append(t.calls, toldCall{true, stored})
		if t.first != nil {
			t.first()
			t.first = nil
		}
	}
	if len(removed) > 0 {
		t.calls = append(t.calls, toldCall{false, removed})
	}
}

// ReannouncePrefix walks a large index a slice per hold of the lock: it
// held the lock for the whole walk (1M chunks: ~30 ms per namespace, 0.4
// to 0.9 s for all; BenchmarkReannouncePrefix), and every store, load and
// lookup of the tier waited. Drops of the least and the most recently used
// chunk, started as the walk tells its first chunks, now land between its
// slices (tried again until they do: the lock goes to a waiter that has
// waited 1 ms); and what the walk and the drops tell, applied in order
// from a clear, is what the disk holds: a chunk told stored and dropped
// since has its removal told after it, a chunk dropped before its slice
// is not told.
func TestReannounceLetsTheTierWorkBetweenSlices(t *testing.T) {
	tl := &told{}
	d, err := Open(Config{Dir: t.TempDir(), Bytes: 1 << 30}, tl.notify)
	require.NoError(t, err)
	defer d.Close()
	const n = 6 * reannounceSlice
	for i := range n {
		data := []byte(fmt.Sprintf("data-%06d", i))
		require.True(t, d.Spill("e", key(i), sum(data), data))
	}
	testkit.Eventually(t, 30*time.Second, time.Millisecond, func() error {
		if st := d.Stats(); st.Chunks != n {
			return fmt.Errorf("%d of %d chunks on disk", st.Chunks, n)
		}
		return nil
	})

	interleaved, tries := false, 0
	for try := 0; !interleaved; try++ {
		tries = try + 1
		require.Less(t, try, 50, "no drop ran between the walk's slices")
		keys := d.Keys()
		require.Greater(t, len(keys), 4*reannounceSlice)
		tl.mu.Lock()
		tl.calls = nil
		var drops sync.WaitGroup
		drops.Add(1)
		tl.first = func() {
			go func() {
				defer drops.Done()
				d.Drop("e", keys[0])           // told already
				d.Drop("e", keys[len(keys)-1]) // its slice not walked yet
			}()
		}
		tl.mu.Unlock()
		d.ReannouncePrefix("chunk-", nil)
		drops.Wait()

		tl.mu.Lock()
		calls := tl.calls
		tl.mu.Unlock()
		held := map[messages.Key]bool{}
		for i, c := range calls {
			for _, k := range c.keys {
				if c.stored {
					held[k] = true
				} else {
					delete(held, k)
					for _, later := range calls[i+1:] {
						interleaved = interleaved || later.stored
					}
				}
			}
		}
		var got []messages.Key
		for k := range held {
			got = append(got, k)
		}
		slices.Sort(got)
		want := d.Keys()
		slices.Sort(want)
		require.Equal(t, want, got, "try %d: what was told is what the disk holds", try)
	}
	t.Logf("a drop ran between the slices in try %d", tries)
}
