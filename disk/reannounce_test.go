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
	}
	if len(removed) > 0 {
		t.calls = append(t.calls, toldCall{false, removed})
	}
}

// ReannouncePrefix walks a large index a slice per hold of the lock: it
// held the lock for the whole walk (1M chunks: ~30 ms per namespace, 0.4
// to 0.9 s for all; BenchmarkReannouncePrefix), and every store, load and
// lookup of the tier waited. Drops of the least and the most recently used
// chunk, made between the walk's first two slices (betweenSlices), finish
// there, not after the walk; and what the walk and the drops tell, applied
// in order from a clear, is what the disk holds: a chunk told stored and
// dropped since has its removal told after it, a chunk dropped before its
// slice is not told. (The drops once raced the walk for the lock, and won
// only by Go's handoff to a waiter of 1 ms: under load, not in 50 walks.)
func TestReannounceLetsTheTierWorkBetweenSlices(t *testing.T) {
	tl := &told{}
	var (
		d                  *Disk
		keys               []messages.Key
		between            int  // betweenSlices' calls
		dropsBetween       bool // the drops finished between the first two slices
		toldBefore, toldAt int  // len(tl.calls) as the drops started and once they finished
	)
	dropped := make(chan struct{})
	cfg := Config{Dir: t.TempDir(), Bytes: 1 << 30, betweenSlices: func() {
		if between++; between > 1 {
			return
		}
		tl.mu.Lock()
		toldBefore = len(tl.calls)
		tl.mu.Unlock()
		go func() {
			defer close(dropped)
			d.Drop("e", keys[0])           // told already
			d.Drop("e", keys[len(keys)-1]) // its slice not walked yet
		}()
		// Off this goroutine, with a deadline: a walk holding the lock here
		// fails the test rather than hanging it. Not a t.Fatal: it would
		// unwind ReannouncePrefix, which does not hold the lock here,
		// through its deferred unlock.
		timer := time.NewTimer(10 * time.Second)
		defer timer.Stop()
		select {
		case <-dropped:
			dropsBetween = true
		case <-timer.C:
		}
		tl.mu.Lock()
		toldAt = len(tl.calls)
		tl.mu.Unlock()
	}}
	d, err := Open(cfg, tl.notify)
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

	keys = d.Keys()
	require.Len(t, keys, n)
	tl.mu.Lock()
	tl.calls = nil
	tl.mu.Unlock()
	d.ReannouncePrefix("chunk-", nil)
	require.Equal(t, 5, between, "the walk's holds of the lock, less one")
	require.True(t, dropsBetween, "the drops, made between the walk's first two slices, did not finish within 10 s there: the walk holds the lock across its slices")
	testkit.Closed(t, dropped, 10*time.Second, "the drops")

	tl.mu.Lock()
	calls := tl.calls
	tl.mu.Unlock()
	// The first slice told, the drops told their removals, the rest told.
	require.Positive(t, toldBefore, "the first slice told nothing")
	require.Equal(t, []toldCall{{false, keys[:1]}, {false, keys[len(keys)-1:]}}, calls[toldBefore:toldAt], "told by the drops")
	require.Greater(t, len(calls), toldAt, "the slices after the drops told nothing")
	for _, c := range calls[toldAt:] {
		require.True(t, c.stored, "a removal told after the drops")
	}
	held := map[messages.Key]bool{}
	for _, c := range calls {
		for _, k := range c.keys {
			if c.stored {
				held[k] = true
			} else {
				delete(held, k)
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
	require.Equal(t, want, got, "what was told is what the disk holds")
	require.Len(t, want, n-2)
}
