package sched

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A Sequencer of the engine's next actor (a re-register) takes in the
// epochs the earlier one knew (Inherit). Once it has begun a new epoch, a
// late heartbeat or batch of the earlier actor's live epoch, or of one
// that ended before it, is Stale: it neither ends the live epoch (reset,
// its batches then Stale, no order naming it) nor orders a resync of an
// epoch the engine left.
func TestAnInheritedEpochArrivingLateIsStale(t *testing.T) {
	now := time.Unix(0, 0)
	s := NewSequencer(now, testLease)
	s.Inherit([]string{"a", "z"}) // a: the earlier actor's live epoch; z ended before it
	require.Equal(t, Decision{Verdict: Apply}, s.Batch(now, "b", 1), "the first epoch here: nothing of this actor to reset")
	require.Equal(t, Decision{}, s.Heartbeat(now, "a", 5), "a late heartbeat of the earlier actor's live epoch")
	require.Equal(t, Decision{Verdict: Stale}, s.Batch(now, "a", 7))
	require.Equal(t, Decision{Verdict: Stale}, s.Batch(now, "z", 3))
	require.Equal(t, Decision{Verdict: Apply}, s.Batch(now, "b", 2), "b is still live")
	require.False(t, s.Resyncing())
	require.Equal(t, "b", s.Epoch())
}

// The earlier actor's live epoch may go on in the next actor: it begins
// here as an unseen epoch would (its seq past 1 a gap, resynced), and only
// another epoch beginning ends it. An epoch that ended before it never
// comes back.
func TestAnInheritedLiveEpochMayGoOn(t *testing.T) {
	now := time.Unix(0, 0)
	s := NewSequencer(now, testLease)
	s.Inherit([]string{"a", "z"})
	require.Equal(t, Decision{Verdict: Dropped, Resync: &ResyncOrder{Epoch: "a", Expected: 1, Got: 8, Reason: "gap"}},
		s.Batch(now, "a", 8))
	require.Equal(t, Decision{Verdict: Apply, Reset: "a"}, s.Batch(now, "b", 1))
	require.Equal(t, Decision{Verdict: Stale}, s.Batch(now, "a", 9))

	fresh := NewSequencer(now, testLease)
	fresh.Inherit([]string{"a", "z"})
	require.Equal(t, Decision{Verdict: Stale}, fresh.Batch(now, "z", 1), "z ended before the earlier actor's a")
	require.Equal(t, Decision{}, fresh.Heartbeat(now, "z", 4))
}
