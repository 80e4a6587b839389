package node_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/cluster"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/node"
)

// Close unmaps the pool after closeCluster, so it returns only once what
// copies into or out of the pool through the cluster has ended: a remote
// load's fetch (held as it allocates a chunk's room, past the cancel Close
// sends it) and a fetch being served (held in readChunk). Each is reached
// through its real entry point (a load message, the fetch server); the
// seam only holds it there.
func TestCloseWaitsForARemoteLoadsFetchAndAFetchBeingServed(t *testing.T) {
	t.Parallel()
	kc := startCluster(t, 3)
	a := kc.engineOn(0, "ea", "m")
	b := kc.engineOn(1, "eb", "m")
	c := kc.engineOn(2, "ec", "m")
	a.register()
	b.register()
	c.register()
	hs := []string{hash("w", 0), hash("w", 1)}
	a.storePrefix("r", hs, 40, 41, 9, "stored by A")
	awaitLookup(t, b, hs, 8, "B")
	awaitLookup(t, c, hs, 8, "C")
	load := func(te *testEngine, req string) {
		_ = collect(t, te.e.nc, "kvactors."+te.id+".load",
			map[string]any{"request": req, "hashes": hs, "num_tokens": 8, "blocks": [][]int{{2, 3}}})
	}
	closeWhileHeld := func(i int, entered <-chan struct{}, release func(), what string) {
		t.Helper()
		testkit.Closed(t, entered, 10*time.Second, what+" held")
		closed := make(chan error, 1)
		go func() { closed <- kc.nodes[i].node.Close(context.Background()) }()
		testkit.NoRecv(t, closed, 300*time.Millisecond, "Close's return while "+what+" is held")
		release()
		require.NoError(t, testkit.Recv(t, closed, 10*time.Second, "Close's return once "+what+" ends"))
	}

	// B's load fetches from A; B closes while its fetch is held.
	fetching, release := kc.nodes[1].node.HoldInClusterGate("fetch")
	load(b, "rb")
	closeWhileHeld(1, fetching, release, "B's remote load's fetch")

	// C's load fetches from A; A closes while it serves the fetch.
	serving, release := kc.nodes[0].node.HoldInClusterGate("read")
	load(c, "rc")
	closeWhileHeld(0, serving, release, "the fetch A serves")
}

// closeOwner starts nA, alone on the NATS cluster through a link (a cut is
// its outage), with lease and shutdown timeout, owning e1 with a request
// live (retiring it publishes a release during Close).
func closeOwner(t *testing.T, lease, shutdown time.Duration) (*env, *testkit.Link) {
	t.Helper()
	kc := &kvCluster{t: t, nats: testkit.NATSCluster(t, 3), dir: t.TempDir()}
	link := testkit.NewLink(t, strings.TrimPrefix(kc.nats.URL(0), "nats://"))
	nA := kc.startNode(0, "nA", func(_ int, c *node.Config) {
		c.NATSURL = "nats://" + link.Addr
		c.Lease, c.ShutdownTimeout = lease, shutdown
		node.WithNATSOptions(nats.IgnoreDiscoveredServers())(c)
	})
	te := nA.newEngine("e1", defaultOpts())
	te.spec.Node = "nA"
	te.register()
	te.send(added("r1", 4), blocksEv("r1", 0, 0, 1))
	awaitRequestRead(t, nA, "e1", "r1")
	return nA, link
}

// A link to NATS cut as Close leaves its engines' closed markers (the
// client not yet aware: its check said connected) leaves no answer to
// come: Close gives the Leaves up as soon as the client sees the
// connection go down, not at the shutdown timeout, which a Leave waited
// out whole (the engine's record lapses after a lease anyway, as after a
// crash).
func TestCloseGivesUpTheLeavesWhenNATSGoesDown(t *testing.T) { // not parallel: sets the package's Leave
	nA, link := closeOwner(t, time.Minute, 40*time.Second) // half a lease: past the test's wait
	var cut sync.Once
	leaves := make(chan string, 8)
	defer node.SetLeave(func(o *cluster.Owners, ctx context.Context, engine string) error {
		cut.Do(link.Cut) // a Leave begun, then the link gone: its update is never answered
		leaves <- engine
		return o.Leave(ctx, engine)
	})()
	began := time.Now()
	closed := make(chan error, 1)
	go func() { closed <- nA.node.Close(context.Background()) }()
	require.Equal(t, "e1", testkit.Recv(t, leaves, 5*time.Second, "e1's Leave"))
	testkit.Recv(t, closed, 5*time.Second, "Close's return after NATS went down (shutdown timeout 40 s)")
	t.Logf("Close took %v", time.Since(began))
}

// A Leave never answered while NATS seems up (JetStream without a quorum,
// a link gone silent: no status change to see) takes at most half a lease, not the shutdown
// timeout: the record lapses a lease after its last keep-alive, so a
// marker later than that could not land, and the releases' flush that
// follows would find no time left (the release published during Close
// counted unconfirmed, ErrUndelivered).
func TestCloseBoundsTheLeavesByHalfALease(t *testing.T) { // not parallel: sets the package's Leave
	nA, _ := closeOwner(t, clusterLease, 40*time.Second)
	defer node.SetLeave(func(_ *cluster.Owners, ctx context.Context, _ string) error {
		<-ctx.Done() // never answered
		return ctx.Err()
	})()
	began := time.Now()
	closed := make(chan error, 1)
	go func() { closed <- nA.node.Close(context.Background()) }()
	require.NoError(t, testkit.Recv(t, closed, 10*time.Second, "Close's return (half a lease: 1 s; shutdown timeout 40 s)"))
	t.Logf("Close took %v", time.Since(began))
}

// A release Close publishes is confirmed only by a flush NATS answers. One
// written out just before the link failed (here into a link gone silent,
// then cut while Close waits for its flush) is lost with it: the client's
// buffer is empty, but that proves nothing, and Close reports the release
// unconfirmed (ErrUndelivered), not delivered.
func TestCloseCountsAReleaseUnconfirmedWhenNATSWentDownAfterIt(t *testing.T) { // not parallel: sets the package's drain
	nA, link := closeOwner(t, time.Minute, 40*time.Second)
	defer node.SetSubscriptionDrain(func(*nats.Subscription) error {
		link.Freeze() // from here on, what the node writes is lost
		// The link's failure, then (the client sees the connection go):
		// before or during the flush that would confirm r1's release.
		time.AfterFunc(200*time.Millisecond, link.Cut)
		return errors.New("no drain")
	})()
	err := nA.node.Close(context.Background())
	require.ErrorIs(t, err, node.ErrUndelivered, "r1's release, lost with the link, reported delivered")
	require.Contains(t, err.Error(), "1 published during shutdown but not confirmed")
}

// Close confirms the releases it published before it leaves the closed
// markers: a Leave never answered (JetStream without a quorum, core NATS
// up) may use the rest of the shutdown timeout, as when half a lease is
// longer than that timeout (--lease 20s, --shutdown-timeout 10s), without
// the release, delivered, being reported unconfirmed (ErrUndelivered).
func TestCloseConfirmsItsReleasesBeforeTheLeaves(t *testing.T) { // not parallel: sets the package's Leave
	nA, _ := closeOwner(t, 4*time.Second, 2*time.Second) // half a lease = the whole shutdown timeout
	defer node.SetLeave(func(_ *cluster.Owners, ctx context.Context, _ string) error {
		<-ctx.Done() // never answered
		return ctx.Err()
	})()
	require.NoError(t, nA.node.Close(context.Background()))
}
