package sim_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/sim"
)

// An event the SDK refused (the scheduler sent what the protocol does not
// allow) fails the run's check, summed across engines like the rest.
func TestRefusedEventsFailTheCheck(t *testing.T) {
	var total sim.Report
	total.Add(sim.Report{Engine: "a"})
	require.NoError(t, total.Err())
	total.Add(sim.Report{Engine: "b", RefusedEvents: 2})
	require.Equal(t, 2, total.RefusedEvents)
	require.ErrorIs(t, total.Err(), sim.ErrCheck)
	require.ErrorContains(t, total.Err(), "2 events the SDK refused")
}
