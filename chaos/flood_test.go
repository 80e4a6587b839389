//go:build chaos

package chaos_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sim"
)

// TestFloodOverCapacity (chaos 3) injects an unpaced flood of event
// batches (about 256 KiB each, 16× --max-pending-bytes in total; 64× with
// -chaos.long) from one engine that never waits, the node paused until
// twice its intake bound has arrived. It proves the node's
// resident set never grows past pool + max-pending-bytes + 256 MiB, that
// what it could not take shows up as overflow resyncs to that engine
// (never a silent loss: every batch it dropped it dropped for an overflow,
// and each overflow resync it counts reaches the engine), and that the
// node then serves a normal simulated engine
// with every check of the simulator's oracle passing.
func TestFloodOverCapacity(t *testing.T) {
	const (
		poolBytes    = 64 << 20
		pendingBytes = 16 << 20
	)
	total := int64(16 * pendingBytes)
	if *long {
		total = 64 * pendingBytes
	}
	srv := floodServer(t, 2*total)
	nc := testkit.Connect(t, srv)
	dir := t.TempDir()
	hello := testkit.Subscribe(t, nc, "kvactors._node.n1.hello")
	node := serve(t, "--nats", srv.ClientURL(), "--lease", "10s", "--node-id", "n1", "--shm-dir", dir,
		"--pool-bytes", fmt.Sprint(poolBytes), "--max-pending-bytes", fmt.Sprint(pendingBytes), "--decode-workers", "1",
		"--slot-bytes", "16384", "--http", "127.0.0.1:0",
		"--log-level", "error")
	resyncs := testkit.Subscribe(t, nc, "kvactors.*.resync") // the flooder's, and the simulated engine's after it
	testkit.Recv(t, hello, 10*time.Second, "the node's hello")

	// The flooding engine is a separate process speaking raw NATS: one
	// register, then batches of hashes as fast as its client takes them.
	// The node is stopped (SIGSTOP) until twice its intake bound has
	// arrived (at most pauseMost), so that the flood comes faster than any
	// node can decode it, whatever this machine's speed or load.
	reg, err := exec.Command(flooderBin, "--nats", srv.ClientURL(), "--engine", "flood", "--shm-dir", dir,
		"--bytes", "0").CombinedOutput()
	require.NoError(t, err, "flooder register: %s", reg)
	flood := exec.Command(flooderBin, "--nats", srv.ClientURL(), "--engine", "flood", "--shm-dir", dir,
		"--register=false", "--bytes", fmt.Sprint(total))
	var floodOut testkit.SyncBuffer
	flood.Stdout, flood.Stderr = &floodOut, &floodOut
	require.NoError(t, node.cmd.Process.Signal(syscall.SIGSTOP))
	inBefore := serverInBytes(t, srv)
	paused := time.Now()
	require.NoError(t, flood.Start())
	floodDone := make(chan error, 1)
	go func() { floodDone <- flood.Wait() }()
	var floodErr error
	finished := false
	// The node stays stopped until twice its intake bound has reached the
	// server for it, or pauseMost passes: a fixed 300 ms let a slow flooder
	// (20–30 MiB/s under two -race suites) send less than the bound, and
	// nothing overflowed.
	tick := time.NewTicker(5 * time.Millisecond)
	for waiting := true; waiting; {
		select {
		case floodErr = <-floodDone:
			finished, waiting = true, false
		case <-tick.C:
			waiting = serverInBytes(t, srv)-inBefore < 2*pendingBytes && time.Since(paused) < pauseMost
		}
	}
	tick.Stop()
	pause, piled := time.Since(paused), serverInBytes(t, srv)-inBefore
	require.NoError(t, node.cmd.Process.Signal(syscall.SIGCONT))
	t.Logf("node stopped for %v, while %d MiB of the flood reached the server", pause.Round(time.Millisecond), piled>>20)
	if !finished {
		floodErr = testkit.Recv(t, floodDone, 2*time.Minute, "the flooder's exit")
	}
	out := []byte(floodOut.String())
	require.NoError(t, floodErr, "flooder: %s", out)
	var sent int64
	var secs float64
	_, err = fmt.Sscanf(string(out), "sent %d %f", &sent, &secs)
	require.NoError(t, err, "flooder said %q", out)
	floodTime := time.Duration(secs * float64(time.Second))
	// What the node could not take it counted as dropped for overflow, and
	// told the engine so: every resync the node published reached the
	// engine, each for an overflow (the node stayed on NATS: no reconnect
	// excuses a drop), and no batch was dropped for another reason.
	reasons := map[string]int{} // engine/reason → resyncs received
	drain := func() {
		for {
			select {
			case m := <-resyncs:
				var rs messages.Resync
				require.NoError(t, json.Unmarshal(m.Data, &rs))
				reasons[strings.Split(m.Subject, ".")[1]+"/"+rs.Reason]++
				continue
			default:
			}
			return
		}
	}
	overflowOnly := func() error {
		drain()
		received := 0
		for k, v := range reasons {
			if !strings.HasSuffix(k, "/"+messages.ResyncOverflow) {
				return fmt.Errorf("resyncs %v: %s is not an overflow", reasons, k)
			}
			received += v
		}
		published := node.metricSum(t, `kvactors_resyncs_total{reason="overflow"}`)
		if all := node.metricSum(t, "kvactors_resyncs_total"); all != published {
			return fmt.Errorf("%v resyncs published, %v of them for an overflow", all, published)
		}
		if float64(received) != published {
			return fmt.Errorf("the node published %v overflow resyncs, the engines received %d (%v)", published, received, reasons)
		}
		dropped := node.metricSum(t, `kvactors_dropped_batches_total{reason="overflow"}`)
		if all := node.metricSum(t, "kvactors_dropped_batches_total"); all != dropped {
			return fmt.Errorf("%v batches dropped, %v of them for an overflow", all, dropped)
		}
		if dropped == 0 || received == 0 {
			return fmt.Errorf("%v batches dropped for an overflow, %d resyncs received, after %d MiB in %v",
				dropped, received, sent>>20, floodTime)
		}
		return nil
	}
	testkit.Eventually(t, 10*time.Second, 10*time.Millisecond, overflowOnly)
	got := reasons["flood/"+messages.ResyncOverflow]
	require.Positive(t, got, "the flooding engine was told to resync: %v", reasons)

	// The node serves a normal engine afterwards.
	enc, err := client.Dial(srv.ClientURL(), "sim")
	require.NoError(t, err)
	t.Cleanup(enc.Close)
	cfg := sim.DefaultConfig()
	cfg.ShmDir, cfg.Log, cfg.Requests = dir, quietLog(), 100
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rep, err := sim.Run(ctx, enc, cfg)
	require.NoError(t, err)
	require.NoError(t, rep.Err())
	// Still: every resync published reached its engine, each for an
	// overflow (the simulated engine's too, should the node still be
	// draining the flood when it starts).
	testkit.Eventually(t, 10*time.Second, 10*time.Millisecond, overflowOnly)

	rss := node.peakRSS(t)
	bound := int64(poolBytes + pendingBytes + 256<<20)
	t.Logf("flood %d MiB in %v (%.0f MiB/s): %d resyncs to the flooding engine %v; node peak RSS %d MiB (bound %d MiB); "+
		"then a normal engine: %d requests, %d chunks verified", sent>>20, floodTime.Round(time.Millisecond),
		float64(sent)/floodTime.Seconds()/(1<<20), got, reasons, rss>>20, bound>>20, rep.Requests, rep.VerifyOK)
	require.Less(t, rss, bound)
}

// pauseMost bounds the flood test's stop of the node: well under lease/2
// (its engine silence) and 3/4 lease (its NATS lapse) of the 10 s lease, so
// the node resumes with its engine and its NATS session both in good
// standing, and every resync it publishes is an overflow's.
const pauseMost = 3 * time.Second

// serverInBytes is what the server has taken from all its clients.
func serverInBytes(t *testing.T, s *server.Server) int64 {
	v, err := s.Varz(nil)
	require.NoError(t, err)
	return v.InBytes
}

// floodServer is testkit.NATSServer without JetStream and with maxPending
// bytes of room for each client: the whole flood. The default (64 MiB)
// is less than the flooder sends in the node's pause, and the server
// would cut the node off as its slow consumer; the node would resync the
// flooder for its reconnect, and its own inbound bound, which this test
// is about, would never be reached.
func floodServer(t *testing.T, maxPending int64) *server.Server {
	t.Helper()
	s, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: server.RANDOM_PORT, MaxPending: maxPending,
		NoLog: true, NoSigs: true})
	require.NoError(t, err)
	t.Cleanup(func() {
		s.Shutdown()
		s.WaitForShutdown()
	})
	s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		t.Fatal("NATS server not ready for connections")
	}
	return s
}
