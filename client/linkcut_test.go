package client_test

import (
	"context"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// TestEngineLinkCutFreesALeaseAfterItsLastMessage: only the engine's link
// fails, the node stays up. The node heard e1 until e1's last message
// reached it, later than the last node message e1 received, so the
// node_lost frees wait a lease from e1's own last publish (the node cannot
// expire e1 sooner). And what e1 flushed while its link was down never
// reaches the node once the link is back (no reconnect buffer): the node,
// same boot, would apply it in the old epoch after e1 freed those requests,
// storing from reused blocks.
func TestEngineLinkCutFreesALeaseAfterItsLastMessage(t *testing.T) {
	t.Parallel()
	s := testkit.NATSServer(t)
	nc := testkit.Connect(t, s)
	f := startFakeNode(t, nc, "n1", "boot1", testLease, func(f *fakeNode) {
		f.holdRelease = func(uint64) bool { return true } // r1's store still pending at the node
		f.hbDelay = 2 * time.Second                       // replies too late to refresh last_seen
	})
	beats := testkit.Subscribe(t, nc, messages.NodeSubject("kvactors", "n1", messages.NodeVerbHeartbeat))
	l := testkit.NewLink(t, s.Addr().String())
	enc := dial(t, "nats://"+l.Addr, "e1")
	require.Equal(t, -1, enc.Opts.ReconnectBufSize, "the engine's connection has the SDK's Options")
	rels := newReleases()
	c := connect(t, enc, client.Config{Engine: "e1", Spec: spec(), OnReleased: rels.on})
	oneRequest(t, c, "r1")
	old := c.Epoch()
	testkit.Recv(t, beats, 5*time.Second, "a node heartbeat")
	f.pauseBeats(true) // the node's last message to e1 is behind us
	// Only spaces the node's last message to e1 apart from e1's last one to
	// the node, so a fence counted from the former shows.
	time.Sleep(testLease / 8)
	tEngine := time.Now() // the node hears e1 at or after this
	c.Added("r2", 4)
	require.NoError(t, c.Flush())
	require.NoError(t, enc.Flush()) // r2's batch reached NATS, so the node
	l.Cut()
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if !enc.IsReconnecting() {
			return fmt.Errorf("status %v", enc.Status())
		}
		return nil
	})
	c.Added("r3", 8)
	c.Blocks("r3", 0, 0, []uint32{5, 6})
	c.Hashes("r3", 0, []byte{1}, []byte{2})
	c.Tokens("r3", 8, 8)
	c.Finished("r3", false, 8, 8)
	require.NoError(t, c.Flush()) // refused by the NATS client (or discarded, were the node lost already)
	if st := c.Stats(); st.PublishErrors+st.DiscardedBatches == 0 {
		t.Errorf("r3's batch was accepted while the link was down: %+v", st)
	}
	first := testkit.Recv(t, rels.ch, 5*time.Second, "the first node_lost free")
	tFree := time.Now()
	second := testkit.Recv(t, rels.ch, 5*time.Second, "the second node_lost free")
	require.ElementsMatch(t, []string{"r1", "r3"}, []string{first.Request, second.Request})
	require.Equal(t, messages.ReasonNodeLost, first.Reason)
	require.Equal(t, messages.ReasonNodeLost, second.Reason)
	if d := tFree.Sub(tEngine); d < testLease {
		t.Errorf("requests freed %v after e1's last message reached the node: the node, connected and unfenced, "+
			"cannot expire e1 before %v", d, testLease)
	}

	f.pauseBeats(false)
	l.Restore()
	// The new epoch's first batch follows on the same connection anything
	// replayed from before the reconnect: once the node has applied it, a
	// replay would be in the node's log.
	testkit.Eventually(t, 10*time.Second, 5*time.Millisecond, func() error {
		epoch := c.Epoch()
		if epoch == old || !c.Live() {
			return fmt.Errorf("no new epoch yet: %+v", c.Stats())
		}
		for _, ev := range f.events(epoch) {
			if ev.Request == "r2" && ev.Type == messages.EvAdded {
				return nil
			}
		}
		return fmt.Errorf("the node has not applied r2's re-announcement in epoch %s", epoch)
	})
	for _, ev := range f.events(old) {
		if ev.Request == "r3" {
			t.Errorf("the node applied r3's %s in epoch %s after the client freed r3 (node_lost)", ev.Type, old)
		}
	}
}

// TestAPublishWhileLostPostponesTheFrees: the free time is recomputed at
// each check, so a message that may have reached the node after its last
// sign of life moves the frees a lease past it. Lookup sends nothing while
// the node is lost.
func TestAPublishWhileLostPostponesTheFrees(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease, func(f *fakeNode) {
		f.holdRelease = func(uint64) bool { return true }
	})
	lookups := testkit.Subscribe(t, nc, "kvactors.e1.lookup")
	rels := newReleases()
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(), OnReleased: rels.on})
	oneRequest(t, c, "r1")
	f.kill()
	// A publish after the node's last sign of life (a batch: no answer
	// tells whether anyone took it) moves the frees a lease past it, also
	// once the loss is declared.
	client.NoteSend(c)
	tSend := time.Now()
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if n := c.Stats().NodeLosses; n != 1 {
			return fmt.Errorf("%d node losses", n)
		}
		return nil
	})
	_, err := c.Lookup(context.Background(), []string{"00"})
	require.ErrorIs(t, err, client.ErrNoNode)
	rel := testkit.Recv(t, rels.ch, 5*time.Second, "r1's node_lost free")
	require.Equal(t, client.Release{Request: "r1", Reason: messages.ReasonNodeLost}, rel)
	if d := time.Since(tSend); d < testLease {
		t.Errorf("freed %v after a publish to the node, want a lease (%v)", d, testLease)
	}
	testkit.NoRecv(t, lookups, 10*time.Millisecond, "a lookup sent while the node was lost")
}

// TestCheckConn: the SDK's Options suit the default lease; a connection
// with a reconnect buffer or slow pings does not, and the client says so
// at register (one on another inbox prefix is refused at Connect:
// TestConnectRefusesAConnectionOnAnotherInbox).
func TestCheckConn(t *testing.T) {
	t.Parallel()
	o := nats.GetDefaultOptions()
	for _, opt := range client.Options("e1") {
		require.NoError(t, opt(&o))
	}
	require.Empty(t, client.CheckConn(o, "e1", 10*time.Second))
	require.Len(t, client.CheckConn(o, "e1", 8*time.Second), 1, "6s to close a dead link is not under 3/4 of 8s")
	require.Len(t, client.CheckConn(nats.GetDefaultOptions(), "e1", 10*time.Second), 3)

	s, nc := testkit.NATS(t)
	startFakeNode(t, nc, "n1", "boot1", testLease)
	var logs testkit.SyncBuffer
	enc, err := nats.Connect(s.ClientURL(), nats.CustomInboxPrefix(client.InboxPrefix("e1")))
	require.NoError(t, err)
	t.Cleanup(enc.Close)
	connect(t, enc, client.Config{Engine: "e1", Spec: spec(),
		Log: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	require.Contains(t, logs.String(), "ReconnectBufSize")
	require.Contains(t, logs.String(), "PingInterval")
}

// TestCheckConnTellsAMissingPerEngineInboxPrefix: a connection whose reply
// inboxes are not under _INBOX.<engine> (the default _INBOX, or another
// engine's) is reported: the node answers none of its requests, and under
// per-engine NATS permissions no other reply would reach it either. The rest of its settings are the SDK's.
func TestCheckConnTellsAMissingPerEngineInboxPrefix(t *testing.T) {
	t.Parallel()
	for _, prefix := range []string{"", client.InboxPrefix("e2")} {
		o := nats.GetDefaultOptions()
		for _, opt := range client.Options("e1") {
			require.NoError(t, opt(&o))
		}
		o.InboxPrefix = prefix
		bad := client.CheckConn(o, "e1", 10*time.Second)
		require.Len(t, bad, 1, "prefix %q", prefix)
		require.Contains(t, bad[0], client.InboxPrefix("e1"))
	}
}

// TestALoadWhileTheLinkIsDownIsNeverSent: with the SDK's Options (no
// reconnect buffer) a load published while the engine's link is down fails
// at once: it was never sent, so it is not in doubt, and once the link is
// back nothing of it reaches the node.
func TestALoadWhileTheLinkIsDownIsNeverSent(t *testing.T) {
	t.Parallel()
	s := testkit.NATSServer(t)
	nc := testkit.Connect(t, s)
	startFakeNode(t, nc, "n1", "boot1", testLease)
	loads := testkit.Subscribe(t, nc, "kvactors.e1.load")
	l := testkit.NewLink(t, s.Addr().String())
	enc := dial(t, "nats://"+l.Addr, "e1")
	c := connect(t, enc, client.Config{Engine: "e1", Spec: spec()})
	l.Cut()
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if !enc.IsReconnecting() {
			return fmt.Errorf("the engine's connection is %v", enc.Status())
		}
		return nil
	})
	_, err := c.Load(context.Background(), "l", []string{"aa"}, 4, [][]int64{{9}})
	require.ErrorIs(t, err, nats.ErrReconnectBufExceeded)
	require.NotErrorIs(t, err, client.ErrLoadInDoubt)
	require.Zero(t, c.Stats().LoadsInDoubt)
	l.Restore()
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if !enc.IsConnected() {
			return fmt.Errorf("the engine's connection is %v", enc.Status())
		}
		return nil
	})
	require.NoError(t, enc.Flush()) // anything replayed is at the server by now,
	require.NoError(t, nc.Flush())  // and in loads
	testkit.NoRecv(t, loads, 50*time.Millisecond, "the load, replayed after the reconnect")
}
