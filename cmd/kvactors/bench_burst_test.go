package main

import (
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	kvbench "github.com/kvactors/kvactors/bench"
)

// runBurst runs `kvactors bench --external-burst` with args and returns
// its report's burst section.
func runBurst(t *testing.T, requests int, args ...string) *kvbench.ExternalBurst {
	t.Helper()
	rep := runBenchJSON(t, append([]string{"--external-burst", strconv.Itoa(requests)}, args...)...)
	require.Nil(t, rep.Throughput, "--external-burst alone runs no in-process phase")
	require.Nil(t, rep.External, "nor the store-heavy external run")
	b := rep.Burst
	require.NotNil(t, b)
	require.Equal(t, requests, b.Requests)
	require.Equal(t, 6*requests, b.Events, "added, hashes, two blocks, tokens, finished per request")
	require.Equal(t, requests, b.Released, "every request released by the SDK")
	require.Zero(t, b.Unexpected, "and none twice")
	require.GreaterOrEqual(t, b.Jobs, requests, "at least one store job per request")
	require.GreaterOrEqual(t, b.Chunks, 8*requests, "every chunk of every request stored (4 per group)")
	require.Zero(t, b.Unstored, "every request had a stored message")
	for _, g := range rep.Goals {
		require.True(t, g.Pass, "goal %s: %v %s (target %s)", g.Name, g.Value, g.Unit, g.Target)
	}
	require.Positive(t, b.NodePeakAnonBytes)
	require.GreaterOrEqual(t, b.NodeMaxRSSBytes, b.NodePeakAnonBytes, "VmHWM holds the anon peak")
	require.LessOrEqual(t, b.DelayP50MS, b.DelayP99MS)
	require.LessOrEqual(t, b.DelayP99MS, b.DelayMaxMS)
	require.Positive(t, b.DelayMaxMS)
	require.GreaterOrEqual(t, b.Seconds, b.PublishSeconds)
	return b
}

// A small burst at the node's default intake budget: everything fits, so
// nothing overflows and nothing is resynced; each chunk is stored once.
func TestBenchExternalBurst(t *testing.T) {
	b := runBurst(t, 2000, "--engines", "2")
	require.Zero(t, b.Overflow, "nothing dropped at the default budget")
	require.Empty(t, b.Resyncs)
	require.Equal(t, 8*2000, b.Chunks, "no chunk stored twice without a resync")
}
