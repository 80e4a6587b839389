package client_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// TestANodesOwnResetOfARunningRequestIsNotUnexpected: after its own NATS
// lapse (or the engine's silence) a node resets the current epoch itself:
// it releases every request it tracked engine_reset, carrying that epoch,
// running ones too, and orders a resync when the lapse ends, on another
// subject. The SDK counts the running request's reset as UnowedResets (not
// UnexpectedRel, which flags a release the protocol does not explain),
// hands it to nobody, keeps the request, and re-announces it in the new
// epoch once the order comes.
func TestANodesOwnResetOfARunningRequestIsNotUnexpected(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease)
	rels := newReleases()
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(), OnReleased: rels.on})
	for _, r := range []string{"run", "done"} {
		c.Added(r, 8)
		c.Blocks(r, 0, 0, []uint32{1, 2})
	}
	c.Finished("done", false, 8, 8)
	require.NoError(t, c.Flush())
	rel := testkit.Recv(t, rels.ch, 5*time.Second, "the release of the finished request")
	require.Equal(t, "done", rel.Request)
	epoch := c.Epoch()

	f.lapse("e1")
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		if st := c.Stats(); st.UnowedResets != 1 {
			return fmt.Errorf("the running request's engine_reset not counted yet: %+v", st)
		}
		return nil
	})
	st := c.Stats()
	require.Zero(t, st.UnexpectedRel)
	require.Zero(t, st.StaleReleases, "the reset carried the current epoch")
	require.Equal(t, 1, st.Releases, "only the finished request's release was handed to the engine")
	require.Equal(t, 1, st.Live, "the running request is still mirrored")
	require.Equal(t, epoch, c.Epoch())

	f.lapseEnds("e1")
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		next := c.Epoch()
		if next == epoch {
			return fmt.Errorf("no new epoch yet")
		}
		for _, ev := range f.events(next) {
			if ev.Type == messages.EvBlocks && ev.Request == "run" {
				return nil
			}
		}
		return fmt.Errorf("epoch %s has not re-announced the running request's blocks: %+v", next, f.events(next))
	})
	require.Zero(t, c.Stats().UnexpectedRel)
	require.Equal(t, 1, c.Stats().Releases)
}

// TestAResetOfTheEpochLeftAtTheNodesLossIsStale: the engine declared its
// node lost and, a lease later, freed its requests node_lost; its epoch
// stays current until the register and resync that follow, but it was
// left. The node, alive behind a lapse of its own, resets that epoch when
// NATS answers again: releases engine_reset for requests the engine freed
// (here one that finished while the node was lost). They are stale
// (OPERATIONS.md: an engine that declared the node lost ignores them), not
// releases the protocol does not explain: chaos.TestNATSOutage counted 15
// such as UnexpectedRel under a 2 s lease.
func TestAResetOfTheEpochLeftAtTheNodesLossIsStale(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease, func(f *fakeNode) {
		f.hbDelay = 2 * time.Second // heartbeat replies too late to keep the node seen once its beats pause
	})
	rels := newReleases()
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(), OnReleased: rels.on})
	c.Added("r", 8)
	c.Blocks("r", 0, 0, []uint32{1, 2})
	require.NoError(t, c.Flush())
	epoch := c.Epoch()
	f.awaitApplied(t, epoch, 2)

	// The register after the frees is refused until the reset is in: a
	// register that succeeded would resync, leaving the epoch by the usual
	// road before the reset arrives (seen under two -race suites).
	f.refuseRegisters("limit: engine refused: --max-engines 1 reached")
	f.pauseBeats(true)
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if n := c.Stats().NodeLosses; n != 1 {
			return fmt.Errorf("%d node losses", n)
		}
		return nil
	})
	c.Finished("r", false, 8, 8)
	require.NoError(t, c.Flush()) // not sent: the node is lost
	rel := testkit.Recv(t, rels.ch, 5*time.Second, "r's node_lost free")
	require.Equal(t, client.Release{Request: "r", Reason: messages.ReasonNodeLost}, rel)
	require.Equal(t, epoch, c.Epoch(), "no resync before the register")

	f.lapse("e1") // r is running at the node: released engine_reset in the epoch
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if st := c.Stats(); st.StaleReleases+st.UnexpectedRel+st.UnowedResets == 0 {
			return fmt.Errorf("the reset has not arrived: %+v", st)
		}
		return nil
	})
	st := c.Stats()
	require.Zero(t, st.UnexpectedRel)
	require.Zero(t, st.UnowedResets)
	require.Equal(t, 1, st.StaleReleases)

	f.refuseRegisters("")
	f.pauseBeats(false) // the node is heard again: the engine registers and resyncs
	f.lapseEnds("e1")
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		if c.Epoch() == epoch || !c.Live() {
			return fmt.Errorf("no new epoch yet: %+v", c.Stats())
		}
		return nil
	})
	st = c.Stats()
	require.Zero(t, st.UnexpectedRel)
	require.Equal(t, 1, st.Releases, "only the node_lost free was handed to the engine")
	require.Zero(t, st.Live, "r was freed and forgotten")
}
