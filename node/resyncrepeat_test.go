package node_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// PROTOCOL.md v2 "Delivery": the resync repeats "(at most once per
// lease_ms/4) while batches or heartbeats of that epoch keep arriving".
// TestResyncRepeatsRateLimited repeats it with batches; here an engine
// whose resync was lost and that has nothing more to publish only
// heartbeats: those alone bring the order again, with the same fields,
// and no more often than lease/4.
func TestResyncRepeatsOnHeartbeatsAlone(t *testing.T) {
	const lease = 400 * time.Millisecond
	e := startNode(t, func(c *node.Config) { c.Lease = lease })
	te := e.newEngine("e1", defaultOpts())
	te.register()
	te.send(added("a", 4))
	te.seq = 3 // batches 2 and 3 lost
	start := time.Now()
	te.send(added("b", 4))
	first := recv(t, te.resync, "first resync")
	want := messages.Resync{Node: e.node.NodeID(), Boot: e.node.Boot(), Epoch: "ep1", Expected: 2, Got: 4,
		Reason: messages.ResyncGap}
	require.Equal(t, want, first)

	beats := 0
	var second messages.Resync
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		select {
		case second = <-te.resync:
			return nil
		default:
		}
		require.Empty(t, te.heartbeat("ep1", te.seq).Error)
		beats++
		return fmt.Errorf("no repeat yet")
	})
	elapsed := time.Since(start)
	require.Equal(t, want, second, "the repeat is the same order")
	require.GreaterOrEqual(t, elapsed, lease/4, "repeated before lease/4")
	require.Greater(t, beats, 3, "heartbeats within lease/4 repeated nothing")
	require.LessOrEqual(t, resyncs(t, e, "gap"), 1+float64(time.Since(start)/(lease/4)))
	require.True(t, te.sync().Resyncing)
}
