package node_test

import (
	"encoding/json"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/node"
)

// engine.Silenced resets the engine's requests, but not its loads: a load
// taken before the silence and still queued when the engine is heard again
// (here by a heartbeat, the same for a late batch or lookup) passes the
// Hearing gate, which the message just refreshed, and copies into the
// engine's blocks although the engine may have declared the node lost and
// reused them ("nothing of the old epoch is applied or copied again").
// A load taken before an engine's silence, still queued behind another copy
// when the silence ends, never copies after it (the engine may have given
// up on it and reused its destination blocks): its silence generation is
// older.
func TestALoadQueuedBeforeASilenceNeverCopiesAfterIt(t *testing.T) {
	const lease = time.Minute
	start := time.Unix(1_800_000_000, 0)
	var clock atomic.Int64
	clock.Store(start.UnixNano())
	dev := &heldDevice{started: make(chan struct{}, 8), gate: make(chan struct{}, 8)}
	e := startNode(t, func(c *node.Config) {
		c.Lease = lease
		c.Transfer.Workers = 1
		c.WrapDevice = dev.wrap
	}, node.WithClock(func() time.Time { return time.Unix(0, clock.Load()) }))
	t.Cleanup(func() { close(dev.gate) })
	te := e.newEngine("e1", defaultOpts())
	te.register()
	te.send(added("a", 4), hashesEv("a", 0, hash("a", 0)), blocksEv("a", 0, 0, 1), tokensEv("a", 4, 4))
	testkit.Recv(t, dev.started, 5*time.Second, "store copy of a")
	dev.gate <- struct{}{}
	recv(t, te.stored, "stored a")

	// b's store holds the one worker; a load of a's chunk queues behind it.
	te.send(added("b", 4), hashesEv("b", 0, hash("b", 0)), blocksEv("b", 0, 0, 2), tokensEv("b", 4, 4))
	testkit.Recv(t, dev.started, 5*time.Second, "store copy of b")
	loadReply := make(chan *nats.Msg, 1)
	_, err := e.nc.ChanSubscribe("_INBOX.queuedload", loadReply)
	require.NoError(t, err)
	body, _ := json.Marshal(map[string]any{"request": "l", "hashes": []string{hash("a", 0)}, "num_tokens": 4,
		"blocks": [][]int{{9}}})
	require.NoError(t, e.nc.PublishRequest("kvactors.e1.load", "_INBOX.queuedload", body))
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if q := metricValue(t, e.reg, "kvactors_transfer_jobs_queued", nil); q != 1 {
			return fmt.Errorf("%v copies queued", q)
		}
		return nil
	})

	clock.Store(start.Add(lease / 2).UnixNano())                              // nothing heard for lease/2
	te.request("heartbeat", map[string]any{"epoch": te.epoch, "seq": te.seq}) // Silenced: requests reset
	require.Equal(t, 1.0, metricValue(t, e.reg, "kvactors_engine_silences_total", nil))
	dev.gate <- struct{}{} // b ends; the worker takes the load
	testkit.NoRecv(t, dev.started, 300*time.Millisecond, "the load taken before the silence copying after it")
}

// A load request that is itself the first message after lease/2 of
// silence (one sent before the engine declared the node lost, delivered
// late, the case engine.Silenced is there for) is copied at once: heard
// refreshes the Hearing before startLoad, and Silenced resets requests only.
// A load that is itself the message ending an engine's silence may be one
// sent before the engine declared the node lost, delivered late: it is
// refused (answered with the error), and so is every load until the engine
// begins a new epoch.
func TestALoadEndingASilenceIsRefused(t *testing.T) {
	const lease = time.Minute
	start := time.Unix(1_800_000_000, 0)
	var clock atomic.Int64
	clock.Store(start.UnixNano())
	dev := &heldDevice{started: make(chan struct{}, 8), gate: make(chan struct{}, 8)}
	e := startNode(t, func(c *node.Config) {
		c.Lease = lease
		c.Transfer.Workers = 1
		c.WrapDevice = dev.wrap
	}, node.WithClock(func() time.Time { return time.Unix(0, clock.Load()) }))
	t.Cleanup(func() { close(dev.gate) })
	te := e.newEngine("e1", defaultOpts())
	te.register()
	te.send(added("a", 4), hashesEv("a", 0, hash("a", 0)), blocksEv("a", 0, 0, 1), tokensEv("a", 4, 4))
	testkit.Recv(t, dev.started, 5*time.Second, "store copy of a")
	dev.gate <- struct{}{}
	recv(t, te.stored, "stored a")

	clock.Store(start.Add(lease / 2).UnixNano()) // nothing heard for lease/2
	loadReply := make(chan *nats.Msg, 1)
	_, err := e.nc.ChanSubscribe("_INBOX.lateload", loadReply)
	require.NoError(t, err)
	body, _ := json.Marshal(map[string]any{"request": "l", "hashes": []string{hash("a", 0)}, "num_tokens": 4,
		"blocks": [][]int{{9}}})
	require.NoError(t, e.nc.PublishRequest("kvactors.e1.load", "_INBOX.lateload", body))
	m := testkit.Recv(t, loadReply, 5*time.Second, "the load's answer")
	require.Contains(t, string(m.Data), "no load until it begins a new epoch")
	testkit.NoRecv(t, dev.started, 100*time.Millisecond, "a load delivered after lease/2 of silence copying")
}
