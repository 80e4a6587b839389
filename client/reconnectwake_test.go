package client_test

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// The client notices its own reconnect at once (PROTOCOL.md engine step
// 13), not at its next heartbeat tick: the lease here is 40 s, so a tick
// comes only every 10 s, and the resync and a heartbeat of the new epoch
// must follow the reconnect within a fraction of that. The connection is
// the caller's, with a ReconnectHandler of its own: that handler still runs
// (the client listens to the connection's status, it sets no handler).
func TestOwnReconnectResyncsAtOnceAndLeavesTheCallersHandler(t *testing.T) {
	t.Parallel()
	const lease = 40 * time.Second
	s := testkit.NATSServer(t)
	nc := testkit.Connect(t, s)
	startFakeNode(t, nc, "n1", "boot1", lease)
	beats := testkit.Subscribe(t, nc, "kvactors.e1.heartbeat")
	theirs := make(chan struct{}, 4)
	enc, err := client.Dial(s.ClientURL(), "e1", nats.ReconnectHandler(func(*nats.Conn) { theirs <- struct{}{} }))
	require.NoError(t, err)
	t.Cleanup(enc.Close)
	c := connect(t, enc, client.Config{Engine: "e1", Spec: spec()})
	first := c.Epoch()
	start := time.Now()

	// Dropping the engine's connection from the server's side is a
	// reconnect for the client, with the server (and the node) still up.
	conns, err := s.Connz(nil)
	require.NoError(t, err)
	for _, ci := range conns.Conns {
		if ci.Name == "kvactors-engine-e1" {
			require.NoError(t, s.DisconnectClientByID(ci.Cid))
		}
	}
	testkit.Recv(t, theirs, 5*time.Second, "the caller's own ReconnectHandler")
	const soon = 3 * time.Second // well under a period (lease/4), from the start
	testkit.Eventually(t, soon, 5*time.Millisecond, func() error {
		if c.Epoch() == first || c.Stats().Resyncs[client.ResyncReconnect] != 1 {
			return fmt.Errorf("epoch unchanged or resyncs %v", c.Stats().Resyncs)
		}
		return nil
	})
	for { // the new epoch's heartbeat, past any earlier one
		m := testkit.Recv(t, beats, soon, "a heartbeat of the new epoch right after the reconnect")
		var hb messages.HeartbeatRequest
		require.NoError(t, json.Unmarshal(m.Data, &hb))
		if hb.Epoch == c.Epoch() {
			break
		}
	}
	require.Less(t, time.Since(start), lease/4, "seen before the first tick could have")
}
