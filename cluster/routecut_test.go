package cluster

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/cluster/ownership"
	"github.com/kvactors/kvactors/internal/testkit"
)

// docs/CLUSTER.md "Fencing the owner", under a network partition rather
// than a lost client link: the owner's NATS server (a follower of the
// claims' stream) has its routes cut, right after the owner's keep-alive
// (the freshest record: the worst moment for its standby). The owner stays
// connected to its server, so only its failing writes tell it; it stops
// serving a lease after its last write's send, and the standby on the
// majority side claims only after that: the claim's acknowledgement comes
// later than the owner's last moment of serving. In the cut the owner's
// keep-alives fail without a fence and a register it reads is not served
// past its lease. Healed, its keep-alive is fenced and the record stays
// the standby's.
func TestARouteCutOwnerStopsServingBeforeItsStandbyClaims(t *testing.T) {
	t.Parallel()
	c := testkit.NATSClusterWithRouteLinks(t, 3)
	openOwners(t, c.Connect(0), "setup", "", 3) // creates the bucket
	leader := streamLeader(c.Cluster)
	require.GreaterOrEqual(t, leader, 0, "no leader of the claims' stream")
	m, k := (leader+1)%3, (leader+2)%3 // the owner's server (a follower), the standby's
	ncOwner := c.Connect(m)
	owner := openOwners(t, ncOwner, "gpu-0", "", 3)
	standby := openOwners(t, c.Connect(k), "gpu-0b", "gpu-0", 3)
	acks := &ackedKV{KeyValue: standby.kv, at: map[string]time.Time{}}
	standby.kv = acks
	// No deadline for the whole test: each call below has its own. The
	// heal waits for the cluster to form again (up to testkit's 20 s), and
	// a deadline set here ran out behind a slow one (seen in the next test).
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	reg := Request{Register: true, Local: true, SpecNode: "gpu-0"}
	mustServe(t, owner, "e1", reg)

	require.NoError(t, attempt(func(ctx context.Context) error {
		_, err := owner.KeepAlive(ctx, "e1")
		return err
	}))
	ownerEnd := owner.heldAt("e1").renewed.Add(testLease) // Serving's bound
	c.Isolate(m)
	cut := time.Now()

	// The owner renews as a node does (lease/4, a failed pass retried), the
	// standby registers until it serves.
	var lastTry time.Time
	testkit.Eventually(t, 5*testLease, 20*time.Millisecond, func() error {
		if time.Since(lastTry) >= testLease/4 {
			lastTry = time.Now()
			kctx, cancel := context.WithTimeout(ctx, testLease/8)
			rev, err := owner.KeepAlive(kctx, "e1")
			cancel()
			if err == nil { // seen once in ~140 runs under two -race suites: say what the cut was then
				t.Fatalf("a keep-alive through the cut-off server s%d succeeded %v after the cut: revision %d; "+
					"the owner's client is on %s; stream leaders now %v (s%d before); s%d has %d routes",
					m, time.Since(cut), rev, ncOwner.ConnectedServerName(), streamLeaders(c.Cluster), leader, m, routesOf(c.Server(m)))
			}
			require.NotErrorIs(t, err, ErrFenced, "fenced in the cut, where nobody can write")
		}
		rctx, cancel := context.WithTimeout(ctx, testLease/2)
		defer cancel()
		d, err := standby.Resolve(rctx, "e1", reg)
		if err != nil {
			return err
		}
		if d.Action != ownership.Serve {
			return fmt.Errorf("standby: %v (%s)", d.Action, d.Reason)
		}
		return nil
	})
	claimed, claimedRev := acks.ackedAt("e1"), standby.Revision("e1")
	stopRenewing := testkit.Every(t, testLease/4, func() { // the standby keeps its claim, as a node does
		kctx, cancel := context.WithTimeout(ctx, testLease/4)
		_, _ = standby.KeepAlive(kctx, "e1")
		cancel()
	})
	defer func() { stop(); stopRenewing() }() // ctx's end first: a keep-alive in flight returns at once
	require.False(t, claimed.Before(ownerEnd), "the standby's claim was acknowledged %v before the owner's lease ended",
		ownerEnd.Sub(claimed))
	require.False(t, owner.Serving("e1", time.Now()))
	rctx, cancel := context.WithTimeout(ctx, testLease/2)
	d, err := owner.Resolve(rctx, "e1", reg) // its own server's replica still shows its record
	cancel()
	require.False(t, err == nil && d.Action == ownership.Serve, "the cut-off owner served a register past its lease")

	c.Heal(m)
	testkit.Eventually(t, 5*testLease, 20*time.Millisecond, func() error {
		kctx, cancel := context.WithTimeout(ctx, testLease)
		defer cancel()
		_, err := owner.KeepAlive(kctx, "e1")
		if errors.Is(err, ErrFenced) {
			return nil
		}
		return fmt.Errorf("the healed owner's keep-alive: %v", err)
	})
	got := eventuallyOwner(t, owner, "e1", "gpu-0b")
	// One of the standby's writes since its claim: it renews meanwhile (a
	// -race run of the suite read revision 7 as the standby moved to 8).
	// The standby records a write's revision when its reply comes, or when
	// its next keep-alive finds the write landed; a read may come between
	// (seen once in a loop under load: revision 10 read, 9 held), so the
	// read is checked against what the standby holds once it catches up.
	require.GreaterOrEqual(t, got.Revision, claimedRev)
	testkit.Eventually(t, 5*testLease, 10*time.Millisecond, func() error {
		if held := standby.Revision("e1"); held < got.Revision {
			return fmt.Errorf("e1's record read at revision %d, the standby holds %d", got.Revision, held)
		}
		return nil
	})
	require.NoError(t, attempt(func(ctx context.Context) (err error) {
		d, err = owner.Resolve(ctx, "e1", reg)
		return err
	}))
	require.Equal(t, ownership.Ignore, d.Action)
	require.Equal(t, "gpu-0b", d.Owner)
	t.Logf("cut→standby's claim %v (owner's lease ended %v after the cut)", claimed.Sub(cut), ownerEnd.Sub(cut))
}

// A stream leader whose routes are cut refuses a write of a key whose last
// write it could not commit as "another write in process" (JetStream
// 10164), on every try, for as long as it leads. That says nothing of
// another writer: the owner writing through it keeps its claim (bounded by
// its local lease) and, once the routes are back, renews it on its own
// record. Before, five such refusals fenced the claim: a node whose server
// led the stream dropped every engine it owned over a cut far shorter than
// a lease, nobody else having written.
func TestAKeepAliveThroughACutOffStreamLeaderIsNotFenced(t *testing.T) {
	t.Parallel()
	// The cut, the heal (a cut route is retried about every second) and
	// the settling of the write left in process, well within the lease:
	// longer than testkit's 20 s wait for the cluster to form again, so
	// the record cannot lapse however slow a heal that succeeds is. At 8 s,
	// one heal took about 12 s (the test 15.8 s, two -race suites beside)
	// and the owner's first keep-alive after it was fenced reading no
	// record: the servers remove a record a lease after its last write.
	const lease = 30 * time.Second
	c := testkit.NATSClusterWithRouteLinks(t, 3)
	openOwnersLease(t, c.Connect(0), "setup", "", 3, lease) // creates the bucket
	m := streamLeader(c.Cluster)
	require.GreaterOrEqual(t, m, 0, "no leader of the claims' stream")
	owner := openOwnersLease(t, c.Connect(m), "gpu-0", "", 3, lease)
	// No deadline for the whole test: each call below has its own. One set
	// here (10 s) ran out while the heal waited for the cluster to form
	// again (two -race suites running beside: the test took 22 s), and
	// every keep-alive after it failed at once, "context deadline exceeded".
	ctx := context.Background()
	reg := Request{Register: true, Local: true, SpecNode: "gpu-0"}
	mustServe(t, owner, "e1", reg)
	rev := owner.Revision("e1")

	c.Isolate(m)
	cut := time.Now()
	// Keep-alives as a node's loop makes them (each bounded, retried every
	// 100 ms) for half a second.
	for until := time.Now().Add(500 * time.Millisecond); time.Now().Before(until); {
		kctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
		_, err := owner.KeepAlive(kctx, "e1")
		cancel()
		require.Error(t, err, "a keep-alive through the cut-off leader succeeded")
		require.NotErrorIs(t, err, ErrFenced, "fenced in the cut, where nobody else can write")
		require.Equal(t, []string{"e1"}, owner.Mine())
	}

	c.Heal(m)
	healed := time.Now()
	testkit.Eventually(t, lease/2, 20*time.Millisecond, func() error {
		kctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
		defer cancel()
		_, err := owner.KeepAlive(kctx, "e1")
		require.NotErrorIs(t, err, ErrFenced, "fenced on its own record")
		return err
	})
	require.True(t, owner.Serving("e1", time.Now()))
	renewed := owner.Revision("e1")
	require.Greater(t, renewed, rev)
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error { // reads may lag: direct gets
		gctx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		e, err := owner.Get(gctx, "e1")
		if err != nil {
			return err
		}
		if e == nil || e.Revision != renewed || e.Identity != (ownership.Identity{Node: "gpu-0", Boot: "gpu-0-boot1"}) {
			return fmt.Errorf("e1's record reads %+v, want the owner's at revision %d", e, renewed)
		}
		return nil
	})
	t.Logf("cut for %v, healed → renewed %v", healed.Sub(cut), time.Since(healed))
}

// heldAt is o's claim on engine as it holds it (zero if none).
func (o *Owners) heldAt(engine string) held {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.mine[engine]
}

// routesOf is how many route connections s has now (-1 if it cannot say).
func routesOf(s *server.Server) int {
	rz, err := s.Routez(nil)
	if err != nil {
		return -1
	}
	return rz.NumRoutes
}
