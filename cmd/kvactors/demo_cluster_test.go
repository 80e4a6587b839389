package main

import (
	"bytes"
	"context"
	"testing"

	"github.com/stretchr/testify/require"
)

// `kvactors demo --cluster 3 --quick`: three NATS servers, three nodes,
// cross-node hits, and every remotely loaded byte checked.
func TestClusterDemo(t *testing.T) {
	var out, errb bytes.Buffer
	code := runDemo([]string{"--cluster", "3", "--quick", "--log-level", "off"}, &out, &errb)
	t.Logf("stdout:\n%s\nstderr:\n%s", out.String(), errb.String())
	require.Equal(t, 0, code)
	require.Contains(t, out.String(), "NATS cluster: 3 servers")
	require.Regexp(t, `cross-node: 48 lookups hit on every token, 48 loads, 96 chunks fetched from other nodes`, out.String())
	require.Regexp(t, `integrity: 192 loaded chunks \(12\.0 MiB\), every byte compared .*: OK`, out.String())
	require.Regexp(t, `(?m)^node-3\s+[0-9a-f]{16}\s+2\s+node-3-e1,node-3-e2\s`, out.String())
	require.Equal(t, 2, runDemo([]string{"--cluster", "1"}, &out, &errb))
}

// The cluster demo takes only --quick, --seed and --log-level of the demo's
// flags; any other given with --cluster did nothing, silently (its engines,
// pool and shm dir are its own), so it is a usage error.
func TestClusterDemoRefusesFlagsItIgnores(t *testing.T) {
	for _, args := range [][]string{
		{"--cluster", "3", "--requests", "10"},
		{"--cluster", "3", "--pool-bytes", "1MiB"},
		{"--cluster", "3", "--shm-dir", t.TempDir()},
		{"--cluster", "3", "--trace-file", "spans.json"},
		{"--cluster", "3", "--require-coverage"},
	} {
		var out, errb bytes.Buffer
		_, code := parseDemoFlags(args, &out, &errb)
		require.Equal(t, 2, code, "args %q", args)
		require.Contains(t, errb.String(), "with --cluster", "args %q", args)
	}
	var out, errb bytes.Buffer
	_, code := parseDemoFlags([]string{"--cluster", "3", "--quick", "--seed", "7", "--log-level", "off"}, &out, &errb)
	require.Equal(t, -1, code, errb.String())
}

// A cluster demo stopped by Ctrl-C exits 130, as the single-node demo does
// (docs/OPERATIONS.md's exit codes), not 1 as if a check had failed.
func TestClusterDemoInterrupted(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	var out, errb bytes.Buffer
	code := runDemoCtx(ctx, []string{"--cluster", "2", "--quick", "--log-level", "off"}, &out, &errb)
	require.Equal(t, exitInterrupted, code, "stdout:\n%s\nstderr:\n%s", out.String(), errb.String())
	require.Contains(t, errb.String(), "interrupted")
}
