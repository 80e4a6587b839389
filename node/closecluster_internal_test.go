package node

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
)

// Close unmaps the pool after closeCluster: so closeCluster cancels the
// fetches of remote loads and returns only once they and the fetches being
// served (both copy into or out of the pool) have ended; none starts after.
func TestCloseClusterWaitsForFetchesIntoAndOutOfThePool(t *testing.T) {
	c := &clusterNode{}
	c.closing, c.close = context.WithCancel(context.Background())
	n := &Node{cl: c}
	require.True(t, c.fetches.enter(), "a remote load fetching")
	require.True(t, c.reads.enter(), "a fetch being served")
	done := make(chan struct{})
	go func() {
		n.closeCluster(context.Background())
		close(done)
	}()
	testkit.Closed(t, c.closing.Done(), 5*time.Second, "the remote load's fetch cancelled")
	testkit.NoRecv(t, done, 50*time.Millisecond, "closeCluster's return while a remote load fetches")
	c.fetches.leave()
	testkit.NoRecv(t, done, 50*time.Millisecond, "closeCluster's return while a fetch is served")
	c.reads.leave()
	testkit.Closed(t, done, 5*time.Second, "closeCluster's return")
	require.False(t, c.fetches.enter(), "a remote load let in after Close")
	require.False(t, c.reads.enter(), "a fetch served after Close")
}
