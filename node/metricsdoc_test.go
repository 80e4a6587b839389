package node_test

import (
	"fmt"
	"maps"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
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

// docRow is one row of docs/OBSERVABILITY.md's metrics table: the metric
// names of its first cell, its type, and its labels, each with the values
// the row lists (nil: none listed, as for kvactors_build_info's).
type docRow struct {
	names  []string
	typ    string
	labels map[string][]string
}

var (
	docNameRE   = regexp.MustCompile("`((?:kvactors|kv_offload|go)_[a-z0-9_]+)`")
	docLabelRE  = regexp.MustCompile("`([a-z_]+)`(?: = ((?:`[^`]+`(?:, )?)+))?")
	docQuotedRE = regexp.MustCompile("`([^`]+)`")
)

// metricsTable parses docs/OBSERVABILITY.md's metrics table ("| metric |
// type | labels | meaning |"); a row naming no metric in full (the
// kvactors_cluster_* row, docs/CLUSTER.md's) is left out.
func metricsTable() ([]docRow, error) {
	data, err := os.ReadFile("../docs/OBSERVABILITY.md")
	if err != nil {
		return nil, err
	}
	text := string(data)
	i := strings.Index(text, "| metric | type | labels | meaning |")
	if i < 0 {
		return nil, fmt.Errorf("docs/OBSERVABILITY.md has no | metric | type | labels | meaning | table")
	}
	var rows []docRow
	for _, line := range strings.Split(text[i:], "\n")[2:] {
		if !strings.HasPrefix(line, "| ") {
			break
		}
		cells := strings.Split(strings.Trim(line, "| "), "|")
		if len(cells) != 4 {
			return nil, fmt.Errorf("row %q: %d cells, want 4", line, len(cells))
		}
		r := docRow{typ: strings.TrimSpace(cells[1]), labels: map[string][]string{}}
		for _, m := range docNameRE.FindAllStringSubmatch(cells[0], -1) {
			r.names = append(r.names, m[1])
		}
		if len(r.names) == 0 {
			continue
		}
		for _, m := range docLabelRE.FindAllStringSubmatch(cells[2], -1) {
			var values []string
			for _, v := range docQuotedRE.FindAllStringSubmatch(m[2], -1) {
				values = append(values, v[1])
			}
			r.labels[m[1]] = values
		}
		rows = append(rows, r)
	}
	return rows, nil
}

// familyLabels is every label of mf with the values its series take.
func familyLabels(mf *dto.MetricFamily) map[string][]string {
	out := map[string][]string{}
	for _, m := range mf.GetMetric() {
		for _, l := range m.GetLabel() {
			if !slices.Contains(out[l.GetName()], l.GetValue()) {
				out[l.GetName()] = append(out[l.GetName()], l.GetValue())
			}
		}
	}
	return out
}

// Every metric docs/OBSERVABILITY.md's table names exists on a fresh node
// with the documented type and labels, each label with exactly the values
// the row lists (every one exists at 0 from the start); and the reject
// reasons it lists are docs/PROTOCOL.md's rejections table's.
func TestTheMetricsTableGivesEachMetricsTypeAndLabels(t *testing.T) {
	t.Parallel()
	rows, err := metricsTable()
	require.NoError(t, err)
	require.NotEmpty(t, rows)
	e := startNode(t, func(c *node.Config) { c.DiskDir, c.DiskBytes = t.TempDir(), 1<<20 })
	mfs, err := e.reg.Gather()
	require.NoError(t, err)
	families := map[string]*dto.MetricFamily{}
	for _, mf := range mfs {
		families[mf.GetName()] = mf
	}
	for _, r := range rows {
		require.Contains(t, []string{"counter", "gauge", "histogram"}, r.typ, "%v: type", r.names)
		for _, name := range r.names {
			mf := families[name]
			require.NotNil(t, mf, "%s is documented but not exported", name)
			require.Equal(t, r.typ, strings.ToLower(mf.GetType().String()), "%s: type", name)
			got := familyLabels(mf)
			require.ElementsMatch(t, slices.Collect(maps.Keys(r.labels)), slices.Collect(maps.Keys(got)), "%s: label names", name)
			for l, want := range r.labels {
				if want != nil {
					require.ElementsMatch(t, want, got[l], "%s: values of %s", name, l)
				}
			}
		}
	}

	var rejected []string
	for _, r := range rows {
		if slices.Contains(r.names, "kvactors_events_rejected_total") {
			rejected = r.labels["reason"]
		}
	}
	data, err := os.ReadFile("../docs/PROTOCOL.md")
	require.NoError(t, err)
	text := string(data)
	i := strings.Index(text, "Rejections (each counted in `kvactors_events_rejected_total{reason}`")
	require.GreaterOrEqual(t, i, 0, "docs/PROTOCOL.md's rejections table")
	// The table starts at the first row after the paragraph, whatever the
	// paragraph's length; its header and separator rows are skipped.
	lines := strings.Split(text[i:], "\n")
	start := slices.IndexFunc(lines, func(l string) bool { return strings.HasPrefix(l, "|") })
	require.GreaterOrEqual(t, start, 0, "docs/PROTOCOL.md's rejections table has rows")
	var protocol []string
	for _, line := range lines[start+2:] {
		if !strings.HasPrefix(line, "| ") {
			break
		}
		for _, m := range docQuotedRE.FindAllStringSubmatch(strings.Split(line, "|")[2], -1) {
			if !slices.Contains(protocol, m[1]) {
				protocol = append(protocol, m[1])
			}
		}
	}
	require.NotEmpty(t, protocol, "docs/PROTOCOL.md's rejections table lists reasons")
	require.ElementsMatch(t, protocol, rejected, "reject reasons: docs/PROTOCOL.md's table and docs/OBSERVABILITY.md's")
}

// checkDocumentedLabelValues fails t for each series of reg whose label
// value docs/OBSERVABILITY.md's table does not list for its metric: a
// value made on the fly (an engine's string, a reason no one documented)
// shows here once a test has had the node produce it. Every node a test
// starts is checked as it ends (startNode).
func checkDocumentedLabelValues(t *testing.T, reg prometheus.Gatherer) {
	t.Helper()
	rows, err := metricsTable()
	if err != nil {
		t.Error(err)
		return
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Error(err)
		return
	}
	for _, mf := range mfs {
		for _, r := range rows {
			if !slices.Contains(r.names, mf.GetName()) {
				continue
			}
			for l, vs := range familyLabels(mf) {
				for _, v := range vs {
					if want := r.labels[l]; want != nil && !slices.Contains(want, v) {
						t.Errorf("%s{%s=%q}: a value docs/OBSERVABILITY.md does not list", mf.GetName(), l, v)
					}
				}
			}
		}
	}
}
