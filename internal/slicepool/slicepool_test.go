package slicepool

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// Get gives empty slices of at least New capacity; Put keeps only slices
// within Keep (a huge one is not handed out again) and never empties them
// of their contents (the caller's job), only of their length.
func TestGetPutKeep(t *testing.T) {
	p := Pool[int]{New: 4, Keep: 8}
	s := p.Get()
	require.Empty(t, s)
	require.GreaterOrEqual(t, cap(s), 4)
	for range 50 { // sync.Pool may drop what it holds (a quarter of Puts under -race)
		s = append(p.Get(), 1, 2, 3)
		p.Put(s)
		if got := p.Get(); cap(got) == cap(s) && &got[:1][0] == &s[0] {
			require.Empty(t, got, "handed out empty")
			require.Equal(t, 1, got[:1][0], "contents left as they were")
			return
		}
	}
	t.Skip("the pool dropped every slice (GC ran between Put and Get)")
}

func TestPutIgnoresTooLargeAndEmpty(t *testing.T) {
	p := Pool[int]{New: 2, Keep: 8}
	big := make([]int, 0, 64)
	p.Put(big)
	p.Put(nil)
	for range 4 {
		require.LessOrEqual(t, cap(p.Get()), 8, "a slice past Keep is never handed out")
	}
}

// Once warm, a Get and Put pair allocates nothing: Put refills the box the
// last Get emptied rather than boxing its slice afresh.
func TestGetPutAllocatesNothingWhenWarm(t *testing.T) {
	if raceEnabled {
		t.Skip("sync.Pool drops items at random under -race")
	}
	p := Pool[int]{New: 4, Keep: 8}
	p.Put(p.Get())
	allocs := testing.AllocsPerRun(100, func() { p.Put(append(p.Get(), 1)) })
	require.Zero(t, allocs, "allocations per Get+Put")
}

// The mechanism behind it, checked where allocations cannot be counted
// (CI runs the suite under -race, which skips the test above): the box a
// Get empties is the one the next Put fills. sync.Pool may drop either
// (a quarter of Puts under -race), so one observed reuse in 100 tries is
// the proof; boxing afresh never reuses one.
func TestPutRefillsTheBoxGetEmptied(t *testing.T) {
	p := Pool[int]{New: 4, Keep: 8}
	for range 100 {
		p.Put(make([]int, 0, 4))
		box, ok := p.p.Get().(*[]int)
		if !ok {
			continue // dropped
		}
		p.p.Put(box)
		s := p.Get() // empties a box (this one, unless dropped) into boxes
		p.Put(s)     // fills a box from boxes
		if again, ok := p.p.Get().(*[]int); ok && again == box {
			require.Equal(t, 4, cap(*again), "it holds the slice Put gave")
			return
		}
	}
	t.Fatal("no Put refilled the box a Get emptied in 100 tries")
}
