package deploy_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"

	"github.com/kvactors/kvactors/node"
)

// adminPort is the port of the default admin address: every packaging file
// must use it (probes, EXPOSE, Service, the config files).
func adminPort(t *testing.T) string {
	t.Helper()
	_, port, err := net.SplitHostPort(node.DefaultConfig().HTTPAddr)
	require.NoError(t, err)
	return port
}

// manifests reads every YAML document of the Kubernetes manifests by kind.
func manifests(t *testing.T) map[string]map[string]any {
	t.Helper()
	data, err := os.ReadFile("kubernetes/kvactors.yaml")
	require.NoError(t, err)
	out := map[string]map[string]any{}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	for {
		var doc map[string]any
		err := dec.Decode(&doc)
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err)
		out[doc["kind"].(string)] = doc
	}
	return out
}

// at walks a decoded YAML/JSON tree by map keys and list indexes.
func at(t *testing.T, v any, path ...any) any {
	t.Helper()
	for _, p := range path {
		switch k := p.(type) {
		case string:
			m, ok := v.(map[string]any)
			require.True(t, ok, "want a mapping at %q in %v", k, path)
			v, ok = m[k]
			require.True(t, ok, "no %q in %v", k, path)
		case int:
			l, ok := v.([]any)
			require.True(t, ok && k < len(l), "want a list of > %d at %v", k, path)
			v = l[k]
		}
	}
	return v
}

// checkConfigFile parses a kvactors config file the way serve does: every
// key must be a flag, every value valid, and the admin address must listen
// on the default port beyond loopback.
func checkConfigFile(t *testing.T, path string) node.Config {
	t.Helper()
	var cfg node.Config
	f := cfg.BindFlags(flag.NewFlagSet("serve", flag.ContinueOnError))
	require.NoError(t, f.Parse([]string{"--config", path}), path)
	require.NoError(t, cfg.Validate(), path)
	host, port, err := net.SplitHostPort(cfg.HTTPAddr)
	require.NoError(t, err)
	require.Equal(t, adminPort(t), port, "%s: admin port", path)
	require.NotEqual(t, "127.0.0.1", host, "%s: probes and Prometheus cannot reach loopback", path)
	require.NotEmpty(t, cfg.NATSURL, "%s: a deployment joins an external NATS cluster", path)
	return cfg
}

// The Kubernetes manifests: a DaemonSet on GPU hosts sharing the host's
// /dev/shm (or IPC), probes on /healthz and /readyz at the admin port the
// config sets, non-root, and a Service exposing that port for metrics.
func TestKubernetesManifests(t *testing.T) {
	docs := manifests(t)
	require.Contains(t, docs, "ConfigMap")
	require.Contains(t, docs, "DaemonSet")
	require.Contains(t, docs, "Service")

	cfgFile := filepath.Join(t.TempDir(), "kvactors.yaml")
	require.NoError(t, os.WriteFile(cfgFile, []byte(at(t, docs["ConfigMap"], "data", "kvactors.yaml").(string)), 0o600))
	cfg := checkConfigFile(t, cfgFile)

	pod := at(t, docs["DaemonSet"], "spec", "template", "spec").(map[string]any)
	c := at(t, pod, "containers", 0).(map[string]any)
	args := at(t, c, "args").([]any)
	require.Equal(t, "serve", args[0])
	require.Contains(t, args, "/etc/kvactors/kvactors.yaml")

	// The shared /dev/shm: host IPC, or the host directory mounted at shm-dir.
	shared := pod["hostIPC"] == true
	for _, v := range at(t, pod, "volumes").([]any) {
		if hp, ok := v.(map[string]any)["hostPath"].(map[string]any); ok && hp["path"] == "/dev/shm" {
			for _, m := range at(t, c, "volumeMounts").([]any) {
				if m.(map[string]any)["name"] == v.(map[string]any)["name"] {
					require.Equal(t, cfg.ShmDir, m.(map[string]any)["mountPath"], "segments dir is the mount")
					shared = true
				}
			}
		}
	}
	require.True(t, shared, "kvactors must see the engines' /dev/shm")

	var portName string
	for _, p := range at(t, c, "ports").([]any) {
		pm := p.(map[string]any)
		if pm["containerPort"] == atoi(t, adminPort(t)) {
			portName = pm["name"].(string)
		}
	}
	require.NotEmpty(t, portName, "the container exposes the admin port %s", adminPort(t))
	for probe, path := range map[string]string{"livenessProbe": "/healthz", "readinessProbe": "/readyz",
		"startupProbe": "/readyz"} {
		require.Equal(t, path, at(t, c, probe, "httpGet", "path"), probe)
		require.Contains(t, []any{portName, atoi(t, adminPort(t))}, at(t, c, probe, "httpGet", "port"), probe)
	}
	require.Equal(t, true, at(t, pod, "securityContext", "runAsNonRoot"))
	require.NotEqual(t, 0, at(t, pod, "securityContext", "runAsUser"))

	containerEnvStarts(t, c, cfgFile)

	svcPort := at(t, docs["Service"], "spec", "ports", 0).(map[string]any)
	require.Equal(t, atoi(t, adminPort(t)), svcPort["port"])
	require.Contains(t, []any{portName, atoi(t, adminPort(t))}, svcPort["targetPort"])
	require.Equal(t, at(t, docs["DaemonSet"], "spec", "selector", "matchLabels"), at(t, docs["Service"], "spec", "selector"))
}

// containerEnvStarts sets the container's environment as the kubelet
// would, on a node named as EKS names them (with dots; $(VAR) expanded from
// the entries before it), and checks that serve's settings with it and the
// config file validate: a node id taken from the node name as it is would
// be refused (dots), and every pod would restart for ever.
func containerEnvStarts(t *testing.T, c map[string]any, cfgFile string) {
	t.Helper()
	const nodeName = "ip-10-0-1-23.us-west-2.compute.internal"
	vars := map[string]string{}
	for _, e := range at(t, c, "env").([]any) {
		em := e.(map[string]any)
		name := em["name"].(string)
		v, literal := em["value"].(string)
		switch {
		case literal:
			v = os.Expand(strings.NewReplacer("$(", "${", ")", "}").Replace(v), func(k string) string { return vars[k] })
		case at(t, em, "valueFrom", "fieldRef", "fieldPath") == "spec.nodeName":
			v = nodeName
		default:
			t.Fatalf("env %s: a value the test cannot set", name)
		}
		vars[name] = v
		t.Setenv(name, v)
	}
	var cfg node.Config
	f := cfg.BindFlags(flag.NewFlagSet("serve", flag.ContinueOnError))
	require.NoError(t, f.Parse([]string{"--config", cfgFile}))
	require.NoError(t, cfg.Validate(), "serve with the container's environment on node %s", nodeName)
}

// The systemd unit runs serve with the sample config, does not restart on
// a usage error (exit 2), and the sample config is valid.
func TestSystemdUnit(t *testing.T) {
	unit, err := os.ReadFile("systemd/kvactors.service")
	require.NoError(t, err)
	require.Regexp(t, `(?m)^ExecStart=\S*kvactors serve --config /etc/kvactors/kvactors.yaml$`, string(unit))
	require.Regexp(t, `(?m)^RestartPreventExitStatus=2$`, string(unit))
	require.Regexp(t, `(?m)^User=\w+$`, string(unit))
	require.NotRegexp(t, `(?m)^User=root$`, string(unit))
	// ProtectSystem=strict: the disk tier's directory must be made writable.
	require.Regexp(t, `(?m)^ProtectSystem=strict$`, string(unit))
	require.Regexp(t, `(?m)^#ReadWritePaths=\S+`, string(unit), "a disk-dir line to uncomment")
	checkConfigFile(t, "systemd/kvactors.yaml")
}

// The Dockerfile: multi-stage, static (no cgo), non-root, the admin port
// exposed and served beyond loopback.
func TestDockerfile(t *testing.T) {
	data, err := os.ReadFile("Dockerfile")
	require.NoError(t, err)
	df := string(data)
	require.GreaterOrEqual(t, len(regexp.MustCompile(`(?m)^FROM `).FindAllString(df, -1)), 2, "multi-stage")
	require.Contains(t, df, "CGO_ENABLED=0")
	require.Regexp(t, `(?m)^USER [1-9]\d*`, df)
	require.Regexp(t, `(?m)^EXPOSE `+adminPort(t)+`$`, df)
	require.Contains(t, df, `"--http", "0.0.0.0:`+adminPort(t)+`"`)
	require.Contains(t, df, "/dev/shm")
}

// The Docker build context leaves out no file git tracks: with .git in the
// context, a missing tracked file reads as a change and go build stamps
// the binary "(dirty)" (kvactors version).
func TestDockerignoreKeepsTrackedFiles(t *testing.T) {
	out, err := exec.Command("git", "-C", "..", "ls-files").Output()
	if err != nil {
		t.Skipf("no git checkout: %v", err)
	}
	data, err := os.ReadFile("Dockerfile.dockerignore")
	require.NoError(t, err)
	var patterns []string
	for _, l := range strings.Split(string(data), "\n") {
		if l = strings.TrimSpace(l); l != "" && !strings.HasPrefix(l, "#") {
			require.False(t, strings.HasPrefix(l, "!"), "no exceptions expected: %s", l)
			patterns = append(patterns, strings.TrimPrefix(l, "/"))
		}
	}
	require.NotEmpty(t, patterns)
	// excluded: the path, or a directory above it, matches the pattern
	// (a leading **/ matches at any depth), as the BuildKit filter does.
	excluded := func(path, p string) bool {
		parts := strings.Split(path, "/")
		rest, anyDepth := strings.CutPrefix(p, "**/")
		for end := 1; end <= len(parts); end++ {
			starts := []int{0}
			if anyDepth {
				starts = make([]int, end)
				for i := range starts {
					starts[i] = i
				}
			}
			for _, start := range starts {
				if ok, _ := filepath.Match(rest, strings.Join(parts[start:end], "/")); ok {
					return true
				}
			}
		}
		return false
	}
	for _, path := range strings.Fields(string(out)) {
		for _, p := range patterns {
			require.False(t, excluded(path, p), "Dockerfile.dockerignore's %q leaves out the tracked %s", p, path)
		}
	}
}

// promName matches metric names in PromQL: kvactors' own, the
// vLLM-compatible kv_offload_*, and the Go runtime's and process's.
var promName = regexp.MustCompile(`\b(kvactors_[a-z0-9_]+|kv_offload_[a-z0-9_]+|go_[a-z0-9_]+|process_[a-z0-9_]+)\b`)

// Every metric the Grafana dashboard queries exists on a running node's
// /metrics (a fresh node: labelled counters are preset, so none is missing
// for want of traffic), and every panel has a query and a title.
func TestDashboardQueriesExistingMetrics(t *testing.T) {
	dash := readDashboard(t)

	exported, body := scrapeFreshNode(t)
	var queried []string
	add := func(expr string) { queried = append(queried, promName.FindAllString(expr, -1)...) }
	for _, p := range dash.Panels {
		require.NotEmpty(t, p.Title)
		require.NotEmpty(t, p.Targets, "panel %q has no query", p.Title)
		for _, tg := range p.Targets {
			require.NotEmpty(t, tg.Expr, "panel %q", p.Title)
			add(tg.Expr)
		}
	}
	for _, v := range dash.Templating.List {
		if s, ok := v.Query.(string); ok {
			add(s)
		}
	}
	require.NotEmpty(t, queried)
	for _, name := range queried {
		require.True(t, slices.Contains(exported, name), "the dashboard queries %s, which a node does not export", name)
	}
	// The runnable-wait panel selects the runtime histogram's bucket by its
	// bound: a change in client_golang's bucketing would leave it empty.
	require.Regexp(t, `go_sched_latencies_seconds_bucket\{le="0\.000917[0-9]*"\}`, body,
		"the bucket the dashboard's runnable-wait query selects (le=~\"0.000917.*\")")
	// The panels the operators asked for (issue 15), and the runtime's
	// account of a latency tail (ninth session).
	for _, m := range []string{"kvactors_events_applied_total", "kvactors_store_deferrals_total",
		"kvactors_store_retries_total", "kvactors_pool_bytes", "kv_offload_total_bytes",
		"kvactors_load_hit_tokens_total", "kvactors_engine_resets_total", "kvactors_resyncs_total",
		"kvactors_dropped_batches_total", "kvactors_store_decision_seconds_bucket", "kvactors_disk_bytes",
		"go_sched_latencies_seconds_bucket", "go_cpu_classes_gc_total_cpu_seconds_total", "go_sync_mutex_wait_total_seconds_total"} {
		require.Contains(t, queried, m)
	}
}

// "Nodes up" counts the nodes whose NATS connection is up: 0, not "no
// data", when none is scraped (the only node down leaves no series to sum).
// A sum over no series is empty; "or vector(0)" is 0 only then.
func TestDashboardNodesUpIsZeroWhenNoNodeIs(t *testing.T) {
	dash := readDashboard(t)
	i := slices.IndexFunc(dash.Panels, func(p dashboardPanel) bool { return p.Title == "Nodes up" })
	require.GreaterOrEqual(t, i, 0, "no Nodes up panel")
	require.Len(t, dash.Panels[i].Targets, 1)
	require.Equal(t, `sum(kvactors_nats_connected{instance=~"$instance"}) or vector(0)`, dash.Panels[i].Targets[0].Expr)
}

// dashboard is what the tests read of the Grafana dashboard.
type dashboard struct {
	Title      string           `json:"title"`
	Panels     []dashboardPanel `json:"panels"`
	Templating struct {
		List []struct {
			Query any `json:"query"`
		} `json:"list"`
	} `json:"templating"`
}

type dashboardPanel struct {
	Title   string `json:"title"`
	Targets []struct {
		Expr string `json:"expr"`
	} `json:"targets"`
}

// readDashboard reads the Grafana dashboard, with at least one panel.
func readDashboard(t *testing.T) dashboard {
	t.Helper()
	data, err := os.ReadFile("grafana/kvactors-dashboard.json")
	require.NoError(t, err)
	var dash dashboard
	require.NoError(t, json.Unmarshal(data, &dash))
	require.NotEmpty(t, dash.Panels)
	return dash
}

// scrapeFreshNode starts a node (with a disk tier, whose metrics exist only
// then) and returns the series names on /metrics.
func scrapeFreshNode(t *testing.T) (names []string, body string) {
	t.Helper()
	n, err := node.Start(context.Background(), node.Config{NATSPort: -1, NATSStoreDir: t.TempDir(),
		ShmDir: t.TempDir(), PoolBytes: 1 << 20, HTTPAddr: "127.0.0.1:0", Registry: prometheus.NewRegistry(),
		DiskDir: t.TempDir(), DiskBytes: 1 << 20, Log: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = n.Close(context.Background()) })
	resp, err := http.Get("http://" + n.HTTPAddr() + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	body = string(raw)
	for _, line := range strings.Split(body, "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		name, _, _ := strings.Cut(line, "{")
		name, _, _ = strings.Cut(name, " ")
		names = append(names, name)
	}
	return names, body
}

func atoi(t *testing.T, s string) int {
	t.Helper()
	n, err := strconv.Atoi(s)
	require.NoError(t, err)
	return n
}
