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

// A waiter on several keys that end in one completion (one job's) is woken
// once for it, not once per key: each wake-up is a message to its actor
// and a retry.
func TestWaitPendingWakesOncePerCompletion(t *testing.T) {
	s := NewShared(64*16, 16)
	_, err := s.PrepareStore(k("a", "b", "c"), []int64{16, 16, 16})
	require.NoError(t, err)
	w := &countWaker{}
	s.WaitPending(k("a", "b", "c"), w)
	s.CompleteStore(k("a", "b", "c"), okSums(k("a", "b", "c"), true))
	require.EqualValues(t, 1, w.n.Load())
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

type staleWaker struct {
	countWaker
	stale bool
}

func (w *staleWaker) Stale() bool { return w.stale }

// Waiters for room are woken first in, first out, as many per completion
// as the keys it ended (or the loads it unpinned), never at once from
// WaitRoom (a decision that cannot fit while the pool has room would
// spin), and a stale one passes its turn to the next.
func TestWaitRoomWakesInTurnAsRoomFrees(t *testing.T) {
	s := NewShared(2*16, 16)
	prep, err := s.PrepareStore(k("a", "b"), []int64{16, 16})
	require.NoError(t, err)
	require.Equal(t, k("a", "b"), prep.Keys)
	failed, err := s.PrepareStore(k("c"), []int64{16})
	require.ErrorIs(t, err, ErrNoRoom, "both slots pending")

	w := make([]*staleWaker, 4)
	for i := range w {
		w[i] = &staleWaker{}
		s.WaitRoom(w[i], failed.RoomGen)
	}
	require.Equal(t, 4, s.RoomWaiting())
	for i := range w {
		require.Zero(t, w[i].n.Load(), "not woken by queueing")
	}
	w[0].stale = true // went on by other means

	s.CompleteStore(k("a"), okSums(k("a"), true)) // one key: one waiter, the first live one
	require.Zero(t, w[0].n.Load(), "stale: skipped")
	require.EqualValues(t, 1, w[1].n.Load())
	require.Zero(t, w[2].n.Load())
	require.Equal(t, 2, s.RoomWaiting())

	prep, err = s.PrepareLoadFrom(k("a"), func(messages.Key) (int64, bool) { return 0, false })
	require.NoError(t, err)
	require.Empty(t, prep.Keys, "a is here: pinned, nothing read back")
	s.CompleteStore(k("b"), nil) // b's copy failed: its room freed, the next waiter woken
	require.EqualValues(t, 1, w[2].n.Load())
	_, err = s.PrepareLoadFrom(k("a"), func(messages.Key) (int64, bool) { return 0, false })
	require.NoError(t, err) // a pinned twice
	s.CompleteLoad(k("a"))  // still pinned by the other load: nothing evictable, nobody woken
	require.Zero(t, w[3].n.Load(), "woken by an unpin that left a pinned")
	require.Equal(t, 1, s.RoomWaiting())
	s.CompleteLoad(k("a")) // unpinned: evictable again, the last waiter woken
	require.EqualValues(t, 1, w[3].n.Load())
	require.Zero(t, s.RoomWaiting())
	s.CompleteStore(k("zz"), nil) // nobody waits: nothing to wake
	for i := 1; i < len(w); i++ {
		require.EqualValues(t, 1, w[i].n.Load(), "woken once: %d", i)
	}
}

// The room queue is bounded: past maxRoomWaiters a registration is not
// kept (its waiter has its timer), and a long queue's taken front is
// compacted away.
func TestWaitRoomIsBounded(t *testing.T) {
	s := NewShared(2*16, 16)
	for range maxRoomWaiters + 10 {
		s.WaitRoom(&countWaker{}, s.roomGen.Load())
	}
	require.Equal(t, maxRoomWaiters, s.RoomWaiting())
	s.mu.Lock()
	woken := s.takeRoom(maxRoomWaiters - 5)
	n, head := len(s.room), s.roomHead
	s.mu.Unlock()
	require.Len(t, woken, maxRoomWaiters-5)
	require.Equal(t, 5, s.RoomWaiting())
	require.Equal(t, 5, n-head)
	require.Zero(t, head, "the taken front compacted")
}

// A change that may free room between a decision that found none and its
// WaitRoom wakes nobody (nobody is queued yet); WaitRoom, told the
// generation the decision saw, wakes at once then. Told the current one,
// it queues (a decision that cannot fit in an unchanged pool must not spin),
// whether the refusal came under the lock or from a full pool's fast path.
func TestWaitRoomWakesAtOnceIfRoomFreedSinceTheDecision(t *testing.T) {
	s := NewShared(2*16, 16)
	_, err := s.PrepareStore(k("a", "b"), []int64{16, 16})
	require.NoError(t, err)
	s.CompleteStore(k("b"), nil) // a change before the refusals: the generation is not the zero value
	_, err = s.PrepareStore(k("b"), []int64{16})
	require.NoError(t, err)
	fast, err := s.PrepareStore(k("c"), []int64{16}) // full: refused without the lock
	require.ErrorIs(t, err, ErrNoRoom)
	unchanged := &countWaker{}
	s.WaitRoom(unchanged, fast.RoomGen)
	require.Zero(t, unchanged.n.Load(), "nothing changed since the fast refusal: queued, not woken")
	require.Equal(t, 1, s.RoomWaiting())
	s.CompleteStore(k("b"), nil)
	require.EqualValues(t, 1, unchanged.n.Load(), "b freed: the queued waiter woken")
	locked, err := s.PrepareStore(k("c", "d", "e"), []int64{16, 16, 16}) // one slot free, three wanted
	require.ErrorIs(t, err, ErrNoRoom)
	require.Greater(t, locked.RoomGen, fast.RoomGen)
	s.CompleteStore(k("zz"), nil) // ends nothing: no change to wake anybody for
	s.CompleteLoad(k("zz"))

	late := &countWaker{}
	s.WaitRoom(late, fast.RoomGen) // b's copy ended after that decision
	require.EqualValues(t, 1, late.n.Load(), "woken at once")
	require.Zero(t, s.RoomWaiting())

	current := &countWaker{}
	s.WaitRoom(current, locked.RoomGen)
	require.Zero(t, current.n.Load(), "nothing changed since: queued, not woken")
	require.Equal(t, 1, s.RoomWaiting())
	s.CompleteStore(k("a"), okSums(k("a"), true))
	require.EqualValues(t, 1, current.n.Load())
}

// PinReadyOrPending pins the ready keys now and each pending one in the
// step its copy makes it ready, so no eviction comes between; a copy that
// fails pins nothing, and once Unpin lets go a copy ending later pins
// nothing for it. Every pin taken is let go of by Unpin.
func TestPinReadyOrPendingPinsAPendingKeyAsItIsMadeReady(t *testing.T) {
	s := NewShared(64*16, 16)
	_, err := s.PrepareStore(k("r"), []int64{16})
	require.NoError(t, err)
	s.CompleteStore(k("r"), okSums(k("r"), true))
	_, err = s.PrepareStore(k("p", "f", "late"), []int64{16, 16, 16})
	require.NoError(t, err)

	pins := s.PinReadyOrPending(k("r", "p", "f", "zz", "p", "late"))
	require.EqualValues(t, 1, s.Stats().Pinned, "r only: p, f and late are pending, zz absent")
	s.CompleteStore(k("p"), okSums(k("p"), true))
	require.EqualValues(t, 2, s.Stats().Pinned, "p pinned as it was made ready")
	s.CompleteStore(k("f"), nil) // its copy failed: absent, nothing to pin
	require.EqualValues(t, 2, s.Stats().Pinned)
	require.Equal(t, 1, s.Waiting(), "late, still pending")

	// Only pinned keys resist eviction: a full pool's store evicts neither.
	more := NewShared(2*16, 16)
	_, err = more.PrepareStore(k("x"), []int64{16})
	require.NoError(t, err)
	_, err = more.PrepareStore(k("y"), []int64{16})
	require.NoError(t, err)
	held := more.PinReadyOrPending(k("x"))
	more.CompleteStore(k("x", "y"), okSums(k("x", "y"), true))
	prep, err := more.PrepareStore(k("z"), []int64{16})
	require.NoError(t, err)
	require.Equal(t, k("y"), prep.Evicted, "x, made ready pinned, is not evicted though older")
	more.Unpin(held)
	require.Zero(t, more.Stats().Pinned)

	s.Unpin(pins)
	require.Zero(t, s.Stats().Pinned, "every pin let go of")
	s.CompleteStore(k("late"), okSums(k("late"), true))
	require.Zero(t, s.Stats().Pinned, "a copy ending after Unpin pins nothing")
	require.Zero(t, s.Waiting())
}

// A completion whose chunk a holder pins as it is made ready can leave the
// pool full (every chunk pending or pinned): the full flag says so after
// that change as after any other, and a store is refused on the fast path.
func TestAPinAsAChunkIsMadeReadyCanFillThePool(t *testing.T) {
	s := NewShared(16, 16) // one chunk
	_, err := s.PrepareStore(k("a"), []int64{16})
	require.NoError(t, err)
	pins := s.PinReadyOrPending(k("a"))
	s.CompleteStore(k("a"), okSums(k("a"), true))
	require.EqualValues(t, 1, s.Stats().Pinned)
	require.True(t, s.full.Load(), "a, the only chunk, pinned")
	_, err = s.PrepareStore(k("b"), []int64{16})
	require.ErrorIs(t, err, errFull)
	s.Unpin(pins)
	require.False(t, s.full.Load())
}
