package node

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// A node that is shutting down still runs (copies, releases, heartbeats
// until the loops stop): a process starting with its id meanwhile must be
// refused, as PROTOCOL.md "Node identity" says of an overlapping restart.
// Close drains the intake's subscriptions first; the identity answer stays
// until the connection closes.
func TestAClosingNodeStillAnswersTheIdentityProbe(t *testing.T) {
	const lease = 400 * time.Millisecond
	n, nc, _ := startInternal(t, func(c *Config) { c.NodeID, c.Lease = "dup", lease })
	beats := testkit.Subscribe(t, nc, "kvactors._node.dup.heartbeat")
	require.True(t, n.loadWaits.enter(), "work in progress that Close waits for (stands for a copy retireAll waits for)")
	closed := make(chan error, 1)
	go func() { closed <- n.Close(context.Background()) }()
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if n.ready.Load() {
			return context.DeadlineExceeded
		}
		return nil
	})
	// Still heartbeating: engines see it alive.
	var hb messages.NodeHeartbeat
	require.NoError(t, json.Unmarshal(testkit.Recv(t, beats, 5*lease, "a heartbeat while closing").Data, &hb))
	require.Equal(t, n.Boot(), hb.Boot)
	// ... and a starting process with its id is answered: the id is held.
	m, err := nc.Request("kvactors._node.dup.identity", nil, time.Second)
	n.loadWaits.leave()
	require.NoError(t, <-closed)
	require.NoError(t, err, "the identity probe while the node still runs and heartbeats")
	var h messages.Hello
	require.NoError(t, json.Unmarshal(m.Data, &h))
	require.Equal(t, messages.Hello{Node: "dup", Boot: n.Boot(), LeaseMS: lease.Milliseconds()}, h, "answered as the holder")
}
