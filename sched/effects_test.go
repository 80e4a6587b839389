package sched

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// Deferrals list every deferral added, in order, whether they fit inline or
// not, and the list All returns is the caller's: Deferrals emptied and
// added to afterwards (the next decision's) do not change it.
func TestDeferralsListEveryOneInOrder(t *testing.T) {
	for n := range 7 {
		var d Deferrals
		var want []Deferral
		for i := range n {
			x := Deferral{Group: i, Chunk: 3, Reason: DeferReason(1 + i%3)}
			d.add(x)
			want = append(want, x)
		}
		got := d.All()
		require.Len(t, got, n, "%d added", n)
		require.Equal(t, nilIfEmpty(want), nilIfEmpty(got), "%d added", n)
		d = Deferrals{}
		for range n {
			d.add(Deferral{Group: 99})
		}
		require.Equal(t, nilIfEmpty(want), nilIfEmpty(got), "a listed slice after the next deferrals (%d added)", n)
	}
}

// A decision over two groups that defers both allocates nothing for them
// (it used to allocate the list on its first deferral).
func TestTwoDeferralsAllocateNothing(t *testing.T) {
	allocs := testing.AllocsPerRun(100, func() {
		var e Effects
		e.Deferred.add(Deferral{Group: 0, Chunk: 1, Reason: DeferHashes})
		e.Deferred.add(Deferral{Group: 1, Chunk: 1, Reason: DeferTokens})
		if len(e.Deferred.All()) != 2 {
			t.Fatal("lost a deferral")
		}
	})
	require.Zero(t, allocs)
}
