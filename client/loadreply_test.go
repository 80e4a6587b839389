package client_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// A load settles only on a reply of the node and boot it was sent to. On
// a cluster every node receives the engine's load; a reply from another
// one (here "nA", answering at once) would say nothing of the copy the
// engine's own node may still be writing into the load's blocks. n1 holds
// the load; nA's answer is passed over, and the load ends with n1's.
func TestALoadSettlesOnlyOnItsOwnNodesReply(t *testing.T) {
	t.Parallel()
	c, gate, held, answered := heldLoadAndAnotherReply(t,
		messages.LoadReply{Error: messages.Overloaded + ": inbound queue full", Node: "nA", Boot: "bootA"})

	done := make(chan error, 1)
	go func() {
		_, err := c.Load(context.Background(), "l", []string{"aa"}, 4, [][]int64{{9}})
		done <- err
	}()
	testkit.Recv(t, held, 5*time.Second, "n1 holds the load (copying)")
	testkit.Recv(t, answered, 5*time.Second, "nA's answer")
	testkit.NoRecv(t, done, 200*time.Millisecond, "the load settled on nA's answer")
	gate <- struct{}{}
	require.NoError(t, testkit.Recv(t, done, 5*time.Second, "the load, once n1 answered"))
}

// A reply from another boot of the node the load was sent to settles it:
// the old process can copy nothing more (a newer boot answered).
func TestALoadSettlesOnAReplyOfAnotherBootOfItsNode(t *testing.T) {
	t.Parallel()
	c, gate, _, _ := heldLoadAndAnotherReply(t, messages.LoadReply{Error: `unknown engine "e1"`, Node: "n1", Boot: "boot2"})
	defer func() { gate <- struct{}{} }()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err := c.Load(ctx, "l", []string{"aa"}, 4, [][]int64{{9}})
	require.Error(t, err)
	require.NotErrorIs(t, err, client.ErrLoadInDoubt, "settled by the new boot's answer")
	require.Contains(t, err.Error(), "unknown engine")
}

// heldLoadAndAnotherReply connects e1 to fake node n1 (boot1), which holds
// every load until the returned gate gets a value (held is told when one
// waits), while another connection answers each load of e1 at once with
// rep (answered is told).
func heldLoadAndAnotherReply(t *testing.T, rep messages.LoadReply) (c *client.Client, gate, held, answered chan struct{}) {
	t.Helper()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease)
	gate, held, answered = make(chan struct{}, 1), make(chan struct{}, 4), make(chan struct{}, 4)
	f.mu.Lock()
	f.loadGate, f.loadsHeld = gate, held
	f.mu.Unlock()
	c = connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec()})
	other, err := nats.Connect(s.ClientURL())
	require.NoError(t, err)
	t.Cleanup(other.Close)
	_, err = other.Subscribe("kvactors.e1.load", func(m *nats.Msg) {
		b, _ := json.Marshal(rep)
		_ = m.Respond(b)
		answered <- struct{}{}
	})
	require.NoError(t, err)
	require.NoError(t, other.Flush())
	return c, gate, held, answered
}
