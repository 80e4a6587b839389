package client_test

import (
	"context"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// loadInDoubt sends a load that the node does not answer within 100 ms
// and returns its error, checked to be a LoadInDoubtError.
func loadInDoubt(t *testing.T, c *client.Client) *client.LoadInDoubtError {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_, err := c.Load(ctx, "l", []string{"aa"}, 4, [][]int64{{9}})
	require.ErrorIs(t, err, client.ErrLoadInDoubt)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	var d *client.LoadInDoubtError
	require.ErrorAs(t, err, &d)
	require.Equal(t, "l", d.Request)
	require.Equal(t, "n1", d.Node)
	require.Equal(t, 1, c.Stats().LoadsInDoubt)
	return d
}

// TestLoadInDoubtUntilItsLateReply: a load the node answers after Load gave
// up is in doubt (its blocks may still be written) through heartbeat round
// trips, which prove nothing about it, and settled by its own late reply.
func TestLoadInDoubtUntilItsLateReply(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease)
	gate, held := f.gateLoads()
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec()})
	d := loadInDoubt(t, c)
	testkit.Recv(t, held, 5*time.Second, "the load waiting at the node")
	stillOpen(t, d.Settled(), 2*testLease, "the load settled while the node still holds it")
	require.True(t, c.Live(), "heartbeats went on meanwhile")
	gate <- struct{}{}
	testkit.Closed(t, d.Settled(), 5*time.Second, "the load settled by its late reply")
	st := c.Stats()
	require.Zero(t, st.LoadsInDoubt)
	require.Equal(t, 1, st.LateLoadReplies)

	gate <- struct{}{} // a load answered in time is in no doubt
	n, err := c.Load(context.Background(), "l2", []string{"aa"}, 4, [][]int64{{9}})
	require.NoError(t, err)
	require.Equal(t, 4, n)
	require.Zero(t, c.Stats().LoadsInDoubt)
}

// TestALateLoadReplyFromANewBootIsANodeLoss: a load in doubt answered late
// by another boot of its node settles, and says the node restarted (step
// 19: a reply with another boot is a node loss), as a reply in time does.
func TestALateLoadReplyFromANewBootIsANodeLoss(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease)
	gate, held := f.gateLoads()
	var logs testkit.SyncBuffer
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(),
		Log: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	losses := c.Stats().NodeLosses
	d := loadInDoubt(t, c)
	testkit.Recv(t, held, 5*time.Second, "the load waiting at the node")
	f.mu.Lock()
	f.loadBoot = "boot2" // the node restarted; its new process answers (only the load: heartbeats say boot1)
	f.mu.Unlock()
	gate <- struct{}{}
	testkit.Closed(t, d.Settled(), 5*time.Second, "the load settled by its late reply")
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if got := c.Stats().NodeLosses; got != losses+1 {
			return fmt.Errorf("%d node losses since the load, want 1", got-losses)
		}
		return nil
	})
	require.Contains(t, logs.String(), `why="new boot boot2"`)
}

// TestLoadInDoubtUntilTheNodeIsLost: a load the node never answers (it
// dies) is settled when the node is declared lost, no sooner than the
// lease after its last heartbeat (its fencing stops copies by then); while
// the node is lost, Load sends nothing.
func TestLoadInDoubtUntilTheNodeIsLost(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease)
	held := make(chan struct{}, 4)
	f.mu.Lock()
	f.loadGate, f.loadsHeld = make(chan struct{}), held
	f.mu.Unlock()
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec()})
	d := loadInDoubt(t, c)
	testkit.Recv(t, held, 5*time.Second, "the load waiting at the node")
	f.kill()
	lastBeat := f.lastHeartbeat()
	testkit.Closed(t, d.Settled(), testLease+2*time.Second, "the load settled by the node's loss")
	require.GreaterOrEqual(t, time.Since(lastBeat), testLease, "settled before the lease since the last heartbeat")
	require.Zero(t, c.Stats().LoadsInDoubt)
	_, err := c.Load(context.Background(), "l2", []string{"aa"}, 4, [][]int64{{9}})
	require.ErrorIs(t, err, client.ErrNoNode)
}

// TestLoadInDoubtUntilUnregistered: a load whose reply is lost is settled
// by Close's unregister, which the node answers only once its loads in
// flight are done.
func TestLoadInDoubtUntilUnregistered(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease)
	f.mu.Lock()
	f.dropLoads = true
	f.mu.Unlock()
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec()})
	d := loadInDoubt(t, c)
	stillOpen(t, d.Settled(), testLease, "the load settled with no reply")
	require.NoError(t, c.Close())
	testkit.Closed(t, d.Settled(), time.Second, "the load settled by the unregister")
}

// stillOpen fails if ch is closed within d (testkit.NoRecv takes a close
// for no value).
func stillOpen(t *testing.T, ch <-chan struct{}, d time.Duration, what string) {
	t.Helper()
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-ch:
		t.Fatalf("unexpected %s", what)
	case <-timer.C:
	}
}

// TestNoLoadIsSentAfterItsNodeWasGivenUp: a loss declared, and its frees
// done, while Load is on its way (the hook runs where another goroutine may
// overtake it) leaves the load refused and unsent: sent later, the lost
// node's fence would not cover it and nothing would settle it.
func TestNoLoadIsSentAfterItsNodeWasGivenUp(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease, func(f *fakeNode) {
		f.holdRelease = func(uint64) bool { return true }
	})
	rels := newReleases()
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(), OnReleased: rels.on,
		RequestTimeout: time.Second})
	oneRequest(t, c, "r1")
	loads := testkit.Subscribe(t, nc, "kvactors.e1.load") // hears loads, never answers
	client.SetBeforeLoad(c, func() {
		f.kill()
		rel := testkit.Recv(t, rels.ch, 5*time.Second, "r1 freed by the node's loss")
		require.Equal(t, messages.ReasonNodeLost, rel.Reason)
	})
	_, err := c.Load(context.Background(), "l", []string{"aa"}, 4, [][]int64{{9}})
	require.ErrorIs(t, err, client.ErrNoNode)
	testkit.NoRecv(t, loads, 200*time.Millisecond, "a load sent after its node was given up")
	require.Zero(t, c.Stats().LoadsInDoubt)
}

// TestALoadWhoseContextIsDoneIsNotSent: Load with a ctx already done sends
// nothing and fails with ctx's error, not in doubt: sent, it could only
// come back in doubt, its destination blocks held until settled.
func TestALoadWhoseContextIsDoneIsNotSent(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	startFakeNode(t, nc, "n1", "boot1", testLease)
	enc := dial(t, s.ClientURL(), "e1")
	c := connect(t, enc, client.Config{Engine: "e1", Spec: spec()})
	loads := testkit.Subscribe(t, nc, "kvactors.e1.load")
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := c.Load(ctx, "l", []string{"aa"}, 4, [][]int64{{9}})
	require.ErrorIs(t, err, context.Canceled)
	require.NotErrorIs(t, err, client.ErrLoadInDoubt)
	requireNoneSent(t, enc, "kvactors.e1.load", loads, "a load whose ctx was done was sent")
	require.Zero(t, c.Stats().LoadsInDoubt)
}
