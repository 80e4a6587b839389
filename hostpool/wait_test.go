package hostpool

import (
	"math/rand"
	"sync/atomic"
	"testing"
	"testing/quick"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

type countWaker struct{ n atomic.Int32 }

func (w *countWaker) Wake() { w.n.Add(1) }

// A waiter on pending keys is woken once, by the first of them to end,
// whether its copy completed or failed; the other keys forget it when they
// end. A key that already ended wakes it at once and keeps nothing.
func TestWaitPendingWakesOnceWhenTheFirstKeyEnds(t *testing.T) {
	s := NewShared(64*16, 16)
	prep, err := s.PrepareStore(k("a", "b", "c"), []int64{16, 16, 16})
	require.NoError(t, err)
	require.Equal(t, k("a", "b", "c"), prep.Keys)

	w, other := &countWaker{}, &countWaker{}
	s.WaitPending(k("a", "b"), w)
	s.WaitPending(k("a", "b"), w) // again (a later retry): kept once per key
	s.WaitPending(k("c"), other)
	require.Equal(t, 3, s.Waiting())
	require.Zero(t, w.n.Load())

	s.CompleteStore(k("b"), nil) // b's copy failed: its room freed, its waiter woken
	require.EqualValues(t, 1, w.n.Load())
	require.Zero(t, other.n.Load(), "c is still pending")
	s.CompleteStore(k("a"), okSums(k("a"), true))
	require.EqualValues(t, 2, w.n.Load(), "a's end wakes its waiter too (harmless to a retry already taken)")
	s.CompleteStore(k("a"), okSums(k("a"), true)) // completed twice: nobody left to wake
	require.EqualValues(t, 2, w.n.Load())
	require.Equal(t, 1, s.Waiting(), "only c, still pending, keeps a waiter")

	late := &countWaker{}
	s.WaitPending(k("c", "a"), late) // a ended before the wait: woken now
	require.EqualValues(t, 1, late.n.Load())
	require.Equal(t, 1, s.Waiting())
	s.WaitPending(k("zz"), late) // absent: woken now too
	require.EqualValues(t, 2, late.n.Load())

	s.CompleteStore(k("c"), okSums(k("c"), true))
	require.EqualValues(t, 1, other.n.Load())
	require.Zero(t, s.Waiting())
}

// Keys read back from a lower tier are pending too; their completion
// (CompleteStorePinned) wakes their waiters.
func TestWaitPendingWakesOnAPinnedCompletion(t *testing.T) {
	s := NewShared(64*16, 16)
	prep, err := s.PrepareLoadFrom(k("d"), func(messages.Key) (int64, bool) { return 16, true })
	require.NoError(t, err)
	require.Equal(t, k("d"), prep.Keys)
	w := &countWaker{}
	s.WaitPending(k("d"), w)
	s.CompleteStorePinned(k("d"), okSums(k("d"), true))
	require.EqualValues(t, 1, w.n.Load())
	require.Zero(t, s.Waiting())
}

// Whatever the order of stores, completions, failures and waits: every
// key kept with a waiter is pending, and every waiter on keys one of which
// ended has been woken; a wait on a key that already ended wakes at once.
func TestPropertyWaitersFollowPendingKeys(t *testing.T) {
	type waiter struct {
		keys []messages.Key
		w    *countWaker
	}
	f := func(seed int64) bool {
		rng := rand.New(rand.NewSource(seed))
		s := NewShared(8*16, 16)
		universe := k("a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l")
		var waiters []waiter
		pick := func() []messages.Key {
			n := 1 + rng.Intn(3)
			out := make([]messages.Key, 0, n)
			for range n {
				out = append(out, universe[rng.Intn(len(universe))])
			}
			return out
		}
		for range 200 {
			switch rng.Intn(3) {
			case 0:
				ks := pick()
				_, _ = s.PrepareStore(ks, make16(len(ks)))
			case 1:
				ks := pick()
				s.CompleteStore(ks, okSums(ks, rng.Intn(2) == 0))
			case 2:
				ks := pick()
				anyEnded := false
				for _, key := range ks {
					if st, _ := s.Lookup(key); st != Pending {
						anyEnded = true
					}
				}
				w := &countWaker{}
				s.WaitPending(ks, w)
				if anyEnded != (w.n.Load() == 1) {
					return false
				}
				waiters = append(waiters, waiter{ks, w})
			}
			if s.Waiting() > s.Stats().Pending {
				return false
			}
			for _, wt := range waiters {
				allPending := true
				for _, key := range wt.keys {
					if st, _ := s.Lookup(key); st != Pending {
						allPending = false
					}
				}
				if !allPending && wt.w.n.Load() == 0 {
					return false // not woken though a key ended
				}
			}
		}
		return true
	}
	require.NoError(t, quick.Check(f, &quick.Config{MaxCount: 300}))
}

func make16(n int) []int64 {
	out := make([]int64, n)
	for i := range out {
		out[i] = 16
	}
	return out
}
