package hostpool

import (
	"errors"
	"fmt"
	"math"
	"runtime"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// The pool's rules come from PROTOCOL.md "What kvactors does": "dedup: keys
// already present, ready or pending, are not stored again; space: evict least
// recently used ready blocks that are not among the offered keys and not
// pinned by a load", "If the pool cannot make room: no job", and "A failed
// copy frees the slots (complete_store with failure)". The sequence below is
// vLLM's tests/v1/kv_offload/test_cpu_offloading_manager.py, adapted.

func k(names ...any) []messages.Key {
	out := make([]messages.Key, len(names))
	for i, n := range names {
		out[i] = messages.Key(fmt.Sprint(n))
	}
	return out
}

// sums are stand-in checksums for a successful completion of keys.
func sums(keys []messages.Key) []uint32 { return make([]uint32, len(keys)) }

// st is the Stats of a pool of one-byte pages holding one-page chunks.
func st(capacity, used, pending, pinned int) *Stats {
	return &Stats{Capacity: int64(capacity), Data: int64(used), PageBytes: 1, Pages: capacity,
		FreePages: capacity - used, Used: used, Pending: pending, Ready: used - pending, Pinned: pinned,
		MaxChunks: MaxChunks}
}

// pop is one step of a pool script.
type pop struct {
	name    string
	store   []messages.Key // PrepareStore
	done    []messages.Key // CompleteStore(done, ok)
	ok      bool
	load    []messages.Key // PrepareLoad
	unload  []messages.Key // CompleteLoad
	touch   []messages.Key // Touch
	wantErr error
	want    Prepared // for store
	states  map[string]State
	stats   *Stats
}

func runPool(t *testing.T, p *Pool, script []pop) {
	t.Helper()
	for i, s := range script {
		msg := fmt.Sprintf("step %d: %s", i, s.name)
		before := snapshot(p)
		var err error
		switch {
		case s.store != nil:
			var got Prepared
			got, err = p.PrepareStore(s.store, nil)
			if s.wantErr == nil {
				// Each new key's room is where the pool now locates it, and
				// its slot is its entry.
				require.Len(t, got.Ends, len(got.Keys), msg)
				require.Len(t, got.Slots, len(got.Keys), msg)
				for i, k := range got.Keys {
					ext, _, st := p.locate(k, nil)
					require.Equal(t, Pending, st, msg)
					require.Equal(t, ext, got.Chunk(i), msg)
					require.Equal(t, lookupRef(p, k), ref(got.Slots[i]), msg)
				}
				got.Ext, got.Ends, got.Slots = nil, nil, nil
				require.Equal(t, s.want, got, msg)
			}
		case s.done != nil:
			var sm []uint32
			if s.ok {
				sm = sums(s.done)
			}
			p.CompleteStore(s.done, sm)
		case s.load != nil:
			err = p.PrepareLoad(s.load)
		case s.unload != nil:
			p.CompleteLoad(s.unload)
		case s.touch != nil:
			p.Touch(s.touch)
		}
		if s.wantErr != nil {
			require.ErrorIs(t, err, s.wantErr, msg)
			require.Equal(t, before, snapshot(p), "%s: a failed call changes nothing", msg)
		} else {
			require.NoError(t, err, msg)
		}
		for key, st := range s.states {
			got, _ := p.Lookup(messages.Key(key))
			require.Equal(t, st, got, "%s: state of %s", msg, key)
		}
		if s.stats != nil {
			require.Equal(t, *s.stats, p.Stats(), msg)
		}
		checkInvariants(t, p)
	}
}

func TestCPUManagerSequence(t *testing.T) {
	runPool(t, New(4, 1), []pop{
		{name: "store [1,2] into fresh slots", store: k(1, 2),
			want: Prepared{Keys: k(1, 2)}, states: map[string]State{"1": Pending, "2": Pending},
			stats: st(4, 2, 2, 0)},
		{name: "pending keys are not loadable", load: k(1), wantErr: ErrNotReady},
		{name: "complete [1,2]", done: k(1, 2), ok: true, states: map[string]State{"1": Ready, "2": Ready},
			stats: st(4, 2, 0, 0)},
		{name: "store [2,3,4,5]: 2 is present, 1 is evicted, 2 is offered so kept", store: k(2, 3, 4, 5),
			want:   Prepared{Keys: k(3, 4, 5), Evicted: k(1)},
			states: map[string]State{"1": Absent, "2": Ready, "3": Pending}},
		{name: "[1,6] has no room while 3,4,5 are pending", store: k(1, 6), wantErr: ErrNoRoom},
		{name: "complete [3,4,5]", done: k(3, 4, 5), ok: true},
		{name: "pin [2,3,4,5]", load: k(2, 3, 4, 5),
			stats: st(4, 4, 0, 4)},
		{name: "pins block eviction", store: k(6), wantErr: ErrNoRoom},
		{name: "unpin", unload: k(2, 3, 4, 5), stats: st(4, 4, 0, 0)},
		{name: "store [6] evicts the least recently used, 2", store: k(6),
			want: Prepared{Keys: k(6), Evicted: k(2)}},
		{name: "a failed completion frees pending keys but not ready ones", done: k(6, 3), ok: false,
			states: map[string]State{"6": Absent, "3": Ready},
			stats:  st(4, 3, 0, 0)},
		{name: "the freed slot is reused", store: k(7), want: Prepared{Keys: k(7)}},
		{name: "all present: nothing to store, no error; 7 is named pending (its copy may yet fail)",
			store: k(3, 4, 7), want: Prepared{Pending: k(7)}},
		{name: "7's copy fails: 7 is absent again", done: k(7), ok: false, states: map[string]State{"7": Absent}},
		{name: "7 offered again is stored", store: k(3, 7), want: Prepared{Keys: k(7)}},
		{name: "pending keys are named in offer order beside new ones", store: k(7, 8, 3),
			want: Prepared{Keys: k(8), Pending: k(7), Evicted: k(4)}},
	})
}

// PROTOCOL.md: eviction picks ready keys "that are not among the offered
// keys": a key offered (present) is never evicted to make room for its
// siblings, even when that means no room.
func TestOfferedKeyNeverEvictedForSiblings(t *testing.T) {
	runPool(t, New(2, 1), []pop{
		{name: "store [a,b]", store: k("a", "b"), want: Prepared{Keys: k("a", "b")}},
		{name: "ready", done: k("a", "b"), ok: true},
		{name: "[a,c]: a is the LRU but offered, so b goes", store: k("a", "c"),
			want: Prepared{Keys: k("c"), Evicted: k("b")}},
		{name: "[a,c,d,e]: only offered or pending keys left", store: k("a", "c", "d", "e"), wantErr: ErrNoRoom},
		{name: "ready c", done: k("c"), ok: true},
		{name: "[c,d,e]: two new keys, only a evictable", store: k("c", "d", "e"), wantErr: ErrNoRoom},
		{name: "[c,d]: a goes", store: k("c", "d"), want: Prepared{Keys: k("d"), Evicted: k("a")}},
	})
}

// PROTOCOL.md "evict least recently used ready blocks". Touch walks keys in
// reverse like vLLM, so the first key of a prefix ends up the most recent and
// a prefix is evicted from its tail.
func TestTouchOrder(t *testing.T) {
	p := New(3, 1)
	_, err := p.PrepareStore(k("a", "b", "c"), nil)
	require.NoError(t, err)
	p.CompleteStore(k("a", "b", "c"), sums(k("a", "b", "c"))) // LRU: a, b, c
	p.Touch(k("a", "b", "zz"))                                // absent keys are ignored; LRU: c, b, a
	require.Equal(t, k("c", "b", "a"), lruOrder(p))

	_, err = p.PrepareStore(k("x"), nil)
	require.NoError(t, err)
	p.Touch(k("x")) // pending keys are not in the LRU
	require.Equal(t, k("b", "a"), lruOrder(p)[:2])

	// The tail of the touched prefix goes first: b, then a.
	got, err := p.PrepareStore(k("y"), nil)
	require.NoError(t, err)
	require.Equal(t, k("b"), got.Evicted)
	got, err = p.PrepareStore(k("z"), nil)
	require.NoError(t, err)
	require.Equal(t, k("a"), got.Evicted)
	checkInvariants(t, p)
}

// The offer marks (an offered key is not evicted for its siblings) live
// as long as the call's epoch, a uint32 that wraps after 2^32 decisions
// (half a day at 100k a second): a mark left from before the wrap must not
// look current to the call whose epoch it names again, or that call keeps
// a chunk it did not offer and finds no room.
func TestOfferMarksDoNotOutliveTheEpochsWrap(t *testing.T) {
	p := New(1, 1)
	_, err := p.PrepareStore(k("a"), nil)
	require.NoError(t, err)
	p.CompleteStore(k("a"), sums(k("a")))
	_, err = p.PrepareStore(k("a"), nil) // a offered: marked with this epoch
	require.NoError(t, err)
	mark := p.epoch
	p.epoch = math.MaxUint32
	_, err = p.PrepareStore(nil, nil) // wraps to 1
	require.NoError(t, err)
	for p.epoch+1 != mark {
		_, err = p.PrepareStore(nil, nil)
		require.NoError(t, err)
	}
	got, err := p.PrepareStore(k("b"), nil) // the epoch a's old mark names
	require.NoError(t, err, "a not offered: evictable")
	require.Equal(t, k("a"), got.Evicted)
	checkInvariants(t, p)
}

// Chunks read back for a load (CompleteStorePinned) are touched as a load's
// are: the first key of the prefix ends up the most recent, so once let go
// of the prefix is evicted from its tail.
func TestReadBackChunksAreTouchedInPrefixOrder(t *testing.T) {
	p := New(3, 1)
	_, err := p.PrepareStore(k("a", "b"), nil) // room to read a and b back into
	require.NoError(t, err)
	p.CompleteStorePinned(k("a", "b"), sums(k("a", "b")))
	require.Equal(t, k("b", "a"), lruOrder(p))
	p.CompleteLoad(k("a", "b"))
	got, err := p.PrepareStore(k("x", "y"), nil)
	require.NoError(t, err)
	require.Equal(t, k("b"), got.Evicted, "the prefix's tail first")
	checkInvariants(t, p)
}

// PROTOCOL.md "P.E.load": an error "naming the missing key"; a failed
// PrepareLoad pins nothing.
func TestPrepareLoadNotReady(t *testing.T) {
	for _, tc := range []struct {
		name    string
		keys    []messages.Key
		bad     messages.Key
		pending bool // ErrPending: wait for bad and try again
	}{
		{"absent", k("zz"), "zz", false},
		{"pending", k("p"), "p", true},
		{"ready then absent", k("r", "zz"), "zz", false},
		{"ready then pending then absent", k("r", "p", "zz"), "zz", false}, // a miss: no use waiting for p
		{"pending then ready", k("p", "r"), "p", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := New(2, 1)
			_, err := p.PrepareStore(k("r", "p"), nil)
			require.NoError(t, err)
			p.CompleteStore(k("r"), sums(k("r")))
			before := snapshot(p)
			err = p.PrepareLoad(tc.keys)
			require.ErrorIs(t, err, ErrNotReady)
			require.Equal(t, tc.pending, errors.Is(err, ErrPending))
			var ke *KeyError
			require.True(t, errors.As(err, &ke))
			require.Equal(t, tc.bad, ke.Key)
			require.Contains(t, err.Error(), fmt.Sprintf("%x", string(tc.bad)))
			require.Equal(t, before, snapshot(p), "nothing pinned")
			require.Zero(t, p.Stats().Pinned)
		})
	}
}

// PROTOCOL.md "not pinned by a load": pins nest, so a key loaded twice stays
// pinned until both loads complete.
func TestPinsNest(t *testing.T) {
	p := New(1, 1)
	_, err := p.PrepareStore(k("a"), nil)
	require.NoError(t, err)
	p.CompleteStore(k("a"), sums(k("a")))
	err = p.PrepareLoad(k("a", "a"))
	require.NoError(t, err)
	err = p.PrepareLoad(k("a"))
	require.NoError(t, err)
	require.Equal(t, 1, p.Stats().Pinned)
	p.CompleteLoad(k("a", "a"))
	_, err = p.PrepareStore(k("b"), nil)
	require.ErrorIs(t, err, ErrNoRoom, "still pinned once")
	p.CompleteLoad(k("a", "a", "zz")) // extra unpins and absent keys are ignored
	require.Zero(t, p.Stats().Pinned)
	got, err := p.PrepareStore(k("b"), nil)
	require.NoError(t, err)
	require.Equal(t, k("a"), got.Evicted)
	checkInvariants(t, p)
}

// PinReady pins the ready keys among those given (once each time given)
// and leaves pending and absent ones alone: a remote load's own local
// chunks, pinned while it fetches the rest, are not evicted for that room.
func TestPinReadyPinsOnlyReadyKeys(t *testing.T) {
	p := New(3, 1)
	_, err := p.PrepareStore(k("r", "p"), nil)
	require.NoError(t, err)
	p.CompleteStore(k("r"), sums(k("r")))
	pinned := p.PinReady(k("zz", "p", "r", "r"))
	require.Equal(t, k("r", "r"), pinned)
	require.Equal(t, 1, p.Stats().Pinned)
	require.Equal(t, 1, p.Stats().Pending, "p is left to the copy filling it")
	_, err = p.PrepareStore(k("a"), nil)
	require.NoError(t, err)
	_, err = p.PrepareStore(k("b"), nil)
	require.ErrorIs(t, err, ErrNoRoom, "r is pinned: not evicted for b")
	p.CompleteLoad(pinned)
	require.Zero(t, p.Stats().Pinned)
	got, err := p.PrepareStore(k("b"), nil)
	require.NoError(t, err)
	require.Equal(t, k("r"), got.Evicted)
	checkInvariants(t, p)
}

// PROTOCOL.md "dedup" and "not among the offered keys", for offered lists
// long ones (a long prompt stored at once), with a key offered twice.
func TestLargeOfferedLists(t *testing.T) {
	var ready, fresh []messages.Key
	for i := range 20 {
		ready = append(ready, messages.Key(fmt.Sprintf("r%02d", i)))
		fresh = append(fresh, messages.Key(fmt.Sprintf("n%02d", i)))
	}
	p := New(24, 1)
	_, err := p.PrepareStore(ready, nil)
	require.NoError(t, err)
	p.CompleteStore(ready, sums(ready))

	// 10 present (offered, so kept), 10 new with one offered twice: 4 free
	// slots, so the 6 least recently used ready keys not offered go.
	offer := append(append(append([]messages.Key{}, ready[10:]...), fresh[:10]...), fresh[0])
	got, err := p.PrepareStore(offer, nil)
	require.NoError(t, err)
	require.Equal(t, fresh[:10], got.Keys)
	require.Equal(t, ready[:6], got.Evicted)
	checkInvariants(t, p)

	// Every ready key offered: nothing is evictable.
	offer = append(append([]messages.Key{}, ready[6:]...), fresh[10:]...)
	before := snapshot(p)
	_, err = p.PrepareStore(offer, nil)
	require.ErrorIs(t, err, ErrNoRoom)
	require.Equal(t, before, snapshot(p))
}

// PROTOCOL.md "If the pool cannot make room": a pool of no slots has no room,
// and "nothing to store" is not "no room".
func TestNewClampsNegativeCapacity(t *testing.T) {
	p := New(-3, 1)
	require.Zero(t, p.Capacity())
	_, err := p.PrepareStore(k("a"), nil)
	require.ErrorIs(t, err, ErrNoRoom)
	got, err := p.PrepareStore(nil, nil)
	require.NoError(t, err, "nothing to store is not an error")
	require.Empty(t, got.Keys)
}

// PROTOCOL.md "ready or pending": the states' names (status and logs).
func TestStateStrings(t *testing.T) {
	require.Equal(t, []string{"absent", "pending", "ready"}, []string{Absent.String(), Pending.String(), Ready.String()})
	state, size := New(1, 1).Lookup("x")
	require.Equal(t, Absent, state)
	require.Zero(t, size)
}

// Bad input to PrepareStore (sizes not matching keys, a size <= 0) is a
// clear error naming the problem and changes nothing; a chunk larger than
// the whole pool is "no room".
func TestPrepareStoreBadSizes(t *testing.T) {
	p := New(4<<10, 1<<10)
	before := snapshot(p)
	_, err := p.PrepareStore(k("a", "b"), []int64{1})
	require.ErrorIs(t, err, ErrBadSize)
	_, err = p.PrepareStore(k("a", "b"), []int64{1, 0})
	require.ErrorIs(t, err, ErrBadSize)
	require.Contains(t, err.Error(), fmt.Sprintf("%x", "b"))
	_, err = p.PrepareStore(k("a"), []int64{5 << 10})
	require.ErrorIs(t, err, ErrNoRoom)
	require.Equal(t, before, snapshot(p))
	checkInvariants(t, p)
}

// A pool filling up with one chunk size sizes its tables once, for as many
// chunks as it holds, instead of doubling its way there; keys stay
// findable across the reserve.
func TestReserveSizesTablesOnce(t *testing.T) {
	p := New(1<<20, 64<<10) // 16 pages of 64 KiB
	const size = 1 << 10    // 1,024 chunks fit
	keys := make([]messages.Key, 0, 1024)
	for i := range 1024 {
		keys = append(keys, messages.Key(fmt.Sprintf("k%04d", i)))
	}
	if _, err := p.PrepareStore(keys[:1], []int64{size}); err != nil {
		t.Fatal(err)
	}
	if c := cap(p.entries); c < 1024 {
		t.Fatalf("after the first key the slab holds %d entries, want room for 1024", c)
	}
	slab := &p.entries[:1][0]
	sizes := make([]int64, 1023)
	for i := range sizes {
		sizes[i] = size
	}
	if _, err := p.PrepareStore(keys[1:], sizes); err != nil {
		t.Fatal(err)
	}
	if &p.entries[0] != slab {
		t.Fatal("the slab was reallocated while the pool filled")
	}
	if p.Len() != 1024 {
		t.Fatalf("pool holds %d keys, want 1024", p.Len())
	}
	for _, k := range keys {
		if _, ok := p.lookup(k); !ok {
			t.Fatalf("key %s lost", k)
		}
	}
}

// CompleteStoreAt trusts a slot only when it holds its key: a wrong, stale
// or out-of-range slot is looked up, so it completes the same keys as
// CompleteStore.
func TestCompleteStoreAtChecksEverySlot(t *testing.T) {
	p := New(4, 1)
	prep, err := p.PrepareStore(k("a", "b", "c"), nil)
	require.NoError(t, err)
	slots := slices.Clone(prep.Slots)
	slots[0], slots[1] = slots[1], slots[0] // swapped: each names the other's entry
	slots[2] = 99                           // out of range
	p.CompleteStoreAt(prep.Keys, slots, sums(prep.Keys))
	for _, key := range prep.Keys {
		_, sum, st := p.locate(key, nil)
		require.Equal(t, Ready, st, string(key))
		require.Equal(t, sums(k(string(key)))[0], sum, string(key))
	}
	// A freed entry (its key cleared) never matches: completing "d" by the
	// slot "a" had, after "a" was dropped, finds "d" itself.
	prep, err = p.PrepareStore(k("d"), nil)
	require.NoError(t, err)
	require.True(t, p.Drop("a", sums(k("a"))[0]))
	p.CompleteStoreAt(k("d"), []int32{slots[1]}, nil) // a failed copy: "d" is freed
	_, _, st := p.locate("d", nil)
	require.Equal(t, Absent, st)
}

// A big pool whose first chunk is small reserves tables for reserveMax
// entries, not for every chunk of that size it could hold.
func TestReserveIsBounded(t *testing.T) {
	p := New(1<<30, 1<<20) // 4,194,304 chunks of 256 bytes would fit
	_, err := p.PrepareStore(k("a"), []int64{256})
	require.NoError(t, err)
	require.Equal(t, reserveMax, cap(p.entries))
}

// A load from disk reserves room without reporting it (it locates its
// keys when it copies), a store reports one room per new key.
func TestPrepareLoadFromReportsNoRooms(t *testing.T) {
	s := NewShared(8, 1)
	prep, err := s.PrepareStore(k("a"), nil)
	require.NoError(t, err)
	require.Len(t, prep.Ends, 1)
	require.Len(t, prep.Slots, 1)
	s.CompleteStoreAt(prep.Keys, prep.Slots, sums(prep.Keys))
	prep, err = s.PrepareLoadFrom(k("a", "b"), func(messages.Key) (int64, bool) { return 1, true })
	require.NoError(t, err)
	require.Equal(t, k("b"), prep.Keys)
	require.Nil(t, prep.Ends)
	require.Nil(t, prep.Slots)
}

// PROTOCOL.md "dedup", for an offer longer than dedupMax: a repeated absent
// key needs room once, so an offer that fits its distinct keys is not
// refused, and evicts only the least recently used keys it needs (the
// naive recomputation in checkPrepareStore).
func TestLongOfferCountsRepeatsOnce(t *testing.T) {
	var ready, fresh []messages.Key
	for i := range 10 {
		ready = append(ready, messages.Key(fmt.Sprintf("r%02d", i)))
	}
	for i := range 30 {
		fresh = append(fresh, messages.Key(fmt.Sprintf("n%02d", i)))
	}
	// 40 keys, 30 distinct: every tenth key is offered again, three times.
	offer := append([]messages.Key{}, fresh...)
	for i := range 10 {
		offer = append(offer, fresh[(i%3)*10])
	}
	require.Greater(t, len(offer), dedupMax)
	for _, tc := range []struct {
		name    string
		pages   int64
		evicted []messages.Key
	}{
		{"room for the distinct keys", 40, nil},
		{"room after evicting four", 36, ready[:4]},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := New(tc.pages, 1)
			_, err := p.PrepareStore(ready, nil)
			require.NoError(t, err)
			p.CompleteStore(ready, sums(ready))
			before := snapshot(p)
			got, err := p.PrepareStore(offer, nil)
			require.NoError(t, err, "30 distinct new keys fit")
			require.Equal(t, fresh, got.Keys, "each new key given room once, in offer order")
			require.Equal(t, tc.evicted, got.Evicted)
			require.Len(t, got.Ends, len(fresh))
			checkInvariants(t, p)

			// The same through the naive model, from the same start, and a
			// second long offer right after (the seen set starts empty).
			p = New(tc.pages, 1)
			_, err = p.PrepareStore(ready, nil)
			require.NoError(t, err)
			p.CompleteStore(ready, sums(ready))
			require.Equal(t, before, snapshot(p))
			checkPrepareStore(t, p, offer, nil)
			checkInvariants(t, p)
			checkPrepareStore(t, p, offer, nil)
		})
	}
}

// A chunk larger than the whole pool is "no room" at once, whatever its
// size: the plan must not cut a hostile size into pages first (a size near
// 2^63 is 2^43 pieces of a 1 MiB page, which never returns), and nothing
// changes.
func TestAChunkLargerThanThePoolIsNoRoomAtOnce(t *testing.T) {
	p := New(4<<20, 1<<20)
	_, err := p.PrepareStore(k("a"), []int64{1 << 20})
	require.NoError(t, err)
	p.CompleteStore(k("a"), []uint32{1})
	before := snapshot(p)
	for _, size := range []int64{p.Capacity() + 1, 1 << 40, 1 << 62, math.MaxInt64} { // ascending: the cheap ones fail first
		var m0, m1 runtime.MemStats
		runtime.ReadMemStats(&m0)
		_, err := p.PrepareStore(k("a", "b"), []int64{1 << 20, size})
		runtime.ReadMemStats(&m1)
		require.ErrorIs(t, err, ErrNoRoom, "size %d", size)
		require.Less(t, m1.TotalAlloc-m0.TotalAlloc, uint64(64<<10), "size %d: allocated for its pieces", size)
		require.Equal(t, before, snapshot(p))
	}
	checkInvariants(t, p)
}
