package hostpool

import (
	"errors"
	"fmt"
	"iter"
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
	FreePages []int32
	Entries   map[messages.Key]entryState
	LRU       []messages.Key
	Pending   int
	Pinned    int
	Data      int64
}

type entryState struct {
	Extents []Extent
	State   State
	Pins    int32
	Size    int64
}

func snapshot(p *Pool) poolState {
	s := poolState{FreePages: slices.Clone(p.freePages), Entries: map[messages.Key]entryState{},
		LRU: lruOrder(p), Pending: p.pending, Pinned: p.pinned, Data: p.dataBytes}
	for k, r := range indexed(p) {
		e := p.entries[r]
		ext, _, _ := p.locate(k, nil)
		s.Entries[k] = entryState{ext, e.state, e.pins, e.size}
	}
	return s
}

// indexed yields every indexed key and its entry, in table order.
func indexed(p *Pool) iter.Seq2[messages.Key, ref] {
	return func(yield func(messages.Key, ref) bool) {
		for _, s := range p.index.slots {
			if s != 0 && !yield(p.entries[slotRef(s)].key, slotRef(s)) {
				return
			}
		}
	}
}

// lookupRef is key's entry, or none.
func lookupRef(p *Pool, key messages.Key) ref {
	if r, ok := p.lookup(key); ok {
		return r
	}
	return none
}

// lruOrder lists ready keys from least to most recently used.
func lruOrder(p *Pool) []messages.Key {
	var out []messages.Key
	for r := p.head; r != none; r = p.entries[r].next {
		out = append(out, p.entries[r].key)
	}
	return out
}

// checkInvariants: every chunk's extents add up to its size, lie in pages of
// their class inside the arena, and overlap no other; page counts agree with
// the slots in use; free pages hold nothing; pending + ready = used; the LRU
// list holds exactly the ready keys; pins only on ready keys; Stats agrees.
func checkInvariants(t *testing.T, p *Pool) {
	t.Helper()
	fail := func(format string, a ...any) {
		t.Helper()
		t.Fatalf("pool invariant: "+format, a...)
	}
	type slotID struct{ pg, idx int32 }
	seen := map[slotID]messages.Key{}
	usedPerPage := make([]int32, len(p.pages))
	pending, ready, pinned := 0, 0, 0
	var data int64
	for k, r := range indexed(p) {
		e := p.entries[r]
		var n int64
		for _, pc := range e.pieces {
			pg := p.pages[pc.pg]
			switch {
			case pg.class == 0:
				fail("%q has a piece in free page %d", k, pc.pg)
			case pc.idx < 0 || pc.idx >= pg.fresh || int64(pc.idx+1)*pg.class > p.pageBytes:
				fail("%q: slot %d of page %d (class %d, fresh %d) out of range", k, pc.idx, pc.pg, pg.class, pg.fresh)
			}
			if other, dup := seen[slotID(pc)]; dup {
				fail("slot %v held by %q and %q", pc, other, k)
			}
			seen[slotID(pc)] = k
			usedPerPage[pc.pg]++
			n += pg.class
		}
		switch {
		case k != e.key:
			fail("entry %q under key %q", e.key, k)
		case n != e.size:
			fail("%q: pieces hold %d bytes, size %d", k, n, e.size)
		case e.pins < 0:
			fail("%q pins %d", k, e.pins)
		case e.state == Pending && e.pins != 0:
			fail("pending %q pinned", k)
		case e.state != Pending && e.state != Ready:
			fail("%q state %v", k, e.state)
		}
		data += e.size
		if e.state == Pending {
			pending++
		} else {
			ready++
		}
		if e.pins > 0 {
			pinned++
		}
	}
	freeSet := map[int32]bool{}
	for _, pg := range p.freePages {
		if freeSet[pg] || p.pages[pg].class != 0 {
			fail("free page %d listed twice or has class %d", pg, p.pages[pg].class)
		}
		freeSet[pg] = true
	}
	avail := map[int64]int64{}
	for i, pg := range p.pages {
		if pg.class == 0 {
			if !freeSet[int32(i)] {
				fail("page %d has no class and is not free", i)
			}
			continue
		}
		c := p.classes[pg.class]
		if usedPerPage[i] != pg.used || pg.used == 0 || pg.used > c.perPage {
			fail("page %d: %d slots held, used %d, per page %d", i, usedPerPage[i], pg.used, c.perPage)
		}
		if int(pg.fresh)-len(pg.free) != int(pg.used) {
			fail("page %d: fresh %d - free %d != used %d", i, pg.fresh, len(pg.free), pg.used)
		}
		if (pg.pos >= 0) != (pg.used < c.perPage) || (pg.pos >= 0 && c.partial[pg.pos] != int32(i)) {
			fail("page %d: partial list position %d, used %d of %d", i, pg.pos, pg.used, c.perPage)
		}
		avail[pg.class] += int64(c.perPage - pg.used)
	}
	for size, c := range p.classes {
		if c.avail != avail[size] {
			fail("class %d: avail %d, pages say %d", size, c.avail, avail[size])
		}
	}
	if pending != p.pending || pinned != p.pinned || data != p.dataBytes {
		fail("counted pending %d pinned %d data %d; pool says %d %d %d", pending, pinned, data,
			p.pending, p.pinned, p.dataBytes)
	}
	n := 0
	prev := none
	for r := p.head; r != none; r = p.entries[r].next {
		e := p.entries[r]
		if e.prev != prev || lookupRef(p, e.key) != r || e.state != Ready {
			fail("LRU entry %q: bad link, not in the map, or not ready", e.key)
		}
		prev = r
		n++
		if n > len(p.entries) {
			fail("LRU list has a cycle")
		}
	}
	if prev != p.tail || n != ready {
		fail("LRU holds %d entries, %d ready keys", n, ready)
	}
	checkIndex(t, &p.index, p.entries)
	if p.index.n > p.maxChunks {
		fail("%d chunks held, at most %d", p.index.n, p.maxChunks)
	}
	want := Stats{Capacity: p.Capacity(), Data: data, PageBytes: p.pageBytes, Pages: len(p.pages),
		FreePages: len(p.freePages), Used: p.index.n, Pending: pending, Ready: ready, Pinned: pinned,
		MaxChunks: p.maxChunks}
	if got := p.Stats(); got != want {
		fail("Stats %+v, want %+v", got, want)
	}
}

// A quick-check of the pool under random operations: the invariants after
// every call, all-or-nothing PrepareStore (ErrNoRoom exactly when free slots
// plus evictable keys fall short, and then nothing changes), eviction of the
// least recently used ready keys that are neither pinned nor offered, and
// PrepareLoad failing exactly when a key is not ready. Half the pools are
// capped at fewer chunks than their pages (SetMaxChunks), which binds as the
// pages do.
func TestPoolQuickCheck(t *testing.T) {
	prop := func(seed int64, capacity uint8) bool {
		rng := rand.New(rand.NewSource(seed))
		p := New(int64(capacity%10), 1)
		if rng.Intn(2) == 0 {
			p.SetMaxChunks(1 + rng.Intn(10))
		}
		alphabet := 12 + rng.Intn(30)
		randKeys := func(n int) []messages.Key {
			out := make([]messages.Key, n)
			for i := range out {
				out[i] = messages.Key(fmt.Sprintf("k%d", rng.Intn(alphabet)))
			}
			return out
		}
		var jobs, loads [][]messages.Key
		var scratch Prepared // reused by half the offers, as a decision's caller does
		for range 150 {
			switch r := rng.Intn(100); {
			case r < 35:
				keys := randKeys(rng.Intn(24))
				checkPrepareStore(t, p, keys, &scratch)
				if got, err := p.PrepareStore(nil, nil); err != nil || len(got.Keys) > 0 {
					t.Fatalf("empty store: %v %v", got, err)
				}
			case r < 38:
				checkPrepareStore(t, p, randKeys(1+rng.Intn(3)), nil)
			case r < 60:
				// Complete the keys of the last prepared jobs (kept in order).
				if len(jobs) == 0 {
					break
				}
				i := rng.Intn(len(jobs))
				p.CompleteStore(jobs[i], okSums(jobs[i], rng.Intn(10) < 7))
				jobs = slices.Delete(jobs, i, i+1)
			case r < 75:
				keys := randKeys(1 + rng.Intn(4))
				before := snapshot(p)
				err := p.PrepareLoad(keys)
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
				stray := randKeys(rng.Intn(3))
				p.CompleteStore(stray, okSums(stray, rng.Intn(2) == 0)) // stray completions
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
	for k, r := range indexed(p) {
		if p.entries[r].state == Pending && !inJob[k] {
			loose = append(loose, k)
		}
	}
	slices.Sort(loose) // map order is random; keep runs reproducible
	if len(loose) > 0 {
		jobs = append(jobs, loose)
	}
	return jobs
}

// checkPrepareStore calls PrepareStore (scratch nil) or PrepareStoreInto
// scratch and checks its outcome against a naive recomputation from the
// pool's state before the call.
func checkPrepareStore(t *testing.T, p *Pool, keys []messages.Key, scratch *Prepared) {
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
	free := min(len(p.pages), p.maxChunks) - len(before.Entries) // every chunk is one page
	var got Prepared
	var err error
	if scratch == nil {
		got, err = p.PrepareStore(keys, nil)
	} else {
		before := scratch.Ext
		err = p.PrepareStoreInto(scratch, keys, nil)
		got = *scratch
		if len(before) > 0 && len(got.Ext) > 0 {
			require.NotSame(t, &before[0], &got.Ext[0], "a job keeps its room: Ext is never reused")
		}
	}
	if len(want) > free+len(evictable) {
		require.ErrorIs(t, err, ErrNoRoom)
		require.Empty(t, got.Keys, "no room: nothing prepared")
		require.Empty(t, got.Evicted, "no room: nothing evicted")
		require.Empty(t, got.Ext, "no room: no room given")
		require.True(t, errors.Is(err, ErrNoRoom))
		require.Equal(t, before, snapshot(p), "no room changes nothing")
		return
	}
	require.NoError(t, err)
	require.Equal(t, want, nilIfEmpty(got.Keys), "dedup keeps the first of each absent key, in order")
	require.Equal(t, nilIfEmpty(evictable[:max(0, len(want)-free)]), nilIfEmpty(got.Evicted),
		"the least recently used unpinned, unoffered ready keys go, and only as many as needed")
	for _, k := range got.Keys {
		st, _ := p.Lookup(k)
		require.Equal(t, Pending, st)
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

// okSums is a completion: checksums when ok, nil (failure) otherwise.
func okSums(keys []messages.Key, ok bool) []uint32 {
	if !ok {
		return nil
	}
	return make([]uint32, len(keys))
}
