package node

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// On a cluster a node whose intake is full answers "node overloaded" only
// for engines it serves: every node receives every engine's messages, and
// the engine takes the first reply from any node. A busy node that does not
// serve it answering its load would have the engine reuse blocks its own
// node is still copying into; answering its register, it would beat the
// claiming node's OK every time while it stays busy, and the engine would
// register in a loop. Both are dropped and counted all the same.
func TestABusyNodeAnswersNoLoadOfAnEngineItDoesNotServe(t *testing.T) {
	t.Parallel()
	s := testkit.NATSServer(t)
	n, err := Start(context.Background(), Config{NATSURL: s.ClientURL(), NodeID: "n0", Cluster: true,
		ClusterReplicas: 1, Lease: 2 * time.Second, FetchTimeout: time.Second, ShmDir: t.TempDir(),
		PoolBytes: 1 << 20, HTTPAddr: "off", Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	t.Cleanup(func() { _ = n.Close(context.Background()) })
	nc := testkit.Connect(t, s)
	overflow := n.metrics.Rejected.WithLabelValues(messages.RejectOverflow)

	taken := takeWholeBudget(t, n.ingest)
	defer freeTotal(n.ingest, taken)
	load := []byte(`{"request":"r1","hashes":["00"],"blocks":[[1]],"tokens":4}`)
	_, err = testkit.EngineRequest(nc, "e1", "kvactors.e1.load", load, 500*time.Millisecond)
	require.Error(t, err, "a node that does not serve e1 answered its load")
	require.Equal(t, 1.0, testutil.ToFloat64(overflow), "the load was dropped unread, and counted")

	_, err = testkit.EngineRequest(nc, "e1", "kvactors.e1.register", []byte(`{}`), 500*time.Millisecond)
	require.Error(t, err, "a node that does not serve e1 answered its register")
	require.Equal(t, 2.0, testutil.ToFloat64(overflow))
}
