package client

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
)

// A heartbeat that no node was subscribed to (the server answers no
// responders) was taken by nobody: it does not count in last_sent, so a
// dead node's unanswered heartbeats do not postpone the node_lost frees by
// a lease. One a node answers does count.
func TestAHeartbeatNobodyTookDoesNotCountAsSent(t *testing.T) {
	t.Parallel()
	s, node := testkit.NATS(t)
	enc, err := nats.Connect(s.ClientURL(), Options("e1")...)
	require.NoError(t, err)
	t.Cleanup(enc.Close)
	c := &Client{nc: enc, subj: "kvactors.e1.", lease: 4 * time.Second, cfg: Config{Engine: "e1", RequestTimeout: 5 * time.Second}}
	beat := func() {
		c.mu.Lock()
		sub, id, err := c.sendHeartbeatLocked("ep", 0)
		c.mu.Unlock()
		require.NoError(t, err)
		c.heartbeat("ep", 0, 0, sub, id)
	}
	beat()
	require.True(t, c.sent.latest().IsZero(), "a heartbeat nobody took counted as sent (%v)", c.sent.latest())

	_, err = node.Subscribe("kvactors.e1.heartbeat", func(m *nats.Msg) { _ = m.Respond([]byte(`{}`)) })
	require.NoError(t, err)
	require.NoError(t, node.Flush())
	before := time.Now()
	beat()
	require.False(t, c.sent.latest().Before(before), "an answered heartbeat not counted")
}
