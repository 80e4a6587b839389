package node_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/node"
)

// Two processes must never share a node id (PROTOCOL.md "Node identity"):
// a node started with the id of one running on the same NATS refuses to
// start, naming the running one's boot; one started beside it anyway (the
// probe skipped, as two starting at the same moment would both pass it) is
// heard by its hello and heartbeats: counted, and the running node's
// /readyz fails until a lease after the last one. Once the first is gone,
// its id starts again at once.
func TestANodeIDServedByARunningProcessIsRefused(t *testing.T) {
	s := testkit.NATSServer(t)
	const lease = 400 * time.Millisecond
	shared := func(id string) func(*node.Config) {
		return func(c *node.Config) { c.NATSURL, c.NodeID, c.Lease = s.ClientURL(), id, lease }
	}
	a := startNode(t, shared("dup"))

	cfg := node.Config{NATSURL: s.ClientURL(), NodeID: "dup", Lease: lease, HTTPAddr: "off", ShmDir: t.TempDir(),
		PoolBytes: 1 << 20}
	_, err := node.Start(context.Background(), cfg)
	require.ErrorIs(t, err, node.ErrNodeIDInUse)
	require.Contains(t, err.Error(), a.node.Boot(), "the refusal names the running boot")
	require.NoError(t, a.node.Ready(), "a refused start is no conflict for the running node")
	require.Zero(t, a.counter("kvactors_node_id_conflicts_total", ""))

	other := startNode(t, shared("other")) // another id on the same NATS starts
	require.NoError(t, other.node.Ready())

	b := startNode(t, shared("dup"), func(c *node.Config) { c.SkipNodeIDCheck = true })
	for _, e := range []*env{a, b} { // each hears the other's hello or heartbeat
		testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
			err := e.node.Ready()
			if err == nil || !strings.Contains(err.Error(), "also in use") {
				return fmt.Errorf("ready: %v", err)
			}
			return nil
		})
		require.Positive(t, e.counter("kvactors_node_id_conflicts_total", ""))
	}
	require.NoError(t, other.node.Ready(), "another id hears nothing of it")

	require.NoError(t, b.node.Close(context.Background()))
	testkit.Eventually(t, 5*lease, 10*time.Millisecond, a.node.Ready) // a lease after the last heartbeat

	require.NoError(t, a.node.Close(context.Background()))
	c := startNode(t, shared("dup")) // the id is free again: no wait
	require.NoError(t, c.node.Ready())
}

// A subscriber on the id's identity subject that never answers (a stuck
// process holding it) is asked again, then refuses the start as one that
// answers but not as a node does; neither is taken for a free id.
func TestANodeIDHeldBySilentOrStrangeSubscriberIsRefused(t *testing.T) {
	s, nc := testkit.NATS(t)
	const lease = 400 * time.Millisecond
	start := func() error {
		_, err := node.Start(context.Background(), node.Config{NATSURL: s.ClientURL(), NodeID: "held", Lease: lease,
			HTTPAddr: "off", ShmDir: t.TempDir(), PoolBytes: 1 << 20})
		return err
	}
	asked := make(chan struct{}, 16)
	silent, err := nc.Subscribe("kvactors._node.held.identity", func(*nats.Msg) { asked <- struct{}{} })
	require.NoError(t, err)
	require.NoError(t, nc.Flush())
	err = start()
	require.ErrorIs(t, err, node.ErrNodeIDInUse)
	require.Contains(t, err.Error(), "did not answer")
	require.Len(t, asked, 3, "asked three times")
	require.NoError(t, silent.Unsubscribe())

	_, err = nc.Subscribe("kvactors._node.held.identity", func(m *nats.Msg) { _ = m.Respond([]byte("hello?")) })
	require.NoError(t, err)
	require.NoError(t, nc.Flush())
	err = start()
	require.ErrorIs(t, err, node.ErrNodeIDInUse)
	require.Contains(t, err.Error(), "not as a node")
}
