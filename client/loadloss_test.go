package client_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// loadBehindACut connects engine e1 through a link to node n1 (boot1),
// with request r1 awaiting a release the node never publishes, cuts the
// engine's link and sends a load: it goes into the connection's reconnect
// buffer and its flush fails, so it is in doubt and not known to have
// reached NATS. It returns once the client has given n1 up and done the
// loss's frees (r1 freed node_lost): the load is still in doubt then, since
// it may yet reach a node that is alive after all.
func loadBehindACut(t *testing.T) (*client.Client, *testkit.Link, *fakeNode, *nats.Conn, *client.LoadInDoubtError) {
	t.Helper()
	s := testkit.NATSServer(t)
	nc := testkit.Connect(t, s)
	f := startFakeNode(t, nc, "n1", "boot1", testLease, func(f *fakeNode) {
		f.holdRelease = func(uint64) bool { return true }
	})
	l := testkit.NewLink(t, s.Addr().String())
	enc := dial(t, "nats://"+l.Addr, "e1")
	rels := newReleases()
	c := connect(t, enc, client.Config{Engine: "e1", Spec: spec(), OnReleased: rels.on,
		RequestTimeout: time.Second})
	oneRequest(t, c, "r1")
	require.NoError(t, enc.Flush()) // r1's batches reached the node

	l.Cut()
	// Reconnecting: what is published now waits in the reconnect buffer
	// (sent before the drop is noticed, it would be lost with the socket).
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if !enc.IsReconnecting() {
			return fmt.Errorf("the engine's connection is %v", enc.Status())
		}
		return nil
	})
	d := loadInDoubt(t, c)
	rel := testkit.Recv(t, rels.ch, 5*time.Second, "r1 freed by the node's loss")
	require.Equal(t, client.Release{Request: "r1", Reason: messages.ReasonNodeLost}, rel)
	// The loss's frees settle the loads in doubt they cover in the same
	// step, before r1's release is handed out.
	select {
	case <-d.Settled():
		t.Fatal("a load whose flush failed was settled by the node's loss: it may still be in the reconnect buffer")
	default:
	}
	require.Equal(t, 1, c.Stats().LoadsInDoubt)
	return c, l, f, nc, d
}

// A load whose flush failed (the engine's own link down) is not covered by
// the lost node's fence: it may wait in the reconnect buffer and reach the
// node after the client gave it up, the node alive after all and never
// fenced. So the loss leaves it in doubt; once the link is back it reaches
// the node, and the node's reply settles it.
func TestALoadWhoseFlushFailedOutlivesTheNodesLoss(t *testing.T) {
	c, l, _, _, d := loadBehindACut(t)
	l.Restore()
	awaitClosed(t, d.Settled(), 10*time.Second, "the load settled by its reply, once it left the reconnect buffer")
	st := c.Stats()
	require.Equal(t, 1, st.LateLoadReplies)
	require.Zero(t, st.LoadsInDoubt)
	require.Equal(t, "boot1", st.Boot)
}

// The same load, when the node restarted meanwhile: its new boot, first
// seen in the register reply (the client's link was down for its hello),
// proves the old process can copy nothing any more, so the register settles
// the load the loss left in doubt. The new boot never answers the load (it
// reaches it from the reconnect buffer): nothing else settles it.
func TestARegisterReplyFromANewBootSettlesALoadTheLossLeftInDoubt(t *testing.T) {
	c, l, f, nc, d := loadBehindACut(t)
	f.kill()
	startFakeNode(t, nc, "n1", "boot2", testLease, func(f *fakeNode) { f.dropLoads = true })
	l.Restore()
	awaitClosed(t, d.Settled(), 10*time.Second, "the load settled by the new boot's register reply")
	st := c.Stats()
	require.Equal(t, "boot2", st.Boot)
	require.Zero(t, st.LoadsInDoubt)
	require.Zero(t, st.LateLoadReplies, "settled by the new boot, not by a reply")
}
