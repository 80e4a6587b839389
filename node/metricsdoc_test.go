package node_test

import (
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/node"
)

// docMetrics returns the metric names a doc's metric tables list (the
// names in backquotes in a row's first cell), below the line that starts
// the metrics part.
func docMetrics(t *testing.T, path, from string) []string {
	t.Helper()
	data, err := os.ReadFile(path)
	require.NoError(t, err)
	text := string(data)
	if from != "" {
		i := strings.Index(text, from)
		require.GreaterOrEqual(t, i, 0, "%s has %q", path, from)
		text = text[i:]
	}
	var names []string
	name := regexp.MustCompile("`((?:kvactors|kv_offload)_[a-z0-9_]+)(?:\\{[a-z_,]*\\})?`")
	for _, row := range regexp.MustCompile("(?m)^\\| (`(?:kvactors|kv_offload)_[^|]*)\\|").FindAllStringSubmatch(text, -1) {
		for _, m := range name.FindAllStringSubmatch(row[1], -1) { // a row may name several
			names = append(names, m[1])
		}
	}
	return names
}

// Every metric family a node registers (with a disk tier, so that its
// families are there too) is documented in docs/OBSERVABILITY.md's
// tables, and every one listed there is registered: a renamed or new
// metric cannot drift from its documentation. The cluster's families are
// CLUSTER.md's (registered only on a cluster node) and may be listed in
// both.
func TestEveryMetricIsDocumentedAndEveryDocumentedOneExists(t *testing.T) {
	t.Parallel()
	e := startNode(t, func(c *node.Config) { c.DiskDir, c.DiskBytes = t.TempDir(), 1<<20 })
	mfs, err := e.reg.Gather()
	require.NoError(t, err)
	var registered []string
	for _, mf := range mfs {
		if n := mf.GetName(); strings.HasPrefix(n, "kvactors_") || strings.HasPrefix(n, "kv_offload_") {
			registered = append(registered, n)
		}
	}
	documented := docMetrics(t, "../docs/OBSERVABILITY.md", "## Metrics")
	cluster := docMetrics(t, "../docs/CLUSTER.md", "")
	require.NotEmpty(t, documented)
	require.NotEmpty(t, cluster)
	for _, n := range registered {
		require.Contains(t, documented, n, "registered but not in docs/OBSERVABILITY.md's tables")
	}
	for _, n := range documented {
		if slices.Contains(cluster, n) {
			continue // a cluster node's
		}
		require.Contains(t, registered, n, "in docs/OBSERVABILITY.md but not registered")
	}
}
