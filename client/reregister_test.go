package client_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
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
	t.Parallel()
	s, nc := testkit.NATS(t)
	f1 := startFakeNode(t, nc, "n1", "boot1", 2*time.Second)
	enc := dial(t, s.ClientURL(), "e1")
	c := connect(t, enc, client.Config{Engine: "e1", Spec: spec(), RequestTimeout: 5 * time.Second})
	forgetAndRefuse(t, f1, c)
	f1.kill() // boot2 starts (mute: no hello) and holds the next register
	regs := testkit.Subscribe(t, nc, "kvactors.e1.register")
	loads := testkit.Subscribe(t, nc, "kvactors.e1.load")
	reg := testkit.Recv(t, regs, 5*time.Second, "the re-register reaching boot2")

	_, err := c.Load(context.Background(), "l", []string{"aa"}, 4, [][]int64{{9}})
	require.ErrorIs(t, err, client.ErrNoNode)
	require.NotErrorIs(t, err, client.ErrLoadInDoubt)
	requireNoneSent(t, enc, "kvactors.e1.load", loads, "a load was sent while the re-register was pending")

	require.NoError(t, reg.Respond([]byte(`{"ok":true,"node":"n1","boot":"boot2","lease_ms":2000}`)))
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		if !c.Live() {
			return fmt.Errorf("not live again yet")
		}
		return nil
	})
}

// TestEventsWhileTheNodeHasForgottenTheEngineAreFreed: the node forgot the
// engine (it released every request engine_gone, as an expiry does) and
// refuses it again (--max-engines): each Finished or Preempted meanwhile
// is answered at once (engine_gone), since the node holds nothing of the
// request, instead of waiting for a register that may never pass. A request
// whose engine_gone has not come yet (its copies still running: the node
// answers "unknown engine" as soon as it drops the engine) waits for it.
func TestEventsWhileTheNodeHasForgottenTheEngineAreFreed(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease)
	rels := newReleases()
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(), OnReleased: rels.on})
	goneAndCopying(t, f, c)
	f.refuseRegisters("limit: engine refused: --max-engines 1 reached")
	f.forget("e1", "copying")
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		if st := c.Stats(); st.RegisterRefusals == 0 || st.UnowedResets == 0 {
			return fmt.Errorf("no refused re-register or engine_gone yet: %+v", st)
		}
		return nil
	})

	c.Finished("gone", false, 8, 8)
	c.Added("new", 8) // never reaches the node: its batches are discarded
	c.Blocks("new", 0, 0, []uint32{3})
	c.Preempted("new")
	c.Finished("copying", false, 8, 8)
	require.NoError(t, c.Flush())
	for _, want := range []string{"gone", "new"} {
		rel := testkit.Recv(t, rels.ch, 5*time.Second, "the release of "+want)
		require.Equal(t, client.Release{Request: want, Reason: messages.ReasonEngineGone}, rel)
	}
	testkit.NoRecv(t, rels.ch, 3*testLease, "a release of the request the node may still copy")
	f.releaseGone("e1", "copying")
	rel := testkit.Recv(t, rels.ch, 5*time.Second, "the engine_gone of the request still copying")
	require.Equal(t, "copying", rel.Request)
	require.Equal(t, messages.ReasonEngineGone, rel.Reason)
	st := c.Stats()
	require.Equal(t, 2, st.ForgottenFrees)
	require.Zero(t, st.Awaiting)
	require.Zero(t, st.NodeLosses)
}

// TestCloseDuringASucceedingReregisterUnregisters: Close while the session
// loop waits on a re-register that then succeeds: no heartbeat goes out
// after Close began, and Close unregisters the registration the loop made
// (else the node keeps the engine, its segments mapped, until it expires).
func TestCloseDuringASucceedingReregisterUnregisters(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f1 := startFakeNode(t, nc, "n1", "boot1", testLease)
	enc := dial(t, s.ClientURL(), "e1")
	c := connect(t, enc, client.Config{Engine: "e1", Spec: spec(), RequestTimeout: 3 * time.Second})
	f1.kill()
	regs := testkit.Subscribe(t, nc, "kvactors.e1.register")
	unregs := make(chan *nats.Msg, 16)
	us, err := nc.Subscribe("kvactors.e1.unregister", func(m *nats.Msg) {
		unregs <- m
		_ = m.Respond([]byte(`{"ok":true,"node":"n1","boot":"boot2"}`))
	})
	require.NoError(t, err)
	defer func() { _ = us.Unsubscribe() }()
	require.NoError(t, nc.Flush())
	reg := testkit.Recv(t, regs, 5*time.Second, "a re-register after the loss")
	hbs := testkit.Subscribe(t, nc, "kvactors.e1.heartbeat") // none goes out while the node is lost

	closed := make(chan error, 1)
	go func() { closed <- c.Close() }()
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if c.Flush() == nil {
			return fmt.Errorf("Close has not begun")
		}
		return nil
	})
	require.NoError(t, reg.Respond([]byte(`{"ok":true,"node":"n1","boot":"boot2","lease_ms":400}`)))
	require.NoError(t, testkit.Recv(t, closed, 5*time.Second, "Close"))
	testkit.Recv(t, unregs, time.Second, "the unregister of the registration the loop made")
	requireNoneSent(t, enc, "kvactors.e1.heartbeat", hbs, "a heartbeat was published after Close began")
}

// TestAnEngineGoneAnswersEveryOwedRelease: a request the engine preempted,
// resumed and finished before the node saw any of it owes two releases
// when the node forgets the engine; its one engine_gone answers both (the
// node holds nothing of it any more), while the node refuses the engine,
// so no resync can answer the second.
func TestAnEngineGoneAnswersEveryOwedRelease(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease)
	rels := newReleases()
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(), OnReleased: rels.on})
	require.NoError(t, c.Added("r1", 8))
	c.Blocks("r1", 0, 0, []uint32{1, 2})
	require.NoError(t, c.Flush())
	epoch := c.Epoch()
	f.awaitApplied(t, epoch, 2)
	c.Preempted("r1") // not flushed: the node never sees them
	c.Resumed("r1")
	c.Finished("r1", false, 8, 8)
	require.Equal(t, 1, c.Stats().Awaiting)
	f.refuseRegisters("limit: engine refused: --max-engines 1 reached")
	f.forget("e1")
	for i := range 2 {
		rel := testkit.Recv(t, rels.ch, 5*time.Second, fmt.Sprintf("release %d of r1", i+1))
		require.Equal(t, client.Release{Request: "r1", Reason: messages.ReasonEngineGone, Epoch: epoch}, rel)
	}
	testkit.NoRecv(t, rels.ch, 2*testLease, "a third release")
	st := c.Stats()
	require.Zero(t, st.Awaiting)
	require.Zero(t, st.Live)
	require.Zero(t, st.ForgottenFrees, "freed by the node's engine_gone, not by the client")
}

// An engine_gone of the old epoch that arrives just after the re-register
// it called for took effect (the node releases a request still copying
// only once its copies end, after it already answered "unknown engine")
// frees what it answers, but does not send the engine to register a second
// time: the node holds the new registration already. It did: the release
// was of the epoch still current until the resync, so it raised the
// re-register again, and heartbeats, loads and batches waited for it.
func TestALateEngineGoneAfterTheReregisterDoesNotRegisterAgain(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease)
	regs := testkit.Subscribe(t, nc, "kvactors.e1.register")
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(), OnReleased: newReleases().on})
	testkit.Recv(t, regs, 5*time.Second, "the first register")
	epoch := goneAndCopying(t, f, c)
	var once sync.Once
	late := make(chan error, 1)
	client.SetAfterReregister(c, func() { // the re-register took effect; the resync has not started
		once.Do(func() {
			f.releaseGone("e1", "copying")
			deadline := time.Now().Add(5 * time.Second)
			for c.Stats().UnowedResets < 2 && time.Now().Before(deadline) {
				time.Sleep(time.Millisecond) // polling the client's count: nothing to wait on
			}
			if n := c.Stats().UnowedResets; n < 2 {
				late <- fmt.Errorf("the late engine_gone was not handled: UnowedResets %d", n)
				return
			}
			late <- nil
		})
	})
	f.forget("e1", "copying")
	testkit.Recv(t, regs, 5*time.Second, "the re-register")
	require.NoError(t, testkit.Recv(t, late, 10*time.Second, "the late engine_gone, in the re-register's wake"))
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if c.Epoch() == epoch {
			return fmt.Errorf("no resync after the re-register yet")
		}
		return nil
	})
	testkit.NoRecv(t, regs, 2*testLease, "a second re-register")
	st := c.Stats()
	require.Equal(t, 2, st.Registers)
	require.Equal(t, map[string]int{client.ResyncReregister: 1}, st.Resyncs)
	require.Equal(t, 2, st.Live, "both still run: the resync re-announces them")
}

// goneAndCopying starts requests "gone" and "copying" (running, blocks
// held) and waits until f has applied them; it returns their epoch. The
// tests then have f forget the engine, holding copying's release.
func goneAndCopying(t *testing.T, f *fakeNode, c *client.Client) string {
	t.Helper()
	for _, r := range []string{"gone", "copying"} {
		c.Added(r, 8)
		c.Blocks(r, 0, 0, []uint32{1, 2})
	}
	require.NoError(t, c.Flush())
	epoch := c.Epoch()
	f.awaitApplied(t, epoch, 4)
	return epoch
}

// TestNoHeartbeatGoesOutWhileAReregisterIsPending: while the node has
// forgotten the engine, the register, retried each period, takes the
// heartbeat's place (checklist step 11): no heartbeat is published.
func TestNoHeartbeatGoesOutWhileAReregisterIsPending(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease)
	enc := dial(t, s.ClientURL(), "e1")
	c := connect(t, enc, client.Config{Engine: "e1", Spec: spec()})
	forgetAndRefuse(t, f, c)
	beats := testkit.Subscribe(t, nc, "kvactors.e1.heartbeat")
	from := c.Stats().RegisterRefusals
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		if n := c.Stats().RegisterRefusals; n < from+2 {
			return fmt.Errorf("%d refusals since, want 2", n-from)
		}
		return nil
	})
	requireNoneSent(t, enc, "kvactors.e1.heartbeat", beats, "a heartbeat was published while a re-register was pending")
}

// TestAStepFlushedBeforeTheReregisterGoesOutWithItsResync: a step flushed
// while the node has forgotten the engine, its register still to pass,
// is not published (the node would drop it; the engine's events wait for a
// registration) but counted, and kept in the mirror: the resync that the
// register starts re-announces it.
func TestAStepFlushedBeforeTheReregisterGoesOutWithItsResync(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease)
	sent := make(chan string, 16)
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(),
		BeforePublish: func(m *nats.Msg, _ uint64, _ int) { sent <- batchEpoch(m) }})
	forgetAndRefuse(t, f, c)
	old := c.Epoch()
	require.NoError(t, c.Added("r", 8))
	require.NoError(t, c.Flush())
	testkit.NoRecv(t, sent, 0, "a batch published while the register was pending") // published under Flush's lock
	require.Equal(t, 1, c.Stats().DiscardedBatches)
	f.refuseRegisters("")
	epoch := testkit.Recv(t, sent, 5*time.Second, "the resync's batch")
	require.NotEqual(t, old, epoch)
	f.awaitApplied(t, epoch, 1)
	require.Equal(t, "r", f.events(epoch)[0].Request)
}
