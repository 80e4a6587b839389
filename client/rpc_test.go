package client_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/internal/testkit"
)

// TestLookupWhileLostIsSafeBesideARegister: Lookups failing while the node
// is lost read the session's node under the lock a register writes it
// under (run with -race).
func TestLookupWhileLostIsSafeBesideARegister(t *testing.T) {
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
