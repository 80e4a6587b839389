package sched

import (
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
)

// Rule (PROTOCOL.md "ready prefix": a ready chunk is never skipped; dedup of
// a key pending in another copy): a chunk whose key another copy is still
// filling is not stored yet. That copy may complete (the chunk is then
// deduplicated) or be cancelled or fail (an engine reset cancels a dead
// epoch's queued copies, freeing their keys); either way, by the time the
// request is released every chunk that was ready at finish is ready in the
// pool, and the request itself stored each chunk at most once.
//
// Random interleavings of: foreign copies holding some of the request's keys
// pending, each resolving ok or cancelled at a random point; the request's
// own copies completing; retry timers firing.
func TestPropertyPendingElsewhereNeverSkipped(t *testing.T) {
	for seed := int64(1); seed <= 500; seed++ {
		rng := rand.New(rand.NewSource(seed))
		n := 1 + rng.Intn(8) // chunks of 4 tokens, one block, one hash each
		h := newHarness(t, oneGroup4(t), 64, added(4*n))
		var foreign []messages.Key
		for c := range n {
			if rng.Intn(2) == 0 {
				foreign = append(foreign, key(0, c, 1))
			}
		}
		_, err := h.pool.PrepareStore(foreign, nil)
		require.NoError(t, err)

		retryDue := false
		attempts := 0 // pending retries since a foreign copy last resolved
		apply := func(e Effects) {
			require.Zero(t, e.GivenUp, "seed %d: nothing given up while copies resolve", seed)
			if e.Retry != nil {
				require.Equal(t, RetryPending, e.Retry.Reason, "seed %d", seed)
				retryDue, attempts = true, e.Retry.Attempt
			}
		}
		h.step(hashes(0, n), blocks(0, 0, seq(1, n)...), tokens(4*n, 4*n))
		if rng.Intn(2) == 0 {
			apply(h.advance())
		}
		h.step(finished(4*n, 4*n))
		apply(h.advance())
		for steps := 0; h.req.Phase() != Done || len(foreign) > 0; steps++ {
			require.Less(t, steps, 1000, "seed %d: bounded", seed)
			switch r := rng.Intn(3); {
			case len(foreign) > 0 && (r == 0 || attempts >= FinishRetryLimit/2):
				i := rng.Intn(len(foreign))
				k := foreign[i]
				foreign = append(foreign[:i], foreign[i+1:]...)
				h.pool.CompleteStore([]messages.Key{k}, sumsIf([]messages.Key{k}, rng.Intn(2) == 0))
				attempts = 0
			case len(h.jobs) > 0 && r == 1:
				for id := range h.jobs {
					apply(h.done(id, true))
					apply(h.advance())
					break
				}
			case retryDue:
				retryDue = false
				apply(h.advance())
			}
		}
		require.Equal(t, []string{messages.ReasonFinished}, h.rels, "seed %d: released once", seed)
		for c := range n {
			st, _ := h.pool.Lookup(key(0, c, 1))
			require.Equal(t, hostpool.Ready, st, "seed %d: chunk %d ready at finish is stored", seed, c)
			require.LessOrEqual(t, h.stored[chunkName(0, messages.ChunkIndex(c))], 1, "seed %d", seed)
		}
	}
}

// A finished request retries at most FinishRetryLimit times from its
// finish: r2 met a key pending in r1's copy on more timer retries than that
// while it ran, and its first decision after finished still retries
// instead of giving up a chunk that copy may yet fail to store.
func TestPendingFailuresWhileRunningAreNotChargedToTheFinish(t *testing.T) {
	lay := layout(t, 4, 1, full(4))
	pool := poolOf(lay, 8)
	r1 := NewRequest(lay, added(4))
	for _, ev := range []*messages.Event{hashes(0, 1), blocks(0, 0, 1), tokens(4, 4)} {
		require.NoError(t, r1.Step(ev))
	}
	require.NotNil(t, r1.Advance(pool).Job, "r1 copies chunk 0: its key is pending")

	add2 := added(4)
	add2.Request = "r2"
	r2 := NewRequest(lay, add2)
	for _, ev := range []*messages.Event{hashes(0, 1), blocks(0, 0, 2), tokens(4, 8)} {
		ev.Request = "r2"
		require.NoError(t, r2.Step(ev))
	}
	for range FinishRetryLimit + 1 {
		e := r2.Advance(pool)
		require.NotNil(t, e.Retry)
		require.Equal(t, RetryPending, e.Retry.Reason)
	}
	fin := finished(4, 8)
	fin.Request = "r2"
	require.NoError(t, r2.Step(fin))
	e := r2.Advance(pool)
	require.Zero(t, e.GivenUp, "nothing given up at the first decision after finished")
	require.NotNil(t, e.Retry)
	require.Equal(t, 1, e.Retry.Attempt, "the finish's first attempt")
}
