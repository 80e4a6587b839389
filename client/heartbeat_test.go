package client_test

import (
	"encoding/json"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/internal/testkit"
)

// TestHeartbeatNeverFollowsTheNextEpoch: a resync on another goroutine
// tries to run at the very moment a heartbeat is about to go out. The node
// must never get that heartbeat, carrying the ended epoch, after the new
// epoch's first batch.
func TestHeartbeatNeverFollowsTheNextEpoch(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	startFakeNode(t, nc, "n1", "boot1", testLease)
	seen := testkit.Subscribe(t, nc, "kvactors.e1.*")
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec()})
	first := c.Epoch()
	c.Added("r1", 8)
	require.NoError(t, c.Flush())
	raced := make(chan struct{}, 1)
	var once sync.Once
	client.SetBeforeHeartbeat(c, func() {
		once.Do(func() {
			done := make(chan struct{})
			go func() {
				c.Resync()
				_ = c.Flush()
				close(done)
			}()
			// Give the resync every chance to go first; if the heartbeat is
			// published under the batches' lock it cannot, and this times out.
			select {
			case <-done:
			case <-time.After(200 * time.Millisecond):
			}
			raced <- struct{}{}
		})
	})
	testkit.Recv(t, raced, 5*time.Second, "a heartbeat raced by a resync")
	newEpoch := false
	for {
		m := testkit.Recv(t, seen, 5*time.Second, "the new epoch's batch and a heartbeat after it")
		var body struct{ Epoch string }
		require.NoError(t, json.Unmarshal(m.Data, &body))
		switch {
		case strings.HasSuffix(m.Subject, ".events"):
			newEpoch = newEpoch || body.Epoch != first
		case strings.HasSuffix(m.Subject, ".heartbeat"):
			if newEpoch {
				require.NotEqual(t, first, body.Epoch, "a heartbeat of the ended epoch after the new epoch's batch")
				return
			}
		}
	}
}
