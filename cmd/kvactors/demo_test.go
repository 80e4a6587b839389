package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/sim"
)

// TestDemoQuick runs `kvactors demo --quick` in-process, scaled down, with
// the spans written to a file: every check must pass (exit 0), the summary
// must say so, and the trace file must hold the engines' step spans with
// the node's batch spans under them.
func TestDemoQuick(t *testing.T) {
	traceFile := filepath.Join(t.TempDir(), "spans.json")
	var stdout, stderr bytes.Buffer
	code := runDemo([]string{"--quick", "--requests", "16", "--spread", "300ms", "--step", "2ms",
		"--shm-dir", t.TempDir(), "--pool-bytes", "64MiB", "--log-level", "off", "--trace-file", traceFile},
		&stdout, &stderr)
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
	for _, want := range []string{"requests", "chunks stored", "deduplicated", "deferred", "retried",
		"decision latency", "releases", "integrity          OK"} {
		require.Contains(t, stdout.String(), want)
	}

	f, err := os.Open(traceFile)
	require.NoError(t, err)
	defer f.Close()
	names := map[string]int{}
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var span struct{ Name string }
		require.NoError(t, json.Unmarshal(sc.Bytes(), &span))
		names[span.Name]++
	}
	require.NoError(t, sc.Err())
	require.Positive(t, names["sim.step"])
	require.Positive(t, names["kvactors.batch"])
	require.Positive(t, names["kvactors.store_job"])
}

func TestDemoBadFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--engines", "0"},
		{"--requests", "1", "--engines", "2"},
		{"--step", "0s"},
		{"--no-such-flag"},
		{"extra"},
		{"--pool-bytes", "abc"},
		{"--min-coverage", "2"},
	} {
		var stdout, stderr bytes.Buffer
		require.Equal(t, 2, runDemo(args, &stdout, &stderr), "args %q", args)
		require.NotEmpty(t, stderr.String())
	}
}

// Ctrl-C during the run: the demo stops the engines, prints the summary
// with "not checked" (never "integrity OK" over nothing), leaves the bar
// where it was, and exits 130 with one line saying so.
func TestDemoInterrupted(t *testing.T) {
	cmd := exec.Command(binary, "demo", "--requests", "400", "--spread", "60s", "--shm-dir", t.TempDir(),
		"--pool-bytes", "64MiB")
	var stdout bytes.Buffer
	cmd.Stdout = &stdout
	stderr, err := cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	started := make(chan struct{})
	var errOut bytes.Buffer
	readDone := make(chan struct{})
	go func() {
		defer close(readDone)
		sc := bufio.NewScanner(stderr)
		sc.Split(bufio.ScanRunes) // the bar rewrites one line without newlines
		once := false
		progressed := regexp.MustCompile(`\([1-9]\d*/400\)`)
		for sc.Scan() {
			errOut.Write(sc.Bytes())
			// Interrupt once some requests are done, so the bar has moved.
			if !once && progressed.MatchString(errOut.String()) {
				once = true
				close(started)
			}
		}
	}()
	select {
	case <-started:
	case <-time.After(20 * time.Second):
		t.Fatal("demo did not start")
	}
	require.NoError(t, cmd.Process.Signal(os.Interrupt))
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err = <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("demo did not stop after Ctrl-C")
	}
	select {
	case <-readDone:
	case <-time.After(5 * time.Second):
		t.Fatal("stderr not closed")
	}
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit)
	require.Equal(t, 130, exit.ExitCode(), "stderr:\n%s", errOut.String())
	require.Contains(t, stdout.String(), "not checked: the run was interrupted")
	require.NotContains(t, stdout.String(), "OK:")
	require.NotContains(t, errOut.String(), "100%")
	require.NotContains(t, errOut.String(), "(400/400)")
	require.Regexp(t, `interrupted after [1-9]\d* of 400 requests`, errOut.String())
	require.NotContains(t, errOut.String(), "checking every stored chunk")
	require.Equal(t, 1, strings.Count(errOut.String(), "kvactors demo: interrupted"), errOut.String())
}

// A pool far too small for the run evicts most chunks before the check:
// the summary reports the coverage, and --require-coverage turns it into a
// failure (without it, a warning and exit 0).
func TestDemoLowCoverage(t *testing.T) {
	args := []string{"--quick", "--requests", "16", "--spread", "300ms", "--step", "2ms",
		"--shm-dir", t.TempDir(), "--pool-bytes", "1MiB", "--log-level", "off", "--min-coverage", "1"}
	var stdout, stderr bytes.Buffer
	code := runDemo(args, &stdout, &stderr)
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
	require.Contains(t, stdout.String(), "coverage")
	require.Contains(t, stderr.String(), "warning: integrity coverage")

	stdout.Reset()
	stderr.Reset()
	code = runDemo(append(args, "--require-coverage"), &stdout, &stderr)
	require.Equal(t, 1, code, "stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
	require.Contains(t, stderr.String(), "below --min-coverage")
}

// TestDemoTracingReadsEnvironment: without --otlp or --trace-file the demo
// exports where OTEL_TRACES_EXPORTER says, as docs/OBSERVABILITY.md's
// Jaeger recipe expects; unset, it exports nothing.
func TestDemoTracingReadsEnvironment(t *testing.T) {
	t.Setenv("OTEL_TRACES_EXPORTER", "console")
	tp, shutdown, on, err := demoTracing(t.Context(), demoOptions{}, io.Discard)
	require.NoError(t, err)
	require.True(t, on)
	require.IsType(t, &sdktrace.TracerProvider{}, tp)
	require.NoError(t, shutdown())

	t.Setenv("OTEL_TRACES_EXPORTER", "")
	_, shutdown, on, err = demoTracing(t.Context(), demoOptions{}, io.Discard)
	require.NoError(t, err)
	require.False(t, on)
	require.NoError(t, shutdown())
}

// A run whose check loaded nothing back (every ready chunk excused, e.g.
// its requests released as node_lost) has coverage 0, not "enough": it is
// below --min-coverage, a warning, and with --require-coverage a failure.
func TestDemoCoverageOfNothingIsNotEnough(t *testing.T) {
	reps := []sim.Report{{Engine: "engine-1", ChunksReady: 12, ReadyNodeLost: 12}}
	var stderr bytes.Buffer
	require.Error(t, checkCoverage(reps, demoOptions{minCoverage: 0.5, requireCoverage: true}, &stderr))
	require.NoError(t, checkCoverage(reps, demoOptions{minCoverage: 0.5}, &stderr))
	require.Contains(t, stderr.String(), "warning: integrity coverage")
	require.NoError(t, checkCoverage(reps, demoOptions{minCoverage: 0, requireCoverage: true}, &stderr))
}

// A run that breaks (one engine's register refused: a spec with no GPU
// blocks) leaves the bar where it was, never at 100% with "checking every
// stored chunk", and the failure is the last thing printed; exit 1.
func TestDemoFailedRunStopsTheBar(t *testing.T) {
	o, code := parseDemoFlags([]string{"--quick", "--requests", "16", "--spread", "300ms", "--step", "2ms",
		"--shm-dir", t.TempDir(), "--pool-bytes", "64MiB"}, io.Discard, io.Discard)
	require.Equal(t, -1, code)
	o.engineFault = func(c *sim.Config) {
		if c.Engine == "engine-2" {
			c.SDK = func(cfg *client.Config) { cfg.Spec.NumGPUBlocks = 0 }
		}
	}
	var stdout, stderr bytes.Buffer
	code = demoExit(t.Context(), o, slog.New(slog.DiscardHandler), &stdout, &stderr)
	t.Logf("stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
	require.Equal(t, 1, code)
	require.Contains(t, stdout.String(), "not checked: the run broke off")
	require.Regexp(t, `\([0-8]/16\)`, stderr.String(), "the bar shows engine-1's requests at most")
	require.NotContains(t, stderr.String(), "100%")
	require.NotContains(t, stderr.String(), "(16/16)")
	require.NotContains(t, stderr.String(), "checking every stored chunk")
	lines := strings.Split(strings.TrimRight(stderr.String(), "\n"), "\n")
	require.True(t, strings.HasPrefix(lines[len(lines)-1], "kvactors demo: "), "the failure last: %q", lines[len(lines)-1])
	require.Contains(t, lines[len(lines)-1], "engine-2")
}
