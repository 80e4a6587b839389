package cluster

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

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
	owner := openOwners(t, c.Connect(m), "gpu-0", "", 3)
	standby := openOwners(t, c.Connect(k), "gpu-0b", "gpu-0", 3)
	acks := &ackedKV{KeyValue: standby.kv, at: map[string]time.Time{}}
	standby.kv = acks
	ctx, stop := context.WithTimeout(context.Background(), 10*time.Second)
	defer stop()
	reg := Request{Register: true, Local: true, SpecNode: "gpu-0"}
	mustServe(t, owner, "e1", reg)

	_, err := owner.KeepAlive(ctx, "e1")
	require.NoError(t, err)
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
			_, err := owner.KeepAlive(kctx, "e1")
			cancel()
			require.Error(t, err, "a keep-alive through the cut-off server succeeded")
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
	claimed := acks.ackedAt("e1")
	renewing := make(chan struct{})
	go func() { // the standby keeps its claim, as a node does
		defer close(renewing)
		tick := time.NewTicker(testLease / 4)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
				kctx, cancel := context.WithTimeout(ctx, testLease/4)
				_, _ = standby.KeepAlive(kctx, "e1")
				cancel()
			}
		}
	}()
	defer func() { stop(); <-renewing }()
	require.False(t, claimed.Before(ownerEnd), "the standby's claim was acknowledged %v before the owner's lease ended",
		ownerEnd.Sub(claimed))
	require.False(t, owner.Serving("e1", time.Now()))
	rctx, cancel := context.WithTimeout(ctx, testLease/2)
	d, err := owner.Resolve(rctx, "e1", reg) // its own server's replica still shows its record
	cancel()
	require.False(t, err == nil && d.Action == ownership.Serve, "the cut-off owner served a register past its lease")

	c.Heal(m)
	testkit.Eventually(t, 5*testLease, 20*time.Millisecond, func() error {
		_, err := owner.KeepAlive(ctx, "e1")
		if errors.Is(err, ErrFenced) {
			return nil
		}
		return fmt.Errorf("the healed owner's keep-alive: %v", err)
	})
	got := eventuallyOwner(t, owner, "e1", "gpu-0b")
	require.Equal(t, standby.Revision("e1"), got.Revision)
	d, err = owner.Resolve(ctx, "e1", reg)
	require.NoError(t, err)
	require.Equal(t, ownership.Ignore, d.Action)
	require.Equal(t, "gpu-0b", d.Owner)
	t.Logf("cut→standby's claim %v (owner's lease ended %v after the cut)", claimed.Sub(cut), ownerEnd.Sub(cut))
}

// heldAt is o's claim on engine as it holds it (zero if none).
func (o *Owners) heldAt(engine string) held {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.mine[engine]
}
