//go:build chaos

package chaos_test

import (
	"context"
	"fmt"
	"os/exec"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/sim"
)

// TestFloodOverCapacity (chaos 3) injects an unpaced flood of event
// batches (about 256 KiB each, 16× --max-pending-bytes in total; 64× with
// -chaos.long) from one engine that never waits. It proves the node's
// resident set never grows past pool + max-pending-bytes + 256 MiB, that
// what it could not take shows up as resyncs to that engine (never a
// silent loss), and that the node then serves a normal simulated engine
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
	srv := testkit.NATSServer(t)
	nc := testkit.Connect(t, srv)
	dir := t.TempDir()
	hello := testkit.Subscribe(t, nc, "kvactors._node.n1.hello")
	node := serve(t, "--nats", srv.ClientURL(), "--lease", "2s", "--node-id", "n1", "--shm-dir", dir,
		"--pool-bytes", fmt.Sprint(poolBytes), "--max-pending-bytes", fmt.Sprint(pendingBytes), "--decode-workers", "1",
		"--slot-bytes", "16384",
		"--log-level", "error")
	resyncs := testkit.Subscribe(t, nc, "kvactors.flood.resync")
	testkit.Recv(t, hello, 10*time.Second, "the node's hello")

	// The flooding engine is a separate process speaking raw NATS: one
	// register, then batches of hashes as fast as its client takes them.
	flood := exec.Command(flooderBin, "--nats", srv.ClientURL(), "--engine", "flood", "--shm-dir", dir,
		"--bytes", fmt.Sprint(total))
	out, err := flood.CombinedOutput()
	require.NoError(t, err, "flooder: %s", out)
	var sent int64
	var secs float64
	_, err = fmt.Sscanf(string(out), "sent %d %f", &sent, &secs)
	require.NoError(t, err, "flooder said %q", out)
	floodTime := time.Duration(secs * float64(time.Second))
	got := 0
	testkit.Eventually(t, 10*time.Second, 10*time.Millisecond, func() error {
		for {
			select {
			case <-resyncs:
				got++
				continue
			default:
			}
			break
		}
		if got == 0 {
			return fmt.Errorf("no resync after %d MiB in %v", sent>>20, floodTime)
		}
		return nil
	})

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

	rss := node.peakRSS(t)
	bound := int64(poolBytes + pendingBytes + 256<<20)
	t.Logf("flood %d MiB in %v (%.0f MiB/s): %d resyncs to the flooding engine; node peak RSS %d MiB (bound %d MiB); "+
		"then a normal engine: %d requests, %d chunks verified", sent>>20, floodTime.Round(time.Millisecond),
		float64(sent)/floodTime.Seconds()/(1<<20), got, rss>>20, bound>>20, rep.Requests, rep.VerifyOK)
	require.Less(t, rss, bound)
}
