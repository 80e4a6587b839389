package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
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
	} {
		var stdout, stderr bytes.Buffer
		require.Equal(t, 2, runDemo(args, &stdout, &stderr), "args %q", args)
		require.NotEmpty(t, stderr.String())
	}
}
