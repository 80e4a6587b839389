package node_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/node"
)

// closeWatchedDevice holds every copy until the test lets it go, and
// records a Close that came while a copy was running.
type closeWatchedDevice struct {
	backend.Attachment
	started      chan struct{}
	gate         chan struct{}
	copying      *atomic.Int32
	closed       *atomic.Bool
	closedUnder  *atomic.Bool // Close while a copy ran
	copiedClosed *atomic.Bool // a copy ran on after Close
}

func newCloseWatched() *closeWatchedDevice {
	return &closeWatchedDevice{started: make(chan struct{}, 8), gate: make(chan struct{}),
		copying: new(atomic.Int32), closed: new(atomic.Bool), closedUnder: new(atomic.Bool), copiedClosed: new(atomic.Bool)}
}

func (d *closeWatchedDevice) wrap(a backend.Attachment) backend.Attachment {
	w := *d
	w.Attachment = a
	return &w
}

func (d *closeWatchedDevice) Copy(dir backend.Direction, a backend.Arena, r []backend.Range) error {
	d.copying.Add(1)
	defer d.copying.Add(-1)
	d.started <- struct{}{}
	<-d.gate
	if d.closed.Load() {
		d.copiedClosed.Store(true)
		return errors.New("a copy on a closed device")
	}
	return d.Attachment.Copy(dir, a, r)
}

func (d *closeWatchedDevice) Close() error {
	if d.copying.Load() > 0 {
		d.closedUnder.Store(true)
	}
	d.closed.Store(true)
	return d.Attachment.Close()
}

// closingUnderACopy starts a node whose copies dev holds, makes one store
// copy start, and starts Close: its error comes on the channel returned.
func closingUnderACopy(t *testing.T, dev *closeWatchedDevice, mutate func(*node.Config)) chan error {
	t.Helper()
	e := startNode(t, func(c *node.Config) {
		c.WrapDevice = dev.wrap
		mutate(c)
	})
	te := e.newEngine("e1", defaultOpts())
	te.register()
	te.oneChunkReady("r")
	testkit.Recv(t, dev.started, 5*time.Second, "r's store copy")
	closed := make(chan error, 1)
	go func() { closed <- e.node.Close(context.Background()) }()
	return closed
}

// Close frees the engines' segments and the arena only once the copies
// reading and writing them have ended: protoactor's StopFuture gave up
// after 10 s and teardown freed them under a copy still running (seen with
// this test's copy held 11 s; held 300 ms here, it shows the order).
func TestCloseFreesNothingUnderARunningCopy(t *testing.T) { // not parallel: sets the package's stop wait
	dev := newCloseWatched()
	closed := closingUnderACopy(t, dev, func(*node.Config) {})
	testkit.NoRecv(t, closed, 300*time.Millisecond, "Close's return while a copy runs")
	close(dev.gate)
	testkit.Recv(t, closed, 10*time.Second, "Close's return once the copy ended")
	require.True(t, dev.closed.Load(), "the device closed at the end")
	require.False(t, dev.closedUnder.Load(), "the device closed under a running copy")
	require.False(t, dev.copiedClosed.Load(), "a copy ran on a closed device")
}

// A copy that does not end within the stop wait leaves the segments, the
// arena and the backend as they are (the process's exit frees them): freed
// under it, the copy would fault or write into memory mapped again.
func TestCloseGivesUpOnACopyThatDoesNotEndAndFreesNothing(t *testing.T) { // not parallel: sets the package's stop wait
	defer node.SetTransferStopWait(200 * time.Millisecond)()
	dev := newCloseWatched()
	closed := closingUnderACopy(t, dev, func(c *node.Config) {
		c.ShutdownTimeout = 500 * time.Millisecond // the release of r waits for its copy: not for long
	})
	testkit.Recv(t, closed, 10*time.Second, "Close's return past the stop wait")
	require.False(t, dev.closed.Load(), "the device closed under a copy that did not end")
	close(dev.gate)
}

// Past its seal a shutting-down node sends no heartbeat, and its loops,
// the watchdog among them, have stopped: a copy still running while Close
// waits for it ran on past the lease with nothing to fail-stop it, into
// blocks the engines had declared free. Close's own wait fail-stops it as
// the watchdog would have.
func TestACopyRunningPastTheLeaseDuringShutdownFailStops(t *testing.T) { // not parallel: sets the package's stop wait; a 400 ms lease
	const lease = 400 * time.Millisecond
	defer node.SetTransferStopWait(20 * lease)()
	stops := make(chan string, 1)
	dev := newCloseWatched()
	start := time.Now()
	closingUnderACopy(t, dev, func(c *node.Config) {
		c.Lease = lease
		c.ShutdownTimeout = lease / 2
		c.FailStop = func(reason string) { stops <- reason }
	})
	reason := testkit.Recv(t, stops, 10*lease, "a fail-stop of the copy running past the lease")
	require.Contains(t, reason, "shutdown")
	require.Less(t, time.Since(start), 3*lease, "the fail-stop came past an engine's lease")
	close(dev.gate)
}

// Close's drain of the intake's subscription ends at a quarter of
// --shutdown-timeout, leaving the rest to the releases: a drain that does
// not end (a server that no longer answers the drain's flush) is given up
// there and the subscription closed. The shutdown goes on as after any
// drain: it frees nothing under the copy still running, and publishes the
// copy's request's release once it ended, within the timeout.
func TestCloseGivesUpADrainThatDoesNotEndAtItsBound(t *testing.T) { // not parallel: sets the package's drain
	const timeout = 2 * time.Second
	drains := make(chan *nats.Subscription, 4)
	defer node.SetSubscriptionDrain(func(s *nats.Subscription) error { drains <- s; return nil })()
	dev := newCloseWatched()
	e := startNode(t, func(c *node.Config) {
		c.WrapDevice = dev.wrap
		c.ShutdownTimeout = timeout
	})
	te := e.newEngine("e1", defaultOpts())
	te.register()
	te.oneChunkReady("r")
	testkit.Recv(t, dev.started, 5*time.Second, "r's store copy")
	closed := make(chan error, 1)
	start := time.Now()
	go func() { closed <- e.node.Close(context.Background()) }()
	s := testkit.Recv(t, drains, 5*time.Second, "the drain's start")
	testkit.Eventually(t, 3*timeout/4, 5*time.Millisecond, func() error {
		if s.IsValid() {
			return errors.New("the intake's subscription is still draining")
		}
		return nil
	})
	require.GreaterOrEqual(t, time.Since(start), timeout/4, "the drain given up before its bound")
	testkit.NoRecv(t, closed, 100*time.Millisecond, "Close's return while a copy runs")
	require.False(t, dev.closed.Load(), "the device closed under a running copy")
	close(dev.gate)
	require.NoError(t, testkit.Recv(t, closed, timeout, "Close's return once the copy ended"))
	require.Less(t, time.Since(start), timeout, "Close ran to its timeout")
	require.Equal(t, "r", recv(t, te.released, "r's release").Request)
	require.True(t, dev.closed.Load(), "the device closed at the end")
	require.False(t, dev.closedUnder.Load(), "the device closed under a running copy")
	require.False(t, dev.copiedClosed.Load(), "a copy ran on a closed device")
}

// A link to NATS cut as Close begins its drain (the client not yet aware:
// its check said connected) leaves nothing to drain: the drain's flush has
// no server to answer it. Close gives the drain up as soon as the client
// sees the connection go down, not at its bound, a quarter of
// --shutdown-timeout. A crash simulated by a cut and a Close, as the cluster
// restart test does, held the old boot past the lease that way, and its
// engine's record lapsed before the next boot could read it.
func TestCloseGivesUpTheDrainWhenNATSGoesDown(t *testing.T) { // not parallel: sets the package's drain
	const timeout = 40 * time.Second // the drain's bound: 10 s
	s := testkit.NATSServer(t)
	link := testkit.NewLink(t, strings.TrimPrefix(s.ClientURL(), "nats://"))
	var cut sync.Once
	drains := make(chan *nats.Subscription, 8)
	defer node.SetSubscriptionDrain(func(s *nats.Subscription) error {
		cut.Do(link.Cut) // a drain begun, then the link gone: its flush is never answered
		drains <- s
		return nil
	})()
	n, err := node.Start(context.Background(), node.Config{NATSURL: "nats://" + link.Addr, NodeID: "cn",
		ShmDir: t.TempDir(), PoolBytes: 1 << 20, HTTPAddr: "off", Registry: prometheus.NewRegistry(),
		ShutdownTimeout: timeout, Log: slog.New(slog.DiscardHandler),
		FailStop: func(reason string) { t.Errorf("the node fail-stopped: %s", reason) }})
	require.NoError(t, err)
	closed := make(chan error, 1)
	go func() { closed <- n.Close(context.Background()) }()
	testkit.Recv(t, drains, 5*time.Second, "the drain's start")
	select {
	case <-closed: // its error says what NATS down left undelivered, if anything: not this test's subject
	case <-time.After(timeout / 8):
		t.Fatalf("Close still draining %v after NATS went down (the drain's bound: %v)", timeout/8, timeout/4)
	}
	require.Len(t, drains, 0, "a drain begun with NATS known to be down")
}

// A link to NATS gone silent before Close (nothing answers, nothing is
// closed: the client, pinging every two minutes, still calls itself
// connected) holds Close for its shutdown timeout: the drain's bound and
// the releases' flush wait for answers the link may yet bring. Not past
// it: once Close's own flush has failed, its teardown does not flush
// again, which waited 2 s more for a PONG that could not change what Close
// reports.
func TestCloseEndsAtItsTimeoutWhenNATSGoesSilent(t *testing.T) { // not parallel: timed against its shutdown timeout, with 1 s to spare
	const timeout = time.Second
	s := testkit.NATSServer(t)
	link := testkit.NewLink(t, strings.TrimPrefix(s.ClientURL(), "nats://"))
	n, err := node.Start(context.Background(), node.Config{NATSURL: "nats://" + link.Addr, NodeID: "sn",
		ShmDir: t.TempDir(), PoolBytes: 1 << 20, HTTPAddr: "off", Registry: prometheus.NewRegistry(),
		ShutdownTimeout: timeout, Log: slog.New(slog.DiscardHandler),
		FailStop: func(reason string) { t.Errorf("the node fail-stopped: %s", reason) }})
	require.NoError(t, err)
	link.Freeze()
	began := time.Now()
	closed := make(chan error, 1)
	go func() { closed <- n.Close(context.Background()) }()
	testkit.Recv(t, closed, timeout+time.Second, "Close's return (shutdown timeout 1 s)")
	t.Logf("Close took %v", time.Since(began))
}
