package client_test

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// overflowRig is a fake node and an engine on it whose first batch the node
// has applied; old is that batch's epoch.
func overflowRig(t *testing.T, backoff time.Duration) (f *fakeNode, c *client.Client, batches <-chan *nats.Msg, old string) {
	t.Helper()
	s, nc := testkit.NATS(t)
	f = startFakeNode(t, nc, "n1", "boot1", 10*time.Second) // heartbeats every 2.5 s
	batches = testkit.Subscribe(t, nc, "kvactors.e1.events")
	c = connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(), OverflowBackoff: backoff})
	c.Added("r0", 8)
	require.NoError(t, c.Flush())
	old = c.Stats().Epoch
	testkit.Recv(t, batches, 5*time.Second, "the first batch")
	f.awaitApplied(t, old, 1)
	return f, c, batches, old
}

// awaitNewEpoch waits (15 s in all) for a batch of an epoch other than old.
func awaitNewEpoch(t *testing.T, batches <-chan *nats.Msg, old string) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		left := time.Until(deadline)
		if left <= 0 {
			t.Fatalf("no batch of a new epoch within 15s (old epoch %s)", old)
		}
		m := testkit.Recv(t, batches, left, "the new epoch's first batch")
		var b struct{ Epoch string }
		require.NoError(t, json.Unmarshal(m.Data, &b))
		if b.Epoch != old {
			return
		}
	}
}

// An overflow resync is answered after Config.OverflowBackoff (drawn from
// [½, 1] of it), not at once: batches flushed meanwhile are held, not
// sent into the full intake, and the new epoch re-announces them.
func TestOverflowResyncWaitsItsBackoff(t *testing.T) {
	t.Parallel()
	const backoff = time.Second
	f, c, batches, old := overflowRig(t, backoff)
	asked := time.Now()
	f.overflow("e1")
	added := 1
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		c.Added(fmt.Sprintf("r%d", added), 8)
		added++
		require.NoError(t, c.Flush())
		if st := c.Stats(); st.HeldBatches == 0 {
			require.Equal(t, old, st.Epoch, "the resync came before any batch was held")
			return fmt.Errorf("no batch held yet")
		}
		return nil
	})
	require.Equal(t, old, c.Stats().Epoch, "no new epoch while the wait lasts")

	awaitNewEpoch(t, batches, old)
	require.GreaterOrEqual(t, time.Since(asked), backoff/2, "the new epoch came before the wait was over")
	st := c.Stats()
	require.Equal(t, 1, st.Resyncs["resync"])
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		seen := map[string]bool{}
		for _, ev := range f.events(st.Epoch) {
			if ev.Type == messages.EvAdded {
				seen[ev.Request] = true
			}
		}
		if len(seen) != added {
			return fmt.Errorf("the new epoch announced %d of %d requests", len(seen), added)
		}
		return nil
	})
}

// An engine that flushes nothing while it waits still resyncs when the
// wait ends, even if a heartbeat was awaiting its reply then (a node whose
// intake overflowed answers slowly): not a heartbeat period later.
func TestOverflowResyncOfAnIdleEngineEndsWithItsWait(t *testing.T) {
	t.Parallel()
	f, _, batches, old := overflowRig(t, 40*time.Millisecond)
	f.mu.Lock()
	f.hbDelay = 300 * time.Millisecond // longer than the wait
	f.mu.Unlock()
	asked := time.Now()
	f.overflow("e1")
	awaitNewEpoch(t, batches, old)
	require.Less(t, time.Since(asked), 2*time.Second, "the resync waited for the next heartbeat period")
}
