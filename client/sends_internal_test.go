package client

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
)

// TestFreeAtMovesWithALaterPublish: the node_lost frees wait a lease from
// the later of the node's last sign of life and the client's last publish
// that may have left it (one in flight counts; one the NATS client refused
// at once does not).
func TestFreeAtMovesWithALaterPublish(t *testing.T) {
	t.Parallel()
	t0 := time.Now()
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	c := &Client{lease: time.Second, lastSeen: t0}
	require.Equal(t, at(time.Second), c.freeAtLocked(), "no publish yet: from the node's last sign of life")

	c.sent.end(c.sent.begin(at(-time.Millisecond)), nil)
	require.Equal(t, at(time.Second), c.freeAtLocked(), "a publish before the node's last sign of life")

	c.sent.end(c.sent.begin(at(300*time.Millisecond)), nil)
	require.Equal(t, at(1300*time.Millisecond), c.freeAtLocked(), "a later publish moves it")

	id := c.sent.begin(at(500 * time.Millisecond))
	require.Equal(t, at(1500*time.Millisecond), c.freeAtLocked(), "a publish in flight counts")
	c.sent.end(id, nats.ErrReconnectBufExceeded)
	require.Equal(t, at(1300*time.Millisecond), c.freeAtLocked(), "refused at once: nothing left the client")

	c.sent.end(c.sent.begin(at(700*time.Millisecond)), context.DeadlineExceeded)
	require.Equal(t, at(1700*time.Millisecond), c.freeAtLocked(), "a request that timed out was sent")
	c.sent.end(c.sent.begin(at(800*time.Millisecond)), fmt.Errorf("wrapped: %w", nats.ErrNoResponders))
	require.Equal(t, at(1700*time.Millisecond), c.freeAtLocked(), "no responders: no node was subscribed, none took it")

	c.lastSeen = at(2 * time.Second)
	require.Equal(t, at(3*time.Second), c.freeAtLocked(), "a later sign of life moves it too")
}
