package main

import (
	"bytes"
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
