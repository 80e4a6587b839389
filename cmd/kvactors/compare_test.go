package main

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"testing"

	"github.com/stretchr/testify/require"

	kvbench "github.com/kvactors/kvactors/bench"
)

// The summary's arithmetic: means, medians (odd and even counts), B's
// change from A's mean, and the pairs B won, per metric.
func TestCompareSummary(t *testing.T) {
	run := func(pair int, side string, usPerEvent, p99 float64) compareRun {
		return compareRun{Pair: pair, Side: side, External: &kvbench.External{NodeUSPerEvent: usPerEvent,
			Latency: []kvbench.ExternalLatencyLevel{{LatencyLevel: kvbench.LatencyLevel{Fraction: 0.5, NodeP99MS: p99}}}}}
	}
	c := comparison{Runs: []compareRun{
		run(1, "A", 4, 2), run(1, "B", 3, 3),
		run(2, "A", 3, 2), run(2, "B", 3.5, 1),
		run(3, "A", 5, 2), run(3, "B", 2, 1),
	}}
	c.summarize()
	byName := map[string]compareMetric{}
	for _, m := range c.Metrics {
		byName[m.Name] = m
	}
	ev := byName["node µs/event"]
	require.InDelta(t, 4.0, ev.MeanA, 1e-9)
	require.InDelta(t, 8.5/3, ev.MeanB, 1e-9)
	require.InDelta(t, 4.0, ev.MedianA, 1e-9)
	require.InDelta(t, 3.0, ev.MedianB, 1e-9)
	require.InDelta(t, (8.5/3-4)/4*100, ev.ChangePct, 1e-9)
	require.Equal(t, 2, ev.BLowerInPair, "pairs 1 and 3")
	require.Equal(t, 3, ev.Pairs)
	p99 := byName["node p99 at 50% ms"]
	require.InDelta(t, 2.0, p99.MeanA, 1e-9)
	require.Equal(t, 2, p99.BLowerInPair)
	// The runtime's figures come from the 50% level, and a node without
	// them (0) is no figure.
	rt := func(pair int, side string, mutex float64) compareRun {
		return compareRun{Pair: pair, Side: side, External: &kvbench.External{
			Latency: []kvbench.ExternalLatencyLevel{{LatencyLevel: kvbench.LatencyLevel{Fraction: 0.5}, NodeMutexWaitSeconds: mutex}}}}
	}
	c2 := comparison{Runs: []compareRun{rt(1, "A", 1.2), rt(1, "B", 0.4), rt(2, "A", 0), rt(2, "B", 0.5)}}
	c2.summarize()
	found := false
	for _, m := range c2.Metrics {
		if m.Name == "mutex wait s at 50%" {
			found = true
			require.InDelta(t, 1.2, m.MeanA, 1e-9, "pair 2's A has no figure")
			require.InDelta(t, 0.45, m.MeanB, 1e-9)
			require.Equal(t, 1, m.Pairs)
			require.Equal(t, 1, m.BLowerInPair)
		}
	}
	require.True(t, found, "bench-compare summarizes the 50% level's mutex wait")
	require.InDelta(t, 2.5, median([]float64{4, 1, 3, 2}), 1e-9)
	require.Zero(t, median(nil))

	// A unit cost of 0 is no figure: left out of the mean and of the pairs.
	unit := func(pair int, side string, job float64) compareRun {
		return compareRun{Pair: pair, Side: side, External: &kvbench.External{UnitUSPerJob: job}}
	}
	c = comparison{Runs: []compareRun{unit(1, "A", 2), unit(1, "B", 0), unit(2, "A", 2), unit(2, "B", 4)}}
	c.summarize()
	for _, m := range c.Metrics {
		if m.Name != "unit µs/store job" {
			continue
		}
		require.InDelta(t, 4.0, m.MeanB, 1e-9, "pair 1's B has no figure")
		require.Equal(t, 1, m.Pairs, "only pair 2 has both")
		require.Zero(t, m.BLowerInPair)
		return
	}
	t.Fatal("no unit job metric")
}

// bench-compare runs its pairs through real children and prints both
// sides; a missing binary is a usage error.
func TestBenchCompareRunsPairs(t *testing.T) {
	shm := t.TempDir()
	cmd := exec.Command(binary, "bench-compare", "--pairs", "1", "--duration", "50ms", "--json", "--shm-dir", shm,
		"--a", binary, "--b", binary)
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	require.NoError(t, err)
	var c comparison
	require.NoError(t, json.Unmarshal(out, &c), "%s", out)
	require.Len(t, c.Runs, 2)
	require.Equal(t, "A", c.Runs[0].Side)
	require.Equal(t, "B", c.Runs[1].Side)
	for _, r := range c.Runs {
		require.Positive(t, r.External.Events)
		require.Positive(t, r.External.NodeUSPerEvent)
		// Both builds' latency levels are paced at the first run's rate.
		require.Equal(t, c.Runs[0].External.EventsPerSec, r.External.LatencyBasePerSec)
		for _, l := range r.External.Latency {
			require.InDelta(t, l.Fraction*c.Runs[0].External.EventsPerSec, l.TargetPerSec, 1e-6*l.TargetPerSec)
		}
	}
	require.Len(t, c.Metrics, len(compareMetrics))

	var stderr bytes.Buffer
	code := run([]string{"bench-compare", "--a", binary, "--b", "/nonexistent/kvactors"}, &bytes.Buffer{}, &stderr)
	require.Equal(t, exitUsage, code, stderr.String())
	code = run([]string{"bench-compare", "--a", binary}, &bytes.Buffer{}, &stderr)
	require.Equal(t, exitUsage, code)
}
