package sched

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
)

// A retry's Attempt counts the consecutive failures of its own kind
// (failAttempt): it sets the backoff, and a finishing request gives up
// past FinishRetryLimit of them. Each kind's run ends where its failure
// does, and an early wake-up spends no attempt but the first.

// fullPool is a pool of capacity chunks of lay whose every page another
// request's copies hold; free gives them back.
func fullPool(t *testing.T, lay *Layout, capacity int) (pool *hostpool.Pool, free func()) {
	t.Helper()
	pool = poolOf(lay, capacity)
	others := otherKeys(capacity)
	_, err := pool.PrepareStore(others, nil)
	require.NoError(t, err)
	return pool, func() { pool.CompleteStore(others, nil) }
}

func requireRetry(t *testing.T, e Effects, reason RetryReason, attempt int, msg string) {
	t.Helper()
	require.NotNil(t, e.Retry, msg)
	require.Equal(t, Retry{Reason: reason, Attempt: attempt, Backoff: backoff(attempt)}, *e.Retry, msg)
}

// A decision that finds room ends a run of pool-full failures: the next
// failure to find room is attempt 1 again, not the run's next.
func TestADecisionWithRoomEndsARunOfPoolFullAttempts(t *testing.T) {
	lay := oneGroup4(t)
	pool, free := fullPool(t, lay, 4)
	r := NewRequest(lay, added(12))
	for _, ev := range ev(hashes(0, 3), blocks(0, 0, 1, 2, 3), tokens(4, 12)) {
		require.NoError(t, r.Step(ev))
	}
	requireRetry(t, r.Advance(pool), RetryPoolFull, 1, "no room")
	requireRetry(t, r.Advance(pool), RetryPoolFull, 2, "no room again")
	free()
	e := r.Advance(pool)
	require.Equal(t, []string{"0/0"}, jobChunks(e.Job))
	_, err := pool.PrepareStore(otherKeys(3), nil) // the job's chunk and these fill it again
	require.NoError(t, err)
	require.NoError(t, r.Step(tokens(8, 12)))
	requireRetry(t, r.Advance(pool), RetryPoolFull, 1, "a new run of failures")
}

// An early wake-up (AdvanceWoken) that fails again spends no attempt, so a
// finishing request gives up after as long as its timers take; but a
// first failure is one whoever meets it (attempt 1, not 0).
func TestAnEarlyWakeUpSpendsOnlyAFirstAttempt(t *testing.T) {
	lay := oneGroup4(t)
	pool, _ := fullPool(t, lay, 4)
	r := NewRequest(lay, added(12))
	for _, ev := range ev(hashes(0, 3), blocks(0, 0, 1, 2, 3), tokens(12, 12)) {
		require.NoError(t, r.Step(ev))
	}
	requireRetry(t, r.AdvanceWoken(pool), RetryPoolFull, 1, "the first failure, woken")
	for range 3 {
		requireRetry(t, r.AdvanceWoken(pool), RetryPoolFull, 1, "woken again: no attempt spent")
	}
	requireRetry(t, r.Advance(pool), RetryPoolFull, 2, "the timer's retry")

	require.NoError(t, r.Step(finished(12, 12)))
	for range 2 * FinishRetryLimit {
		e := r.AdvanceWoken(pool)
		require.Zero(t, e.GivenUp, "wake-ups alone never give up")
		require.NotNil(t, e.Retry)
	}
}

// Decisions that meet a key pending in another copy count their own run:
// a decision between them that finds room for the rest does not end it
// (it did, counted as pool-full failures that each decision with room
// resets, and the pending retry stayed at attempt 1 and its shortest
// backoff for as long as the other copy ran).
func TestPendingAttemptsCountTheirOwnRun(t *testing.T) {
	lay := oneGroup4(t)
	pool := poolOf(lay, 8)
	r1 := NewRequest(lay, added(4))
	for _, ev := range ev(hashes(0, 1), blocks(0, 0, 1), tokens(4, 4)) {
		require.NoError(t, r1.Step(ev))
	}
	require.NotNil(t, r1.Advance(pool).Job, "r1 copies chunk 0: its key is pending")

	add2 := added(4)
	add2.Request = "r2"
	r2 := NewRequest(lay, add2)
	for _, ev := range ev(hashes(0, 1), blocks(0, 0, 2), tokens(4, 8)) {
		ev.Request = "r2"
		require.NoError(t, r2.Step(ev))
	}
	for attempt := 1; attempt <= 3; attempt++ {
		requireRetry(t, r2.Advance(pool), RetryPending, attempt, "chunk 0 still pending in r1's copy")
	}
}

// A copy that succeeds ends a run of failed copies: the next failed copy
// is attempt 1 again.
func TestACopyThatSucceedsEndsARunOfFailedCopies(t *testing.T) {
	h := newHarness(t, oneGroup4(t), 64, added(12))
	h.step(hashes(0, 3), blocks(0, 0, 1, 2, 3), tokens(4, 12))
	e := h.advance()
	require.Equal(t, []string{"0/0"}, jobChunks(e.Job))
	requireRetry(t, h.done(e.Job.ID, false), RetryCopyFailed, 1, "a failed copy")
	e = h.advance()
	require.Equal(t, []string{"0/0"}, jobChunks(e.Job), "offered again")
	require.Nil(t, h.done(e.Job.ID, true).Retry)
	h.step(tokens(8, 12))
	e = h.advance()
	require.Equal(t, []string{"0/1"}, jobChunks(e.Job))
	requireRetry(t, h.done(e.Job.ID, false), RetryCopyFailed, 1, "a new run of failed copies")
}

// roomPreparer is a Preparer that gives no room and reports the pool's
// room generation, as hostpool.Shared does.
type roomPreparer struct{ gen uint64 }

func (p roomPreparer) PrepareStoreInto(out *hostpool.Prepared, _ []messages.Key, _ []int64) error {
	out.RoomGen = p.gen
	return hostpool.ErrNoRoom
}

// A decision that found no room hands over the room generation it saw:
// the request actor's wait for room wakes at once if room freed since
// (hostpool.Shared.WaitRoom); without it, it waits for the next free.
func TestAPoolFullRetryCarriesTheRoomGenerationSeen(t *testing.T) {
	r := NewRequest(oneGroup4(t), added(4))
	for _, ev := range ev(hashes(0, 1), blocks(0, 0, 1), tokens(4, 4)) {
		require.NoError(t, r.Step(ev))
	}
	e := r.Advance(roomPreparer{gen: 7})
	requireRetry(t, e, RetryPoolFull, 1, "no room")
	require.Equal(t, uint64(7), e.RoomGen)
}
