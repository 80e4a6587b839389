package sched

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// PROTOCOL.md "EventBatch" (engine reset: queued copies cancelled, in-flight
// copies finish, then released) and "finished" (released when no copy is
// queued or in flight): a copy that fails once its request can never offer
// its chunks again (reset: T is 0 and the block ids are forgotten; aborted:
// the final T is below them) asks for no retry, and the release goes out as
// that copy ends, not a backoff later (up to RetryMax) after a retry that
// could store nothing.
func TestAFailedCopyWithNothingLeftToStoreReleasesAtOnce(t *testing.T) {
	for _, tc := range []struct {
		name   string
		end    func(h *harness) Effects // ends the request while its job copies
		reason string
	}{
		{name: "engine reset", reason: messages.ReasonEngineReset, end: func(h *harness) Effects {
			return h.record(h.req.Reset(messages.ReasonEngineReset))
		}},
		{name: "engine gone", reason: messages.ReasonEngineGone, end: func(h *harness) Effects {
			return h.record(h.req.Reset(messages.ReasonEngineGone))
		}},
		{name: "aborted with nothing computed", reason: messages.ReasonAborted, end: func(h *harness) Effects {
			h.step(aborted(0, 12))
			return h.advance()
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, oneGroup4(t), 64, added(12))
			h.step(hashes(0, 3), blocks(0, 0, 1, 2, 3), tokens(12, 12))
			job := h.advance().Job
			require.NotNil(t, job)
			e := tc.end(h)
			require.False(t, e.Done, "not released while its copy runs")
			e = h.done(job.ID, false)
			require.Nil(t, e.Retry, "nothing is left to retry")
			require.Equal(t, []string{tc.reason}, e.Releases, "released as the copy ends")
			require.True(t, e.Done)
			require.Zero(t, e.GivenUp)
			require.Equal(t, Done, h.req.Phase())
		})
	}
}
