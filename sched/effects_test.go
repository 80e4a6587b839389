package sched

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// Deferrals list every deferral added, in order, whether they fit inline or
// not, and the list All returns is the caller's: adding to the Deferrals
// afterwards does not change it.
func TestDeferralsListEveryOneInOrder(t *testing.T) {
	for n := range 7 {
		var d Deferrals
		var want []Deferral
		for i := range n {
			x := Deferral{Group: i, Chunk: 3, Reason: DeferReason(1 + i%3)}
			d.add(x)
			want = append(want, x)
		}
		require.Equal(t, n, d.Len(), "%d added", n)
		got := d.All()
		require.Equal(t, nilIfEmpty(want), nilIfEmpty(got), "%d added", n)
		d.add(Deferral{Group: 99})
		require.Len(t, got, n, "a listed slice is not changed by a later add (%d added)", n)
	}
}

// A decision over two groups that defers both allocates nothing for them
// (it used to allocate the list on its first deferral).
func TestTwoDeferralsAllocateNothing(t *testing.T) {
	allocs := testing.AllocsPerRun(100, func() {
		var e Effects
		e.Deferred.add(Deferral{Group: 0, Chunk: 1, Reason: DeferHashes})
		e.Deferred.add(Deferral{Group: 1, Chunk: 1, Reason: DeferTokens})
		if e.Deferred.Len() != 2 {
			t.Fatal("lost a deferral")
		}
	})
	require.Zero(t, allocs)
}
