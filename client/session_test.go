package client_test

import (
	"context"
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

// TestRefusedReregisterIsSurfaced: after a node loss the new boot refuses
// the engine (say --max-engines is reached). Each refusal is counted, the
// first logged at Warn, and handed to OnRegisterRefused; the client keeps
// trying, and registers once the node accepts it.
func TestRefusedReregisterIsSurfaced(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease)
	var logs testkit.SyncBuffer
	refused := make(chan error, 64)
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(),
		Log: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn})),
		OnRegisterRefused: func(err error) {
			select {
			case refused <- err:
			default:
			}
		}})
	c.Added("r1", 8)
	require.NoError(t, c.Flush())
	f.kill()
	const why = "limit: engine refused: --max-engines 1 reached"
	f2 := startFakeNode(t, nc, "n1", "boot2", testLease, func(f *fakeNode) { f.refuse = why })
	require.ErrorContains(t, testkit.Recv(t, refused, 5*time.Second, "a refused re-register"), why)
	testkit.Recv(t, refused, 5*time.Second, "a second refusal: the client keeps trying")
	st := c.Stats()
	require.GreaterOrEqual(t, st.RegisterRefusals, 2)
	require.Contains(t, st.RegisterRefused, why)
	require.False(t, c.Live())
	require.Equal(t, 1, strings.Count(logs.String(), "re-register refused"), "one Warn per distinct refusal: %s",
		logs.String())
	require.Contains(t, logs.String(), "level=WARN")

	f2.refuseRegisters("")
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		if st := c.Stats(); st.Boot != "boot2" || st.Resyncs["new_boot"] != 1 || st.RegisterRefused != "" {
			return fmt.Errorf("boot %s, resyncs %v, refused %q", st.Boot, st.Resyncs, st.RegisterRefused)
		}
		return nil
	})
	require.True(t, c.Live())
}

// TestConnectEndsWithItsContext: a register that reaches a responder that
// never answers is bounded by Connect's ctx, not only by RequestTimeout.
func TestConnectEndsWithItsContext(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	attempts := testkit.Subscribe(t, nc, "kvactors.e1.register") // hears, never answers
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := client.Connect(ctx, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(),
			RequestTimeout: time.Minute})
		done <- err
	}()
	testkit.Recv(t, attempts, 5*time.Second, "the register")
	require.ErrorIs(t, testkit.Recv(t, done, 2*time.Second, "Connect ending with its ctx"), context.DeadlineExceeded)
}

// TestCloseWhileReregisterPending: the node forgot the engine and refuses
// it again, so a re-register is pending; Close sends no unregister (the
// node would only answer "unknown engine") and reports no error.
func TestCloseWhileReregisterPending(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease)
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec()})
	f.mu.Lock()
	f.registered, f.refuse = false, "limit: no"
	f.mu.Unlock()
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		if c.Stats().RegisterRefusals == 0 {
			return fmt.Errorf("no refused re-register yet")
		}
		return nil
	})
	require.NoError(t, c.Close())
	_, unregisters := f.counts()
	require.Zero(t, unregisters)
}

// TestALateMessageOfAPastBootIsNoNews: once the engine has registered with
// boot2, a message boot1 sent before it died (delivered late) is not a
// restart of boot2 (PROTOCOL.md step 14); nor is one of a boot not seen
// before that never answers (boot3: boot2 answers the probe, so boot3 is
// older); a boot not seen before that answers is (boot4).
func TestALateMessageOfAPastBootIsNoNews(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f1 := startFakeNode(t, nc, "n1", "boot1", testLease)
	var logs testkit.SyncBuffer
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(),
		Log: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	f1.kill()
	f2 := startFakeNode(t, nc, "n1", "boot2", testLease)
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if st := c.Stats(); st.Boot != "boot2" || st.Registers != 2 {
			return fmt.Errorf("registered %d times, boot %q", st.Registers, st.Boot)
		}
		return nil
	})
	st0 := c.Stats()
	losses := st0.NodeLosses

	// On one subscription, in order: boot1's late heartbeat, then boot3's.
	beat := messages.NodeSubject("kvactors", "n1", messages.NodeVerbHeartbeat)
	f2.publish(beat, messages.NodeHeartbeat{Node: "n1", Boot: "boot1"})
	f2.publish(beat, messages.NodeHeartbeat{Node: "n1", Boot: "boot3"})
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		st := c.Stats()
		if st.BootsSuspected != st0.BootsSuspected+1 || st.BootsStale != st0.BootsStale+1 {
			return fmt.Errorf("%d boots suspected, %d stale since boot2's register; want boot3 probed and found stale",
				st.BootsSuspected-st0.BootsSuspected, st.BootsStale-st0.BootsStale)
		}
		return nil
	})
	require.Equal(t, losses, c.Stats().NodeLosses)
	require.True(t, c.Live())

	f2.kill()
	startFakeNode(t, nc, "n1", "boot4", testLease)
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if got := c.Stats().NodeLosses; got != losses+1 {
			return fmt.Errorf("%d node losses since boot2's register, want 1", got-losses)
		}
		return nil
	})
	require.Contains(t, logs.String(), `why="new boot boot4"`)
	require.NotContains(t, logs.String(), `why="new boot boot1"`, "boot1's late heartbeat was taken for a restart of boot2")
	require.NotContains(t, logs.String(), `why="new boot boot3"`, "boot3, which never answered, was taken for a restart")
	require.NoError(t, c.Close())
}

func TestPastBoots(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name               string
		past               []string
		node, boot, rn, rb string
		want               []string
	}{
		{"first register", nil, "", "", "n1", "b1", nil},
		{"same boot again", []string{"b0"}, "n1", "b1", "n1", "b1", []string{"b0"}},
		{"a restart", []string{"b0"}, "n1", "b1", "n1", "b2", []string{"b0", "b1"}},
		{"another node", []string{"b0"}, "n1", "b1", "n2", "b9", nil},
		{"a past boot answers", []string{"b0", "b1"}, "n1", "b2", "n1", "b1", []string{"b0", "b2"}},
		{"bounded", []string{"b0", "b1", "b2", "b3"}, "n1", "b4", "n1", "b5", []string{"b1", "b2", "b3", "b4"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, client.PastBoots(tc.past, tc.node, tc.boot, tc.rn, tc.rb))
		})
	}
}

// TestConnectRetriesARegisterTheNodeWasTooBusyToTake: a node whose intake
// is full answers a register "node overloaded: …, try again" (it dropped
// it unread): Connect retries it, as it retries one nobody answered,
// instead of taking it for a refusal of the spec.
func TestConnectRetriesARegisterTheNodeWasTooBusyToTake(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	registers := 0
	sub, err := nc.Subscribe("kvactors.e1.register", func(m *nats.Msg) {
		registers++ // one handler goroutine: no lock needed
		if registers == 1 {
			_ = m.Respond([]byte(`{"error":"node overloaded: inbound queue full, try again","node":"n1","boot":"b1"}`))
			return
		}
		_ = m.Respond([]byte(`{"ok":true,"node":"n1","boot":"b1","lease_ms":400}`))
	})
	require.NoError(t, err)
	defer func() { _ = sub.Unsubscribe() }()
	require.NoError(t, nc.Flush())
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := client.Connect(ctx, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec()})
	require.NoError(t, err, "Connect gave up on an overloaded node")
	defer func() { _ = c.Close() }()
	require.Equal(t, 1, c.Stats().Registers)
}

// TestAReregisterTheNodeWasTooBusyToTakeIsNoRefusal: after the node forgot
// the engine, a register answered "node overloaded" is retried without
// being counted or reported as a refusal (OnRegisterRefused).
func TestAReregisterTheNodeWasTooBusyToTakeIsNoRefusal(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease)
	refused := make(chan error, 16)
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(),
		OnRegisterRefused: func(err error) { refused <- err }})
	registers := testkit.Subscribe(t, nc, "kvactors.e1.register")
	f.mu.Lock()
	f.registered, f.refuse = false, "node overloaded: inbound queue full, try again"
	f.mu.Unlock()
	testkit.Recv(t, registers, 5*time.Second, "a re-register")
	testkit.Recv(t, registers, 5*time.Second, "a retried re-register")
	f.refuseRegisters("")
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		if !c.Live() {
			return fmt.Errorf("not registered again yet")
		}
		return nil
	})
	st := c.Stats()
	require.Zero(t, st.RegisterRefusals)
	require.Empty(t, st.RegisterRefused)
	require.Empty(t, refused)
}

// A re-register takes effect in one step: the moment the new boot is the
// session's, the loss is over, so a request finished just then is owed
// its release by the new boot and is not freed node_lost. Before, the
// loss ended in a second step, and a request finished between the two was
// freed at once, though the new boot was already registered (seen as a
// flake of TestARestartSeenBeforeTheRegisterReplyDoesNotSettleTheNewBootsLoads).
func TestARequestFinishedAsTheReregisterTakesEffectIsNotFreedNodeLost(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	hold := func(f *fakeNode) { f.holdRelease = func(uint64) bool { return true } }
	f1 := startFakeNode(t, nc, "n1", "boot1", testLease, hold)
	rels := newReleases()
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(), OnReleased: rels.on})
	oneRequest(t, c, "r1")

	type step struct {
		before, after client.Stats
		err           error
	}
	steps := make(chan step, 4)
	client.SetAfterReregister(c, func() { // on the session loop, as the engine's own goroutine could
		before := c.Stats()
		c.Added("r2", 8)
		c.Blocks("r2", 0, 0, []uint32{3, 4})
		err := c.Finished("r2", false, 8, 8)
		select {
		case steps <- step{before, c.Stats(), err}:
		default:
		}
	})
	f1.kill()
	startFakeNode(t, nc, "n1", "boot2", testLease, hold)
	rel := testkit.Recv(t, rels.ch, 5*time.Second, "r1 freed by boot1's loss")
	require.Equal(t, client.Release{Request: "r1", Reason: messages.ReasonNodeLost}, rel)

	st := testkit.Recv(t, steps, 5*time.Second, "the re-register with boot2")
	require.NoError(t, st.err)
	require.Equal(t, "boot2", st.before.Boot)
	require.Equal(t, 2, st.before.Registers)
	require.Equal(t, st.before.NodeLostFrees, st.after.NodeLostFrees, "r2, finished as boot2 became the session's, was freed node_lost")
	require.Equal(t, st.before.Releases, st.after.Releases, "r2 was freed before boot2 released it")
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error { // the new epoch's resync follows
		if !c.Live() {
			return fmt.Errorf("the session with boot2 is not live")
		}
		return nil
	})
}
