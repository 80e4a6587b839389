package client_test

import (
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// link is a loopback TCP proxy to a NATS server for the engine's
// connection alone: cut, the engine's link is down (every reconnect
// refused) while the node, connected directly, stays up.
type link struct {
	t      *testing.T
	addr   string
	target string

	mu    sync.Mutex
	ln    net.Listener
	conns []net.Conn
}

func newLink(t *testing.T, target string) *link {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	l := &link{t: t, addr: ln.Addr().String(), target: target, ln: ln}
	go l.serve(ln)
	t.Cleanup(l.cut)
	return l
}

func (l *link) serve(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return // cut
		}
		s, err := net.Dial("tcp", l.target)
		if err != nil {
			_ = c.Close()
			continue
		}
		l.mu.Lock()
		l.conns = append(l.conns, c, s)
		l.mu.Unlock()
		pipe := func(dst, src net.Conn) {
			_, _ = io.Copy(dst, src)
			_ = dst.Close()
			_ = src.Close()
		}
		go pipe(c, s)
		go pipe(s, c)
	}
}

// cut closes the listener and every connection through it.
func (l *link) cut() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.ln != nil {
		_ = l.ln.Close()
		l.ln = nil
	}
	for _, c := range l.conns {
		_ = c.Close()
	}
	l.conns = nil
}

// restore listens again on the same address.
func (l *link) restore() {
	l.t.Helper()
	ln, err := net.Listen("tcp", l.addr)
	require.NoError(l.t, err, "listen again on %s", l.addr)
	l.mu.Lock()
	l.ln = ln
	l.mu.Unlock()
	go l.serve(ln)
}

// loadBehindACut connects engine e1 through a link to node n1 (boot1),
// with request r1 awaiting a release the node never publishes, cuts the
// engine's link and sends a load: it goes into the connection's reconnect
// buffer and its flush fails, so it is in doubt and not known to have
// reached NATS. It returns once the client has given n1 up and done the
// loss's frees (r1 freed node_lost): the load is still in doubt then, since
// it may yet reach a node that is alive after all.
func loadBehindACut(t *testing.T) (*client.Client, *link, *fakeNode, *nats.Conn, *client.LoadInDoubtError) {
	t.Helper()
	s := testkit.NATSServer(t)
	nc := testkit.Connect(t, s)
	f := startFakeNode(t, nc, "n1", "boot1", testLease, func(f *fakeNode) {
		f.holdRelease = func(uint64) bool { return true }
	})
	l := newLink(t, s.Addr().String())
	enc := dial(t, "nats://"+l.addr, "e1")
	rels := newReleases()
	c := connect(t, enc, client.Config{Engine: "e1", Spec: spec(), OnReleased: rels.on,
		RequestTimeout: time.Second})
	oneRequest(t, c, "r1")
	require.NoError(t, enc.Flush()) // r1's batches reached the node

	l.cut()
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
	l.restore()
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
	l.restore()
	awaitClosed(t, d.Settled(), 10*time.Second, "the load settled by the new boot's register reply")
	st := c.Stats()
	require.Equal(t, "boot2", st.Boot)
	require.Zero(t, st.LoadsInDoubt)
	require.Zero(t, st.LateLoadReplies, "settled by the new boot, not by a reply")
}
