package node_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// A clustered node that owns an engine (the Go SDK) restarts with its id
// twice: gracefully (Close, then a new boot), then as a crash (its link cut,
// so nothing it does after reaches NATS, then a new boot). Either way the
// new boot finds the previous boot's record at start, answers the engine's
// heartbeat "unknown engine", and the engine, shown the restart, waits out
// its frees (a lease) and registers with the new boot: served again about a
// lease after the new boot started (docs/CLUSTER.md "Failures", a node
// restarts with the same id). Before, Close deleted the record, the new boot
// did not know the engine, and the engine waited a lease of silence to
// declare its node lost and a lease more for its frees: about twice as long
// as after a crash. A request running at the graceful Close gets the closing
// boot's engine_reset (nothing owed: it frees nothing) and, finished on the
// last boot, is released once, by it.
func TestClusterGracefulRestartServesItsEngineAgainAsSoonAsACrashRestart(t *testing.T) { // not parallel: timed against the lease
	kc := &kvCluster{t: t, nats: testkit.NATSCluster(t, 3), dir: t.TempDir()}
	link := testkit.NewLink(t, strings.TrimPrefix(kc.nats.URL(0), "nats://"))
	start := func() *env { // nA on server 0, through the link: a cut is its crash
		return kc.startNode(0, "nA", func(_ int, c *node.Config) {
			c.NATSURL = "nats://" + link.Addr
			node.WithNATSOptions(nats.IgnoreDiscoveredServers())(c)
		})
	}
	nA := start()
	kc.nodes = []*env{nA, kc.startNode(1, "nB")} // another node, which must leave e1 alone
	kc.waitSeen()
	owners := ownersBucket(t, kc.nodes[1].nc) // through nB: up across nA's crash

	te := nA.newEngine("e1", defaultOpts()) // its segment and blocks; the SDK speaks for it
	te.spec.Node = "nA"
	c, releases := sdkEngine(t, kc.nats.URLs(2), "e1", te.spec, nil)
	released := func(req string) []client.Release { return releases()[req] }
	live := func(req string, block uint32) { // a request holding a block, unfinished
		t.Helper()
		require.NoError(t, c.Added(req, 4))
		require.NoError(t, c.Blocks(req, 0, 0, []uint32{block}))
		require.NoError(t, c.Flush())
		awaitRequestRead(t, nA, "e1", req)
	}
	// restart takes nA down (down), starts its next boot and returns how
	// long after that boot's start e1 was served by it, and after down.
	restart := func(how string, down func()) (fromStart, fromDown time.Duration) {
		t.Helper()
		old := c.Stats().Boot
		began := time.Now()
		down()
		// The record's last write as the servers stored it: the bucket's
		// TTL (a lease) runs from there, so the new boot finds the record
		// only if it reads the bucket within a lease of it. A crash's
		// Close that waited out its drain (NATS gone) once let it lapse.
		last, err := owners.Get(context.Background(), "e1")
		require.NoError(t, err, "%s restart: e1's record gone %v after the old boot began to go down", how, time.Since(began))
		nA = start()
		started := time.Now()
		// The mechanism itself, timing aside: the new boot read its
		// previous boot's record of e1 (a closed marker after a graceful
		// Close) at start, so it answers e1's heartbeat "unknown engine".
		require.True(t, nA.node.DroppedHere("e1"), "%s restart: the new boot did not find e1 as its previous boot's (started %v after the record's last write; lease %v)",
			how, started.Sub(last.Created()), clusterLease)
		testkit.Eventually(t, 4*clusterLease, 5*time.Millisecond, func() error {
			if st := c.Stats(); st.Node != "nA" || st.Boot != nA.node.Boot() || !c.Live() {
				return fmt.Errorf("e1 on %s/%s (live %v), not yet on the new boot %s", st.Node, st.Boot, c.Live(), nA.node.Boot())
			}
			return nil
		})
		served := time.Now()
		require.NotEqual(t, old, nA.node.Boot())
		require.Equal(t, []string{"e1"}, nA.node.Engines())
		require.Empty(t, kc.nodes[1].node.Engines(), "nB took e1")
		t.Logf("%s restart: e1 served by the new boot %v after its start, %v after the old one went down (lease %v)",
			how, served.Sub(started), served.Sub(began), clusterLease)
		return served.Sub(started), served.Sub(began)
	}

	live("r1", 1)
	resets := c.Stats().UnowedResets
	graceful, gracefulDown := restart("graceful", func() {
		require.NoError(t, nA.node.Close(context.Background()))
		// r1 runs: its engine_reset frees nothing (nothing is owed), and
		// the SDK counts it.
		testkit.Eventually(t, clusterLease, 5*time.Millisecond, func() error {
			if got := c.Stats().UnowedResets; got == resets {
				return errors.New("r1's engine_reset by the closing boot not received")
			}
			return nil
		})
	})

	live("r2", 2)
	crash, crashDown := restart("crash", func() {
		link.Cut() // nothing nA does from here on reaches NATS
		_ = nA.node.Close(context.Background())
		link.Restore()
	})
	// Both requests, live across the restarts, finish on the last boot and
	// are released once, by it.
	require.NoError(t, c.Finished("r1", false, 4, 4))
	require.NoError(t, c.Finished("r2", false, 4, 4))
	require.NoError(t, c.Flush())
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if len(released("r1")) == 0 || len(released("r2")) == 0 {
			return errors.New("r1 and r2 not both released")
		}
		return nil
	})
	for _, r := range []string{"r1", "r2"} {
		rs := released(r)
		require.Len(t, rs, 1, "releases of %s: %+v", r, rs)
		require.Equal(t, messages.ReasonFinished, rs[0].Reason, "release of %s", r)
	}
	require.Zero(t, c.Stats().UnexpectedRel)

	// A crash restart is served about a lease after the new boot's start
	// (the engine's frees); a graceful one must be no slower.
	require.Less(t, crash, clusterLease*3/2, "crash restart")
	require.Less(t, graceful, clusterLease*3/2, "graceful restart: served %v after the new boot's start (crash: %v)", graceful, crash)
	require.Less(t, gracefulDown, crashDown+clusterLease/2, "graceful restart: served %v after the Close (crash: %v after the cut)", gracefulDown, crashDown)
}
