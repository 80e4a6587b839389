//go:build chaos

package chaos_test

import (
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// TestShutdownTimeoutWithReleasesInFlight (chaos 5) injects a SIGINT while
// 500 just-finished requests are queued or being copied by a node with one
// copy worker and a --shutdown-timeout far too short for them. It proves
// the node exits non-zero and logs how many releases it left undelivered,
// and that nothing is lost silently: the engine gets exactly one release
// per request, from the node or as node_lost no later than lease + 1 s
// after the exit, and the node_lost ones are exactly those the node
// counted (plus any it logged as unconfirmed when its final flush failed).
//
// Copies are fast, so the node is stopped (SIGSTOP, well under lease/2)
// while the engine publishes, and gets SIGINT as soon as a heartbeat shows
// it applied every batch. If it still finished everything before the signal landed
// (exit 0, every release from the node), nothing was in flight: the fault
// was not injected and the attempt is repeated, at most three times.
func TestShutdownTimeoutWithReleasesInFlight(t *testing.T) {
	for attempt := 1; ; attempt++ {
		res := shutdownOnce(t)
		t.Logf("attempt %d: exit %d, node logged %d undelivered, %d unconfirmed, %d unapplied messages; engine: %d "+
			"released by the node, %d node_lost, all within %v of the exit; resyncs %v, stale releases %d", attempt,
			res.code, res.undelivered, res.unconfirmed, res.unapplied, res.requests-res.nodeLost, res.nodeLost, res.freed.Round(time.Millisecond), res.st.Resyncs,
			res.st.StaleReleases)
		if res.code == 0 && res.nodeLost == 0 && attempt < 3 {
			continue // the node was done before the signal: nothing was in flight
		}
		require.NotZero(t, res.code, "a shutdown that timed out with releases owed must fail; output:\n%s", res.out)
		require.Contains(t, res.out, "shutdown timed out with releases undelivered")
		// The node's count is exact: a release it counted as undelivered
		// never reaches the engine, and every other one does, unless the
		// final flush failed (unconfirmed_releases=M): so the engine frees
		// between N and N+M as node_lost, never more (no silent loss). Every
		// batch was applied before the signal, so messages the node dropped
		// unread (unapplied_messages) announce no request.
		require.GreaterOrEqual(t, res.undelivered, 0, "the node must log undelivered_releases=N")
		require.GreaterOrEqual(t, res.nodeLost, res.undelivered)
		require.LessOrEqual(t, res.nodeLost, res.undelivered+res.unconfirmed)
		return
	}
}

type shutdownResult struct {
	code, requests, nodeLost, undelivered, unconfirmed, unapplied int
	st                                                            client.Stats
	freed                                                         time.Duration
	out                                                           string
}

func shutdownOnce(t *testing.T) shutdownResult {
	const lease = 4 * time.Second
	res := shutdownResult{requests: 500, undelivered: -1}
	srv := testkit.NATSServer(t)
	nc := engineConn(t, srv.ClientURL(), "e1")
	dir := t.TempDir()
	node := serve(t, "--nats", srv.ClientURL(), "--lease", lease.String(), "--node-id", "n1", "--shm-dir", dir,
		"--pool-bytes", "320M", "--copy-workers", "1", "--shutdown-timeout", "1ms")
	r := newRig(t, nc, dir, "e1", res.requests, 2, 256<<10) // 256 MiB to copy: it takes a while
	for i := range res.requests {
		r.fill(i)
	}
	require.NoError(t, node.cmd.Process.Signal(syscall.SIGSTOP))
	for i := range res.requests {
		r.announce(i)
		r.finish(i)
		if i%50 == 49 {
			r.flush()
		}
	}
	r.flush()
	require.NoError(t, nc.Flush())
	require.NoError(t, node.cmd.Process.Signal(syscall.SIGCONT))
	// SIGINT once the node has applied every batch: the 500 finished
	// events are in its hands, their copies queued or running. A heartbeat
	// with seq 0 reads `applied` without claiming a lost tail.
	epoch, last := r.c.Epoch(), r.c.Stats().Seq
	hb, err := json.Marshal(messages.HeartbeatRequest{Epoch: epoch})
	require.NoError(t, err)
	testkit.Eventually(t, 10*time.Second, time.Millisecond, func() error {
		m, err := nc.Request("kvactors.e1.heartbeat", hb, time.Second)
		if err != nil {
			return err
		}
		var rep messages.HeartbeatReply
		if err := json.Unmarshal(m.Data, &rep); err != nil {
			return err
		}
		if rep.Applied < last {
			return fmt.Errorf("node applied %d of %d batches", rep.Applied, last)
		}
		return nil
	})
	require.NoError(t, node.cmd.Process.Signal(os.Interrupt))
	res.code = node.exitCode(t, 30*time.Second)
	exited := time.Now()

	testkit.Eventually(t, lease+time.Second, 10*time.Millisecond, func() error {
		if n := r.released(0, res.requests); n < res.requests {
			return fmt.Errorf("%d of %d requests released", n, res.requests)
		}
		return nil
	})
	res.freed = time.Since(exited)
	for i := range res.requests {
		if r.releasesOf(i)[0].Reason == messages.ReasonNodeLost {
			res.nodeLost++
		}
	}
	res.out = node.out.String()
	res.st = r.c.Stats()
	if m := regexp.MustCompile(`undelivered_releases=(\d+)`).FindStringSubmatch(res.out); m != nil {
		res.undelivered, _ = strconv.Atoi(m[1])
	}
	if m := regexp.MustCompile(`unconfirmed_releases=(\d+)`).FindStringSubmatch(res.out); m != nil {
		res.unconfirmed, _ = strconv.Atoi(m[1])
	}
	if m := regexp.MustCompile(`unapplied_messages=(\d+)`).FindStringSubmatch(res.out); m != nil {
		res.unapplied, _ = strconv.Atoi(m[1])
	}
	return res
}
