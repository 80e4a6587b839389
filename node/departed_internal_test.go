package node

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend/shm"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// Engines that come and go under fresh ids (pod names), all in one shared
// namespace (so the namespace bound never stops them), left behind what the
// node keeps per id for the boot (cleared, releases, epochs) for good. Once
// departedKeep other ids have left after one, it is forgotten; the latest
// departed are kept, and an id forgotten registers again as a new one.
func TestIDsLongGoneAreForgotten(t *testing.T) {
	n, nc, dir := startInternal(t, nil)
	const keep = 8
	n.mu.Lock()
	n.departed.keep = keep
	n.mu.Unlock()
	register := func(id, name string) {
		t.Helper()
		seg, err := shm.Create(dir, id+"-"+name, 4096)
		require.NoError(t, err)
		t.Cleanup(func() { _ = seg.Remove() })
		spec, _ := json.Marshal(messages.EngineSpec{Namespace: "shared", TokensPerHash: 4, BlocksPerChunk: 1, NumGPUBlocks: 4,
			Segments: []messages.Segment{seg.Spec()}, Groups: []messages.GroupSpec{{Kind: "full", TokensPerBlock: 4,
				Regions: []messages.Region{{BlockStride: 1024, BlockBytes: 1024}}}}})
		reply, err := testkit.EngineRequest(nc, id, "kvactors."+id+".register", spec, 5*time.Second)
		require.NoError(t, err)
		require.Contains(t, string(reply.Data), `"ok":true`)
	}
	const ids = 40
	for i := range ids {
		id := fmt.Sprintf("pod%d", i)
		register(id, "kv")
		// an epoch with one release (a finished of an unknown request)
		require.NoError(t, nc.Publish("kvactors."+id+".events",
			fmt.Appendf(nil, `{"epoch":"%s-e","seq":1,"events":[{"type":"finished","request":"r","computed":0,"total":0}]}`, id)))
		reply, err := testkit.EngineRequest(nc, id, "kvactors."+id+".unregister", []byte(`{}`), 5*time.Second)
		require.NoError(t, err)
		require.Contains(t, string(reply.Data), `"ok":true`)
	}
	sizes := func() (int, int, int, int) {
		n.mu.Lock()
		defer n.mu.Unlock()
		return len(n.cleared), len(n.releases), len(n.epochs), len(n.stateBudgets)
	}
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if c, r, e, b := sizes(); c > keep || r > keep || e > keep || b > keep {
			return fmt.Errorf("after %d ids came and went, the node keeps cleared %d, releases %d, epochs %d, state budgets %d; bound %d",
				ids, c, r, e, b, keep)
		}
		return nil
	})
	n.mu.Lock()
	last := fmt.Sprintf("pod%d", ids-1)
	_, kept := n.releases[last]
	_, forgot := n.releases["pod0"]
	n.mu.Unlock()
	require.True(t, kept, "the latest departed id forgotten")
	require.False(t, forgot, "the first departed id kept")
	register("pod0", "kv2") // forgotten: a new id again
	n.mu.Lock()
	defer n.mu.Unlock()
	require.True(t, n.cleared["pod0"] && n.releases["pod0"] != nil && n.epochs["pod0"] != nil && n.stateBudgets["pod0"] != nil)
}

// A few ids leaving again and again keep the departure queue within twice
// the ids remembered.
func TestDeparturesOfTheSameIDsStayBounded(t *testing.T) {
	n := &Node{engines: map[string]*engineRec{}, ending: map[string][]<-chan struct{}{}, cleared: map[string]bool{}}
	n.departed.keep = 8
	for i := range 100000 {
		n.departedLocked(fmt.Sprintf("pod%d", i%5))
	}
	require.LessOrEqual(t, len(n.departed.queue), 2*5+64)
	require.Len(t, n.departed.last, 5)
}
