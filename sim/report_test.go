package sim_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/sim"
)

// An event the SDK refused (the scheduler sent what the protocol does not
// allow), or a release it could not match to an owed one, fails the run's
// check, summed across engines like the rest; an unowed reset (the
// protocol explains it) does not.
func TestRefusedEventsAndUnexpectedReleasesFailTheCheck(t *testing.T) {
	var total sim.Report
	total.Add(sim.Report{Engine: "a", UnowedResets: 3})
	require.NoError(t, total.Err())
	total.Add(sim.Report{Engine: "b", RefusedEvents: 2})
	require.Equal(t, 2, total.RefusedEvents)
	require.ErrorIs(t, total.Err(), sim.ErrCheck)
	require.ErrorContains(t, total.Err(), "2 events the SDK refused")

	total = sim.Report{}
	total.Add(sim.Report{Engine: "a", UnexpectedReleases: 1, UnowedResets: 2})
	total.Add(sim.Report{Engine: "b", UnexpectedReleases: 1})
	require.Equal(t, 2, total.UnexpectedReleases)
	require.Equal(t, 2, total.UnowedResets)
	require.ErrorIs(t, total.Err(), sim.ErrCheck)
	require.ErrorContains(t, total.Err(), "2 releases the SDK could not match")
}

// TestSummaryOfABrokenRunGivesNoVerdict: a run that an error ended before
// its final check finished (here the node goes away as the check starts)
// has checked nothing, so the summary must not print "integrity OK" over
// it, as it does not for an interrupted run.
func TestSummaryOfABrokenRunGivesNoVerdict(t *testing.T) {
	nc, dir, n := startNode(t, 64<<20)
	cfg := smallConfig("e1", dir)
	cfg.Requests = 10
	cfg.RequestTimeout = 500 * time.Millisecond
	cfg.BeforeCheck = func() { _ = n.Close(context.Background()) }
	rep, err := sim.Run(runCtx(t), engineConn(t, nc, cfg.Engine), cfg)
	require.Error(t, err)
	require.False(t, rep.Interrupted)
	require.True(t, rep.CheckSkipped)

	var out strings.Builder
	sim.WriteSummary(&out, []sim.Report{rep}, sim.NodeStats{}, rep.Serving)
	require.Contains(t, out.String(), "not checked: the run broke off")
	require.NotContains(t, out.String(), "OK")
}
