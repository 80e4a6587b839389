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

// registeredMetrics returns the kvactors_ and kv_offload_ metric families
// e's registry gathers. A labelled family is gathered only once it has a
// child: every label value kvactors knows is created at 0 at start
// (docs/OBSERVABILITY.md), so none is missing here; one created lazily
// would be, and its documented name would then fail as not registered.
func registeredMetrics(t *testing.T, e *env) []string {
	t.Helper()
	mfs, err := e.reg.Gather()
	require.NoError(t, err)
	var registered []string
	for _, mf := range mfs {
		if n := mf.GetName(); strings.HasPrefix(n, "kvactors_") || strings.HasPrefix(n, "kv_offload_") {
			registered = append(registered, n)
		}
	}
	return registered
}

// Every metric family a node registers (with a disk tier, so that its
// families are there too) is documented in docs/OBSERVABILITY.md's
// tables, and every one listed there is registered: a renamed or new
// metric cannot drift from its documentation. The cluster's families are
// CLUSTER.md's (registered only on a cluster node, checked by
// TestEveryClusterMetricIsDocumentedAndEveryDocumentedOneExists) and may
// be listed in both.
func TestEveryMetricIsDocumentedAndEveryDocumentedOneExists(t *testing.T) {
	t.Parallel()
	e := startNode(t, func(c *node.Config) { c.DiskDir, c.DiskBytes = t.TempDir(), 1<<20 })
	registered := registeredMetrics(t, e)
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

// A cluster node (one embedded NATS, with a disk tier) registers exactly
// the families the docs list: every kvactors_cluster_ one is in
// docs/CLUSTER.md's metrics table, every other one in docs/OBSERVABILITY.md's
// or CLUSTER.md's, and every one either lists is registered. A cluster
// metric added, renamed or dropped without its doc line fails here; the
// plain node's test cannot see them.
func TestEveryClusterMetricIsDocumentedAndEveryDocumentedOneExists(t *testing.T) {
	t.Parallel()
	e := startNode(t, func(c *node.Config) { c.Cluster, c.DiskDir, c.DiskBytes = true, t.TempDir(), 1<<20 })
	registered := registeredMetrics(t, e)
	documented := docMetrics(t, "../docs/OBSERVABILITY.md", "## Metrics")
	cluster := docMetrics(t, "../docs/CLUSTER.md", "")
	require.NotEmpty(t, cluster)
	require.True(t, slices.ContainsFunc(registered, func(n string) bool { return strings.HasPrefix(n, "kvactors_cluster_") }),
		"a cluster node registers kvactors_cluster_ families: %v", registered)
	for _, n := range registered {
		if strings.HasPrefix(n, "kvactors_cluster_") {
			require.Contains(t, cluster, n, "a cluster node registers it but it is not in docs/CLUSTER.md's metrics table")
			continue
		}
		require.True(t, slices.Contains(documented, n) || slices.Contains(cluster, n),
			"a cluster node registers %s but neither docs/OBSERVABILITY.md's nor docs/CLUSTER.md's tables list it", n)
	}
	for _, n := range cluster {
		require.Contains(t, registered, n, "in docs/CLUSTER.md but a cluster node does not register it")
	}
	for _, n := range documented {
		require.Contains(t, registered, n, "in docs/OBSERVABILITY.md but a cluster node does not register it")
	}
}
