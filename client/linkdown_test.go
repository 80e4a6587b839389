package client_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// A resync whose batch the NATS client refused (the link is down) is not
// tried again at every Flush: each try would start another epoch and
// re-announce every live request on the engine's step, only to fail again
// (a 5 s NATS outage counted 2,169 resyncs in chaos.TestNATSOutage). It
// waits until the connection is up again, holding the steps flushed
// meanwhile (the resync re-announces them), and then runs once.
func TestAResyncWaitsForTheLinkInsteadOfRetryingAtEveryFlush(t *testing.T) {
	t.Parallel()
	const lease = 4 * time.Second // the node is not lost while the link is down: only the resync is due
	s := testkit.NATSServer(t)
	nc := testkit.Connect(t, s)
	f := startFakeNode(t, nc, "n1", "boot1", lease)
	l := testkit.NewLink(t, s.Addr().String())
	enc := dial(t, "nats://"+l.Addr, "e1")
	c := connect(t, enc, client.Config{Engine: "e1", Spec: spec(), OnReleased: newReleases().on})
	c.Added("r1", 64)
	c.Blocks("r1", 0, 0, []uint32{1, 2, 3, 4})
	require.NoError(t, c.Flush())
	old := c.Epoch()

	l.Cut()
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if !enc.IsReconnecting() {
			return fmt.Errorf("status %v", enc.Status())
		}
		return nil
	})
	const steps = 20
	for i := range steps {
		c.Tokens("r1", i+1, 64) // a step of prefill
		require.NoError(t, c.Flush())
	}
	st := c.Stats()
	require.Zero(t, st.NodeLosses, "the node was lost while the link was down: the test needs a longer lease")
	require.Equal(t, 1, st.PublishErrors, "the first step's batch refused, no resync batch tried after it")
	require.Equal(t, steps-1, st.HeldBatches, "the steps after it held for the resync")
	require.Empty(t, st.Resyncs, "no resync started while the link was down")

	l.Restore()
	testkit.Eventually(t, 10*time.Second, 5*time.Millisecond, func() error {
		epoch := c.Epoch()
		if epoch == old {
			return fmt.Errorf("no new epoch yet: %+v", c.Stats())
		}
		for _, ev := range f.events(epoch) {
			if ev.Request == "r1" && ev.Type == messages.EvTokens && ev.Computed == steps {
				return nil
			}
		}
		return fmt.Errorf("the node has not applied r1's re-announcement (its tokens through the outage) in epoch %s",
			epoch)
	})
	require.Equal(t, map[string]int{client.ResyncPublishError: 1}, c.Stats().Resyncs,
		"one resync, once the link was back")
}

// An overflow resync whose wait ends while the link is down waits for the
// link too, without the session loop waking every millisecond for it:
// it did, each wake-up trying a heartbeat that could not be sent, until
// the link came back or the node was lost.
func TestAnOverflowWaitEndingWhileTheLinkIsDownDoesNotSpinTheSessionLoop(t *testing.T) {
	t.Parallel()
	const lease = 8 * time.Second // heartbeats every 2 s; the node is not lost while the link is down
	s := testkit.NATSServer(t)
	nc := testkit.Connect(t, s)
	f := startFakeNode(t, nc, "n1", "boot1", lease)
	l := testkit.NewLink(t, s.Addr().String())
	enc := dial(t, "nats://"+l.Addr, "e1")
	c := connect(t, enc, client.Config{Engine: "e1", Spec: spec(), OnReleased: newReleases().on,
		OverflowBackoff: 400 * time.Millisecond,
		RequestTimeout:  100 * time.Millisecond}) // a heartbeat cut off waits no longer for its reply
	c.Added("r1", 64)
	require.NoError(t, c.Flush())
	old := c.Epoch()
	f.awaitApplied(t, old, 1)

	f.overflow("e1")
	step := 0
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		step++
		c.Tokens("r1", step, 64)
		require.NoError(t, c.Flush())
		if c.Stats().HeldBatches == 0 {
			return fmt.Errorf("the overflow resync has not reached the engine")
		}
		return nil
	})
	l.Cut() // within the overflow's wait (200–400 ms)
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if !enc.IsReconnecting() {
			return fmt.Errorf("status %v", enc.Status())
		}
		return nil
	})
	heartbeats := make(chan struct{}, 4096)
	client.SetBeforeHeartbeat(c, func() {
		select {
		case heartbeats <- struct{}{}:
		default:
		}
	})
	// 1.5 s with the link down: the wait ends in it; a heartbeat period is 2 s.
	window := time.After(1500 * time.Millisecond)
	tries := 0
	for waiting := true; waiting; {
		select {
		case <-heartbeats:
			tries++
		case <-window:
			waiting = false
		}
	}
	require.LessOrEqual(t, tries, 2, "heartbeats tried in 1.5 s with the link down after an overflow's wait")
	require.Empty(t, c.Stats().Resyncs, "no resync started while the link was down")

	l.Restore()
	testkit.Eventually(t, 10*time.Second, 5*time.Millisecond, func() error {
		if c.Epoch() == old {
			return fmt.Errorf("no new epoch yet: %+v", c.Stats())
		}
		return nil
	})
	require.Equal(t, map[string]int{client.ResyncNode: 1}, c.Stats().Resyncs, "one resync, once the link was back")
}
