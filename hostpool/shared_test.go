package hostpool

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// Shared is the one pool of a node, used by every request actor at once: each
// method is one critical section. Run under -race.
func TestSharedConcurrentUse(t *testing.T) {
	const workers, rounds = 8, 300
	// Mixed chunk sizes (a 16-byte page, chunks of 3 to 40 bytes): several
	// classes and multi-page chunks share the pages.
	s := NewShared(64*16, 16)
	sizeOf := func(k messages.Key) int64 { return 3 + int64(len(k)*7)%38 }
	common := k("c0", "c1", "c2", "c3") // keys every worker stores and loads
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range rounds {
				own := messages.Key(fmt.Sprintf("w%d-%d", w, i%20))
				keys := append([]messages.Key{own}, common[i%len(common)])
				prep, err := s.PrepareStore(keys, []int64{sizeOf(keys[0]), sizeOf(keys[1])})
				if err != nil && !errors.Is(err, ErrNoRoom) {
					errs <- err
					return
				}
				if err == nil {
					s.CompleteStore(prep.Keys, okSums(prep.Keys, i%7 != 0))
				}
				if err := s.PrepareLoad(keys); err == nil {
					loc, err := s.Locate(keys)
					if err != nil || len(loc.Ends) != len(keys) || loc.Ends[len(keys)-1] != len(loc.Ext) {
						errs <- fmt.Errorf("locate %v: %+v %v", keys, loc, err)
						return
					}
					s.CompleteLoad(keys)
				} else if !errors.Is(err, ErrNotReady) {
					errs <- err
					return
				}
				s.Lookup(own)
				if st, _ := s.Lookup(common[i%len(common)]); st > Ready {
					errs <- fmt.Errorf("state %v", st)
					return
				}
				if st := s.Stats(); st.Data > st.Capacity || st.Pinned > st.Used {
					errs <- fmt.Errorf("stats %+v", st)
					return
				}
			}
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("workers did not finish within 30s")
	}
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.Equal(t, int64(64*16), s.Capacity())
	require.Zero(t, s.Stats().Pinned, "every load completed")
	s.mu.Lock()
	defer s.mu.Unlock()
	checkInvariants(t, s.pool)
}

// Lookup tells ready, pending and absent keys apart, with a ready key's size
// (sched.HitTokens stops a lookup at the first key not ready).
func TestSharedLookupStates(t *testing.T) {
	s := NewShared(8, 1)
	_, err := s.PrepareStore(k("a", "b", "c", "d"), nil)
	require.NoError(t, err)
	s.CompleteStore(k("a", "b", "d"), okSums(k("a", "b", "d"), true))
	for key, want := range map[messages.Key]State{"a": Ready, "b": Ready, "c": Pending, "d": Ready, "zz": Absent} {
		st, _ := s.Lookup(key)
		require.Equal(t, want, st, "%s", key)
	}
}

// Shared.PrepareLoad also touches the loaded keys: a loaded prefix is hot and
// is evicted last.
func TestSharedPrepareLoadTouches(t *testing.T) {
	s := NewShared(3, 1)
	_, err := s.PrepareStore(k("a", "b", "c"), nil)
	require.NoError(t, err)
	s.CompleteStore(k("a", "b", "c"), okSums(k("a", "b", "c"), true))
	err = s.PrepareLoad(k("a"))
	require.NoError(t, err)
	s.CompleteLoad(k("a"))
	got, err := s.PrepareStore(k("x"), nil)
	require.NoError(t, err)
	require.Equal(t, k("b"), got.Evicted, "a was touched by its load")
	err = s.PrepareLoad(k("zz"))
	require.ErrorIs(t, err, ErrNotReady)
	require.Equal(t, Stats{Capacity: 3, Data: 3, PageBytes: 1, Pages: 3, Used: 3, Pending: 1, Ready: 2,
		MaxChunks: MaxChunks}, s.Stats())
}

// A load over a lower tier touches the keys it found in host memory too.
func TestSharedPrepareLoadFromTouches(t *testing.T) {
	s := NewShared(3, 1)
	_, err := s.PrepareStore(k("a", "b", "c"), nil)
	require.NoError(t, err)
	s.CompleteStore(k("a", "b", "c"), okSums(k("a", "b", "c"), true))
	_, err = s.PrepareLoadFrom(k("a"), func(messages.Key) (int64, bool) { return 0, false })
	require.NoError(t, err)
	s.CompleteLoad(k("a"))
	got, err := s.PrepareStore(k("x"), nil)
	require.NoError(t, err)
	require.Equal(t, k("b"), got.Evicted, "a was touched by its load")
}

// While every slot is pending or pinned, Shared answers no room without the
// lock (even for an offer of present keys, retried once a slot frees); a
// completed store lifts it.
func TestSharedFullFastPath(t *testing.T) {
	s := NewShared(2, 1)
	_, err := s.PrepareStore([]messages.Key{"a", "b"}, nil)
	require.NoError(t, err)
	require.True(t, s.full.Load())
	_, err = s.PrepareStore([]messages.Key{"c"}, nil)
	require.ErrorIs(t, err, ErrNoRoom)
	_, err = s.PrepareStore([]messages.Key{"a"}, nil)
	require.ErrorIs(t, err, ErrNoRoom, "present keys wait too while full")
	s.CompleteStore([]messages.Key{"a"}, okSums([]messages.Key{"a"}, true))
	require.False(t, s.full.Load())
	got, err := s.PrepareStore([]messages.Key{"a"}, nil)
	require.NoError(t, err)
	require.Empty(t, got.Keys, "a is deduplicated once the pool is not full")
	got, err = s.PrepareStore([]messages.Key{"c"}, nil)
	require.NoError(t, err)
	require.Equal(t, []messages.Key{"c"}, got.Keys)
	require.Equal(t, []messages.Key{"a"}, got.Evicted, "the ready key makes room")
	require.True(t, s.full.Load(), "b and c pending")
}

// With no free page and every chunk pending, a page of small slots with a
// slot free still takes a chunk of its class: the pool is not full, and the
// fast refusal must not turn that chunk away.
func TestAFreeSlotKeepsThePoolFromFull(t *testing.T) {
	s := NewShared(1024, 1024)
	_, err := s.PrepareStore(k("a"), []int64{64}) // the only page, cut into 64-byte slots
	require.NoError(t, err)
	require.Zero(t, s.Stats().FreePages)
	require.False(t, s.full.Load(), "15 slots free")
	got, err := s.PrepareStore(k("b"), []int64{64})
	require.NoError(t, err)
	require.Equal(t, k("b"), got.Keys)
}

// A load's end that unpins the chunks of a full pool makes them evictable:
// the pool is no longer full (its fast refusal would turn every store away
// until some other change), and as many room waiters as chunks unpinned are
// woken. Both ends: CompleteLoad (a remote read's, Unpin's) and EndLoad (a
// load job's).
func TestALoadsEndLiftsFullAndWakesRoomWaiters(t *testing.T) {
	for name, end := range map[string]func(*Shared, []messages.Key){
		"CompleteLoad": func(s *Shared, keys []messages.Key) { s.CompleteLoad(keys) },
		"EndLoad":      func(s *Shared, keys []messages.Key) { s.By("e").EndLoad(keys) },
	} {
		t.Run(name, func(t *testing.T) {
			s := NewShared(2, 1)
			_, err := s.PrepareStore(k("a", "b"), nil)
			require.NoError(t, err)
			s.CompleteStore(k("a", "b"), okSums(k("a", "b"), true))
			require.NoError(t, s.PrepareLoad(k("a", "b")))
			require.True(t, s.full.Load())
			prep, err := s.PrepareStore(k("c"), nil)
			require.ErrorIs(t, err, ErrNoRoom)
			w1, w2, w3 := &countWaker{}, &countWaker{}, &countWaker{}
			for _, w := range []Waker{w1, w2, w3} {
				s.WaitRoom(w, prep.RoomGen)
			}

			end(s, k("a", "b"))
			require.False(t, s.full.Load(), "a and b evictable")
			require.Equal(t, []int32{1, 1, 0}, []int32{w1.n.Load(), w2.n.Load(), w3.n.Load()}, "one waiter per chunk unpinned")
			got, err := s.PrepareStore(k("c"), nil)
			require.NoError(t, err)
			require.Equal(t, k("b"), got.Evicted, "the load touched a, then b: b is older")
		})
	}
}

// A load over a lower tier: ready keys are pinned, fetchable absent keys get
// pending room (evicting LRU keys not in the load), all-or-nothing; a pending
// or unfetchable key, or no room, changes nothing. CompleteStorePinned makes
// the fetched keys ready and pinned at once.
func TestSharedPrepareLoadFrom(t *testing.T) {
	s := NewShared(3, 1)
	_, err := s.PrepareStore(k("a", "b", "p"), nil)
	require.NoError(t, err)
	s.CompleteStore(k("a", "b"), okSums(k("a", "b"), true)) // LRU: a, b; p pending
	onDisk := func(key messages.Key) (int64, bool) { return 1, key == "d" || key == "e" }
	snap := func() poolState {
		s.mu.Lock()
		defer s.mu.Unlock()
		return snapshot(s.pool)
	}

	before := snap()
	for _, keys := range [][]messages.Key{k("a", "p"), k("a", "zz"), k("d", "e", "a", "b"), k("p", "d", "zz")} {
		_, err := s.PrepareLoadFrom(keys, onDisk)
		require.Error(t, err, "%v", keys)
		require.Equal(t, before, snap(), "%v: nothing changed", keys)
	}
	// A pending key is ErrPending, naming it, when every other key is
	// loadable (here or on disk); a miss beside it is a plain ErrNotReady.
	var ke *KeyError
	_, err = s.PrepareLoadFrom(k("a", "d", "p"), onDisk)
	require.ErrorIs(t, err, ErrPending)
	require.ErrorAs(t, err, &ke)
	require.Equal(t, messages.Key("p"), ke.Key)
	_, err = s.PrepareLoadFrom(k("p", "d", "zz"), onDisk)
	require.ErrorIs(t, err, ErrNotReady)
	require.NotErrorIs(t, err, ErrPending, "zz is a miss: no use waiting for p")
	require.ErrorAs(t, err, &ke)
	require.Equal(t, messages.Key("zz"), ke.Key)
	require.Equal(t, before, snap(), "nothing changed")
	_, err = s.PrepareLoadFrom(k("d", "e", "a", "b"), onDisk)
	require.ErrorIs(t, err, ErrNoRoom, "a and b are pinned by the load, p is pending: no room for d and e")

	prep, err := s.PrepareLoadFrom(k("b", "d", "d"), onDisk)
	require.NoError(t, err)
	fetched := prep.Keys
	require.Equal(t, k("d"), fetched, "fetched once")
	require.Equal(t, k("a"), prep.Evicted, "the LRU key not in the load makes room")
	st, _ := s.Lookup("d")
	require.Equal(t, Pending, st)
	s.CompleteStorePinned(fetched, []uint32{7})
	st, _ = s.Lookup("d")
	require.Equal(t, Ready, st)
	require.Equal(t, 2, s.Stats().Pinned, "b and d pinned")
	_, err = s.PrepareStore(k("x"), nil)
	require.ErrorIs(t, err, ErrNoRoom, "pinned and pending: nothing to evict")
	s.CompleteLoad(k("b", "d", "d"))
	require.Zero(t, s.Stats().Pinned)
	loc, err := s.Locate(k("d"))
	require.NoError(t, err)
	require.Equal(t, []uint32{7}, loc.Sums)
	s.mu.Lock()
	checkInvariants(t, s.pool)
	s.mu.Unlock()
}

// A load from disk of more than dedupMax absent keys, one repeated: the
// repeat is fetched into one room, so a pool with room for the distinct
// keys (after evicting what it must, least recently used first) takes the
// load, and evicts nothing beyond that.
func TestSharedPrepareLoadFromLongRepeats(t *testing.T) {
	var ready, onDisk []messages.Key
	for i := range 4 {
		ready = append(ready, messages.Key(fmt.Sprintf("r%d", i)))
	}
	for i := range 30 {
		onDisk = append(onDisk, messages.Key(fmt.Sprintf("d%02d", i)))
	}
	// 36 keys: one ready key, then the 30 on disk, then five repeats.
	load := append(append([]messages.Key{ready[3]}, onDisk...), onDisk[0], onDisk[7], onDisk[7], onDisk[29], ready[3])
	fetch := func(k messages.Key) (int64, bool) { return 1, slices.Contains(onDisk, k) }
	for _, tc := range []struct {
		name    string
		pages   int64
		evicted []messages.Key
	}{
		{"room for the distinct keys", 34, nil},
		{"room after evicting two", 32, ready[:2]},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := NewShared(tc.pages, 1)
			_, err := s.PrepareStore(ready, nil)
			require.NoError(t, err)
			s.CompleteStore(ready, sums(ready))
			prep, err := s.PrepareLoadFrom(load, fetch)
			require.NoError(t, err, "30 distinct keys to fetch fit")
			require.Equal(t, onDisk, prep.Keys, "each fetched key given room once")
			require.Equal(t, tc.evicted, prep.Evicted)
			s.CompleteStorePinned(prep.Keys, sums(prep.Keys))
			st := s.Stats()
			require.Equal(t, 31, st.Pinned, "r3 and the 30 fetched keys")
			require.Equal(t, 34-len(tc.evicted), st.Used)
			s.CompleteLoad(load)
			require.Zero(t, s.Stats().Pinned)
			s.mu.Lock()
			checkInvariants(t, s.pool)
			s.mu.Unlock()
		})
	}
}

// A completion that panics under the pool's lock (here its journal, a
// caller's bug; the copy queue recovers such a panic and goes on) leaves
// the lock free: the node's other steps, copies and teardown carry on.
// Both completions that journal: a store's, and a load's read back from a
// lower tier (pinned).
func TestAPanickingCompletionLeavesThePoolUnlocked(t *testing.T) {
	for _, pinned := range []bool{false, true} {
		t.Run(fmt.Sprintf("pinned=%v", pinned), func(t *testing.T) {
			s := NewShared(64, 16)
			b := s.By("e1")
			keys := k("a")
			if pinned {
				_, err := b.PrepareLoadFrom(keys, func(messages.Key) (int64, bool) { return 16, true })
				require.NoError(t, err)
			} else {
				_, err := b.PrepareStore(keys, []int64{16})
				require.NoError(t, err)
			}
			s.SetJournal(func(bool, []messages.Key, string) { panic("journal failure injected") })
			require.Panics(t, func() {
				if pinned {
					b.CompleteStorePinned(keys, []uint32{1})
				} else {
					b.CompleteStore(keys, []uint32{1})
				}
			})

			done := make(chan error, 1)
			go func() {
				_, err := b.PrepareStore(k("b"), []int64{16})
				done <- err
			}()
			select {
			case err := <-done:
				require.NoError(t, err)
			case <-time.After(5 * time.Second):
				t.Fatal("the pool's lock is still held after the panic")
			}
		})
	}
}
