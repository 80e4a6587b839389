package node_test

import (
	"fmt"
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
// families are there too) is documented, and every documented one is
// registered: a renamed, new or dropped metric cannot drift from its
// documentation. A plain node's families are docs/OBSERVABILITY.md's; a
// cluster node (one embedded NATS) adds the kvactors_cluster_ ones, which
// are docs/CLUSTER.md's metrics table's (only a cluster node registers
// them, and a family may be listed in both docs).
func TestEveryMetricIsDocumentedAndEveryDocumentedOneExists(t *testing.T) {
	t.Parallel()
	documented := docMetrics(t, "../docs/OBSERVABILITY.md", "## Metrics")
	cluster := docMetrics(t, "../docs/CLUSTER.md", "")
	require.NotEmpty(t, documented)
	require.NotEmpty(t, cluster)
	for _, clustered := range []bool{false, true} {
		t.Run(fmt.Sprint("cluster=", clustered), func(t *testing.T) {
			t.Parallel()
			e := startNode(t, func(c *node.Config) { c.Cluster, c.DiskDir, c.DiskBytes = clustered, t.TempDir(), 1<<20 })
			registered := registeredMetrics(t, e)
			require.Equal(t, clustered, slices.ContainsFunc(registered, func(n string) bool { return strings.HasPrefix(n, "kvactors_cluster_") }),
				"kvactors_cluster_ families registered: %v", registered)
			for _, n := range registered {
				switch {
				case strings.HasPrefix(n, "kvactors_cluster_"):
					require.Contains(t, cluster, n, "registered but not in docs/CLUSTER.md's metrics table")
				case clustered:
					require.True(t, slices.Contains(documented, n) || slices.Contains(cluster, n),
						"registered %s but neither docs/OBSERVABILITY.md's nor docs/CLUSTER.md's tables list it", n)
				default:
					require.Contains(t, documented, n, "registered but not in docs/OBSERVABILITY.md's tables")
				}
			}
			for _, n := range documented {
				if !clustered && slices.Contains(cluster, n) {
					continue // a cluster node's
				}
				require.Contains(t, registered, n, "in docs/OBSERVABILITY.md but not registered")
			}
			if clustered {
				for _, n := range cluster {
					require.Contains(t, registered, n, "in docs/CLUSTER.md but a cluster node does not register it")
				}
			}
		})
	}
}
