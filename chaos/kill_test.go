//go:build chaos

package chaos_test

import (
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// TestKill9AndRestart (chaos 1) injects a SIGKILL of a real `kvactors
// serve` (its NATS server is the test's, so the engine's connection
// survives) while 200 requests are live: a quarter finished and released,
// a quarter just finished (the node, stopped, never reads them), half
// running with their blocks held. It proves: every finished request is released exactly once, by
// the node (before or after the kill) or as node_lost, no later than
// lease + 1 s after the death; a
// restarted node gets the engine back (register, new epoch) and stores
// every chunk the engine still holds; finishing the running half then
// releases each exactly once.
func TestKill9AndRestart(t *testing.T) {
	const lease = time.Second
	requests := 200
	if *long {
		requests = 1000
	}
	srv := testkit.NATSServer(t)
	nc := engineConn(t, srv.ClientURL(), "e1")
	dir := t.TempDir()
	args := []string{"--nats", srv.ClientURL(), "--lease", lease.String(), "--node-id", "n1", "--shm-dir", dir,
		"--pool-bytes", "64M", "--log-level", "warn"}
	node := serve(t, args...)
	hello := testkit.Subscribe(t, nc, "kvactors._node.n1.hello")
	r := newRig(t, nc, dir, "e1", requests, 4, 4096)
	first := r.c.Stats().Boot
	for i := range requests {
		r.start(i)
		if i%20 == 19 {
			r.flush()
		}
	}
	r.flush()
	// Wait for the node to have stored the running half, so the restart
	// must store it again from the blocks the engine still holds.
	testkit.Eventually(t, 20*time.Second, 50*time.Millisecond, func() error {
		n, err := r.allLoadable(requests/2, requests)
		if err != nil || n < requests/2 {
			return fmt.Errorf("%d of %d running requests stored (%v)", n, requests/2, err)
		}
		return nil
	})
	// The first quarter finishes and is released by the node; the second
	// finishes right before the SIGKILL.
	for i := range requests / 4 {
		r.finish(i)
	}
	r.flush()
	testkit.Eventually(t, 10*time.Second, 10*time.Millisecond, func() error {
		if n := r.released(0, requests/4); n < requests/4 {
			return fmt.Errorf("%d of %d released before the kill", n, requests/4)
		}
		return nil
	})
	// Stopped first, so these finishes are surely never applied: their
	// releases can only come as node_lost.
	require.NoError(t, node.cmd.Process.Signal(syscall.SIGSTOP))
	for i := requests / 4; i < requests/2; i++ {
		r.finish(i)
	}
	r.flush()
	node.kill9(t)
	died := time.Now()

	testkit.Eventually(t, lease+time.Second, 10*time.Millisecond, func() error {
		if n := r.released(0, requests/2); n < requests/2 {
			return fmt.Errorf("%d of %d finished requests released", n, requests/2)
		}
		return nil
	})
	freedAll := time.Since(died)
	nodeLost := 0
	for i := range requests / 2 {
		if r.releasesOf(i)[0].Reason == messages.ReasonNodeLost {
			nodeLost++
		}
	}
	require.Equal(t, requests/4, nodeLost, "the finishes the node never read are freed as node_lost")
	require.Zero(t, r.released(requests/2, requests), "a running request released")

	restarted := time.Now()
	serve(t, args...)
	testkit.Recv(t, hello, 10*time.Second, "the restarted node's hello")
	testkit.Eventually(t, 20*time.Second, 50*time.Millisecond, func() error {
		if st := r.c.Stats(); st.Boot == first || st.Boot == "" {
			return fmt.Errorf("engine still on boot %q", st.Boot)
		}
		n, err := r.allLoadable(requests/2, requests)
		if err != nil || n < requests/2 {
			return fmt.Errorf("%d of %d held requests stored again (%v)", n, requests/2, err)
		}
		return nil
	})
	recovered := time.Since(restarted)

	for i := requests / 2; i < requests; i++ {
		r.finish(i)
	}
	r.flush()
	testkit.Eventually(t, 10*time.Second, 20*time.Millisecond, func() error {
		if n := r.released(requests/2, requests); n < requests/2 {
			return fmt.Errorf("%d of %d released after the restart", n, requests/2)
		}
		return nil
	})
	// A late duplicate would show up within a few node heartbeats.
	for range requests {
		testkit.Recv(t, r.relCh, time.Second, "a release already counted")
	}
	testkit.NoRecv(t, r.relCh, lease, "a release beyond one per request")
	require.Equal(t, requests, r.released(0, requests))
	st := r.c.Stats()
	require.Equal(t, 1, st.NodeLosses)
	t.Logf("requests %d lease %v: finished half freed %v after SIGKILL (%d as node_lost); "+
		"restart to all held chunks stored again: %v; resyncs %v", requests, lease, freedAll.Round(time.Millisecond),
		nodeLost, recovered.Round(time.Millisecond), st.Resyncs)
}
