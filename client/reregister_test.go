package client_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/internal/testkit"
)

// forgetAndRefuse makes f forget the engine (as an expiry does) and refuse
// its registers, and waits until the client has been refused once: a
// re-register is pending.
func forgetAndRefuse(t *testing.T, f *fakeNode, c *client.Client) {
	t.Helper()
	f.mu.Lock()
	f.registered, f.refuse = false, "limit: engine refused: --max-engines 1 reached"
	f.mu.Unlock()
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		if c.Stats().RegisterRefusals == 0 {
			return fmt.Errorf("no refused re-register yet")
		}
		return nil
	})
}

// TestNoLoadIsSentWhileAReregisterIsPending: while the node has forgotten
// the engine, Load sends nothing (ErrNoNode). Sent then, a load could
// follow a register to a new boot of the node and be taken by it once it
// knows the engine, while that register's reply settles the loads
// addressed to the old boot: the engine would reuse blocks being copied
// into.
func TestNoLoadIsSentWhileAReregisterIsPending(t *testing.T) {
	s, nc := testkit.NATS(t)
	f1 := startFakeNode(t, nc, "n1", "boot1", 2*time.Second)
	enc := dial(t, s.ClientURL(), "e1")
	c := connect(t, enc, client.Config{Engine: "e1", Spec: spec(), RequestTimeout: 5 * time.Second})
	forgetAndRefuse(t, f1, c)
	f1.kill() // boot2 starts (mute: no hello) and holds the next register
	regs := make(chan *nats.Msg, 16)
	rs, err := nc.Subscribe("kvactors.e1.register", func(m *nats.Msg) { regs <- m })
	require.NoError(t, err)
	defer func() { _ = rs.Unsubscribe() }()
	loads := testkit.Subscribe(t, nc, "kvactors.e1.load")
	reg := testkit.Recv(t, regs, 5*time.Second, "the re-register reaching boot2")

	_, err = c.Load(context.Background(), "l", []string{"aa"}, 4, [][]int64{{9}})
	require.ErrorIs(t, err, client.ErrNoNode)
	require.NotErrorIs(t, err, client.ErrLoadInDoubt)
	// Published on the engine's connection after Load returned, the marker
	// comes after anything Load sent.
	require.NoError(t, enc.Publish("kvactors.e1.load", []byte("marker")))
	require.Equal(t, "marker", string(testkit.Recv(t, loads, 5*time.Second, "the marker").Data),
		"a load was sent while the re-register was pending")

	require.NoError(t, reg.Respond([]byte(`{"ok":true,"node":"n1","boot":"boot2","lease_ms":2000}`)))
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		if !c.Live() {
			return fmt.Errorf("not live again yet")
		}
		return nil
	})
}
