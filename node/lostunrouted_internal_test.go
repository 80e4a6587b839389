package node

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// A batch intake drops while its engine's register still waits in the
// shard (the engine not routed yet) makes the engine resync with reason
// overflow (PROTOCOL.md "Delivery"), not gap: the loss is kept until the
// register has made the engine's actor, which is told before the engine's
// next batch, and that batch's gap (the first of the epoch, seq 2) is
// resynced for the loss. Said gap, the SDK would answer at once, into the
// full intake, without its overflow backoff.
//
// The shard's worker is held inside the turn of another engine's actor
// (same shard; its mailbox runs on the worker), the intake's budget is
// taken while e1's batch arrives, and the loss is flushed, as the session
// loop's tick would, while the register still waits. Lease is an hour: no
// tick flushes on its own.
func TestABatchLostWhileItsRegisterWaitsResyncsOverflow(t *testing.T) {
	t.Parallel()
	n, nc, dir := startInternal(t, func(c *Config) { c.Lease = time.Hour })
	in := n.ingest
	shard := in.shard("e1")
	e0 := "e0"
	for i := 1; in.shard(e0) != shard; i++ {
		e0 = fmt.Sprintf("e0-%d", i)
	}
	h := registerHeldEngine(t, n, nc, dir, e0)
	h.arm.Store(true)
	require.NoError(t, nc.Publish("kvactors."+e0+".events", []byte(`{"epoch":"a","seq":1,"events":[]}`)))
	require.NoError(t, nc.Flush())
	testkit.Recv(t, h.holding, 5*time.Second, "the worker held in "+e0+"'s actor")

	resync := testkit.Subscribe(t, nc, "kvactors.e1.resync")
	registered := make(chan error, 1)
	go func() { registered <- tryRegister(t, nc, dir, "e1") }()
	queued := func(k int) func() error {
		return func() error {
			if got := len(in.queues[shard]); got != k {
				return fmt.Errorf("%d messages wait in the shard, want %d", got, k)
			}
			return nil
		}
	}
	testkit.Eventually(t, 5*time.Second, time.Millisecond, queued(1)) // e1's register

	rest := in.budget - in.pending.Load()
	require.True(t, holdTotal(in, rest))
	batch := func(seq int) {
		require.NoError(t, nc.Publish("kvactors.e1.events", fmt.Appendf(nil, `{"epoch":"a","seq":%d,"events":[]}`, seq)))
		require.NoError(t, nc.Flush())
	}
	batch(1)
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if v := testutil.ToFloat64(n.metrics.DroppedBatches.WithLabelValues(messages.ResyncOverflow)); v != 1 {
			return fmt.Errorf("overflow drops %v", v)
		}
		return nil
	})
	freeTotal(in, rest)
	in.flushLost() // e1 is not routed yet
	batch(2)
	testkit.Eventually(t, 5*time.Second, time.Millisecond, queued(2))

	h.release()
	require.NoError(t, testkit.Recv(t, registered, 5*time.Second, "e1's register reply"))
	var rs messages.Resync
	require.NoError(t, json.Unmarshal(testkit.Recv(t, resync, 5*time.Second, "e1's resync").Data, &rs))
	require.Equal(t, messages.Resync{Node: n.NodeID(), Boot: n.Boot(), Epoch: "a", Expected: 1, Got: 2,
		Reason: messages.ResyncOverflow}, rs)
}
