package sim

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
)

// The SDK counters a run's check judges reach the report: a release the SDK
// could not match, or an event it refused, fails the check; an unowed reset
// (the protocol explains it) is shown and passes.
func TestTheSDKsCountersReachTheCheck(t *testing.T) {
	var r Report
	r.takeSDKStats(client.Stats{UnowedResets: 2, Resyncs: map[string]int{client.ResyncReconnect: 1, client.ResyncLostRelease: 2}})
	require.NoError(t, r.Err())
	require.Equal(t, 2, r.UnowedResets)
	require.Equal(t, 3, r.Resyncs)

	r = Report{Engine: "e1"}
	r.takeSDKStats(client.Stats{UnexpectedRel: 1})
	require.ErrorIs(t, r.Err(), ErrCheck)
	require.ErrorContains(t, r.Err(), "engine e1: 1 releases the SDK could not match")

	r = Report{Engine: "e1"}
	r.takeSDKStats(client.Stats{BadHashes: 1, OutOfRange: 1})
	require.ErrorContains(t, r.Err(), "engine e1: 2 events the SDK refused")
}
