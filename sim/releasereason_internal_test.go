package sim

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/messages"
)

// oracleOwing is an engine with one request, r1, owing a release for each
// of events (oldest first), no block held: what onReleased and
// settleReleases need and no more.
func oracleOwing(events ...string) (*engine, *request) {
	cfg := DefaultConfig()
	e := &engine{cfg: cfg, al: newAllocator(&cfg), byID: map[string]*request{}, rep: Report{Releases: map[string]int{}}}
	r := &request{id: "r1", expected: map[string]int{}, received: map[string]int{}, held: map[string][][][]uint32{},
		blocks: make([][]uint32, len(cfg.Groups)), written: make([]int, len(cfg.Groups))}
	e.reqs, e.byID[r.id] = []*request{r}, r
	for _, ev := range events {
		e.hold(r, ev)
	}
	return e, r
}

// A release answers the request's oldest owed event, and only the reasons
// the node or the SDK's recovery give that event pass (releaseAnswers). A
// finished request released preempted passed: onReleased filed any reason
// not owed under the oldest owed event.
func TestAReleaseMustCarryAReasonItsOldestOwedEventMayGet(t *testing.T) {
	P, F, A := messages.ReasonPreempted, messages.ReasonFinished, messages.ReasonAborted
	for _, tc := range []struct {
		name     string
		owed     []string
		released []string
		ok       bool
	}{
		{"finished released preempted", []string{F}, []string{P}, false},
		{"finished released aborted", []string{F}, []string{A}, false},
		{"aborted released finished", []string{A}, []string{F}, false},
		{"preempted released finished, no finish owed", []string{P}, []string{F}, false},
		{"preempted and finished released preempted twice", []string{P, F}, []string{P, P}, false},
		{"in order", []string{P, P, F}, []string{P, P, F}, true},
		// The preemption's release was lost: the finish's, of the same
		// epoch, answers it; the resync's new epoch releases the finish.
		{"a lost preemption's release recovered", []string{P, F}, []string{F, F}, true},
		{"a lost preemption's release recovered, aborted", []string{P, P, A}, []string{P, A, A}, true},
		{"the node's reset", []string{P, F}, []string{messages.ReasonEngineReset, F}, true},
		{"the node dropped the engine", []string{P, F}, []string{messages.ReasonEngineGone, messages.ReasonEngineGone}, true},
		{"the node lost", []string{F}, []string{messages.ReasonNodeLost}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, r := oracleOwing(tc.owed...)
			for _, reason := range tc.released {
				e.onReleased(client.Release{Request: r.id, Reason: reason})
			}
			e.settleReleases()
			require.Zero(t, e.owed, "every release frees its event, even one of a wrong reason (no stall)")
			if tc.ok {
				require.NoError(t, e.rep.Err())
			} else {
				require.Error(t, e.rep.Err(), "releases %v for events %v passed the check", tc.released, tc.owed)
			}
		})
	}
}

// The finish's release that came for a lost preemption's answers the
// preemption (PROTOCOL.md step 11): the blocks given up then are freed, and
// those held at the finish wait, since the resync's new epoch may store
// from them before it releases the finish again.
func TestAReleaseFreesTheOldestOwedEventsBlocks(t *testing.T) {
	e, r := oracleOwing(messages.ReasonPreempted, messages.ReasonFinished)
	e.onReleased(client.Release{Request: r.id, Reason: messages.ReasonFinished})
	require.Equal(t, []string{messages.ReasonFinished}, r.owedOrder)
	require.Len(t, r.held[messages.ReasonFinished], 1, "the finish's blocks are still held")
	require.Empty(t, r.held[messages.ReasonPreempted])
}
