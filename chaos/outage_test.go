//go:build chaos

package chaos_test

import (
	"context"
	"fmt"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/sim"
)

// natsOn starts a NATS server (the library) on 127.0.0.1:port (0: any).
func natsOn(t *testing.T, port int) *server.Server {
	t.Helper()
	if port == 0 {
		port = server.RANDOM_PORT
	}
	s, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: port, NoLog: true, NoSigs: true})
	require.NoError(t, err)
	s.Start()
	require.True(t, s.ReadyForConnections(10*time.Second), "NATS server on port %d not ready", port)
	t.Cleanup(func() { s.Shutdown(); s.WaitForShutdown() })
	return s
}

// TestNATSOutage (chaos 2) injects a 5 s outage of the NATS server that
// both a real `kvactors serve` and a simulated engine use, in the middle
// of the engine's traffic, then restarts it on the same port. It proves no
// request is stranded (the run ends: every finished or preempted request
// released exactly once per event), every loss shows up as a resync (the
// engine's epochs after the outage), and the simulator's oracle holds:
// every chunk ready when its request finished, blocks held, is stored or
// present, and every stored chunk loads back byte for byte — what a
// fault-free run guarantees.
//
// With a lease shorter than the outage (the second subtest) both sides
// give up on each other: the node expires the engine, the engine frees
// every owed request as node_lost after the lease, then registers again
// and resyncs; the oracle then excuses only the chunks of requests whose
// release said node_lost.
func TestNATSOutage(t *testing.T) {
	t.Run("lease 10s", func(t *testing.T) { natsOutage(t, 10*time.Second) })
	t.Run("lease 2s", func(t *testing.T) { natsOutage(t, 2*time.Second) })
}

func natsOutage(t *testing.T, lease time.Duration) {
	outage := 5 * time.Second
	first := natsOn(t, 0)
	url := first.ClientURL()
	port := first.Addr().(*net.TCPAddr).Port
	dir := t.TempDir()
	hello := testkit.Subscribe(t, testkit.Connect(t, first), "kvactors._node.n1.hello")
	node := serve(t, "--nats", url, "--node-id", "n1", "--shm-dir", dir, "--pool-bytes", "256M", "--log-level", "error",
		"--lease", lease.String(), "--http", "127.0.0.1:0")
	testkit.Recv(t, hello, 10*time.Second, "the node's hello")

	nc, err := client.Dial(url, "sim")
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	cfg := sim.DefaultConfig()
	cfg.ShmDir, cfg.Log = dir, quietLog()
	cfg.Requests = 600
	cfg.StallTimeout = 30 * time.Second
	if *long {
		cfg.Requests = 3000
	}
	var done atomic.Int64
	outageStarted := make(chan struct{})
	type restart struct {
		s   *server.Server
		err error
	}
	restarted := make(chan restart, 1)
	cfg.OnRequestDone = func() {
		if done.Add(1) == int64(cfg.Requests/4) {
			close(outageStarted)
		}
	}
	go func() {
		<-outageStarted
		first.Shutdown()
		first.WaitForShutdown()
		<-time.After(outage) // the fault's length, not a wait for an event
		s, err := natsOnNoCleanup(port)
		restarted <- restart{s, err}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	rep, err := sim.Run(ctx, nc, cfg)
	second := testkit.Recv(t, restarted, 30*time.Second, "the restarted NATS server")
	require.NoError(t, second.err)
	t.Cleanup(func() { second.s.Shutdown(); second.s.WaitForShutdown() })
	require.NoError(t, err)
	require.NoError(t, rep.Err())
	require.GreaterOrEqual(t, rep.Resyncs, 1, "the outage must show up as a resync")
	require.Zero(t, rep.Missing+rep.MissingReleases+rep.DuplicateReleases+rep.UnknownReleases+rep.VerifyFailed)
	// Every batch the node dropped belongs to an epoch it asked to resync,
	// for the same reason (the reconnect resync alone does not excuse a
	// batch dropped for a gap or an overflow).
	dropped := node.metricSum(t, "kvactors_dropped_batches_total")
	resyncs := node.metricSum(t, "kvactors_resyncs_total")
	for _, reason := range []string{"gap", "reconnect", "overflow"} {
		sel := `{reason="` + reason + `"}`
		if d := node.metricSum(t, "kvactors_dropped_batches_total"+sel); d > 0 {
			require.Positive(t, node.metricSum(t, "kvactors_resyncs_total"+sel),
				"%v batches dropped for %s without a resync for it", d, reason)
		}
	}
	if lease < outage {
		require.Positive(t, rep.NodeLosses, "a %v outage outlasts a %v lease", outage, lease)
	}
	t.Logf("node: %v batches dropped, %v resyncs published", dropped, resyncs)
	t.Logf("%d requests around a %v NATS outage, lease %v: %d resyncs, %d node losses, %d batches; %d chunks "+
		"ready, %d stored, %d verified, %d excused by node_lost; releases %v (%d unowed resets at the SDK); SDK resyncs by reason %v",
		rep.Requests, outage, lease, rep.Resyncs, rep.NodeLosses, rep.Batches, rep.ChunksReady, rep.ChunksStored,
		rep.VerifyOK, rep.ReadyNodeLost, rep.Releases, rep.UnowedResets, rep.ResyncsBy)
}

// natsOnNoCleanup restarts the server from a goroutine (no t.Cleanup
// there); the test registers its shutdown once it has it.
func natsOnNoCleanup(port int) (*server.Server, error) {
	s, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: port, NoLog: true, NoSigs: true})
	if err != nil {
		return nil, err
	}
	s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		s.Shutdown()
		return nil, fmt.Errorf("restarted NATS server on port %d not ready", port)
	}
	return s, nil
}
