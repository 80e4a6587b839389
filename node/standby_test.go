package node_test

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// A standby started while its primary is alive has heard nothing of it yet
// (the primary's next heartbeat is up to lease/4 away): it must not take
// the engines that name the primary and register meanwhile
// (PROTOCOL.md "Clusters": only once N "has sent no hello or heartbeat for
// a lease").
func TestAFreshStandbyLeavesALivePrimarysEnginesAlone(t *testing.T) {
	t.Parallel()
	// Heartbeats every lease/4 = 7.5 s: the standby starts and the engines
	// register well before n0's first heartbeat after its hello.
	const lease = 30 * time.Second
	kc := startCluster(t, 1, func(_ int, c *node.Config) { c.Lease = lease })
	sb := kc.startNode(1, "sb", func(_ int, c *node.Config) { c.Lease, c.Cluster, c.StandbyFor = lease, false, "n0" })
	onStandby := 0
	for i := range 4 {
		id := fmt.Sprintf("e%d", i)
		te := kc.nodes[0].newEngine(id, defaultOpts())
		te.spec.Node = "n0" // the engine names its (live) primary
		replies := collect(t, kc.nodes[0].nc, "kvactors."+id+".register", te.spec)
		var r messages.RegisterReply
		require.NoError(t, json.Unmarshal(testkit.Recv(t, replies, 10*time.Second, "register reply").Data, &r))
		require.True(t, r.OK, r.Error)
		if r.Node == "sb" {
			onStandby++
		}
	}
	for _, ni := range sb.node.ClusterNodes() { // the kv_events of the registers name n0, but say nothing of its life
		require.True(t, ni.LastSeen.IsZero(), "the standby heard %s before the registers: the test shows nothing", ni.Node)
	}
	require.Zero(t, decisions(sb, "claim"), "the standby decided to claim engines that name a live primary")
	require.Zero(t, onStandby, "engines naming a live primary were taken by its standby")
}

// A standby started after its primary died cannot tell the primary is gone
// until it has listened for a lease: it takes the primary's engines a lease
// after its own start, not before.
func TestAStandbyTakesADeadPrimarysEnginesALeaseAfterItStarted(t *testing.T) {
	t.Parallel()
	kc := startCluster(t, 0)
	// The first register must be decided within a lease of the standby's
	// start for the test to show anything; on a loaded 2-core machine the
	// start alone took 2.2 s, past clusterLease, so the standby has a longer
	// lease of its own.
	lease := 3 * clusterLease
	before := time.Now()
	sb := kc.startNode(0, "sb", func(_ int, c *node.Config) { c.Cluster, c.StandbyFor, c.Lease = false, "n0", lease })
	te := sb.newEngine("e0", defaultOpts())
	te.spec.Node = "n0" // n0 never started
	register := func(wait time.Duration) *messages.RegisterReply {
		replies := collect(t, sb.nc, "kvactors.e0.register", te.spec)
		select {
		case m := <-replies:
			var r messages.RegisterReply
			require.NoError(t, json.Unmarshal(m.Data, &r))
			return &r
		case <-time.After(wait):
			return nil
		}
	}
	replies := collect(t, sb.nc, "kvactors.e0.register", te.spec)
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		if decisions(sb, "ignore")+decisions(sb, "claim") == 0 {
			return fmt.Errorf("the standby has not decided the register yet")
		}
		return nil
	})
	require.Less(t, time.Since(before), lease, "the first register was decided within a lease of the start")
	require.Zero(t, decisions(sb, "claim"), "the standby claimed before it could tell n0 is gone")
	testkit.NoRecv(t, replies, 100*time.Millisecond, "a register reply")

	var r *messages.RegisterReply
	testkit.Eventually(t, 4*lease, 10*time.Millisecond, func() error {
		if r = register(200 * time.Millisecond); r == nil {
			return fmt.Errorf("no register reply after %v", time.Since(before))
		}
		return nil
	})
	require.True(t, r.OK, r.Error)
	require.Equal(t, "sb", r.Node)
	require.GreaterOrEqual(t, time.Since(before), lease, "taken over a lease after the standby's start at the earliest")
}

// A standby holds no engine while its primary is alive, those that name no
// node included (docs/CLUSTER.md "Deployment"): it does not even try to
// claim them, so every one goes to the primary. Before, it raced the
// primary for each (Decide claimed an unnamed engine for any local node).
func TestAStandbyLeavesUnnamedEnginesToItsLivePrimary(t *testing.T) {
	t.Parallel()
	kc := startCluster(t, 1)
	var logs lineLog
	logs.dumpOnFailure(t)
	sb := kc.startNode(1, "sb", func(_ int, c *node.Config) {
		c.Cluster, c.StandbyFor = false, "n0"
		c.Log = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})) // an ignored register is a Debug line
	})
	for i := range 4 {
		id := fmt.Sprintf("e%d", i)
		te := kc.nodes[0].newEngine(id, defaultOpts()) // names no node; its memory is on both nodes' host
		replies := collect(t, kc.nodes[0].nc, "kvactors."+id+".register", te.spec)
		var r messages.RegisterReply
		require.NoError(t, json.Unmarshal(testkit.Recv(t, replies, 10*time.Second, "register reply").Data, &r))
		require.True(t, r.OK, r.Error)
		require.Equal(t, "n0", r.Node)
	}
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		if got := decisions(sb, "ignore"); got < 4 {
			return fmt.Errorf("the standby decided %v of the 4 registers", got)
		}
		return nil
	})
	require.Zero(t, decisions(sb, "claim"), "the standby tried to claim unnamed engines of a live primary")
	require.Empty(t, sb.node.Engines())
}
