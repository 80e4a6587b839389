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
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
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
// offers for both.
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
	}{
		{[]string{"NATS_TOKEN=s3cret"}, 0},
		{[]string{"NATS_TOKEN=wrong"}, 1},
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
