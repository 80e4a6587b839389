package client_test

import (
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// dialBuffered connects engine through url with a reconnect buffer, as an
// engine's own connection may have against the SDK's Options (CheckConn
// warns): what is published while the link is down waits in it, to be
// sent once the link is back.
func dialBuffered(t *testing.T, url, engine string) *nats.Conn {
	t.Helper()
	nc, err := client.Dial(url, engine, nats.ReconnectBufSize(8<<20))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	return nc
}

// loadBehindACut connects engine e1 through a link to node n1 (boot1) on a
// connection with a reconnect buffer (dialBuffered), with request r1
// awaiting a release the node never publishes, cuts the engine's link and
// sends a load: it goes into the connection's reconnect buffer and its
// flush fails, so it is in doubt and not known to have reached NATS. It returns once the client has given n1 up and done the
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
	enc := dialBuffered(t, "nats://"+l.Addr, "e1")
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
	t.Parallel()
	c, l, _, _, d := loadBehindACut(t)
	l.Restore()
	testkit.Closed(t, d.Settled(), 10*time.Second, "the load settled by its reply, once it left the reconnect buffer")
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
	t.Parallel()
	c, l, f, nc, d := loadBehindACut(t)
	f.kill()
	startFakeNode(t, nc, "n1", "boot2", testLease, func(f *fakeNode) { f.dropLoads = true })
	l.Restore()
	testkit.Closed(t, d.Settled(), 10*time.Second, "the load settled by the new boot's register reply")
	st := c.Stats()
	require.Equal(t, "boot2", st.Boot)
	require.Zero(t, st.LoadsInDoubt)
	require.Zero(t, st.LateLoadReplies, "settled by the new boot, not by a reply")
}

// A restart first seen in a heartbeat reply (the new boot says no hello and
// no node heartbeat here), before the register reply, marks the old boot's
// process gone (otherBoot), so the loss settles every load sent to it. The
// register reply then makes the new boot the session's, and the mark must
// go with the boot it was about: when the new boot is lost in turn, by
// silence this time (the engine's own link is cut), a load whose flush
// failed may still sit in the reconnect buffer and reach that boot alive
// after all, so the loss leaves it in doubt (without the reset, the old
// boot's mark settled it). Once the link is back the load reaches the node
// and its reply settles it. (On a connection with a reconnect buffer; with
// the SDK's Options the load fails at once, never sent.)
func TestARestartSeenBeforeTheRegisterReplyDoesNotSettleTheNewBootsLoads(t *testing.T) {
	t.Parallel()
	s := testkit.NATSServer(t)
	nc := testkit.Connect(t, s)
	hold := func(f *fakeNode) { f.holdRelease = func(uint64) bool { return true } }
	boot1 := startFakeNode(t, nc, "n1", "boot1", testLease, hold)
	l := testkit.NewLink(t, s.Addr().String())
	enc := dialBuffered(t, "nats://"+l.Addr, "e1")
	rels := newReleases()
	var logs testkit.SyncBuffer
	c := connect(t, enc, client.Config{Engine: "e1", Spec: spec(), OnReleased: rels.on,
		RequestTimeout: time.Second, Log: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	oneRequest(t, c, "r1")
	require.NoError(t, enc.Flush())

	boot1.kill()
	startFakeNode(t, nc, "n1", "boot2", testLease, hold, func(f *fakeNode) { f.mute = true })
	rel := testkit.Recv(t, rels.ch, 5*time.Second, "r1 freed by boot1's loss")
	require.Equal(t, client.Release{Request: "r1", Reason: messages.ReasonNodeLost}, rel)
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if st := c.Stats(); st.Boot != "boot2" || st.Registers != 2 {
			return fmt.Errorf("registered %d times, boot %q", st.Registers, st.Boot)
		}
		return nil
	})
	require.Equal(t, 1, strings.Count(logs.String(), "client: node lost"), logs.String())
	require.Contains(t, logs.String(), `why="new boot boot2"`, "boot2 seen in a heartbeat reply, before its register reply")
	oneRequest(t, c, "r2") // owes a release boot2 never publishes
	require.NoError(t, enc.Flush())

	l.Cut()
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if !enc.IsReconnecting() {
			return fmt.Errorf("the engine's connection is %v", enc.Status())
		}
		return nil
	})
	d := loadInDoubt(t, c)
	require.Equal(t, "boot2", d.Boot)
	rel = testkit.Recv(t, rels.ch, 5*time.Second, "r2 freed by boot2's loss")
	require.Equal(t, client.Release{Request: "r2", Reason: messages.ReasonNodeLost}, rel)
	select { // settled, if at all, in the same step, before r2's release was handed out
	case <-d.Settled():
		t.Fatal("boot2's loss by silence settled a load whose flush failed: boot1's restart was taken for boot2's")
	default:
	}
	require.Equal(t, 2, c.Stats().NodeLosses)
	require.Equal(t, 1, c.Stats().LoadsInDoubt)

	l.Restore()
	testkit.Closed(t, d.Settled(), 10*time.Second, "the load settled by its reply, once it left the reconnect buffer")
	require.Equal(t, 1, c.Stats().LateLoadReplies)
}
