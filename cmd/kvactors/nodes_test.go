package main

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/cluster"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// `kvactors nodes` (the real binary) lists every node of a cluster with its
// boot, its engines (reported and owned), its pool usage and the age of its
// last heartbeat.
func TestNodesListsTheCluster(t *testing.T) {
	nc3 := testkit.NATSCluster(t, 3)
	dir := t.TempDir()
	var ns []*node.Node
	for i, id := range []string{"gpu-0", "gpu-1"} {
		n, err := node.Start(context.Background(), node.Config{NATSURL: nc3.URLs(i), NodeID: id, Cluster: true,
			ClusterReplicas: 3, Lease: 3 * time.Second, ShmDir: dir, PoolBytes: 1 << 20, HTTPAddr: node.HTTPOff,
			Registry: prometheus.NewRegistry(), Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
		require.NoError(t, err)
		t.Cleanup(func() { _ = n.Close(context.Background()) })
		ns = append(ns, n)
	}
	spec, _ := engineSpec(t, dir, "e1", "gpu-1")
	enc := nc3.Connect(2, client.Options("e1")...)
	data, _ := json.Marshal(spec)
	// No reply (the cluster's JetStream may still be electing the owners
	// bucket's leader just after it formed) is retried, as an engine does
	// (PROTOCOL.md step 5).
	var m *nats.Msg
	var err error
	for range 3 {
		if m, err = enc.Request("kvactors.e1.register", data, 10*time.Second); err == nil {
			break
		}
	}
	require.NoError(t, err)
	var r messages.RegisterReply
	require.NoError(t, json.Unmarshal(m.Data, &r))
	require.True(t, r.OK, r.Error)
	// A 3 s lease: the owner's claim is renewed within it, however loaded
	// the machine (with 1 s, a claim lapsed under a full parallel test run
	// and the engine showed unowned). The engine stays alive past the lease
	// however slowly the command starts: a heartbeat (seq 0) is a sign of life that changes nothing else.
	// They go out on a ticker, not after each reply, so a slow reply on a
	// loaded machine cannot stretch the gap between two past the lease.
	hb, _ := json.Marshal(messages.HeartbeatRequest{})
	stopBeats := testkit.Every(t, 200*time.Millisecond, func() {
		_ = enc.Publish(messages.EngineSubject("kvactors", "e1", messages.VerbHeartbeat), hb) // no reply needed
	})
	defer stopBeats()

	out, err := exec.Command(binary, "nodes", "--nats", nc3.URL(0), "--wait", "1s").CombinedOutput()
	require.NoError(t, err, string(out))
	t.Logf("kvactors nodes:\n%s", out)
	require.Regexp(t, regexp.MustCompile(`(?m)^gpu-0\s+`+ns[0].Boot()+`\s+0\s+-\s+0\.0MiB/1\.0MiB\s+-\s+[0-9.]+m?s ago$`), string(out))
	require.Regexp(t, regexp.MustCompile(`(?m)^gpu-1\s+`+ns[1].Boot()+`\s+1\s+e1\s+0\.0MiB/1\.0MiB\s+-\s+[0-9.]+m?s ago$`), string(out))
}

// `kvactors nodes` authenticates as serve does: NATS_TOKEN (and
// NATS_USER/NATS_PASSWORD) from the environment, which docs/OPERATIONS.md
// offers for both. No node runs: logged in, it hears no heartbeat (exit 1,
// said so); refused, it says that.
func TestNodesUsesNATSSecretsFromEnv(t *testing.T) {
	// JetStream: without it there is no cluster to list (TestNodesWithoutJetStreamSaysSo).
	s, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: server.RANDOM_PORT, NoLog: true,
		NoSigs: true, Authorization: "s3cret", JetStream: true, StoreDir: t.TempDir()})
	require.NoError(t, err)
	s.Start()
	t.Cleanup(s.Shutdown)
	require.True(t, s.ReadyForConnections(10*time.Second))
	for _, tc := range []struct {
		env  []string
		code int
		says string
	}{
		{[]string{"NATS_TOKEN=s3cret"}, 1, "no node heartbeat heard"},
		{[]string{"NATS_TOKEN=wrong"}, 1, "Authorization Violation"},
	} {
		cmd := exec.Command(binary, "nodes", "--nats", s.ClientURL(), "--wait", "100ms")
		cmd.Env = append(os.Environ(), tc.env...)
		out, err := cmd.CombinedOutput()
		code := 0
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			code = exit.ExitCode()
		}
		require.Equal(t, tc.code, code, "%v: %s", tc.env, out)
		require.Contains(t, string(out), tc.says, tc.env)
	}
}

// `kvactors nodes` against a NATS without JetStream says that is what is
// wrong (no cluster can run there, so there is no registry to list) and
// exits 1, rather than an empty table and a "no responders" aside.
func TestNodesWithoutJetStreamSaysSo(t *testing.T) {
	s, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: server.RANDOM_PORT, NoLog: true, NoSigs: true})
	require.NoError(t, err)
	s.Start()
	t.Cleanup(s.Shutdown)
	require.True(t, s.ReadyForConnections(10*time.Second))
	cmd := exec.Command(binary, "nodes", "--nats", s.ClientURL(), "--wait", "100ms")
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err = cmd.Run()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit, "stdout %s stderr %s", stdout.String(), stderr.String())
	require.Equal(t, 1, exit.ExitCode())
	require.Contains(t, stderr.String(), "has no JetStream")
	require.Contains(t, stderr.String(), "no cluster registry")
	require.Equal(t, 1, strings.Count(stderr.String(), "\n"), stderr.String())
	require.Empty(t, stdout.String(), "no table of no nodes")
}

// `kvactors nodes` listens for as long as the cluster needs, whatever
// --wait says: a heartbeat period of the ownership bucket's lease (lease/4)
// and a fifth of one again. Nodes with a 4 s lease beat every second: with
// --wait 100ms the survey still hears one. Hearing no heartbeat at all is a
// failure (exit 1) said on stderr, not an empty table and exit 0.
func TestNodesWaitsForTheClustersHeartbeatPeriod(t *testing.T) {
	s, nc := testkit.NATS(t)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	const lease = 4 * time.Second
	_, err = cluster.OpenOwners(ctx, js, cluster.Config{Node: "gpu-0", Boot: "b0", Lease: lease}, nil)
	require.NoError(t, err)

	nodes := func() (stdout, stderr string, code int, took time.Duration) {
		cmd := exec.Command(binary, "nodes", "--nats", s.ClientURL(), "--wait", "100ms")
		var out, errOut strings.Builder
		cmd.Stdout, cmd.Stderr = &out, &errOut
		start := time.Now()
		err := cmd.Run()
		took = time.Since(start)
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			code = exit.ExitCode()
		} else {
			require.NoError(t, err)
		}
		return out.String(), errOut.String(), code, took
	}
	stdout, stderr, code, took := nodes()
	require.Equal(t, 1, code, "stdout %s stderr %s", stdout, stderr)
	require.GreaterOrEqual(t, took, lease*3/10, "listened a heartbeat period and more")
	require.Contains(t, stderr, "no node heartbeat heard in 1.2s")
	require.Empty(t, stdout, "no table of no nodes")

	// A node of that lease, beating every lease/4.
	hb, _ := json.Marshal(messages.NodeHeartbeat{Node: "gpu-0", Boot: "b0", LeaseMS: lease.Milliseconds()})
	stopBeats := testkit.Every(t, lease/4, func() {
		_ = nc.Publish(messages.NodeSubject("kvactors", "gpu-0", messages.NodeVerbHeartbeat), hb)
	})
	defer stopBeats()
	stdout, stderr, code, _ = nodes()
	require.Equal(t, 0, code, "stdout %s stderr %s", stdout, stderr)
	require.Regexp(t, regexp.MustCompile(`(?m)^gpu-0\s+b0\s+0\s+`), stdout)
}
