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
)

// TestLookupWhileLostIsSafeBesideARegister: Lookups failing while the node
// is lost read the session's node under the lock a register writes it
// under (run with -race).
func TestLookupWhileLostIsSafeBesideARegister(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f1 := startFakeNode(t, nc, "n1", "boot1", testLease)
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(),
		RequestTimeout: 100 * time.Millisecond})
	f1.kill()
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if c.Stats().NodeLosses == 0 {
			return fmt.Errorf("no loss yet")
		}
		return nil
	})
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			_, _ = c.Lookup(context.Background(), []string{"01"})
		}
	}()
	startFakeNode(t, nc, "n1", "boot2", testLease)
	testkit.Eventually(t, 10*time.Second, 5*time.Millisecond, func() error {
		if !c.Live() {
			return fmt.Errorf("not live yet")
		}
		return nil
	})
	close(stop)
	wg.Wait()
}

// Close retries an unregister the node answered "node overloaded" (its
// full intake dropped it unread), as a register is retried: given up, the
// node would keep the engine and its segments until it expired.
func TestCloseRetriesAnUnregisterTheNodeWasTooBusyToTake(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", time.Minute)
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec()})
	f.kill()
	var mu sync.Mutex
	n := 0
	us, err := nc.Subscribe("kvactors.e1.unregister", func(m *nats.Msg) {
		mu.Lock()
		n++
		first := n == 1
		mu.Unlock()
		if first {
			_ = m.Respond([]byte(`{"error":"node overloaded: inbound queue full, try again","node":"n1","boot":"boot1"}`))
			return
		}
		_ = m.Respond([]byte(`{"ok":true,"released":0,"node":"n1","boot":"boot1"}`))
	})
	require.NoError(t, err)
	defer func() { _ = us.Unsubscribe() }()
	require.NoError(t, nc.Flush())
	err = c.Close()
	mu.Lock()
	defer mu.Unlock()
	require.NoError(t, err, "Close after an unregister the node was too busy to take")
	require.Equal(t, 2, n, "the unregister sent again")
}
