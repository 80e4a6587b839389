package client_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/internal/testkit"
)

// TestRefusedReregisterIsSurfaced: after a node loss the new boot refuses
// the engine (say --max-engines is reached). Each refusal is counted, the
// first logged at Warn, and handed to OnRegisterRefused; the client keeps
// trying, and registers once the node accepts it.
func TestRefusedReregisterIsSurfaced(t *testing.T) {
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

	f2.mu.Lock()
	f2.refuse = ""
	f2.mu.Unlock()
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
