//go:build cuda

package node_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend/cuda"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// TestCUDAClusterRefusesAnEngineNamingNoNode: on a cluster of cuda nodes a
// register naming no node is refused by every node alike, before any
// claim (a CUDA IPC handle does not say which host it is from, so a claim
// would be won at random by a node that cannot open it); one naming its
// node is served by that node. Runs on scripts/cuda-check's fake driver.
func TestCUDAClusterRefusesAnEngineNamingNoNode(t *testing.T) {
	kc := startCluster(t, 2, func(_ int, c *node.Config) { c.Backend, c.CUDADevice = cuda.Name, e2eDevice() })
	te := kc.nodes[0].newEngine("gpuengine", defaultOpts())
	spec := te.spec
	spec.Segments = []messages.Segment{{CUDAIPC: strings.Repeat("00", 64), Bytes: 64 * 256}}
	replies := collect(t, kc.nodes[0].nc, "kvactors.gpuengine.register", spec)
	for range kc.nodes {
		var r messages.RegisterReply
		require.NoError(t, json.Unmarshal(testkit.Recv(t, replies, 10*time.Second, "a refusal").Data, &r))
		require.False(t, r.OK)
		require.Contains(t, r.Error, "must name its node")
	}
	testkit.NoRecv(t, replies, 200*time.Millisecond, "a third answer")
	for _, e := range kc.nodes {
		require.Empty(t, e.node.Engines(), "nothing claimed on %s", e.node.NodeID())
	}
}
