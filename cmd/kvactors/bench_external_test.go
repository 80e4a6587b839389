package main

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	kvbench "github.com/kvactors/kvactors/bench"
)

// A tiny --external run: the child is started and stopped, every finished
// request is released exactly once over real NATS, and the report's figures
// are the stated quotients of its counts (not a check of speed).
//
// GOGC, which the bench passes on to its child, is low enough that the
// child collects during every latency level: each level must count them.
func TestBenchExternalArithmetic(t *testing.T) {
	t.Setenv("GOGC", "2")
	dir := t.TempDir()
	prof, trace := filepath.Join(dir, "cpu.pprof"), filepath.Join(dir, "l50.trace")
	levelProf := filepath.Join(dir, "l50.pprof")
	rep := runBenchJSON(t, "--external", "--duration", "50ms", "--engines", "2",
		"--external-cpuprofile", prof, "--external-trace", trace, "--external-level-cpuprofile", levelProf,
		"--external-procs", "1")
	// The child's profiles and trace came back whole: gzipped profiles, and
	// an execution trace with its header.
	for _, p := range []string{prof, levelProf} {
		b, err := os.ReadFile(p)
		require.NoError(t, err)
		require.True(t, bytes.HasPrefix(b, []byte{0x1f, 0x8b}), "a gzipped pprof profile: %s", p)
	}
	b, err := os.ReadFile(trace)
	require.NoError(t, err)
	require.Regexp(t, `^go 1\.\d+ trace\x00`, string(b[:min(len(b), 16)]))
	require.Greater(t, len(b), 1000, "the trace holds events")
	// Profiles of the --external run need one.
	var stderr bytes.Buffer
	code := run([]string{"bench", "--external-trace", filepath.Join(dir, "x.trace")}, &bytes.Buffer{}, &stderr)
	require.Equal(t, exitUsage, code, stderr.String())
	require.Contains(t, stderr.String(), "add --external")
	require.Nil(t, rep.Throughput, "--external alone runs no in-process phase")
	e := rep.External
	require.NotNil(t, e)
	require.Equal(t, 1, e.NodeProcs, "the child ran with the GOMAXPROCS asked for, as its /metrics says")
	require.Positive(t, e.Events)
	require.Positive(t, e.Finishes)
	require.Equal(t, e.Finishes, e.Requests, "one released per finished event, no more")
	require.Positive(t, e.StoreJobs)
	require.GreaterOrEqual(t, e.StoredChunks, e.StoreJobs, "a stored message names at least one chunk")
	require.Positive(t, e.Seconds)
	require.InDelta(t, float64(e.Events)/e.Seconds, e.EventsPerSec, 1e-6*e.EventsPerSec)
	require.InDelta(t, float64(e.Events)/float64(e.Requests), e.EventsPerReq, 1e-9)
	require.Positive(t, e.NodeCPUSeconds, "the child's CPU time was read")
	require.InDelta(t, e.NodeCPUSeconds*1e6/float64(e.Events), e.NodeUSPerEvent, 1e-9)
	require.InDelta(t, e.NodeCPUSeconds*1e6/float64(e.StoredChunks), e.NodeUSPerChunk, 1e-9)
	require.InDelta(t, e.NodeCPUSeconds*1e6/float64(e.StoreJobs), e.NodeUSPerJob, 1e-9)
	require.Positive(t, e.NoStoreEvents)
	require.InDelta(t, e.NoStoreCPUSeconds*1e6/float64(e.NoStoreEvents), e.NoStoreUSPerEvent, 1e-9)
	require.InDelta(t, (e.NodeCPUSeconds*1e6-float64(e.Events)*e.NoStoreUSPerEvent)/float64(e.StoredChunks),
		e.StoreUSPerChunk, 1e-6)
	require.Positive(t, e.NarrowEvents)
	require.Positive(t, e.NarrowStoreJobs)
	require.GreaterOrEqual(t, e.NarrowStoredChunks, e.NarrowStoreJobs)
	require.Less(t, float64(e.NarrowStoredChunks)/float64(e.NarrowStoreJobs), float64(e.StoredChunks)/float64(e.StoreJobs),
		"the narrow mix's jobs hold fewer chunks")
	if e.UnitUSPerChunk != 0 || e.UnitUSPerJob != 0 { // solved: both mixes' storing CPU is what the units make
		ns := e.NoStoreUSPerEvent
		for _, m := range []struct {
			cpu                  float64
			events, chunks, jobs int
		}{{e.NodeCPUSeconds, e.Events, e.StoredChunks, e.StoreJobs}, {e.NarrowCPUSeconds, e.NarrowEvents, e.NarrowStoredChunks, e.NarrowStoreJobs}} {
			require.InDelta(t, m.cpu*1e6-float64(m.events)*ns, e.UnitUSPerChunk*float64(m.chunks)+e.UnitUSPerJob*float64(m.jobs),
				1e-3*max(1, m.cpu*1e6))
		}
	}
	require.Positive(t, e.RawEvents)
	require.InDelta(t, e.EventsPerSec/e.RawEventsPerSec, e.Ratio, 1e-9)
	require.Positive(t, e.NodeMaxRSSBytes)
	require.Len(t, e.Latency, 2, "latency levels at 25% and 50%")
	for _, l := range e.Latency {
		require.Positive(t, l.Events)
		require.Positive(t, l.Jobs, "%.0f%%: stored messages timed", l.Fraction*100)
		// Every job the level caused is timed on both sides, and only those:
		// the node's count is this level's delta, not the histogram's total.
		require.Equal(t, uint64(l.Jobs), l.NodeJobs, "%.0f%%: jobs timed at the node", l.Fraction*100)
		require.Zero(t, l.Unmatched, "%.0f%%: stored messages not matched to a batch", l.Fraction*100)
		require.Zero(t, l.RejectedOrFailed, "%.0f%%: events rejected", l.Fraction*100)
		require.Equal(t, e.EventsPerSec, e.LatencyBasePerSec, "paced at fractions of the run's own rate")
		require.InDelta(t, l.Fraction*e.EventsPerSec, l.TargetPerSec, 1e-6*e.EventsPerSec)
		require.Positive(t, l.ClientP50MS, "%.0f%%: a stored message takes time", l.Fraction*100)
		require.LessOrEqual(t, l.ClientP50MS, l.ClientP99MS)
		require.LessOrEqual(t, l.ClientP99MS, l.ClientP999MS)
		require.Positive(t, l.NodeP50MS, "%.0f%%: the decision histogram was scraped", l.Fraction*100)
		require.LessOrEqual(t, l.NodeP50MS, l.NodeP99MS)
		require.LessOrEqual(t, l.NodeP99MS, l.NodeP999MS)
		require.LessOrEqual(t, l.NodeQueueWaitP50MS, l.NodeQueueWaitP99MS)
		require.LessOrEqual(t, l.NodeStoredP50MS, l.NodeStoredP99MS)
		require.LessOrEqual(t, l.NodeIntakeWaitP50MS, l.NodeIntakeWaitP99MS)
		require.Positive(t, l.NodeIntakeWaitP99MS, "%.0f%%: the batches' intake waits were scraped", l.Fraction*100)
		require.Positive(t, l.NodeStoredP99MS, "%.0f%%: arrival → stored was scraped", l.Fraction*100)
		require.Positive(t, l.NodeQueueWaitP99MS, "%.0f%%: the jobs' queue waits were scraped", l.Fraction*100)
		require.Positive(t, l.GCCycles, "%.0f%%: the child's collections during the level", l.Fraction*100)
		require.Positive(t, l.NodeGCCPUShare, "%.0f%%: the collections' CPU", l.Fraction*100)
		require.Positive(t, l.NodeRunnableSamples, "%.0f%%: the child's scheduling latencies were scraped", l.Fraction*100)
		require.GreaterOrEqual(t, l.NodeRunnableOver1MS, l.NodeRunnableOver10MS)
		require.LessOrEqual(t, l.NodeRunnableOver1MS, 1.0)
		require.Less(t, l.NodeGCCPUShare, 1.0, "a share of the busy CPU")
		// NodeMutexWaitSeconds may be 0 in a short level: TestLevelReadsTheRuntimeWindow checks its arithmetic.
		require.Positive(t, l.NodeSwitchesPerEvent, "%.0f%%: the child's threads woke", l.Fraction*100)
		require.Positive(t, l.NodeSyscallsPerEvent, "%.0f%%: the child read its connections", l.Fraction*100)
	}
	require.Equal(t, 0.25, e.Latency[0].Fraction)
	require.Equal(t, 0.5, e.Latency[1].Fraction)
	names := map[string]bool{}
	for _, g := range rep.Goals {
		names[g.Name] = true
	}
	require.True(t, names["external: node CPU per event"])
	require.True(t, names["external: node p99 at 50%"])
	require.True(t, names["external: node CPU per event, nothing stored"])
	require.True(t, names["external: storing adds per stored chunk"])
	require.True(t, names["external: storing adds per store job"])
	require.True(t, names["external: client p99 at 50%"])
}

// runBenchJSON runs `kvactors bench --json` with args (the engines' shm in
// a temp dir, this test binary's serve as the child) and decodes its report;
// the engines' segments must be gone after it.
func runBenchJSON(t *testing.T, args ...string) kvbench.Report {
	t.Helper()
	shm := t.TempDir()
	cmd := exec.Command(binary, append([]string{"bench", "--json", "--shm-dir", shm, "--serve-binary", binary}, args...)...)
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	require.NoError(t, err)
	var rep kvbench.Report
	require.NoError(t, json.Unmarshal(out, &rep), "%s", out)
	left, err := os.ReadDir(shm)
	require.NoError(t, err)
	require.Empty(t, left, "the engines' segments are removed")
	return rep
}
