//go:build chaos

package main

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// A burst of 100,000 requests (~45 MiB of batches) into a node whose intake
// budget is 32 MiB: the node drops what does not fit and tells the engines
// to resync; the SDK engines re-announce their live requests, and every
// request is still stored and released exactly once, within the memory
// bound (runBurst checks the goals: pool + 256 MiB for issue 14's 40k
// requests, plus its 1.5 KB heap per live request for the 60k more here).
func TestBenchBurstPastTheIntakeBudget(t *testing.T) {
	b := runBurst(t, 100_000, "--external-burst-budget", "33554432")
	require.Positive(t, b.Overflow, "the node dropped batches past its budget and asked for resyncs")
	require.Positive(t, b.Resyncs["resync"], "the engines resynced on the node's word")
}
