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

// poolState is a deep, comparable copy of a pool, to prove a failed call
// changed nothing.
type poolState struct {
	Fresh   int
	Free    []Slot
	Entries map[messages.Key]entryState
	LRU     []messages.Key
	Pending int
	Pinned  int
}

type entryState struct {
	Slot  Slot
	State State
	Pins  int32
}

// entryView is an entry with its slot, as the invariants read it.
type entryView struct {
	key   messages.Key
	slot  Slot
	state State
	pins  int32
}

func entriesOf(p *Pool) map[messages.Key]entryView {
	m := make(map[messages.Key]entryView, len(p.index))
	for k, sl := range p.index {
		e := p.slots[sl]
		m[k] = entryView{e.key, sl, e.state, e.pins}
	}
	return m
}

func snapshot(p *Pool) poolState {
	s := poolState{Fresh: p.fresh, Free: slices.Clone(p.free), Entries: map[messages.Key]entryState{},
		LRU: lruOrder(p), Pending: p.pending, Pinned: p.pinned}
	for k, e := range entriesOf(p) {
		s.Entries[k] = entryState{e.slot, e.state, e.pins}
	}
	return s
}

// lruOrder lists ready keys from least to most recently used.
func lruOrder(p *Pool) []messages.Key {
	var out []messages.Key
	for sl := p.head; sl != none; sl = p.slots[sl].next {
		out = append(out, p.slots[sl].key)
	}
	return out
}

// checkInvariants: used <= capacity; slots unique and either used or free;
// pending + ready = used; the LRU list holds exactly the ready keys; pins
// only on ready keys; Stats agrees. (Plain comparisons: it runs after every
// operation of the quick-check.)
func checkInvariants(t *testing.T, p *Pool) {
	t.Helper()
	fail := func(format string, a ...any) {
		t.Helper()
		t.Fatalf("pool invariant: "+format, a...)
	}
	entries := entriesOf(p)
	if len(entries) > p.capacity || p.fresh > p.capacity {
		fail("used %d, fresh %d, capacity %d", len(entries), p.fresh, p.capacity)
	}
	seen := make(map[Slot]bool, p.fresh)
	pending, ready, pinned := 0, 0, 0
	for k, e := range entries {
		switch {
		case k != e.key:
			fail("entry %q under key %q", e.key, k)
		case e.slot < 0 || int(e.slot) >= p.fresh:
			fail("slot %d of %q never handed out (fresh %d)", e.slot, k, p.fresh)
		case seen[e.slot]:
			fail("slot %d used twice", e.slot)
		case e.pins < 0:
			fail("%q pins %d", k, e.pins)
		case e.state == Pending && e.pins != 0:
			fail("pending %q pinned", k)
		case e.state != Pending && e.state != Ready:
			fail("%q state %v", k, e.state)
		}
		seen[e.slot] = true
		if e.state == Pending {
			pending++
		} else {
			ready++
		}
		if e.pins > 0 {
			pinned++
		}
	}
	for _, s := range p.free {
		if s < 0 || int(s) >= p.fresh || seen[s] {
			fail("free slot %d in use, freed twice or never handed out", s)
		}
		seen[s] = true
	}
	if p.fresh != len(entries)+len(p.free) {
		fail("%d slots handed out, %d used + %d free", p.fresh, len(entries), len(p.free))
	}
	if pending != p.pending || pinned != p.pinned || len(entries) != pending+ready {
		fail("counted pending %d pinned %d ready %d; pool says pending %d pinned %d used %d",
			pending, pinned, ready, p.pending, p.pinned, len(entries))
	}
	n := 0
	prev := none
	for sl := p.head; sl != none; sl = p.slots[sl].next {
		e := p.slots[sl]
		if e.prev != prev || p.index[e.key] != sl || e.state != Ready {
			fail("LRU entry %q: bad link, not in the map, or not ready", e.key)
		}
		prev = sl
		n++
		if n > len(p.slots) {
			fail("LRU list has a cycle")
		}
	}
	if prev != p.tail || n != ready {
		fail("LRU holds %d entries, %d ready keys", n, ready)
	}
	want := Stats{Capacity: p.capacity, Used: len(entries), Pending: pending, Ready: ready,
		Pinned: pinned, Free: p.capacity - len(entries)}
	if got := p.Stats(); got != want {
		fail("Stats %+v, want %+v", got, want)
	}
}

// A quick-check of the pool under random operations: the invariants after
// every call, all-or-nothing PrepareStore (ErrNoRoom exactly when free slots
// plus evictable keys fall short, and then nothing changes), eviction of the
// least recently used ready keys that are neither pinned nor offered, and
// PrepareLoad failing exactly when a key is not ready.
func TestPoolQuickCheck(t *testing.T) {
	prop := func(seed int64, capacity uint8) bool {
		rng := rand.New(rand.NewSource(seed))
		p := New(int(capacity % 10))
		alphabet := 12 + rng.Intn(30)
		randKeys := func(n int) []messages.Key {
			out := make([]messages.Key, n)
			for i := range out {
				out[i] = messages.Key(fmt.Sprintf("k%d", rng.Intn(alphabet)))
			}
			return out
		}
		var jobs, loads [][]messages.Key
		for range 150 {
			switch r := rng.Intn(100); {
			case r < 35:
				keys := randKeys(rng.Intn(24))
				checkPrepareStore(t, p, keys)
				if got, err := p.PrepareStore(nil); err != nil || len(got.Keys) > 0 {
					t.Fatalf("empty store: %v %v", got, err)
				}
			case r < 38:
				checkPrepareStore(t, p, randKeys(1+rng.Intn(3)))
			case r < 60:
				// Complete the keys of the last prepared jobs (kept in order).
				if len(jobs) == 0 {
					break
				}
				i := rng.Intn(len(jobs))
				p.CompleteStore(jobs[i], rng.Intn(10) < 7)
				jobs = slices.Delete(jobs, i, i+1)
			case r < 75:
				keys := randKeys(1 + rng.Intn(4))
				before := snapshot(p)
				slotsGot, err := p.PrepareLoad(keys)
				allReady := true
				for _, k := range keys {
					if st, _ := p.Lookup(k); st != Ready {
						allReady = false
					}
				}
				if err != nil {
					require.ErrorIs(t, err, ErrNotReady)
					require.False(t, allReady)
					require.Equal(t, before, snapshot(p))
					break
				}
				require.True(t, allReady)
				for i, k := range keys {
					_, s := p.Lookup(k)
					require.Equal(t, s, slotsGot[i])
				}
				loads = append(loads, keys)
			case r < 85:
				if len(loads) > 0 {
					i := rng.Intn(len(loads))
					p.CompleteLoad(loads[i])
					loads = slices.Delete(loads, i, i+1)
				}
			case r < 95:
				p.Touch(randKeys(rng.Intn(5)))
			default:
				p.CompleteStore(randKeys(rng.Intn(3)), rng.Intn(2) == 0) // stray completions
			}
			checkInvariants(t, p)
			// Track the keys each successful store left pending.
			jobs = pendingJobs(p, jobs)
		}
		return !t.Failed()
	}
	require.NoError(t, quick.Check(prop, &quick.Config{MaxCount: 200, Rand: rand.New(rand.NewSource(1))}))
}

// pendingJobs keeps, as jobs, the pending keys not yet in any job.
func pendingJobs(p *Pool, jobs [][]messages.Key) [][]messages.Key {
	inJob := map[messages.Key]bool{}
	for _, j := range jobs {
		for _, k := range j {
			inJob[k] = true
		}
	}
	var loose []messages.Key
	for k, e := range entriesOf(p) {
		if e.state == Pending && !inJob[k] {
			loose = append(loose, k)
		}
	}
	slices.Sort(loose) // map order is random; keep runs reproducible
	if len(loose) > 0 {
		jobs = append(jobs, loose)
	}
	return jobs
}

// checkPrepareStore calls PrepareStore and checks its outcome against a naive
// recomputation from the pool's state before the call.
func checkPrepareStore(t *testing.T, p *Pool, keys []messages.Key) {
	t.Helper()
	before := snapshot(p)
	offered := map[messages.Key]bool{}
	var want []messages.Key
	for _, k := range keys {
		if _, present := before.Entries[k]; !present && !offered[k] {
			want = append(want, k)
		}
		offered[k] = true
	}
	var evictable []messages.Key // LRU order
	for _, k := range before.LRU {
		if before.Entries[k].Pins == 0 && !offered[k] {
			evictable = append(evictable, k)
		}
	}
	free := p.capacity - len(before.Entries)
	got, err := p.PrepareStore(keys)
	if len(want) > free+len(evictable) {
		require.ErrorIs(t, err, ErrNoRoom)
		require.True(t, errors.Is(err, ErrNoRoom))
		require.Equal(t, before, snapshot(p), "no room changes nothing")
		return
	}
	require.NoError(t, err)
	require.Equal(t, want, nilIfEmpty(got.Keys), "dedup keeps the first of each absent key, in order")
	require.Len(t, got.Slots, len(want))
	require.Equal(t, nilIfEmpty(evictable[:max(0, len(want)-free)]), nilIfEmpty(got.Evicted),
		"the least recently used unpinned, unoffered ready keys go, and only as many as needed")
	for i, k := range got.Keys {
		st, s := p.Lookup(k)
		require.Equal(t, Pending, st)
		require.Equal(t, got.Slots[i], s)
	}
	for _, k := range got.Evicted {
		st, _ := p.Lookup(k)
		require.Equal(t, Absent, st)
	}
	for k := range offered {
		st, _ := p.Lookup(k)
		require.NotEqual(t, Absent, st, "every offered key is present after a successful store")
	}
}

func nilIfEmpty[T any](s []T) []T {
	if len(s) == 0 {
		return nil
	}
	return s
}
